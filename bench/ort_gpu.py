"""Decode step of an exported artifact in ONNX Runtime (an execution provider, CUDA by default) beside the torch
backend on the same artifact, in the same run, with the roofline.

For each batch x context the K/V and index-key pools are filled with random values (the same bytes on both sides:
the torch backend's pools are copied into ONNX Runtime's) and every sequence decodes one token at position
``context``. Reported per row: milliseconds of one ``forward`` step of each backend (median of ``--reps``), the
ratio ORT / torch, ORT's cost at each context over its cost at the smallest one (the issue's target: within 1.3x
from 4k to 32k, and within 2x of the torch backend with kernels), whether both pick the same greedy tokens, and
the roofline (bytes the step must read, ``bench/decode.py``'s ``step_bytes``, over the device-to-device copy
bandwidth measured in the same run).

Variants: ``plain`` is the artifact as exported (every ``m3`` node runs its ONNX function body); ``lowered`` is
its ``ort-contrib`` flavour (``export --flavour ort-contrib [--lower MoE,MXFP8Linear,PagedAttention]``:
``com.microsoft`` kernels, experimental, ``m3export/export/lowering.py``; which lowerings it holds is copied from
the manifest into the JSON), timed with its greedy agreement and largest logit difference to the torch backend
when the artifact has it. The lowered logits are held to twice the plain graph's own largest difference to the
torch backend (floor: one bf16 ulp of the logit scale): the lowering's extra error (the norm gain ``1 + w`` rounded
to the activation dtype, another rounding order inside the fused ops) is about one more 16-bit rounding of the
values two 16-bit implementations already round differently (``tests/test_ort_cuda_stream.py`` uses the same
bound). ``ort_enqueue_ms`` is how long ``forward`` takes to return before the device finishes: well under the
step on a sync-free path (ORT on torch's stream), the whole step where something waits on the host.

  python bench/ort_gpu.py --artifact art/mini-bf16              # H200 + onnxruntime-gpu: table + JSON
  python bench/ort_gpu.py --smoke --artifact art/tiny           # CPU script check (CPU EP, fp32 tiny artifact)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import decode_batch, step_bytes  # noqa: E402  (bench/decode.py: the one decode-step roofline)
from results_file import write_results  # noqa: E402  (bench/results_file.py)

SMOKE = False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn, reps: int, device: torch.device, until_done: bool = True) -> float:
    """Median milliseconds of ``fn``, the device idle before each call; ``until_done``: until the device has
    finished it (ORT may run on a stream of its own), else until ``fn`` returns (the host's share of a step)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        if until_done:
            _sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    _sync(device)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device) -> float:
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = timed_ms(lambda: b.copy_(a), 20, device)
    return 2 * a.numel() / (ms * 1e-3)


def copy_pages(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """The torch backend's pool ``src`` into a session's pool ``dst``, page for page. The graphed torch backend
    (CUDA) allocates one scratch page past the ones asked for (its padded rows write there), so ``src`` may have
    more pages than ``dst``; the batch addresses only pages below ``dst``'s count."""
    if src.shape[0] < dst.shape[0] or src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"pool {name}: the torch backend's {tuple(src.shape)} cannot fill ORT's {tuple(dst.shape)}")
    dst.copy_(src[:dst.shape[0]])


def main() -> int:
    global SMOKE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", required=True, help="exported artifact (a bf16 `mini` one on the H200)")
    ap.add_argument("--provider", default="cuda", help="ONNX Runtime execution provider (default: %(default)s)")
    ap.add_argument("--shapes", default="1x4096,1x32768,8x4096,8x32768", help="batch x context pairs")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "ort_gpu_h200.json"))
    ap.add_argument("--smoke", action="store_true", help="CPU EP, short contexts: checks the script, measures nothing")
    args = ap.parse_args()
    SMOKE = args.smoke

    from m3export.export.artifact import load_artifact
    from m3export.plugins.onnxruntime.providers import parse_provider, require
    from m3export.runtime.backends import create_backend
    from m3export.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

    provider = require(parse_provider("cpu" if SMOKE else args.provider))
    device = torch.device(provider.device)
    art = load_artifact(args.artifact, verify_checksums=False)
    cfg, page = art.config, art.page_size
    ort_be = OnnxRuntimeBackend(art, provider)
    lowered_be, lowered_error = None, None
    if "ort-contrib" in art.manifest.flavours:
        try:  # a lowering ORT cannot load here is a result to report, not the end of the benchmark
            lowered_be = OnnxRuntimeBackend(art, provider, flavour="ort-contrib")
        except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
            lowered_error = f"{type(e).__name__}: {e}"[:2000]
    torch_be = create_backend("torch", args.artifact, device=str(device))
    if SMOKE:  # the class the GPU gets (CUDA graphs off here): its pools hold a scratch page past the sessions'
        from m3export.runtime.backends.cuda_graph import GraphedTorchBackend

        torch_be = GraphedTorchBackend(torch_be.model, torch_be.dtype, use_graphs=False, pad_eagerly=True)
    elt = torch.empty((), dtype=ort_be.graph_dtype.torch).element_size()
    shapes = [(1, 40), (2, 90)] if SMOKE else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    bw = copy_bandwidth(device)
    import onnxruntime

    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)",
           "onnxruntime": onnxruntime.__version__, "provider": str(provider), "artifact": str(art.root),
           "dtype": art.manifest.dtype, "mxfp8": art.manifest.mxfp8, "page_size": page,
           "copy_bandwidth_TBps": bw / 1e12,
           "lowered": "ort-contrib flavour (experimental)" if lowered_be else lowered_error or
                      "not in this artifact (export it with --flavour ort-contrib)",
           "lowerings": {g: {k: r.get(k) for k in ("lowered", "applied", "kept", "gain_rounding")}
                         for g, r in art.manifest.flavours.get("ort-contrib", {}).items()},
           "rows": []}
    print(f"{'batch':>5s} {'context':>7s} {'torch ms':>9s} {'ort ms':>9s} {'enqueue':>8s} {'ort/torch':>9s} "
          f"{'vs first':>8s} {'roofline ms':>11s}  greedy")
    first: dict[int, float] = {}
    g = torch.Generator(device=device).manual_seed(0)
    for batch, context in shapes:
        b, pages = decode_batch(batch, context, page, device)
        for be in (x for x in (ort_be, lowered_be, torch_be) if x is not None):
            be.allocate(pages, page)
        for pool in (p for layer in torch_be._caches for p in layer):
            pool.normal_(0.0, 1.0, generator=g)
        for session in [be._main for be in (ort_be, lowered_be) if be is not None]:  # the same bytes, graph order
            for name, pool in zip(session.pool_inputs, (p for layer in torch_be._caches for p in layer)):
                copy_pages(session.pool_tensors[name], pool, name)
        ids = torch.randint(0, cfg.vocab_size, (batch,), generator=g, device=device)
        rows = torch.arange(batch, device=device)
        with torch.no_grad():
            lo, _ = ort_be.forward(ids, b, rows)
            lt, _ = torch_be.forward(ids, b, rows)
            same = bool((lo.argmax(-1) == lt.argmax(-1)).all())
            plain_diff = float((lo - lt).abs().max())
            t_ms = timed_ms(lambda: torch_be.forward(ids, b, rows), args.reps, device)
            o_ms = timed_ms(lambda: ort_be.forward(ids, b, rows), args.reps, device)
            o_enqueue = timed_ms(lambda: ort_be.forward(ids, b, rows), args.reps, device, until_done=False)
            lowered = {}
            if lowered_be is not None:
                try:
                    ll, _ = lowered_be.forward(ids, b, rows)
                    diff = float((ll - lt).abs().max())
                    bound = max(2 * plain_diff, 2.0 ** -8 * float(lt.abs().max()))
                    lowered = {"ort_lowered_ms": timed_ms(lambda: lowered_be.forward(ids, b, rows), args.reps,
                                                          device),
                               "lowered_greedy_same": bool((ll.argmax(-1) == lt.argmax(-1)).all()),
                               "lowered_max_abs_logit_diff": diff, "lowered_logit_bound": bound,
                               "lowered_within_bound": diff <= bound}
                except Exception as e:  # noqa: BLE001 - e.g. a kernel ORT lacks for these shapes
                    lowered = {"lowered_error": f"{type(e).__name__}: {e}"[:2000]}
        first.setdefault(batch, o_ms)
        roof_ms = step_bytes(torch_be.model, cfg, batch, context, elt, {
            i: cfg.num_local_experts for i in range(cfg.num_hidden_layers)}) / bw * 1e3
        row = {"batch": batch, "context": context, "torch_ms": t_ms, "ort_plain_ms": o_ms,
               "ort_enqueue_ms": o_enqueue, "plain_max_abs_logit_diff": plain_diff,
               "ort_over_torch": o_ms / t_ms,
               "ort_over_first_context": o_ms / first[batch], "roofline_ms_all_experts": roof_ms,
               "greedy_same": same,
               "pool_pages": {"torch": int(torch_be._caches[0][0].shape[0]),
                              "ort": int(next(iter(ort_be._main.pool_tensors.values())).shape[0])},
               **lowered}
        res["rows"].append(row)
        low = (f"  lowered {lowered['ort_lowered_ms']:.2f} ms "
               f"{'same' if lowered['lowered_greedy_same'] else 'DIFFERENT'} "
               f"{'within' if lowered['lowered_within_bound'] else 'OUTSIDE'} bound" if "ort_lowered_ms" in lowered
               else f"  lowered: {lowered['lowered_error'][:80]}" if lowered else "")
        print(f"{batch:5d} {context:7d} {t_ms:9.2f} {o_ms:9.2f} {o_enqueue:8.2f} {o_ms / t_ms:9.2f} "
              f"{o_ms / first[batch]:8.2f} "
              f"{roof_ms:11.3f}  {'same' if same else 'DIFFERENT'}{low}", flush=True)
    write_results(res, args.json)
    return 0 if all(r["greedy_same"] and r.get("lowered_greedy_same", True) and r.get("lowered_within_bound", True)
                    for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
