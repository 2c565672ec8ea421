"""Host time of a decode step of the onnxruntime backend: what a step costs besides ONNX Runtime's own run, and
how many io_binding calls a steady step makes (``PagedSession`` binds once: 0).

For each batch x context every sequence decodes one token at position ``context`` through
``OnnxRuntimeBackend.forward`` (the engine's path), the same step repeated. Reported per row (medians of
``--reps``): ``step_ms``, the whole step until the device is done; ``enqueue_ms``, until ``forward`` returns
(on a sync-free CUDA path the host's share of the step); ``host_us``, the step with ORT's
``run_with_iobinding`` replaced by a no-op (binding, copies into the bound input buffers, output buffers,
checks: the session's own overhead); ``binding_calls``, the IOBinding calls (binds, get_outputs) of one steady
step. The pools hold zeros: ORT's time does not depend on their values.

  python bench/ort_step_host.py --artifact /tmp/art/tiny --provider cpu --threads 1   # CPU: the session's overhead
  python bench/ort_step_host.py --artifact art/mini-bf16 --provider cuda              # H200 + onnxruntime-gpu
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import decode_batch  # noqa: E402  (bench/decode.py: the decode step's batch)
from ort_gpu import timed_ms  # noqa: E402  (bench/ort_gpu.py: median ms, until done or until it returns)
from results_file import RESULTS, write_results  # noqa: E402  (bench/results_file.py)

BINDING_CALLS = ("bind_input", "bind_output", "bind_ortvalue_input", "bind_ortvalue_output", "get_outputs")


def count_binding_calls(fn) -> int:
    """IOBinding calls ``fn`` makes (the class's methods wrapped while it runs)."""
    from onnxruntime.capi.onnxruntime_inference_collection import IOBinding

    counts: Counter = Counter()
    originals = {m: getattr(IOBinding, m) for m in BINDING_CALLS}

    def counted(method):
        def call(*args, **kwargs):
            counts[method] += 1
            return originals[method](*args, **kwargs)
        return call

    try:
        for m in BINDING_CALLS:
            setattr(IOBinding, m, counted(m))
        fn()
    finally:
        for m, f in originals.items():
            setattr(IOBinding, m, f)
    return sum(counts.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--provider", default="cuda", help="ONNX Runtime execution provider (default: %(default)s)")
    ap.add_argument("--shapes", default=None, help="batch x context pairs (default: 1x4096,8x4096,1x32768,8x32768 "
                                                   "on a GPU EP, 1x64,8x256 on the CPU EP)")
    ap.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None, help="default: bench/results/ort_step_host_<device>.json")
    args = ap.parse_args()

    from m3export.export.artifact import load_artifact
    from m3export.plugins.onnxruntime.providers import parse_provider, require
    from m3export.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

    provider = require(parse_provider(args.provider))
    device = torch.device(provider.device)
    art = load_artifact(args.artifact, verify_checksums=False)
    backend = OnnxRuntimeBackend(art, provider, threads=args.threads)
    session = backend._main
    default = "1x64,8x256" if device.type == "cpu" else "1x4096,8x4096,1x32768,8x32768"
    shapes = [tuple(int(v) for v in s.split("x")) for s in (args.shapes or default).split(",")]
    import onnxruntime

    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "onnxruntime": onnxruntime.__version__, "provider": str(provider), "artifact": str(art.root),
           "dtype": art.manifest.dtype, "pools": len(session.pool_inputs), "threads": args.threads, "rows": []}
    print(f"{'batch':>5s} {'context':>7s} {'step ms':>8s} {'enqueue ms':>10s} {'host us':>8s} {'binding calls':>13s}")
    for batch, context in shapes:
        b, pages = decode_batch(batch, context, art.page_size, device)
        backend.allocate(pages, art.page_size)
        ids = torch.zeros(batch, dtype=torch.int64, device=device)
        rows = torch.arange(batch, device=device)
        step = lambda: backend.forward(ids, b, rows)  # noqa: E731 - its outputs dropped, as the engine does
        step_ms = timed_ms(step, args.reps, device, until_done=True)
        enqueue_ms = timed_ms(step, args.reps, device, until_done=False)
        calls = count_binding_calls(step)
        run = session.session.run_with_iobinding
        session.session.run_with_iobinding = lambda *a: None  # the session's own work only
        try:
            host_us = timed_ms(step, args.reps, device, until_done=False) * 1e3
        finally:
            del session.session.run_with_iobinding  # the class's method again
        assert session.session.run_with_iobinding.__func__ is run.__func__
        row = {"batch": batch, "context": context, "step_ms": step_ms, "enqueue_ms": enqueue_ms, "host_us": host_us,
               "binding_calls": calls}
        res["rows"].append(row)
        print(f"{batch:5d} {context:7d} {step_ms:8.3f} {enqueue_ms:10.3f} {host_us:8.1f} {calls:13d}", flush=True)
    name = "h200" if "H200" in res["device"] else device.type
    write_results(res, args.json or RESULTS / f"ort_step_host_{name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
