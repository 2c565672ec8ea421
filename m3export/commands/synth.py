"""``m3export synth``: write a random-weight checkpoint (either layout, BF16/FP32/MXFP8) for tests and demos."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

NAME = "synth"
HELP = "Write a synthetic random-weight M3 checkpoint (sharded safetensors + config + tokenizer)."
EXAMPLES = """\
  m3export synth --preset tiny --out ckpt/tiny
  m3export synth --preset tiny --out ckpt/tiny-hf --layout hf --dtype mxfp8
  m3export synth --preset tiny --out ckpt/tiny-nomtp --no-mtp --seed 3
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny", choices=["tiny", "mini"],
                   help="model size (the full release is exported from sparse files: bench/export_full.py)")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--layout", default="original", choices=["original", "hf"],
                   help="tensor names: MiniMax's release layout or the transformers layout")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32", "mxfp8"], help="weight format")
    p.add_argument("--seed", type=int, default=0, help="weights depend only on (seed, tensor name)")
    p.add_argument("--shard-mb", type=int, default=64, help="approximate shard size in MiB")
    p.add_argument("--no-mtp", action="store_true", help="leave the MTP modules out (as the public release does)")


#: Key synth adds to the checkpoint's config.json, so that what runs it later can say its weights are random.
RANDOM_WEIGHTS_KEY = "m3export_random_weights"


def has_random_weights(source: str) -> bool:
    """True for a checkpoint directory that ``m3export synth`` wrote (its config.json carries the mark), and for
    an artifact exported from a preset or from such a checkpoint (its manifest's ``source`` says which)."""
    from ..sources import MANIFEST

    def marked(checkpoint: Path) -> bool:
        return bool(json.loads((checkpoint / "config.json").read_text(encoding="utf-8")).get(RANDOM_WEIGHTS_KEY))

    root = Path(source)
    try:
        if (root / MANIFEST).is_file():  # an artifact (an in-place one names its own directory)
            origin = json.loads((root / MANIFEST).read_text(encoding="utf-8")).get("source", "")
            kind, _, where = origin.partition(":")
            return kind == "preset" or (kind == "checkpoint" and marked(Path(where)))
        return marked(root)
    except (OSError, ValueError, AttributeError):
        return False  # not readable as either: whoever loads it reports that


def run(args: argparse.Namespace) -> int:
    from ..checkpoint.writer import write_checkpoint
    from ..config import preset

    cfg = preset(args.preset)
    out = write_checkpoint(args.out, cfg, args.layout, args.dtype, seed=args.seed, shard_bytes=args.shard_mb << 20,
                           with_mtp=not args.no_mtp, with_tokenizer=args.preset == "tiny")
    config = Path(out) / "config.json"
    raw = json.loads(config.read_text(encoding="utf-8"))
    raw[RANDOM_WEIGHTS_KEY] = {"seed": args.seed}
    config.write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.preset} checkpoint ({args.layout} layout, {args.dtype}, random weights from seed {args.seed}: "
          f"its generations are meaningless by design) to {out}")
    return 0
