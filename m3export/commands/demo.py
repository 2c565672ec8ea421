"""``m3export demo``: the main job on the embedded default, end to end, in one command.

A tiny random-weight M3 is written as a real checkpoint (original layout, with MTP module and tokenizer),
exported to an ONNX artifact, verified in ONNX Runtime against PyTorch, and generated from (ONNX Runtime
backend, with MTP speculation) — every step through the same code paths a real checkpoint takes.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

NAME = "demo"
HELP = "Run the main job on the embedded tiny default: synth -> export -> verify -> generate."
EXAMPLES = """\
  m3export demo
  m3export demo --workdir /tmp/m3demo --prompt "Once upon a time" --max-tokens 48
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", help="where to keep the checkpoint and artifact (default: a temporary directory)")
    p.add_argument("--prompt", default="The quick brown fox", help="prompt for the generation step")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    p.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "torch"],
                   help="runtime backend for the generation step")


def run(args: argparse.Namespace) -> int:
    from ..cli import main

    with tempfile.TemporaryDirectory(prefix="m3demo-") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        ckpt, art = work / "checkpoint", work / "artifact"
        steps = [
            ("synth", [] if ckpt.exists() else ["synth", "--preset", "tiny", "--out", str(ckpt)]),
            ("export", [] if art.exists() else ["export", "--checkpoint", str(ckpt), "--out", str(art)]),
            ("verify", ["verify", str(art)]),
            ("generate", ["generate", str(art), "--prompt", args.prompt, "--max-tokens", str(args.max_tokens),
                          "--backend", args.backend, "--speculative", "2", "--seed", "0"]),
        ]
        for title, argv in steps:
            if not argv:
                print(f"== {title}: reusing {work}", flush=True)
                continue
            print(f"== {title}: m3export {' '.join(argv)}", flush=True)
            rc = main(argv)
            if rc:
                print(f"== {title} failed (exit {rc})")
                return rc
        print(f"== done: checkpoint {ckpt}, artifact {art}" if args.workdir else "== done")
    return 0
