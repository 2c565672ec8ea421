"""The sampled pass of a decode step (``runtime.acceptance.decide`` for rows that verify no draft): the sampling
kernel (``plugins/kernels/sampling.py``) against the batched float64 definitions, in the same run.

``decide`` is called with ``--vocab``-wide float32 logits already on the device (as a GPU backend leaves them), each
path forced in turn (``acceptance.sampling_kernel``), for each batch size and sampling mode:

* ``wall``: microseconds a call, its one device-to-host copy included (what the engine's ``sample`` phase pays);
* ``device``: the device time of the kernels a call launched (torch.profiler, mean over the calls);
* ``redone``: rows the kernel flagged (a top-p nucleus past its candidates) and ``decide`` redrew with the
  definitions, per call;
* ``same``: whether both paths gave every row the same token (they must, up to float64 rounding: see the kernel
  module's docstring).

Modes: ``temp`` (temperature 0.8), ``topk_topp`` (0.8, top-k 50, top-p 0.95), ``topp`` (0.8, top-p 0.95 on peaked
logits, N(0, 16): a nucleus of ~150 tokens, within the kernel's candidates), ``topp_flat`` (top-p 0.95 on N(0, 4)
logits: a nucleus of ~39k tokens, every row redone), ``topk`` (0.8, top-k 50), ``minp`` (0.8, min-p 0.05).

  python bench/sampling.py --device cuda                  # H200: batch 1 / 8 / 64, every mode
  python bench/sampling.py --device cuda --batches 1,2,4 --modes temp,topp --calls 50
  python bench/sampling.py --device cpu --vocab 4096 --batches 1 --calls 2   # interpreter: checks the script only
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: m3export
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: results_file
from results_file import RESULTS, write_results  # noqa: E402

from m3export.runtime import SamplingParams  # noqa: E402
from m3export.runtime import acceptance  # noqa: E402
from m3export.runtime.acceptance import Row, decide  # noqa: E402
from m3export.runtime.sampling import PositionalRandom  # noqa: E402

MODES = {  # name: (params, logits scale)
    "temp": (SamplingParams(temperature=0.8), 4.0),
    "topk_topp": (SamplingParams(temperature=0.8, top_k=50, top_p=0.95), 4.0),
    "topp": (SamplingParams(temperature=0.8, top_p=0.95), 4.0),
    "topp_flat": (SamplingParams(temperature=0.8, top_p=0.95), 2.0),
    "topk": (SamplingParams(temperature=0.8, top_k=50), 4.0),
    "minp": (SamplingParams(temperature=0.8, min_p=0.05), 4.0),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(logits: torch.Tensor, params: SamplingParams, kernel: bool, calls: int) -> dict:
    """One path of ``decide`` over ``calls`` steps (positions 0..calls-1, so every call draws new uniforms)."""
    from torch.profiler import ProfilerActivity, profile

    dev = logits.device
    real = acceptance.sampling_kernel
    redone = []
    real_redo = acceptance._redo
    acceptance.sampling_kernel = lambda device, p: kernel
    acceptance._redo = lambda x, rows, flagged: redone.extend(flagged) or real_redo(x, rows, flagged)
    try:
        rngs = [PositionalRandom(1000 + i) for i in range(logits.shape[0])]

        def step(pos):
            return [r.token for r in decide(logits, [Row(params, rng, pos) for rng in rngs])]

        for pos in range(3):  # compile, warm the allocator
            step(pos)
        redone.clear()
        _sync(dev)
        tokens, t0 = [], time.perf_counter()
        for pos in range(calls):
            tokens.append(step(pos))
        _sync(dev)
        wall = (time.perf_counter() - t0) / calls * 1e6
        device_us = float("nan")
        if dev.type == "cuda":
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for pos in range(calls):
                    step(pos)
                _sync(dev)
            device_us = sum(e.device_time for e in prof.events() if e.device_time > 0) / calls
        return {"wall_us": wall, "device_us": device_us, "redone_per_call": len(redone) / calls, "tokens": tokens}
    finally:
        acceptance.sampling_kernel = real
        acceptance._redo = real_redo


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="where the logits are (default: %(default)s)")
    ap.add_argument("--batches", default="1,8,64", help="rows per step, comma-separated (default: %(default)s)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"any of {', '.join(MODES)} (default: all)")
    ap.add_argument("--vocab", type=int, default=200064, help="logits per row (default: M3's %(default)s)")
    ap.add_argument("--calls", type=int, default=20, help="timed decide calls per setting (default: %(default)s)")
    ap.add_argument("--json", default=None, help="default bench/results/sampling_<device type>.json")
    args = ap.parse_args()
    dev = torch.device(args.device)
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown mode {m!r} (expected {', '.join(MODES)})")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    rows = []
    print(f"decide, sampled rows without drafts, vocabulary {args.vocab}, {name}; us a call (wall / device)")
    print(f"{'mode':>10} {'batch':>5} {'definitions':>19} {'kernel':>19} {'redone':>7} {'same':>5} {'wall x':>7}")
    for batch in [int(b) for b in args.batches.split(",")]:
        for m in modes:
            params, scale = MODES[m]
            gen = torch.Generator().manual_seed(batch)
            logits = (torch.randn(batch, args.vocab, generator=gen) * scale).to(dev)
            ref = measure(logits, params, False, args.calls)
            ker = measure(logits, params, True, args.calls)
            same = ref.pop("tokens") == ker.pop("tokens")
            row = {"mode": m, "batch": batch, "definitions": ref, "kernel": ker, "same_tokens": same,
                   "wall_ratio": ref["wall_us"] / ker["wall_us"]}
            rows.append(row)
            print(f"{m:>10} {batch:>5} {ref['wall_us']:>9.0f} / {ref['device_us']:>7.0f} "
                  f"{ker['wall_us']:>9.0f} / {ker['device_us']:>7.0f} {ker['redone_per_call']:>7.1f} "
                  f"{str(same):>5} {row['wall_ratio']:>6.2f}x")
    out = write_results({"device": name, "vocab": args.vocab, "calls": args.calls, "rows": rows},
                        args.json or RESULTS / f"sampling_{dev.type}.json")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
