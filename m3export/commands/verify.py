"""``m3export verify``: the artifact in ONNX Runtime against the PyTorch model rebuilt from it."""

from __future__ import annotations

import argparse

from ..plugins.onnxruntime.providers import add_argument as add_provider_argument
from .arguments import bounded_int

NAME = "verify"
HELP = ("Run an artifact in ONNX Runtime (any execution provider, paged caches bound in place) next to its PyTorch "
        "model over a prefill and decode steps; report per-output errors, block-selection and greedy-token "
        "agreement.")
EXAMPLES = """\
  m3export verify art/tiny
  m3export verify art/tiny --decode-steps 8 --tolerance 1e-5
  m3export verify art/mini --provider cuda        # the CUDA execution provider (pip install onnxruntime-gpu)
  m3export verify /data/MiniMax-M3-MXFP8 --fast     # an in-place artifact, without hashing its shards
"""


_count = bounded_int(0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", metavar="DIR", help="artifact directory written by 'm3export export'")
    p.add_argument("--decode-steps", type=_count, default=4, help="decode / multi-token steps after the prefill")
    p.add_argument("--tolerance", type=float, default=None,
                   help="max relative error per output (default: 1e-4 for float32, looser for 16-bit)")
    add_provider_argument(p)
    p.add_argument("--fast", action="store_true",
                   help="skip hashing the files (the weight file and, for an in-place artifact, every linked "
                        "checkpoint shard); sizes and shard headers are still checked")


def run(args: argparse.Namespace) -> int:
    from ..export.verify import verify_artifact
    from ..plugins.onnxruntime.providers import parse_provider, require

    provider = require(parse_provider(args.provider))  # before loading anything: a missing EP is one line
    report = verify_artifact(args.artifact, decode_steps=args.decode_steps, tolerance=args.tolerance,
                             hash_files=not args.fast, providers=provider.session_providers())
    print("\n".join(report.lines()))
    return 0 if report.passed else 1
