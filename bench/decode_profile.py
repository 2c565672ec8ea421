"""Where the time of one whole ``mini`` decode step goes: torch.profiler over steady, graph-replayed decode steps.

``bench/decode.py`` times the step; this script splits it. For each batch x context (batch 1 / 4k and batch 8 / 32k
by default) it builds the same model, pools and tokens as ``bench/decode.py`` (``mini`` with ``--experts`` routed
experts, MXFP8 or bf16 weights), lets ``GraphedTorchBackend`` capture the step, and profiles ``--steps`` replays,
each between two device synchronisations so the kernels of one step are those that start inside its host range.
Per step it reports:

* device time per kernel family (``FAMILIES``): the Triton kernels by name; everything else (cuBLAS, PyTorch's
  elementwise / reduction / sort / scatter kernels, copies) by the module it ran under, which a graph replay does
  not record: one eager step of the same backend is profiled with every module's forward wrapped in a labelled
  range, and its launch sequence is aligned with the replayed one (the same ops in the same stream order);
* launches (kernels, copies and memsets) and gaps: the device's idle time between the step's first kernel start and
  its last kernel end (launch latency inside the graph, and host work outside it), with the widest gaps named;
* each family's bytes that must be read (``bench/decode.py: step_bytes_by_family``: weights once, the routed
  experts the batch touches, the context's index keys and K/V) against its time, as a fraction of the copy
  bandwidth measured in the same run (``--bandwidth`` overrides it);
* the kernel names behind each family, for the table's reader to check the attribution.

On the CPU (``--device cpu``: the ``tiny`` preset, fp32, the reference ops, no graphs) the same code runs over
host-side ops instead of device kernels: it checks the script's logic (``tests/test_bench_decode_profile.py``),
measures nothing meaningful.

  python bench/decode_profile.py                      # H200: table + bench/results/decode_profile_h200.json
  python bench/decode_profile.py --device cpu         # CPU logic check
  python bench/decode_profile.py --shapes 1x131072 --settings default={} \
      --settings 'w16={"lightning_indexer": {"topk": {"num_warps": 16}}}'   # a launch setting in the model
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import difflib
import os
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: m3export
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: decode, results_file
from results_file import RESULTS, write_results  # noqa: E402  (bench/results_file.py)

FAMILIES = (
    "indexer scan", "top-k", "sparse attention", "dense attention", "MoE routing", "MoE gate-up", "MoE down",
    "MoE combine", "linear", "lm_head", "norms / rope / cache write", "embedding", "elementwise", "copies",
)
"""Kernel families, in table order. ``linear`` is ``m3::mxfp8_linear`` (tensor-core tiles or the GEMV) and, for bf16
weights, cuBLAS under the model's ``Linear``; ``lm_head`` is the bf16 output projection (cuBLAS), the largest single
read of the step; ``MoE routing`` holds the router logits GEMM, the routing kernel and the expert permutation."""

# Triton kernels (plugins/kernels/*) by their exact names, as CUDA and the profiler report them; on the CPU the op
# that stands for them (one op per family at most: the CPU cannot split an op into its kernels).
_BY_NAME = (
    (r"_index_scan|m3::lightning_indexer", "indexer scan"),
    (r"_block_topk", "top-k"),
    (r"_sparse_paged_attention|m3::sparse_paged_attention", "sparse attention"),
    (r"_paged_attention|m3::paged_attention", "dense attention"),
    (r"_route", "MoE routing"),
    (r"_gate_up(_gemv)?|m3::moe(_mxfp8)?", "MoE gate-up"),
    (r"_down(_gemv)?", "MoE down"),
    (r"_combine", "MoE combine"),
    (r"_mxfp8_linear|_linear_gemv|m3::mxfp8_linear", "linear"),
    (r"_norm_rope|_add_rms_norm", "norms / rope / cache write"),
)
_COPY = re.compile(r"[Mm]emcpy|[Mm]emset|copy_kernel|CatArray|aten::copy_|aten::cat|aten::to\b|aten::_to_copy")

SCOPE_PREFIX = "m3scope:"
# Innermost module scope -> family of the kernels that are not Triton kernels named above.
_BY_SCOPE = {
    "moe": "MoE routing", "norm": "norms / rope / cache write", "rope": "norms / rope / cache write",
    "linear": "linear", "lm_head": "lm_head", "embedding": "embedding",
}


def family(name: str, scope: str = "") -> str:
    """The family of one kernel (or CPU op) ``name`` launched under module scope ``scope`` (innermost last,
    '/'-separated; '' when unknown). The split-K merge of attention belongs to the attention it finishes."""
    for pattern, fam in _BY_NAME:
        if re.fullmatch(pattern, name):
            return fam
    inner = scope.rsplit("/", 1)[-1]
    if name == "_merge":
        return "sparse attention" if "attention.sparse" in scope else "dense attention"
    if inner in _BY_SCOPE:
        return _BY_SCOPE[inner]
    return "copies" if _COPY.search(name) else "elementwise"


@dataclasses.dataclass
class Kernel:
    """One device kernel (or, on the CPU, one top-level op) of a step: microseconds on the profiler's clock."""

    name: str
    start: float
    end: float
    scope: str = ""


def busy_intervals(kernels: list[Kernel]) -> list[tuple[float, float]]:
    """The union of the kernels' [start, end) intervals, sorted and disjoint."""
    out: list[list[float]] = []
    for k in sorted(kernels, key=lambda k: k.start):
        if out and k.start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], k.end)
        else:
            out.append([k.start, k.end])
    return [(a, b) for a, b in out]


def step_summary(kernels: list[Kernel]) -> dict:
    """Span (first start to last end), busy time (union), gaps = span - busy, launches, the widest gaps and the
    kernels on either side of them, and device time / launches per family (overlapping kernels each count their
    own time, so the families' times can exceed the busy time when kernels run concurrently); each gap is charged
    to the family of the kernel that ends it (``gap_before_us``: the launch latency of that family's kernels)."""
    if not kernels:
        return dict(launches=0, span_us=0.0, busy_us=0.0, gaps_us=0.0, widest_gaps=[], families={})
    ks = sorted(kernels, key=lambda k: k.start)
    busy = busy_intervals(ks)
    span = busy[-1][1] - busy[0][0]
    busy_us = sum(b - a for a, b in busy)
    fams: dict[str, dict] = {}
    gaps = []
    for (_, a_end), (b_start, _) in zip(busy, busy[1:]):
        before = max((k for k in ks if k.end <= a_end), key=lambda k: k.end)
        after = ks[bisect.bisect_left([k.start for k in ks], b_start)]
        gaps.append(dict(us=b_start - a_end, after=before.name, before=after.name))
        f = fams.setdefault(family(after.name, after.scope), dict(us=0.0, launches=0, gap_before_us=0.0, kernels={}))
        f["gap_before_us"] += b_start - a_end
    for k in ks:
        f = fams.setdefault(family(k.name, k.scope), dict(us=0.0, launches=0, gap_before_us=0.0, kernels={}))
        f["us"] += k.end - k.start
        f["launches"] += 1
        f["kernels"][k.name] = f["kernels"].get(k.name, 0) + 1
    return dict(launches=len(ks), span_us=span, busy_us=busy_us, gaps_us=span - busy_us,
                widest_gaps=sorted(gaps, key=lambda g: -g["us"])[:5], families=fams)


def combine_steps(steps: list[dict], bytes_by_family: dict[str, int], bandwidth: float) -> dict:
    """Mean over steps of every number in ``step_summary``, with each family's bytes that must be read and the
    fraction of ``bandwidth`` (bytes/s) that reading them in the family's time would take (NaN without a time)."""
    n = len(steps)
    mean = lambda key: sum(s[key] for s in steps) / n  # noqa: E731
    out = dict(steps=n, launches=mean("launches"), span_us=mean("span_us"), busy_us=mean("busy_us"),
               gaps_us=mean("gaps_us"), widest_gaps=steps[-1]["widest_gaps"] if steps else [], families={})
    names = [f for f in FAMILIES if any(f in s["families"] for s in steps) or f in bytes_by_family]
    for f in names:
        us = sum(s["families"].get(f, {}).get("us", 0.0) for s in steps) / n
        gap = sum(s["families"].get(f, {}).get("gap_before_us", 0.0) for s in steps) / n
        launches = sum(s["families"].get(f, {}).get("launches", 0) for s in steps) / n
        kernels: dict[str, int] = {}
        for s in steps:
            for k, c in s["families"].get(f, {}).get("kernels", {}).items():
                kernels[k] = kernels.get(k, 0) + c
        need = bytes_by_family.get(f)
        frac = need / (us * 1e-6) / bandwidth if need and us > 0 and bandwidth == bandwidth else None
        out["families"][f] = dict(us=us, launches=launches, gap_before_us=gap, bytes=need, fraction_of_bandwidth=frac,
                                  kernels={k: c / n for k, c in sorted(kernels.items(), key=lambda kv: -kv[1])})
    return out


def align_scopes(replayed: list[str], eager: list[tuple[str, str]]) -> list[str]:
    """Scopes for a replayed step's kernel names from an eager step's (name, scope) launches: the longest matching
    runs of names (``difflib``) carry their scopes over; a replayed kernel with no eager counterpart (the graph
    backend's input copies, say) gets ''."""
    scopes = [""] * len(replayed)
    sm = difflib.SequenceMatcher(a=replayed, b=[n for n, _ in eager], autojunk=False)
    for a, b, size in sm.get_matching_blocks():
        for i in range(size):
            scopes[a + i] = eager[b + i][1]
    return scopes


class ModuleScopes:
    """Labels every forward of the model's modules with a profiler range ``m3scope:<what>`` (norm, rope, linear,
    attention.sparse / attention.dense, moe, mlp, layer, lm_head, embedding) while installed."""

    def __init__(self, model):
        from m3export.model.attention import Attention
        from m3export.model.layer import DecoderLayer
        from m3export.model.linear import Linear
        from m3export.model.mlp import DenseMLP, MoE
        from m3export.model.norm import RMSNorm
        from m3export.model.rope import Rotary

        kinds = ((RMSNorm, "norm"), (Rotary, "rope"), (Linear, "linear"), (MoE, "moe"), (DenseMLP, "mlp"),
                 (DecoderLayer, "layer"))
        self.hooks, self.open = [], []
        for mod in model.modules():
            what = next((w for cls, w in kinds if isinstance(mod, cls)), None)
            if isinstance(mod, Attention):
                what = "attention.sparse" if mod.sparse else "attention.dense"
            if mod is model.lm_head:
                what = "lm_head"
            if mod is model.model.embed_tokens:
                what = "embedding"
            if what is not None:
                self.hooks.append(mod.register_forward_pre_hook(lambda m, a, w=what: self._enter(w)))
                self.hooks.append(mod.register_forward_hook(lambda m, a, o: self._exit()))

    def _enter(self, what: str) -> None:
        rf = torch.profiler.record_function(SCOPE_PREFIX + what)
        rf.__enter__()
        self.open.append(rf)

    def _exit(self) -> None:
        self.open.pop().__exit__(None, None, None)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


class Scopes:
    """The module scope of a host moment: the ``m3scope:`` ranges that contain it, '/'-joined, outermost first.
    Found by time, not by the profiler's event tree, so a kernel linked to a runtime call or to a range itself
    gets its scope too."""

    def __init__(self, events):
        cpu = torch.autograd.DeviceType.CPU
        self.labels = sorted((e.time_range.start, e.time_range.end, e.name[len(SCOPE_PREFIX):]) for e in events
                             if e.device_type == cpu and e.name.startswith(SCOPE_PREFIX))

    def at(self, t: float) -> str:
        return "/".join(name for a, b, name in self.labels if a <= t <= b)


def _is_label(evt) -> bool:
    return evt.name.startswith(SCOPE_PREFIX) or evt.name.startswith("decode_step_")


def eager_launches(events) -> list[tuple[str, str]]:
    """(kernel name, module scope) of every device kernel of an eager step, in device order: each kernel's scope is
    that of the host op it is linked to (the profiler's correlation id). Where the profiler's events carry no
    links, the kernels each host op lists (``FunctionEvent.kernels``, in the ops' start order) stand in."""
    cpu, dev = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    scopes = Scopes(events)
    kernels = sorted((e for e in events if e.device_type == dev and not _is_label(e)), key=lambda e: e.time_range.start)
    if not any(getattr(e, "linked_correlation_id", 0) for e in kernels):
        host = sorted((e for e in events if e.device_type == cpu and getattr(e, "kernels", None)),
                      key=lambda e: e.time_range.start)
        return [(k.name, scopes.at(e.time_range.start)) for e in host for k in e.kernels]
    ops = {e.id: e for e in events if e.device_type == cpu and not getattr(e, "linked_correlation_id", 0)}
    out = []
    for e in kernels:
        linked = getattr(e, "linked_correlation_id", 0)
        op = ops.get(linked) if linked else None  # 0: linked to no host op
        out.append((e.name, scopes.at(op.time_range.start) if op is not None else ""))
    return out


def step_ranges(events) -> list[tuple[float, float]]:
    return sorted((e.time_range.start, e.time_range.end) for e in events
                  if e.name.startswith("decode_step_") and e.device_type == torch.autograd.DeviceType.CPU)


def device_kernels(events, ranges) -> list[list[Kernel]]:
    """The device kernels (and copies / memsets) that start inside each host step range."""
    steps: list[list[Kernel]] = [[] for _ in ranges]
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA or _is_label(e):
            continue
        for i, (a, b) in enumerate(ranges):
            if a <= e.time_range.start <= b:
                steps[i].append(Kernel(e.name, e.time_range.start, e.time_range.end))
    return [sorted(s, key=lambda k: k.start) for s in steps]


def host_ops(events, ranges) -> list[list[Kernel]]:
    """CPU stand-in for device kernels: the outermost ops (not labels) inside each step range, with their scopes."""
    steps: list[list[Kernel]] = [[] for _ in ranges]
    scopes = Scopes(events)
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or _is_label(e):
            continue
        p = e.cpu_parent
        while p is not None and _is_label(p):
            p = p.cpu_parent
        if p is not None:
            continue  # inside another op: counted with it
        for i, (a, b) in enumerate(ranges):
            if a <= e.time_range.start <= b:
                steps[i].append(Kernel(e.name, e.time_range.start, e.time_range.end, scopes.at(e.time_range.start)))
    return [sorted(s, key=lambda k: k.start) for s in steps]


def profile_shape(model, cfg, b: int, ctx: int, args, device: str, elt: int, bw: float) -> dict:
    """Profile ``args.steps`` steady decode steps of batch ``b`` at context ``ctx``; returns one JSON row."""
    from decode import decode_batch, fill_pool, step_bytes_by_family, touched_experts
    from m3export.runtime.backends.cuda_graph import GraphedTorchBackend
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device == "cuda"
    g = torch.Generator(device=device).manual_seed(1000 * b + ctx)
    batch, pages = decode_batch(b, ctx, args.page_size, device)
    from m3export.ops.kv_fp8 import resolve_cache_dtype

    cache_dtype = resolve_cache_dtype(args.kv_cache_dtype, model.lm_head.weight.dtype)
    max_len = max(ctx + 1, args.max_model_len or 0)  # the replayed step's block tables are this wide
    be = GraphedTorchBackend(model, cache_dtype, use_graphs=cuda, max_model_len=max_len)
    be.allocate(max(pages, -(-max_len // args.page_size)), args.page_size)
    for layer in be._caches:
        for pool in layer:
            fill_pool(pool, g, cache_dtype == torch.float8_e4m3fn)
    ids = torch.randint(0, cfg.vocab_size, (b,), device=device, generator=g)
    rows = torch.arange(b, device=device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    counts, hooks = touched_experts(model, ids, b)
    be.use_graphs = False
    be.forward(ids, batch, rows)
    for h in hooks:
        h.remove()
    need = step_bytes_by_family(model, cfg, b, ctx, elt, counts)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    # One eager step with module scopes: which module launched each kernel (a replay does not say).
    scopes = ModuleScopes(model)
    try:
        sync()
        with profile(activities=activities) as prof:
            with record_function("decode_step_eager"):
                be.forward(ids, batch, rows)
                sync()
        eager_events = prof.events()
    finally:
        scopes.remove()
    eager = eager_launches(eager_events) if cuda else []

    be.use_graphs = cuda
    # The engine hands this backend host batches (one pinned copy fills the graph's inputs) and device token ids
    # (sampled there): the replayed steps get the same, so their copies are the engine's.
    batch, rows = (batch.to("cpu"), rows.cpu()) if cuda else (batch, rows)
    for _ in range(3):  # capture (CUDA) and warm up
        be.forward(ids, batch, rows)
    sync()
    replayed = bool(be.replays) if cuda else False
    scopes = None if cuda else ModuleScopes(model)  # the CPU runs eagerly: its ops carry their scopes directly
    try:
        with profile(activities=activities) as prof:
            for i in range(args.steps):
                with record_function(f"decode_step_{i}"):
                    be.forward(ids, batch, rows)
                    sync()
        events = prof.events()
    finally:
        if scopes is not None:
            scopes.remove()
    ranges = step_ranges(events)
    if cuda:
        steps = device_kernels(events, ranges)
        for s in steps:
            for k, scope in zip(s, align_scopes([k.name for k in s], eager)):
                k.scope = scope
    else:
        steps = host_ops(events, ranges)
    row = dict(batch=b, context=ctx, graph_replayed=replayed, experts_touched=counts,
               bytes_needed=sum(need.values()), eager_launches=len(eager) if cuda else None,
               host_ms_per_step=sum(bb - a for a, bb in ranges) / len(ranges) / 1e3,
               **combine_steps([step_summary(s) for s in steps], need, bw))
    if cuda and not any(steps):
        row["error"] = "the profiler recorded no device kernel inside the steps (CUPTI did not trace the replays)"
    return row


def parse_settings(items: list[str]) -> dict:
    """``NAME=JSON`` items -> {name: {module: {part: {setting: value}}}}, each checked against the module's DEFAULTS
    (an unknown module, part or setting is an error naming it, before any model is built; the settings by
    ``_batch.launch_settings``, which every launcher reads them through)."""
    import importlib
    import json

    from m3export.plugins.kernels._batch import launch_settings

    out = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--settings {item!r}: expected NAME=JSON")
        try:
            over = json.loads(text)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--settings {name}: not JSON ({e})") from None
        if not isinstance(over, dict):
            raise SystemExit(f"--settings {name}: expected a JSON object {{module: {{part: {{...}}}}}}")
        for module, parts in over.items():
            try:
                defaults = importlib.import_module(f"m3export.plugins.kernels.{module}").DEFAULTS
            except (ImportError, AttributeError):
                raise SystemExit(f"--settings {name}: no kernel module {module!r} with DEFAULTS") from None
            for part, entries in parts.items():
                if part not in defaults:
                    raise SystemExit(f"--settings {name}: {module} has no part {part!r}; known: {sorted(defaults)}")
                try:
                    launch_settings(module, defaults, {part: entries}, part)
                except ValueError as e:
                    raise SystemExit(f"--settings {name}: {e}") from None
        out[name] = over
    return out


class launch_defaults:
    """Within the block, the kernel modules' DEFAULTS carry ``over``'s entries (what the model's ops launch with);
    restored on exit."""

    def __init__(self, over: dict):
        import importlib

        self.parts = [(importlib.import_module(f"m3export.plugins.kernels.{m}").DEFAULTS[part], entries)
                      for m, parts in over.items() for part, entries in parts.items()]

    def __enter__(self):
        self.saved = [dict(table) for table, _ in self.parts]
        for table, entries in self.parts:
            table.update(entries)

    def __exit__(self, *exc):
        for (table, _), saved in zip(self.parts, self.saved):
            table.clear()
            table.update(saved)


ATTENTION_PART = ("indexer scan", "top-k", "sparse attention")
"""The families of the sparse layers' attention, whose sum at batch 1 the attention-kernels issue compares across
contexts (its target: 128k within 1.2x of 4k)."""


def attention_part(rows: list[dict], bandwidth: float = float("nan")) -> dict:
    """Per settings, the batch-1 rows' ``ATTENTION_PART`` sum in us per step by context, and each context's sum over
    that of the shortest context profiled ({settings: {"us": {ctx: us}, "over_shortest": {ctx: ratio},
    "least_over_shortest": {ctx: ratio}}}).

    ``least_over_shortest`` is the least that ratio can be on this device: the shortest context's part as
    measured, plus the bytes the longer context's part must read beyond it (the families' ``bytes``: the index
    keys of the extra context; the sparse attention reads the same top-k blocks at every length) at ``bandwidth``.
    No kernel reads those bytes faster than the copy bandwidth, and the short part's time is not theirs to hide:
    at batch 1 it is launch and dependent-load latency (the scan's first key tile waits for the token's position,
    its block table entry and the page it names) that a longer scan pays too before its keys stream. It says what
    a target on the ratio asks of the kernels: below it, only a shorter short part (which raises the ratio) or
    fewer bytes."""
    out: dict = {}
    for r in rows:
        if r["batch"] == 1:
            fams = r["families"]
            us = sum(fams.get(f, {}).get("us", 0.0) for f in ATTENTION_PART)
            need = sum(fams.get(f, {}).get("bytes") or 0 for f in ATTENTION_PART)
            part = out.setdefault(r.get("settings", "default"), {"us": {}, "bytes": {}})
            part["us"][r["context"]], part["bytes"][r["context"]] = us, need
    for part in out.values():
        shortest = min(part["us"])
        first = part["us"][shortest]
        part["over_shortest"] = {c: (u / first if first else float("nan")) for c, u in part["us"].items()}
        part["least_over_shortest"] = {
            c: ((first + (b - part["bytes"][shortest]) / bandwidth * 1e6) / first if first else float("nan"))
            for c, b in part["bytes"].items()}
    return out


def print_table(res: dict) -> None:
    for r in res["rows"]:
        print(f"\n[{r.get('settings', 'default')}] batch {r['batch']}, context {r['context']} "
              f"({'graph replay' if r['graph_replayed'] else 'eager'}): "
              f"device span {r['span_us']:.0f} us = busy {r['busy_us']:.0f} + gaps {r['gaps_us']:.0f}; "
              f"{r['launches']:.0f} launches per step (eager step: {r['eager_launches']}); "
              f"{r['bytes_needed'] / 1e6:.0f} MB must be read; host {r['host_ms_per_step']:.2f} ms per step and sync")
        print(f"  {'family':<28} {'us':>8} {'%':>5} {'launches':>8} {'gap us':>7} {'MB':>8} {'% of bw':>7}  kernels")
        for f, v in r["families"].items():
            mb = f"{v['bytes'] / 1e6:8.1f}" if v["bytes"] else f"{'-':>8}"
            frac = f"{100 * v['fraction_of_bandwidth']:7.0f}" if v["fraction_of_bandwidth"] else f"{'-':>7}"
            share = 100 * v["us"] / r["span_us"] if r["span_us"] else float("nan")
            names = ", ".join(f"{k} x{c:g}" for k, c in list(v["kernels"].items())[:3])
            print(f"  {f:<28} {v['us']:8.1f} {share:5.1f} {v['launches']:8.1f} {v['gap_before_us']:7.1f} {mb} {frac}  "
                  f"{names[:90]}")
        print(f"  {'gaps (device idle)':<28} {r['gaps_us']:8.1f} "
              f"{100 * r['gaps_us'] / r['span_us'] if r['span_us'] else float('nan'):5.1f}")
        for gp in r["widest_gaps"][:3]:
            print(f"    gap {gp['us']:.1f} us between {gp['after'][:50]} and {gp['before'][:50]}")
    for name, part in res.get("attention_part", {}).items():
        cells = ", ".join(f"{c}: {u:.1f} us ({part['over_shortest'][c]:.2f}x; at least "
                          f"{part['least_over_shortest'][c]:.2f}x)" for c, u in sorted(part["us"].items()))
        print(f"\n[{name}] batch 1, {' + '.join(ATTENTION_PART)} per step (over the shortest context; the least "
              f"that can be: its part plus the extra bytes at the copy bandwidth): {cells}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--experts", type=int, default=128, help="routed experts (mini; the release has 128)")
    ap.add_argument("--weights", choices=["mxfp8", "bf16"], default="mxfp8")
    ap.add_argument("--shapes", default="1x4096,8x32768", help="batch x context pairs")
    ap.add_argument("--steps", type=int, default=5, help="profiled steady steps per shape")
    ap.add_argument("--page-size", type=int, default=None,
                    help="tokens per cache page (default: the engine's, runtime.engine.default_page_size: 16 for "
                         "M3's index blocks of 128; the profile used 64 until 2026-12-02)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "bf16", "fp8"], default="auto",
                    help="K/V and index-key pools: the model dtype (auto), bf16, or fp8 (E4M3 codes with per-row "
                         "fp32 scales, as `--kv-cache-dtype fp8` of the engine) (default: %(default)s)")
    ap.add_argument("--settings", action="append", default=None, metavar="NAME=JSON",
                    help="profile every shape under these kernel launch settings too, in the same process (one "
                         "model): NAME=JSON, JSON {kernel module: {part: {setting: value}}} over that module's "
                         "DEFAULTS, e.g. 'w16={\"lightning_indexer\": {\"topk\": {\"num_warps\": 16}}}'; "
                         "repeatable; the rows say which (default: the DEFAULTS alone, named 'default')")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the engine's max_model_len, which sets the width of a replayed step's block tables "
                         "(at least each shape's context + 1; default: that, an engine sized to each shape): a "
                         "4k-context step of a server configured for 128k is '--shapes 1x4096 --max-model-len 131073'")
    ap.add_argument("--bandwidth", type=float, default=None, help="bytes/s (default: measured copy bandwidth)")
    ap.add_argument("--json", default=None, help="default bench/results/decode_profile_{h200,cpu}.json")
    args = ap.parse_args(argv)
    settings = parse_settings(args.settings or ["default={}"])
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench/decode_profile.py needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2

    import decode
    from m3export.config import preset
    from m3export.runtime.engine import default_page_size

    if not cuda:  # the routing kernel that counts the experts a step touches runs interpreted on the CPU
        os.environ["TRITON_INTERPRET"] = "1"
    if cuda:
        cfg = dataclasses.replace(preset("mini"), num_local_experts=args.experts).validate()
        dtype = torch.bfloat16
        from m3export.plugins.kernels import register

        register()
        bw = args.bandwidth or decode.copy_bandwidth()
        args.page_size = args.page_size or default_page_size(cfg)
    else:  # tiny, fp32, the reference ops: the logic check
        cfg, dtype = preset("tiny"), torch.float32
        args.page_size = min(args.page_size or 4, 4)
        bw = args.bandwidth or float("nan")
        decode.SMOKE = True
    elt = torch.empty((), dtype=dtype).element_size()
    if args.kv_cache_dtype == "fp8":  # bytes per cached element: the E4M3 code and its row's fp32 scale, shared
        elt = 1 + 4 / cfg.head_dim  # by head_dim (index keys: index_head_dim, the same 128 in every preset)
    model = decode.build_model(cfg, args.weights == "mxfp8", args.device, dtype)
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu (logic check)", "torch": torch.__version__,
           "preset": "mini" if cuda else "tiny", "experts": cfg.num_local_experts, "weights": args.weights,
           "page_size": args.page_size, "kv_cache_dtype": args.kv_cache_dtype, "max_model_len": args.max_model_len,
           "bandwidth_TBps": bw / 1e12, "families": list(FAMILIES), "rows": []}
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    res["settings"] = settings
    for name, over in settings.items():
        with launch_defaults(over):
            for b, ctx in shapes:
                res["rows"].append(dict(settings=name, **profile_shape(model, cfg, b, ctx, args, args.device, elt,
                                                                       bw)))
                if cuda:
                    torch.cuda.empty_cache()
    res["attention_part"] = attention_part(res["rows"], bw)
    out = args.json or str(RESULTS / f"decode_profile_{'h200' if cuda else 'cpu'}.json")
    write_results(res, out)
    print_table(res)
    print(f"\n{out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
