"""Attention-side Triton kernels on the GPU at ``mini`` dimensions: correctness against the references, then speed.

    python bench/attention.py [--out bench/results/attention.json] [--quick]

Dimensions are M3's per layer (``mini`` = ``full`` per layer): 64 query / 4 KV heads of 128, 4 index heads of
128, index blocks of 128 tokens, top-16, one local block; pages of 128 tokens (= the index block), bf16.

For every kernel and shape it prints and records: the median time of an eager call (``triton.testing.do_bench``;
Python launch cost included) and, for decode, of the same calls replayed from a CUDA graph (the kernels' own
time, as a serving loop with graphs sees it), the bytes it must move (each input read once, each output written
once) and the FLOPs it must do, the fraction of the copy bandwidth and of the bf16 tensor-core rate measured in
the same run (a 2 GiB device copy; an 8192^3 bf16 matmul), and the speed-up of the eager call over the
reference (``m3export.ops``, eager) where the reference fits in memory and time.
Small inputs are read from several page sets in turn so that repeated calls do not run from L2.

Sparse prefill is timed on two selection sources (``bench/prefill_selections.py``): the indexer's on random index
queries (the worst case: neighbouring tokens share few blocks) and on index keys and queries that drift along the
prompt (a documented model of a real prompt's selections); each row records the selections' adjacent-token overlap
and the union of 4 / 8 / 16 consecutive tokens' blocks over top-k, and counts FLOPs over each token's own selected
keys, never a tile's union.

Correctness, on the same inputs: block selections must equal the reference's exactly; attention outputs must lie
within ``paged_attention.output_error_bound`` (3.06 * 2^-8 * max|V| in bf16: P rounded for the tensor-core
product, the output rounded on each side, fp32 score and rescaling error; derived beside it). Long prefills are
checked on their last tokens against a reference called for those tokens alone (it gathers only their context),
since the full reference is quadratic in memory.

``--kv-cache-dtype fp8``: the pools are E4M3 with per-row fp32 scales (``m3export.ops.kv_fp8``); kernels and
references read the same bytes, max|V| is that of the values as read, and a cached element counts one byte plus
its share of the row's 4-byte scale.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefill_selections import overlap_stats, prefill_selection, selected_keys  # noqa: E402
from results_file import write_results  # noqa: E402  (bench/results_file.py)

HQ, HKV, D, HI, DI = 64, 4, 128, 4, 128
BS, TOPK, LOCAL, INIT, PAGE = 128, 16, 1, 0, 128
SCALE = D**-0.5


def bench(fn):
    """Median seconds; calls over 50 ms (long prefills) are timed twice with events instead of do_bench."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(2):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    if min(times) > 0.05:
        return min(times)
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def graph_seconds(fn, sets, reps=10):
    """Kernel time without Python launch cost: ``reps`` calls (cycling the page sets) captured in one CUDA
    graph, replayed and timed with events, per call. The launchers never sync, so they capture as is."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for s in sets:
            fn(*s)  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(*sets[i % len(sets)])
    return bench(g.replay) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/attention.json")
    ap.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    ap.add_argument("--kv-cache-dtype", choices=["bf16", "fp8"], default="bf16",
                    help="K/V and index-key pools in bf16, or E4M3 with per-row fp32 scales")
    ap.add_argument("--sweep", action="store_true",
                    help="instead: time each kernel's DEFAULTS against its VARIANTS (bench/attention_sweep.py; "
                         "its own options follow, e.g. --sweep --out $OUT/attention_sweep.json)")
    if "--sweep" in sys.argv[1:]:
        import attention_sweep

        return attention_sweep.main([a for a in sys.argv[1:] if a != "--sweep"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/attention.py needs a CUDA device")

    import triton

    from m3export.ops.attention import paged_attention_reference, sparse_paged_attention_reference
    from m3export.ops.indexer import lightning_indexer_reference
    from m3export.plugins.kernels import lightning_indexer as LI
    from m3export.plugins.kernels import paged_attention as PA
    from m3export.plugins.kernels import sparse_paged_attention as SPA

    dev = torch.device("cuda")
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d"), "dims": dict(hq=HQ, hkv=HKV, d=D, index_heads=HI, index_dim=DI,
                                                           block=BS, topk=TOPK, local=LOCAL, page=PAGE),
           "kv_cache_dtype": args.kv_cache_dtype, "checks": [], "rows": []}

    def check_selection(name, sel, ref, iq, ikc, bt, qsl, sl, pos):
        """Exact, up to fp32 near-ties by the conformance suite's rule (``m3export.ops.conformance``: two blocks
        whose float64 scores are closer than an fp32 dot can resolve may come out in either order)."""
        from m3export.ops.conformance import Verdict, _compare_selection, upcast

        v = Verdict()
        if fp8:  # the near-tie rule on the keys as read
            ikc = dequantize_rows(ikc, iks, torch.float64)
        _compare_selection(sel, ref, upcast([iq, ikc, bt, qsl, sl, pos]),
                           dict(block_size=BS, topk_blocks=TOPK, local_blocks=LOCAL, init_blocks=INIT), v)
        check(name, v.ok, f"{len(v.failures)} (token, head) rows differ beyond fp32 near-ties, "
              f"{len(v.near_ties)} near-tie rows, of {sel.shape[0] * sel.shape[1]}")

    # ---- ceilings, measured now
    a = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    copy_bw = 2 * a.numel() / bench(lambda: b.copy_(a))
    del a, b
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    y = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    mm_rate = 2 * 8192**3 / bench(lambda: x @ y)
    del x, y
    res["copy_bytes_per_s"], res["bf16_flops_per_s"] = copy_bw, mm_rate
    print(f"copy {copy_bw / 1e12:.2f} TB/s, bf16 matmul {mm_rate / 1e12:.0f} TFLOP/s", flush=True)

    # ---- one pool for every shape: 64 sequences of 128k tokens
    max_tokens = (8 if args.quick else 64) * 131072
    pages = max_tokens // PAGE + 64
    kc = torch.randn(pages, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
    vc = torch.randn(pages, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
    ikc = torch.randn(pages, PAGE, DI, device=dev, dtype=torch.bfloat16)
    perm = torch.randperm(pages, device=dev).to(torch.int32)
    fp8 = args.kv_cache_dtype == "fp8"
    kv_bytes_per_element = 1 + 4 / D if fp8 else 2
    if fp8:
        import functools

        from m3export.ops.kv_fp8 import FP8, dequantize_rows, quantize_rows

        def quantized(pool):
            """E4M3 pool + scales, a few thousand pages at a time (fp32 temporaries of the whole pool would not
            fit beside it)."""
            q = torch.empty(pool.shape, dtype=FP8, device=dev)
            s = torch.empty(pool.shape[:-1], device=dev)
            for i in range(0, pool.shape[0], 4096):
                q[i:i + 4096], s[i:i + 4096] = quantize_rows(pool[i:i + 4096])
            return q, s

        (kc, ks), (vc, vs), (ikc, iks) = quantized(kc), quantized(vc), quantized(ikc)
        LI_forward = functools.partial(LI.forward, index_k_scale=iks)
        SPA_forward = functools.partial(SPA.forward, k_scale=ks, v_scale=vs)
        PA_forward = functools.partial(PA.forward, k_scale=ks, v_scale=vs)
        lightning_indexer_reference = functools.partial(lightning_indexer_reference, index_k_scale=iks)
        sparse_paged_attention_reference = functools.partial(sparse_paged_attention_reference, k_scale=ks,
                                                             v_scale=vs)
        paged_attention_reference = functools.partial(paged_attention_reference, k_scale=ks, v_scale=vs)
    else:
        LI_forward, SPA_forward, PA_forward = LI.forward, SPA.forward, PA.forward

    def batch(bsz, ctx, new, offset=0):
        """bsz sequences of ctx tokens (the last ``new`` new), pages from the shuffled pool from ``offset``."""
        per = -(-ctx // PAGE)
        need = bsz * per
        start = offset % max(1, pages - need)
        bt = perm[start:start + need].view(bsz, per).contiguous()
        qsl = torch.arange(0, bsz + 1, device=dev, dtype=torch.int32) * new
        sl = torch.full((bsz,), ctx, device=dev, dtype=torch.int32)
        pos = (torch.arange(ctx - new, ctx, device=dev).repeat(bsz)).long()
        return bt, qsl, sl, pos

    def rotating(bsz, ctx, new, bytes_read):
        """Several page sets when one would sit in L2 (60 MB) so repeated calls read HBM."""
        n = 1 if bytes_read > 256e6 else 8
        step = pages // n
        return [batch(bsz, ctx, new, i * step) for i in range(n)]

    def cycle(fn, sets):
        state = {"i": 0}

        def run():
            s = sets[state["i"] % len(sets)]
            state["i"] += 1
            return fn(*s)
        return run

    def row(kernel, mode, bsz, ctx, t_eager, t_ref, nbytes, flops, extra=None, graph=None):
        """``seconds``: one eager call (Python launch cost included); ``graph_seconds``: the same replayed from a
        CUDA graph (kernel time). Fractions of the ceilings use the graph time where there is one."""
        t_k = graph or t_eager
        r = dict(kernel=kernel, mode=mode, batch=bsz, context=ctx, seconds=t_eager, graph_seconds=graph,
                 bytes=nbytes, flops=flops, frac_copy_bw=nbytes / t_k / copy_bw, frac_bf16_peak=flops / t_k / mm_rate,
                 reference_seconds=t_ref, speedup_vs_reference=(t_ref / t_eager) if t_ref else None)
        if extra:
            r.update(extra)
        res["rows"].append(r)
        ref_s = f"{t_ref * 1e3:9.2f}" if t_ref else "      n/a"
        sp = f"{t_ref / t_eager:8.1f}x" if t_ref else "      n/a"
        gr = f"{graph * 1e6:8.1f}" if graph else "     n/a"
        print(f"{kernel:10s} {mode:8s} B={bsz:<3d} ctx={ctx:<7d} {t_eager * 1e6:9.1f} us graph {gr} us  "
              f"{nbytes / t_k / 1e12:5.2f} TB/s ({100 * r['frac_copy_bw']:5.1f}%)  "
              f"{flops / t_k / 1e12:6.1f} TFLOP/s ({100 * r['frac_bf16_peak']:5.1f}%)  ref {ref_s} ms {sp}"
              + "".join(f"  {k} {v:.3g}" if isinstance(v, float) else f"  {k} {v}" for k, v in (extra or {}).items()),
              flush=True)

    def check(name, ok, detail):
        res["checks"].append(dict(name=name, ok=bool(ok), detail=detail))
        print(f"CHECK {name}: {'ok' if ok else 'FAILED'} {detail}", flush=True)

    def save():  # after every shape, so that a run cut short still leaves its numbers
        res["all_checks_ok"] = all(c["ok"] for c in res["checks"])
        write_results(res, args.out)  # and a copy in $OUT on the device machine

    def guarded(name, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001  (recorded as a failed check; the other shapes still run)
            check(name, False, f"{type(e).__name__}: {e}"[:500])
            torch.cuda.synchronize()
        save()

    def time_ref(fn):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    if fp8:  # the attention bound takes max|V| as read
        vmax = max(dequantize_rows(vc[i:i + 4096], vs[i:i + 4096]).abs().max().item()
                   for i in range(0, vc.shape[0], 4096))
    else:
        vmax = max(vc.amax().item(), -vc.amin().item())
    bound = PA.output_error_bound(torch.bfloat16, vmax, fp8)  # derived in plugins/kernels/paged_attention.py
    decode_shapes = [(b, c) for b in (1, 8, 64) for c in (4096, 32768, 131072)]
    if args.quick:
        decode_shapes = [(1, 4096), (8, 32768), (1, 131072)]

    def decode(bsz, ctx):
        iq = torch.randn(bsz, HI, DI, device=dev, dtype=torch.bfloat16)
        q = torch.randn(bsz, HQ, D, device=dev, dtype=torch.bfloat16)
        idx_bytes = bsz * ctx * DI * kv_bytes_per_element
        sets = rotating(bsz, ctx, 1, idx_bytes)
        ref_ok = bsz * ctx <= 8 * 32768 or (bsz == 1)
        # indexer
        sel = LI_forward(iq, ikc, *sets[0], BS, TOPK, LOCAL, INIT)
        t_ref = None
        if ref_ok:
            ref = lightning_indexer_reference(iq, ikc, *sets[0], BS, TOPK, LOCAL, INIT)
            check_selection(f"indexer decode B={bsz} ctx={ctx}", sel, ref, iq, ikc, *sets[0])
            t_ref = time_ref(lambda: lightning_indexer_reference(iq, ikc, *sets[0], BS, TOPK, LOCAL, INIT))
        t = bench(cycle(lambda *s: LI_forward(iq, ikc, *s, BS, TOPK, LOCAL, INIT), sets))
        tg = graph_seconds(lambda *s: LI_forward(iq, ikc, *s, BS, TOPK, LOCAL, INIT), sets)
        row("indexer", "decode", bsz, ctx, t, t_ref, idx_bytes + bsz * HI * TOPK * 4, 2 * bsz * HI * ctx * DI,
            graph=tg)
        # top-k alone on a prepared block-score buffer
        nb = -(-ctx // BS)
        scores = torch.randn(bsz, HI, nb, device=dev)
        pos = sets[0][3]
        topk_launch = lambda: LI.block_topk(scores, pos, BS, TOPK, LOCAL, INIT)  # noqa: E731  (the launch alone)
        row("topk", "decode", bsz, ctx, bench(topk_launch), None, scores.numel() * 4 + bsz * HI * TOPK * 4, 0,
            graph=graph_seconds(lambda: topk_launch(), [()]))
        # sparse attention on the indexer's selection
        kv_bytes = bsz * HKV * min(TOPK * BS, ctx) * 2 * D * kv_bytes_per_element
        t_ref = None
        o = SPA_forward(q, kc, vc, *sets[0], sel, BS, SCALE)
        if ref_ok:
            ref = sparse_paged_attention_reference(q, kc, vc, *sets[0], sel, BS, SCALE)
            err = (o.float() - ref.float()).abs().max().item()
            check(f"sparse decode B={bsz} ctx={ctx}", err <= bound, f"max abs err {err:.2e}")
            t_ref = time_ref(lambda: sparse_paged_attention_reference(q, kc, vc, *sets[0], sel, BS, SCALE))
        sels = [LI_forward(iq, ikc, *s, BS, TOPK, LOCAL, INIT) for s in sets]
        ssets = [(*s, x) for s, x in zip(sets, sels)]
        t = bench(cycle(lambda *s: SPA_forward(q, kc, vc, *s[:4], s[4], BS, SCALE), ssets))
        tg = graph_seconds(lambda *s: SPA_forward(q, kc, vc, *s[:4], s[4], BS, SCALE), ssets)
        row("sparse", "decode", bsz, ctx, t, t_ref, kv_bytes + 2 * q.numel() * 2,
            4 * bsz * HQ * min(TOPK * BS, ctx) * D, graph=tg)
        # dense paged attention
        dense_bytes = bsz * ctx * HKV * 2 * D * kv_bytes_per_element
        dsets = rotating(bsz, ctx, 1, dense_bytes)
        t_ref = None
        o = PA_forward(q, kc, vc, *dsets[0], SCALE)
        if ref_ok and bsz * ctx <= 8 * 32768:
            ref = paged_attention_reference(q, kc, vc, *dsets[0], SCALE)
            err = (o.float() - ref.float()).abs().max().item()
            check(f"dense decode B={bsz} ctx={ctx}", err <= bound, f"max abs err {err:.2e}")
            t_ref = time_ref(lambda: paged_attention_reference(q, kc, vc, *dsets[0], SCALE))
        t = bench(cycle(lambda *s: PA_forward(q, kc, vc, *s, SCALE), dsets))
        tg = graph_seconds(lambda *s: PA_forward(q, kc, vc, *s, SCALE), dsets)
        row("dense", "decode", bsz, ctx, t, t_ref, dense_bytes + 2 * q.numel() * 2, 4 * bsz * HQ * ctx * D,
            graph=tg)

    for bsz, ctx in decode_shapes:
        guarded(f"decode B={bsz} ctx={ctx}", lambda: decode(bsz, ctx))

    prefill = [4096, 16384] if args.quick else [4096, 16384, 65536]

    def prefill_one(n):
        s = batch(1, n, n)
        iq = torch.randn(n, HI, DI, device=dev, dtype=torch.bfloat16)
        q = torch.randn(n, HQ, D, device=dev, dtype=torch.bfloat16)
        tail = 64  # last tokens checked against a reference that gathers only their context
        bt, _, sl, pos = s
        tail_args = (bt, torch.tensor([0, tail], device=dev, dtype=torch.int32), sl, pos[-tail:])
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        sel = LI_forward(iq, ikc, *s, BS, TOPK, LOCAL, INIT)
        peak = torch.cuda.max_memory_allocated() - base
        ref = lightning_indexer_reference(iq[-tail:], ikc, *tail_args, BS, TOPK, LOCAL, INIT)
        check_selection(f"indexer prefill {n} (last {tail} tokens)", sel[-tail:], ref, iq[-tail:], ikc, *tail_args)
        t_ref = time_ref(lambda: lightning_indexer_reference(iq, ikc, *s, BS, TOPK, LOCAL, INIT)) if n <= 4096 \
            else None
        t = bench(lambda: LI_forward(iq, ikc, *s, BS, TOPK, LOCAL, INIT))
        row("indexer", "prefill", 1, n, t, t_ref, n * DI * 2 * 2, 2 * HI * DI * n * (n + 1) // 2,
            dict(peak_scratch_bytes=peak))
        o = SPA_forward(q, kc, vc, *s, sel, BS, SCALE)
        ref = sparse_paged_attention_reference(q[-tail:], kc, vc, *tail_args, sel[-tail:], BS, SCALE)
        err = (o[-tail:].float() - ref.float()).abs().max().item()
        check(f"sparse prefill {n} (last {tail} tokens)", err <= bound, f"max abs err {err:.2e}")
        t_ref = time_ref(lambda: sparse_paged_attention_reference(q, kc, vc, *s, sel, BS, SCALE)) if n <= 4096 \
            else None
        sparse_bytes = 2 * n * HQ * D * 2 + n * HKV * 2 * D * kv_bytes_per_element
        t = bench(lambda: SPA_forward(q, kc, vc, *s, sel, BS, SCALE))
        # FLOPs of the work the op must do: each token's distinct usable selected keys (not a tile's union)
        row("sparse", "prefill", 1, n, t, t_ref, sparse_bytes, 4 * (HQ // HKV) * D * selected_keys(sel, pos, BS),
            dict(selection="random", **overlap_stats(sel, pos, s[1], BS)))
        # the same on selections like the model's (bench/prefill_selections.py: the indexer kernel on index keys
        # and queries that drift along the prompt); the random row above is the worst case
        msel, _ = prefill_selection(LI.forward, "model", n, HI, DI, PAGE, BS, TOPK, LOCAL, INIT, dev)
        o = SPA_forward(q, kc, vc, *s, msel, BS, SCALE)
        ref = sparse_paged_attention_reference(q[-tail:], kc, vc, *tail_args, msel[-tail:], BS, SCALE)
        err = (o[-tail:].float() - ref.float()).abs().max().item()
        check(f"sparse prefill {n}, model selections (last {tail} tokens)", err <= bound, f"max abs err {err:.2e}")
        t = bench(lambda: SPA_forward(q, kc, vc, *s, msel, BS, SCALE))
        row("sparse", "prefill", 1, n, t, None, sparse_bytes, 4 * (HQ // HKV) * D * selected_keys(msel, pos, BS),
            dict(selection="model", **overlap_stats(msel, pos, s[1], BS)))
        o = PA_forward(q, kc, vc, *s, SCALE)
        ref = paged_attention_reference(q[-tail:], kc, vc, *tail_args, SCALE)
        err = (o[-tail:].float() - ref.float()).abs().max().item()
        check(f"dense prefill {n} (last {tail} tokens)", err <= bound, f"max abs err {err:.2e}")
        t_ref = time_ref(lambda: paged_attention_reference(q, kc, vc, *s, SCALE)) if n <= 4096 else None
        t = bench(lambda: PA_forward(q, kc, vc, *s, SCALE))
        row("dense", "prefill", 1, n, t, t_ref, 2 * n * HQ * D * 2 + n * HKV * 2 * D * kv_bytes_per_element,
            4 * HQ * D * n * (n + 1) // 2)

    for n in prefill:
        guarded(f"prefill {n}", lambda: prefill_one(n))

    # batch 1: indexer + sparse attention of one decode step at 128k over the same at 4k
    one = {(r["kernel"], r["context"]): r["graph_seconds"] or r["seconds"]
           for r in res["rows"] if r["mode"] == "decode" and r["batch"] == 1}
    if ("indexer", 131072) in one and ("indexer", 4096) in one:
        res["batch1_indexer_plus_sparse_128k_over_4k"] = (one["indexer", 131072] + one["sparse", 131072]) / (
            one["indexer", 4096] + one["sparse", 4096])
        print(f"batch 1, indexer + sparse: 128k / 4k = {res['batch1_indexer_plus_sparse_128k_over_4k']:.2f}")
    save()
    print(f"wrote {args.out}; checks {'all ok' if res['all_checks_ok'] else 'FAILED'}")
    return 0 if res["all_checks_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
