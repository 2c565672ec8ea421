"""``m3export build``: TensorRT engines for an artifact (the graphs' TensorRT flavour, the m3 plugins, optimisation
profiles for decode and prefill steps over the dynamic token / sequence / page dimensions, a timing cache, engine
metadata)."""

from __future__ import annotations

import argparse

from .arguments import bounded_int

NAME = "build"
HELP = ("Build TensorRT engines from an artifact: m3 nodes become the m3 plugins (Triton kernels compiled ahead of "
        "time), optimisation profiles for decode steps (up to --max-batch tokens) and for every step (up to "
        "--max-num-tokens) span the token / batch / page dimensions. Needs TensorRT and a GPU.")
EXAMPLES = """\
  m3export build art/mini --out engines/mini
  m3export build art/mini --out engines/mini --max-num-tokens 8192 --max-batch 128 --max-model-len 131072
  m3export build art/mini --out engines/mini --timing-cache ~/.cache/m3export/h200.cache   # reuse tactic timings
  m3export build art/tiny --out engines/tiny --graphs model              # the main graph only, no MTP graphs
Without TensorRT the command stops at once with one line naming what to install.
"""


_positive = bounded_int(1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..build.profiles import DEFAULTS

    p.add_argument("artifact", metavar="ARTIFACT", help="artifact directory written by 'm3export export'")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for the engines, flavour graphs and "
                   "build.json (created; must be empty unless --force)")
    p.add_argument("--max-num-tokens", type=_positive, default=DEFAULTS["max_num_tokens"],
                   help="most new tokens in one step (prefill chunk + decodes), the largest profile's max T "
                        "(default %(default)s)")
    p.add_argument("--max-batch", type=_positive, default=DEFAULTS["max_batch"],
                   help="most sequences in one step, the profiles' max B; also the max T of the decode profile "
                        "(default %(default)s)")
    p.add_argument("--max-model-len", type=_positive, default=None,
                   help="longest sequence (prompt + output): block-table width and the indexer top-k's block "
                        f"bound (default: the config's max_position_embeddings, at most {DEFAULTS['max_model_len']})")
    p.add_argument("--num-pages", type=_positive, default=None,
                   help="pages of the cache pools the engine is built for (default: max-batch x pages of "
                        "max-model-len, plus one)")
    p.add_argument("--timing-cache", metavar="FILE", default=None,
                   help="TensorRT timing cache to read and update (default: DIR/timing.cache)")
    p.add_argument("--graphs", default=None, help="comma-separated graphs to build (default: model and every mtpK)")
    p.add_argument("--force", action="store_true", help="replace a non-empty DIR")


def run(args: argparse.Namespace) -> int:
    from ..build.engine import build_engines

    result = build_engines(args.artifact, args.out, max_num_tokens=args.max_num_tokens, max_batch=args.max_batch,
                           max_model_len=args.max_model_len, num_pages=args.num_pages,
                           timing_cache=args.timing_cache,
                           graphs=args.graphs.split(",") if args.graphs else None, force=args.force)
    print(f"engines in {result}")
    return 0
