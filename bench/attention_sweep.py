"""Launch-parameter sweep of the attention kernels: each kernel's ``DEFAULTS`` against its module's ``VARIANTS``.

    python3 bench/attention.py --sweep [--out bench/results/attention_sweep.json] [--budget-s 190]
    python3 bench/attention.py --sweep --only sparse-decode:16x32768,indexer-scan:1x131072   # chosen shapes
    python3 bench/attention.py --sweep --only sparse-prefill-model:16384 --variants NAME,NAME   # chosen variants
    python3 bench/attention.py --sweep --only indexer-scan:1x131072 --index-keys fp8   # E4M3 index keys
    python3 bench/attention.py --sweep --device cpu --out /tmp/attention_sweep_cpu.json   # logic only

Groups, after issue 11's unmet targets (``docs/performance.md``): ``sparse-decode`` (copy bandwidth at batch
>= 16), ``indexer-scan`` (the scan launch alone, copy bandwidth, batch 1 at 128k), ``topk`` (the block top-16
launch alone), ``sparse-prefill`` (bf16 TFLOP/s on the indexer's selections for random index queries and
keys: neighbouring tokens share few blocks, the worst case for tiles of several tokens) and
``sparse-prefill-model`` (the same on index keys and queries that drift along the prompt,
``bench/prefill_selections.py``'s model of a real prompt's selections). Prefill FLOPs count each token's own
selected keys (the work the op must do), and every prefill row carries the selections' adjacent-token overlap and
the union of 4 / 8 / 16 consecutive tokens' blocks over top-k.

Every (variant, shape) is checked the way ``bench/attention.py`` checks the defaults, on the same inputs: selections
equal to the reference's up to fp32 near-ties (the conformance suite's rule), attention within
``paged_attention.output_error_bound``. Decode is checked on its first (up to) 4 sequences and prefill on its last
64 tokens, each against a reference called for those alone (it gathers only their context). Decode is timed from
CUDA-graph replays (kernel time, page sets cycled so that small inputs do not run from L2), prefill eagerly (the
"union" loop's tile lists included). FLOPs and bytes are counted as ``bench/attention.py`` counts them, and the
ceilings (copy rate, bf16 matmul rate) are measured in the same run.

Every variant is a complete setting (``VARIANTS`` in the kernel modules); one equal to the current ``DEFAULTS``
is not timed again. ``--only GROUP:SHAPE,...`` times just those shapes (decode, scan and top-k shapes are
``BATCHxCONTEXT``, prefill ones the prompt length, e.g. ``sparse-prefill:16384``), so a short GPU call can
spend its seconds where a target is missed.

A group's winner is the variant with the smallest geometric mean of (its time / the defaults' time) over the group's
shapes measured for every variant, among variants whose every check passed; the sweep prints the ``DEFAULTS`` entry
to copy into the kernel module (the winning variant's settings). It also prints the batch-1 ratio (indexer scan +
top-k + sparse decode at 128k over 4k) with the defaults and with the winners. Measurements stop being started after
``--budget-s`` seconds; the JSON is written after every shape, so a run cut short keeps what it measured. Prefill
rows also carry ``graph_seconds`` / ``graph_tflops``: the same call replayed from a CUDA graph (the launcher's tile
lists and the kernel on the device, without the host's launch cost), to tell a short launch's host overhead from
the kernel's own time; ``seconds`` stays the eager call, as in earlier sweeps. On
the GPU it ends with what the compiler made of each setting (``compiled_kernels``: shared memory, registers,
programs per SM that these allow).

``--device cpu`` runs the same code at tiny dimensions under ``TRITON_INTERPRET=1`` (checks real, times
meaningless): the way to check this script without a GPU.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefill_selections import overlap_stats, prefill_selection, selected_keys  # noqa: E402
from results_file import write_results  # noqa: E402  (bench/results_file.py)

# M3's per-layer dimensions (those of bench/attention.py) on the GPU; tiny ones for the interpreter.
DIMS = {
    "cuda": dict(hq=64, hkv=4, d=128, hi=4, di=128, bs=128, topk=16, local=1, init=0, page=128),
    "cpu": dict(hq=16, hkv=2, d=32, hi=2, di=32, bs=16, topk=4, local=1, init=0, page=16),
}
SHAPES = {  # decode: (batch, context); prefill: prompt length (one sequence)
    "cuda": {"sparse-decode": [(1, 4096), (1, 131072), (16, 32768), (64, 32768)],
             "sparse-prefill": [4096, 16384, 65536],
             "sparse-prefill-model": [4096, 16384, 65536],
             "indexer-scan": [(1, 4096), (1, 131072), (8, 32768)],
             "topk": [(1, 4096), (1, 131072), (64, 32768)]},
    "cpu": {"sparse-decode": [(1, 64), (1, 128), (3, 128)], "sparse-prefill": [80], "sparse-prefill-model": [80],
            "indexer-scan": [(1, 64), (1, 128), (3, 128)], "topk": [(1, 64), (1, 128), (3, 128)]},
}
GROUPS = ("sparse-decode", "indexer-scan", "topk", "sparse-prefill", "sparse-prefill-model")
CHECK_SEQS, CHECK_TAIL = 4, 64
# Prefill calls captured per CUDA graph for the kernel-time column (each call keeps its output in the graph's pool:
# 1 GB per call at 64k tokens).
PREFILL_GRAPH_REPS = 3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/attention_sweep.json")
    ap.add_argument("--budget-s", type=float, default=190.0,
                    help="start no measurement after this many seconds (what was measured is kept)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated subset of {','.join(GROUPS)}")
    ap.add_argument("--only", default="",
                    help="comma-separated GROUP:SHAPE, e.g. sparse-decode:16x32768,indexer-scan:1x131072 "
                         "(BATCHxCONTEXT; prefill groups: the prompt length); overrides --groups")
    ap.add_argument("--index-keys", choices=["bf16", "fp8"], default="bf16",
                    help="the index-key pool the indexer groups read: bf16, or E4M3 codes with per-row fp32 scales "
                         "(``--kv-cache-dtype fp8``'s index keys); K / V stay bf16 (default: %(default)s)")
    ap.add_argument("--variants", default="",
                    help="comma-separated VARIANTS names: time the defaults and only these (a name no swept kernel "
                         "has is refused)")
    args = ap.parse_args(argv)
    groups = [g for g in args.groups.split(",") if g]
    if set(groups) - set(GROUPS):
        raise SystemExit(f"attention_sweep: unknown groups {sorted(set(groups) - set(GROUPS))}; known: {GROUPS}")
    shapes = None
    if args.only:
        shapes = only_shapes(args.only)
        groups = list(shapes)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated
    elif not torch.cuda.is_available():
        raise SystemExit("bench/attention.py --sweep needs a CUDA device (or --device cpu for a logic check)")
    names = [n for n in args.variants.split(",") if n]
    return Sweep(args.device, groups, args.budget_s, args.out, shapes, names, args.index_keys).run()


def only_shapes(spec: str) -> dict:
    """``--only`` -> {group: [shapes]}, in the order given; a group or shape outside ``GROUPS`` refused by name.
    Any shape is accepted (not only those of ``SHAPES``), so e.g. batch 16 at 128k can be timed too."""
    chosen: dict = {}
    for item in filter(None, spec.split(",")):
        group, _, shape = item.partition(":")
        if group not in GROUPS:
            raise SystemExit(f"attention_sweep: --only {item!r}: unknown group {group!r}; known: {GROUPS}")
        try:
            parsed = int(shape) if group.startswith("sparse-prefill") else tuple(int(x) for x in shape.split("x"))
        except ValueError:
            parsed = None
        if parsed is None or (isinstance(parsed, tuple) and len(parsed) != 2):
            want = "a prompt length" if group.startswith("sparse-prefill") else "BATCHxCONTEXT"
            raise SystemExit(f"attention_sweep: --only {item!r}: shape {shape!r} is not {want}")
        chosen.setdefault(group, []).append(parsed)
    return chosen


class Sweep:
    def __init__(self, device: str, groups: list[str], budget_s: float, out: str, shapes: dict | None = None,
                 names: list[str] | None = None, index_keys: str = "bf16"):
        import triton

        from m3export.plugins.kernels import lightning_indexer, sparse_paged_attention

        self.LI, self.SPA = lightning_indexer, sparse_paged_attention
        self.cpu = device == "cpu"
        self.dev = torch.device(device)
        self.dims = DIMS[device]
        self.shapes = shapes or SHAPES[device]
        self.groups, self.out = groups, out
        self.names = set(names or ())
        self.index_fp8 = index_keys == "fp8"
        known = {n for m in (self.LI, self.SPA) for part in m.VARIANTS.values() for n in part}
        if self.names - known:
            raise SystemExit(f"attention_sweep: --variants: no kernel has {sorted(self.names - known)}")
        self.t0, self.budget_s = time.monotonic(), budget_s
        self.res = {"device": torch.cuda.get_device_name() if not self.cpu else "cpu (interpreter)",
                    "torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
                    "dims": self.dims, "defaults": {"sparse_paged_attention": self.SPA.DEFAULTS,
                                                    "lightning_indexer": self.LI.DEFAULTS},
                    "index_keys": index_keys, "rows": [], "skipped": [], "winners": {}}
        torch.manual_seed(0)

    # ------------------------------------------------------------------------------------------- set-up
    def ceilings(self):
        if self.cpu:
            self.copy_bw, self.mm_rate = 1.0, 1.0  # fractions are meaningless under the interpreter
            return
        from attention import bench

        a = torch.empty(2 << 30, dtype=torch.uint8, device=self.dev)
        b = torch.empty_like(a)
        self.copy_bw = 2 * a.numel() / bench(lambda: b.copy_(a))
        del a, b
        x = torch.randn(8192, 8192, dtype=torch.bfloat16, device=self.dev)
        self.mm_rate = 2 * 8192**3 / bench(lambda: x @ x)
        del x
        self.res["copy_bytes_per_s"], self.res["bf16_flops_per_s"] = self.copy_bw, self.mm_rate
        print(f"copy {self.copy_bw / 1e12:.2f} TB/s, bf16 matmul {self.mm_rate / 1e12:.0f} TFLOP/s", flush=True)

    def pools(self):
        """One shuffled pool of K, V and index keys large enough for every shape of the chosen groups."""
        dm = self.dims
        need = [b * c for g in self.groups if not g.startswith("sparse-prefill") for b, c in self.shapes[g]]
        need += [n for g in self.groups if g.startswith("sparse-prefill") for n in self.shapes[g]]
        self.pages = -(-max(need) // dm["page"]) + 64
        shape = (self.pages, dm["page"])
        self.kc = torch.randn(*shape, dm["hkv"], dm["d"], device=self.dev, dtype=torch.bfloat16)
        self.vc = torch.randn(*shape, dm["hkv"], dm["d"], device=self.dev, dtype=torch.bfloat16)
        self.ikc = torch.randn(*shape, dm["di"], device=self.dev, dtype=torch.bfloat16)
        self.iks, self.ikc_read = None, self.ikc  # FP8: the scale pool, and the keys as the kernels read them
        if self.index_fp8:
            from m3export.ops.kv_fp8 import dequantize_rows, quantize_rows

            self.ikc, self.iks = quantize_rows(self.ikc)
            self.ikc_read = dequantize_rows(self.ikc, self.iks)
        self.perm = torch.randperm(self.pages, device=self.dev).to(torch.int32)
        self.vmax = max(self.vc.amax().item(), -self.vc.amin().item())

    def paged(self, bsz, ctx, new, offset=0):
        """(block_tables, query_start_loc, seq_lens, positions): bsz sequences of ctx tokens, the last ``new``
        new, on shuffled pages from ``offset``."""
        per = -(-ctx // self.dims["page"])
        start = offset % max(1, self.pages - bsz * per)
        bt = self.perm[start:start + bsz * per].view(bsz, per).contiguous()
        qsl = torch.arange(0, bsz + 1, device=self.dev, dtype=torch.int32) * new
        sl = torch.full((bsz,), ctx, device=self.dev, dtype=torch.int32)
        pos = torch.arange(ctx - new, ctx, device=self.dev).repeat(bsz).long()
        return bt, qsl, sl, pos

    def page_sets(self, bsz, ctx, bytes_read):
        """Decode inputs on several page sets when one would sit in L2 (60 MB), so replays read HBM."""
        n = 1 if bytes_read > 256e6 or self.cpu else 8
        return [self.paged(bsz, ctx, 1, i * (self.pages // n)) for i in range(n)]

    @staticmethod
    def first(args, n):
        """The first n decode sequences of (bt, qsl, sl, pos): what the references are called on."""
        bt, qsl, sl, pos = args
        return bt[:n], qsl[:n + 1], sl[:n], pos[:n]

    # ------------------------------------------------------------------------------------------- measuring
    def over_budget(self, what: str) -> bool:
        if time.monotonic() - self.t0 > self.budget_s:
            self.res["skipped"].append(what)
            print(f"SKIPPED (budget) {what}", flush=True)
            return True
        return False

    def graph_time(self, fn, sets):
        if self.cpu:
            return self.eager_time(lambda: fn(*sets[0]))
        from attention import graph_seconds

        return graph_seconds(fn, sets)

    def eager_time(self, fn):
        if self.cpu:
            fn()
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
        from attention import bench

        return bench(fn)

    def record(self, group, shape, variant, settings, seconds, nbytes, flops, ok, detail, extra=None):
        r = dict(group=group, shape=list(shape) if isinstance(shape, tuple) else [1, shape], variant=variant,
                 settings=settings, seconds=seconds, bytes=nbytes, flops=flops,
                 frac_copy_bw=nbytes / seconds / self.copy_bw if seconds else None,
                 frac_bf16_peak=flops / seconds / self.mm_rate if seconds else None, ok=bool(ok), detail=detail)
        r.update(extra or {})
        self.res["rows"].append(r)
        t = f"{seconds * 1e6:10.1f} us" if seconds else "         -   "
        rates = "" if self.cpu or not seconds else (
            f"{nbytes / seconds / 1e12:6.2f} TB/s ({100 * r['frac_copy_bw']:5.1f}%)  "
            f"{flops / seconds / 1e12:6.1f} TFLOP/s ({100 * r['frac_bf16_peak']:5.1f}%)  ")
        more = "".join(f"  {k} {v:.3g}" if isinstance(v, float) else f"  {k} {v}" for k, v in (extra or {}).items())
        print(f"{group:21s} {str(shape):14s} {variant:30s} {t}  {rates}{'ok' if ok else 'FAILED'} {detail}{more}",
              flush=True)

    def variants(self, module, part):
        """The defaults, then every variant that runs something else (a variant equal to the defaults, e.g. the
        last sweep's winner, would only time the same launch twice)."""
        return [("default", dict(module.DEFAULTS[part]))] + [
            (name, settings) for name, settings in module.VARIANTS[part].items()
            if settings != module.DEFAULTS[part] and (not self.names or name in self.names)]

    def each_variant(self, group, shape, module, part, run):
        """``run(settings) -> (seconds, bytes, flops, ok, detail, extra)`` for the defaults and every variant;
        a variant that raises (e.g. too much shared memory for the device) is recorded as failed."""
        for name, settings in self.variants(module, part):
            if self.over_budget(f"{group} {shape} {name}"):
                continue
            try:
                seconds, nbytes, flops, ok, detail, extra = run(settings)
            except Exception as e:  # noqa: BLE001  (one failed variant; the others still run)
                seconds, nbytes, flops, ok, detail, extra = None, 0, 0, False, f"{type(e).__name__}: {e}"[:300], None
                if not self.cpu:
                    torch.cuda.synchronize()
            self.record(group, shape, name, settings, seconds, nbytes, flops, ok, detail, extra)
        write_results(self.res, self.out)

    def check_attention(self, got, ref):
        err = (got.float() - ref.float()).abs().max().item()
        from m3export.plugins.kernels.paged_attention import output_error_bound

        bound = output_error_bound(torch.bfloat16, self.vmax)  # derived there from what the kernels round
        return err <= bound, f"max abs err {err:.2e} (bound {bound:.2e})"

    def check_selection(self, sel, ref, iq, args):
        from m3export.ops.conformance import Verdict, _compare_selection, upcast

        if torch.equal(sel, ref):
            return True, "equal"
        dm = self.dims
        v = Verdict()
        _compare_selection(sel, ref, upcast([iq, self.ikc_read, *args]),
                           dict(block_size=dm["bs"], topk_blocks=dm["topk"], local_blocks=dm["local"],
                                init_blocks=dm["init"]), v)
        return v.ok, f"{len(v.failures)} rows differ beyond fp32 near-ties, {len(v.near_ties)} near-tie rows"

    # ------------------------------------------------------------------------------------------- groups
    def sparse_decode(self, bsz, ctx):
        from m3export.ops.attention import sparse_paged_attention_reference

        dm = self.dims
        attrs = (dm["bs"], dm["topk"], dm["local"], dm["init"])
        iq = torch.randn(bsz, dm["hi"], dm["di"], device=self.dev, dtype=torch.bfloat16)
        q = torch.randn(bsz, dm["hq"], dm["d"], device=self.dev, dtype=torch.bfloat16)
        keys = min(dm["topk"] * dm["bs"], ctx)
        nbytes = bsz * dm["hkv"] * keys * 2 * dm["d"] * 2 + 2 * q.numel() * 2
        flops = 4 * bsz * dm["hq"] * keys * dm["d"]
        sets = self.page_sets(bsz, ctx, nbytes)
        sets = [(*s, self.LI.forward(iq, self.ikc, *s, *attrs, self.iks)) for s in sets]
        n = min(bsz, CHECK_SEQS)
        ref = sparse_paged_attention_reference(q[:n], self.kc, self.vc, *self.first(sets[0][:4], n),
                                               sets[0][4][:n], dm["bs"], dm["d"]**-0.5)

        def call(cfg):
            return lambda *s: self.SPA.forward(q, self.kc, self.vc, *s, dm["bs"], dm["d"]**-0.5, config=cfg)

        def run(settings):
            fn = call({"decode": settings})
            ok, detail = self.check_attention(fn(*sets[0])[:n], ref)
            return self.graph_time(fn, sets), nbytes, flops, ok, detail, None

        self.each_variant("sparse-decode", (bsz, ctx), self.SPA, "decode", run)

    def sparse_prefill(self, n, group):
        from m3export.ops.attention import sparse_paged_attention_reference

        dm = self.dims
        s = self.paged(1, n, n)
        source = "model" if group == "sparse-prefill-model" else "random"
        sel, _ = prefill_selection(self.LI.forward, source, n, dm["hi"], dm["di"], dm["page"], dm["bs"], dm["topk"],
                                   dm["local"], dm["init"], self.dev)
        q = torch.randn(n, dm["hq"], dm["d"], device=self.dev, dtype=torch.bfloat16)
        tail = min(CHECK_TAIL, n)
        bt, qsl, sl, pos = s
        tail_args = (bt, torch.tensor([0, tail], device=self.dev, dtype=torch.int32), sl, pos[-tail:])
        ref = sparse_paged_attention_reference(q[-tail:], self.kc, self.vc, *tail_args, sel[-tail:], dm["bs"],
                                               dm["d"]**-0.5)
        # FLOPs of the work the op must do (each token's own selected keys), whatever a variant's tiles read
        flops = 4 * (dm["hq"] // dm["hkv"]) * dm["d"] * selected_keys(sel, pos, dm["bs"])
        nbytes = 2 * n * dm["hq"] * dm["d"] * 2 + n * dm["hkv"] * 2 * dm["d"] * 2
        overlap = overlap_stats(sel, pos, qsl, dm["bs"])  # the same for every variant: beside each row's rate

        def run(settings):
            fn = lambda: self.SPA.forward(q, self.kc, self.vc, *s, sel, dm["bs"], dm["d"]**-0.5,  # noqa: E731
                                          config={"prefill": settings})
            ok, detail = self.check_attention(fn()[-tail:], ref)
            extra = dict(overlap)
            if not self.cpu:  # the same calls replayed from a CUDA graph: the device's time, no host launch cost
                from attention import graph_seconds

                extra["graph_seconds"] = graph_seconds(lambda: fn(), [()], reps=PREFILL_GRAPH_REPS)
                extra["graph_tflops"] = flops / extra["graph_seconds"] / 1e12
            return self.eager_time(fn), nbytes, flops, ok, detail, extra

        self.each_variant(group, n, self.SPA, "prefill", run)

    def indexer(self, part, bsz, ctx):
        from m3export.ops.indexer import lightning_indexer_reference

        dm = self.dims
        attrs = (dm["bs"], dm["topk"], dm["local"], dm["init"])
        iq = torch.randn(bsz, dm["hi"], dm["di"], device=self.dev, dtype=torch.bfloat16)
        nb = -(-ctx // dm["bs"])
        key_bytes = dm["di"] + 4 if self.index_fp8 else dm["di"] * 2  # an FP8 key: its codes and its row's scale
        scan_bytes = bsz * ctx * key_bytes + bsz * dm["hi"] * nb * 4
        sets = self.page_sets(bsz, ctx, scan_bytes)
        n = min(bsz, CHECK_SEQS)
        first = self.first(sets[0], n)
        ref = lightning_indexer_reference(iq[:n], self.ikc, *first, *attrs, index_k_scale=self.iks)
        pos = sets[0][3]

        def scan(cfg):
            return lambda *s: self.LI.scan(iq, self.ikc, *s, dm["bs"], self.iks, config=cfg)

        def topk(scores, cfg):
            return self.LI.block_topk(scores, pos, *attrs, config=cfg)

        def run_scan(settings):
            if settings.get("fold_topk"):  # the top-k runs inside this launch: time the op (scan + top-k)
                fn = lambda *s: self.LI.forward(iq, self.ikc, *s, *attrs, self.iks,  # noqa: E731
                                                config={"scan": settings})
                ok, detail = self.check_selection(fn(*sets[0])[:n], ref, iq[:n], first)
                return (self.graph_time(fn, sets), scan_bytes, 2 * bsz * dm["hi"] * ctx * dm["di"], ok, detail,
                        {"includes_topk": True})
            fn = scan({"scan": settings})
            ok, detail = self.check_selection(topk(fn(*sets[0]), None)[:n], ref, iq[:n], first)
            return (self.graph_time(fn, sets), scan_bytes, 2 * bsz * dm["hi"] * ctx * dm["di"], ok, detail, None)

        scores = scan(None)(*sets[0])

        def run_topk(settings):
            cfg = {"topk": settings}
            ok, detail = self.check_selection(topk(scores, cfg)[:n], ref, iq[:n], first)
            nbytes = bsz * dm["hi"] * (nb + dm["topk"]) * 4
            return self.graph_time(lambda: topk(scores, cfg), [()]), nbytes, 0, ok, detail, None

        if part == "scan":
            self.each_variant("indexer-scan", (bsz, ctx), self.LI, "scan", run_scan)
        else:
            self.each_variant("topk", (bsz, ctx), self.LI, "topk", run_topk)

    # ------------------------------------------------------------------------------------------- results
    def winners(self):
        modules = {"sparse-decode": ("sparse_paged_attention", self.SPA, "decode"),
                   "sparse-prefill": ("sparse_paged_attention", self.SPA, "prefill"),
                   "sparse-prefill-model": ("sparse_paged_attention", self.SPA, "prefill"),
                   "indexer-scan": ("lightning_indexer", self.LI, "scan"),
                   "topk": ("lightning_indexer", self.LI, "topk")}
        for group in self.groups:
            rows = [r for r in self.res["rows"] if r["group"] == group]
            names = list(dict.fromkeys(r["variant"] for r in rows))
            shapes = [tuple(r["shape"]) for r in rows if r["variant"] == "default" and r["seconds"]]
            times = {(r["variant"], tuple(r["shape"])): r["seconds"] for r in rows if r["seconds"]}
            bad = {r["variant"] for r in rows if not r["ok"]}
            shapes = [s for s in shapes if all((v, s) in times for v in names if v not in bad)]
            if not shapes:
                continue
            score = {v: math.exp(sum(math.log(times[v, s] / times["default", s]) for s in shapes) / len(shapes))
                     for v in names if v not in bad and all((v, s) in times for s in shapes)}
            best = min(score, key=score.get)
            module_name, module, part = modules[group]
            entry = dict(module.VARIANTS[part][best]) if best != "default" else None
            self.res["winners"][group] = dict(variant=best, time_over_default=score[best], shapes=shapes,
                                              failed=sorted(bad), scores=score,
                                              defaults_entry=entry)
            print(f"WINNER {group}: {best} ({score[best]:.3f} x the defaults' time, geometric mean over "
                  f"{len(shapes)} shapes; failed: {sorted(bad) or 'none'})")
            if best != "default":
                print(f"  flip: {module_name}.DEFAULTS[{part!r}] = {entry!r}")

    def batch1_ratio(self):
        """Batch 1: indexer scan + top-k + sparse decode at the longest over the shortest context."""
        def t(group, ctx, variant):
            return next((r["seconds"] for r in self.res["rows"] if r["group"] == group and r["variant"] == variant
                         and r["shape"] == [1, ctx] and r["seconds"]), None)

        ctxs = sorted({c for b, c in self.shapes.get("sparse-decode", []) if b == 1})
        if len(ctxs) < 2 or not {"sparse-decode", "indexer-scan", "topk"} <= set(self.groups):
            return
        lo, hi = ctxs[0], ctxs[-1]
        for label, pick in (("defaults", lambda g: "default"),
                            ("winners", lambda g: self.res["winners"].get(g, {}).get("variant", "default"))):
            parts = [(t(g, hi, pick(g)), t(g, lo, pick(g))) for g in ("indexer-scan", "topk", "sparse-decode")]
            if all(a and b for a, b in parts):
                ratio = sum(a for a, _ in parts) / sum(b for _, b in parts)
                self.res[f"batch1_{hi}_over_{lo}_{label}"] = ratio
                print(f"batch 1, scan + top-k + sparse, {label}: {hi} / {lo} = {ratio:.2f} "
                      f"({sum(a for a, _ in parts) * 1e6:.1f} / {sum(b for _, b in parts) * 1e6:.1f} us)")

    def compiled_kernels(self):
        """What the compiler made of each setting, to check the variants' reasoning (programs resident per SM):
        for every compiled scan / sparse-attention kernel its shared memory, registers, spills, warps, stages and
        the constexprs that tell the settings apart. Hopper: 228 KB of shared memory per SM (1 KB of it reserved
        per program), 64k registers. Read from Triton's JIT cache; anything it does not expose is left out (a
        diagnostic only, never a reason to fail the sweep)."""
        rows = []
        for fn in (self.SPA._sparse_paged_attention, self.LI._index_scan):
            for entry in getattr(fn, "device_caches", {}).values():
                for k in list(entry[0].values()):
                    try:
                        k._init_handles()
                        consts = {fn.arg_names[i[0]]: v for i, v in k.src.constants.items()
                                  if len(i) == 1 and isinstance(v, (bool, int, float, str))}
                        shared, regs, warps = int(k.metadata.shared), k.n_regs, int(k.metadata.num_warps)
                        rows.append(dict(
                            kernel=k.name, shared_bytes=shared, n_regs=regs, n_spills=k.n_spills, num_warps=warps,
                            num_stages=int(k.metadata.num_stages),
                            per_sm_by_shared=233472 // (shared + 1024),
                            per_sm_by_registers=65536 // (regs * 32 * warps) if regs else None,
                            constexprs={n: consts[n] for n in ("TOKENS", "ROWS", "BLOCK_N", "SPLITS", "LOOP", "BS",
                                                               "TMA", "STAGES", "FOLD", "FUSED", "LEAN")
                                       if n in consts}))
                    except Exception as e:  # noqa: BLE001  (an attribute this Triton does not have)
                        rows.append(dict(kernel=getattr(k, "name", "?"), error=f"{type(e).__name__}: {e}"[:200]))
        self.res["compiled_kernels"] = rows
        for r in rows:
            if "error" in r:
                print(f"compiled {r['kernel']}: {r['error']}")
            else:
                print(f"compiled {r['kernel']:24s} {r['constexprs']} warps {r['num_warps']} stages {r['num_stages']} "
                      f"shared {r['shared_bytes'] / 1024:.0f} KB regs {r['n_regs']} spills {r['n_spills']}: "
                      f"{r['per_sm_by_shared']} per SM by shared memory, {r['per_sm_by_registers']} by registers")

    def run(self) -> int:
        self.ceilings()
        self.pools()
        for group in self.groups:
            for shape in self.shapes[group]:
                if group == "sparse-decode":
                    self.sparse_decode(*shape)
                elif group.startswith("sparse-prefill"):
                    self.sparse_prefill(shape, group)
                else:
                    self.indexer("scan" if group == "indexer-scan" else "topk", *shape)
        self.winners()
        self.batch1_ratio()
        if not self.cpu:
            self.compiled_kernels()
        self.res["all_defaults_ok"] = all(r["ok"] for r in self.res["rows"] if r["variant"] == "default")
        write_results(self.res, self.out)
        failed = [f"{r['group']} {r['shape']} {r['variant']}" for r in self.res["rows"] if not r["ok"]]
        print(f"wrote {self.out}; {len(self.res['rows'])} measurements, failed: {failed or 'none'}, "
              f"skipped for the budget: {len(self.res['skipped'])}")
        return 0 if self.res["all_defaults_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
