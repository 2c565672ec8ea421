"""``m3export demo``: the main job on the embedded default, end to end, in one command.

The embedded checkpoint (``m3export.embedded``: a small M3 trained on Python source, original layout, two MTP
modules, BPE tokenizer) is exported to an ONNX artifact, verified in ONNX Runtime against PyTorch, and generated
from (ONNX Runtime backend, with MTP speculation) — every step through the same code paths a real checkpoint
takes. ``--checkpoint`` runs the same job on any other checkpoint.
"""

from __future__ import annotations

import argparse
import shlex
import tempfile
from pathlib import Path

from .arguments import bounded_int, check_text

NAME = "demo"
HELP = "Run the main job on the embedded trained default: export -> verify -> generate (speculative)."
EXAMPLES = """\
  m3export demo
  m3export demo --workdir /tmp/m3demo --prompt "class Stack:" --max-tokens 48
  m3export demo --checkpoint ckpt/tiny                      # any checkpoint (m3export synth writes random ones)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", help="where to keep the checkpoint and artifact (default: a temporary directory)")
    p.add_argument("--checkpoint", metavar="DIR", help="checkpoint to run (default: the embedded trained model)")
    p.add_argument("--prompt", default="    for i in range(len(items)):", help="prompt for the generation step")
    p.add_argument("--max-tokens", type=bounded_int(1), default=32,
                   help="tokens to generate (checked before anything runs)")
    p.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "torch"],
                   help="runtime backend for the generation step")


def run(args: argparse.Namespace) -> int:
    from ..cli import main
    from ..embedded import default_model

    check_text("--prompt", args.prompt)  # now, not after export and verify have run

    with tempfile.TemporaryDirectory(prefix="m3demo-") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        ckpt, art = Path(args.checkpoint) if args.checkpoint else default_model(), work / "artifact"
        steps = [
            ("export", [] if art.exists() else ["export", "--checkpoint", str(ckpt), "--out", str(art)]),
            ("verify", ["verify", str(art)]),
            ("generate", ["generate", str(art), "--prompt", args.prompt, "--max-tokens", str(args.max_tokens),
                          "--backend", args.backend, "--speculative", "2", "--temperature", "0"]),
        ]
        from .synth import has_random_weights

        if not args.checkpoint:
            print(f"== model: the embedded default {ckpt.name} ({ckpt}): a small M3 trained on the Python standard "
                  "library's source, so it continues Python code (docs/embedded_model.md)", flush=True)
        else:
            print(f"== model: {ckpt}", flush=True)
        if has_random_weights(str(ckpt)):
            print(f"== note: {ckpt} holds random weights (m3export synth): the generated text is meaningless by "
                  "design", flush=True)
        for title, argv in steps:
            if not argv:
                print(f"== {title}: reusing {work}", flush=True)
                continue
            print(f"== {title}: {shlex.join(['m3export', *argv])}", flush=True)  # pasteable as it is
            rc = main(argv)
            if rc:
                print(f"== {title} failed (exit {rc})")
                return rc
        print(f"== done: checkpoint {ckpt}, artifact {art}" if args.workdir else "== done")
    return 0
