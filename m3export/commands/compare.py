"""``m3export compare``: the same paged steps through several backends, with a per-output error table."""

from __future__ import annotations

import argparse

NAME = "compare"
HELP = ("Run the same paged batches (a mixed prefill of two sequences, then decodes, then each MTP graph) through "
        "several backends and print, per output, each backend's error against the first one.")
EXAMPLES = """\
  m3export compare art/tiny                                     # torch vs onnxruntime (the defaults)
  m3export compare art/tiny --backends torch,onnxruntime --decode-steps 8
  m3export compare engines/mini --backends torch,tensorrt --device cuda    # an engine directory of 'm3export build'
The first backend is the reference. A backend that is unavailable here is reported with the reason and makes the
command exit with status 1; so does an output over its tolerance (default by dtype: fp32 1e-4, fp16 2e-2,
bf16 5e-2 of the reference's largest value, as 'm3export verify').
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", metavar="ARTIFACT", help="artifact directory written by 'm3export export'")
    p.add_argument("--backends", default="torch,onnxruntime",
                   help="comma-separated backends, the first is the reference (default %(default)s; choices: torch, "
                        "onnxruntime, tensorrt)")
    p.add_argument("--decode-steps", type=int, default=3, help="decode steps after the prefill (default %(default)s)")
    p.add_argument("--device", default="cpu", help="device of the torch backend and the batches (default cpu)")
    p.add_argument("--tolerance", type=float, default=None, help="max relative error per output (default by dtype)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt tokens (default 0)")


def run(args: argparse.Namespace) -> int:
    from ..compare import compare_backends

    report = compare_backends(args.artifact, [b.strip() for b in args.backends.split(",") if b.strip()],
                              decode_steps=args.decode_steps, device=args.device, tolerance=args.tolerance,
                              seed=args.seed)
    print("\n".join(report.lines()))
    return 0 if report.passed else 1
