"""One launch of the block top-k (``m3::lightning_indexer``'s second kernel), profiled alone: what a decode step pays.

``bench/attention.py --sweep`` times a kernel as back-to-back graph replays, where one launch's ramp-up hides behind
the last one's tail; a decode step launches the top-k once per layer between other kernels. Here each setting is
launched ``--reps`` times, one launch at a time, and torch.profiler gives each launch's own device time (median):

* ``warm``: the launches one after another;
* ``cold``: a 512 MB write before each launch, so the block maxima and the kernel's code come from HBM, as after a
  step's MoE weights went through L2.

Inputs: batch-1 decode rows at M3's dims (4 index heads, blocks of 128 keys, top-16, one local block), random block
maxima of a context of ``--contexts`` tokens. Every setting's ids are checked against the reference's selection
(``m3export.ops.indexer.select_blocks``) before it is timed.

  python bench/topk_launch.py                                   # H200: default + every top-k variant, 4k / 32k / 128k
  python bench/topk_launch.py --contexts 131072 --variants bitonic-w8-g16 --reps 50
  python bench/topk_launch.py --contexts 4096,32768,131072 --table-context 131072   # rows of a 128k engine
  python bench/topk_launch.py --device cpu --contexts 2048 --reps 1   # interpreter: checks the script only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: m3export
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: results_file
from results_file import RESULTS, write_results  # noqa: E402

HEADS, BLOCK, TOPK, LOCAL, INIT = 4, 128, 16, 1, 0


def time_launches(run, reps: int, flush: torch.Tensor | None) -> float:
    """Median device time (us) of one ``run()`` launch over ``reps``, each alone; ``flush``: written before each."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if flush is not None:
                flush.fill_(1)
            run()
        torch.cuda.synchronize()
    times = [e.device_time for e in prof.events() if "_block_topk" in e.name and e.device_time > 0]
    return statistics.median(times) if times else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="(default: %(default)s)")
    ap.add_argument("--contexts", default="4096,32768,131072", help="decode positions (default: %(default)s)")
    ap.add_argument("--variants", default="", help="comma-separated lightning_indexer.VARIANTS['topk'] names "
                    "beside the defaults (default: all of them)")
    ap.add_argument("--table-context", type=int, default=None,
                    help="each row's block maxima as wide as this context's blocks (a decode graph's block table is "
                         "as wide as max_model_len, whatever the row's own context) (default: the row's own)")
    ap.add_argument("--reps", type=int, default=30, help="launches per setting and mode (default: %(default)s)")
    ap.add_argument("--json", default=None, help="default bench/results/topk_launch_{h200,cpu}.json")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench/topk_launch.py needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from m3export.ops.indexer import select_blocks
    from m3export.plugins.kernels import lightning_indexer as LI

    names = [v for v in args.variants.split(",") if v] or list(LI.VARIANTS["topk"])
    unknown = [v for v in names if v not in LI.VARIANTS["topk"]]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {sorted(LI.VARIANTS['topk'])}")
    settings = {"default": None, **{n: {"topk": LI.VARIANTS["topk"][n]} for n in names
                                    if LI.VARIANTS["topk"][n] != LI.DEFAULTS["topk"]}}
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda") if cuda else None
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)", "torch": torch.__version__,
           "reps": args.reps, "table_context": args.table_context, "defaults": LI.DEFAULTS["topk"], "rows": []}
    gen = torch.Generator().manual_seed(0)
    print(f"{'context':>8} {'blocks':>6} {'setting':<24} {'warm us':>8} {'cold us':>8}")
    for ctx in (int(c) for c in args.contexts.split(",")):
        nb = -(-(max(ctx, args.table_context or 0) + 1) // BLOCK)
        scores = torch.randn(1, HEADS, nb, generator=gen).to(args.device)
        pos = torch.tensor([ctx], device=args.device)
        want = select_blocks(scores.cpu(), pos.cpu(), BLOCK, TOPK, LOCAL, INIT)
        for name, config in settings.items():
            align = (config or {}).get("topk", LI.DEFAULTS["topk"])["align"]
            laid_out = LI.block_maxima_buffer(1, HEADS, nb, args.device, align)  # as ``forward``'s scan leaves them
            laid_out.copy_(scores)

            def run():
                return LI.block_topk(laid_out, pos, BLOCK, TOPK, LOCAL, INIT, config=config)
            if not torch.equal(run().cpu(), want):
                raise SystemExit(f"{name} at context {ctx}: ids differ from the reference's (ops.indexer.select_blocks)")
            row = dict(context=ctx, blocks=nb, setting=name, config=(config or {}).get("topk", LI.DEFAULTS["topk"]))
            if cuda:
                row["warm_us"] = time_launches(run, args.reps, None)
                row["cold_us"] = time_launches(run, args.reps, flush)
            res["rows"].append(row)
            fmt = lambda k: f"{row[k]:8.2f}" if k in row else f"{'-':>8}"  # noqa: E731
            print(f"{ctx:>8} {nb:>6} {name:<24} {fmt('warm_us')} {fmt('cold_us')}", flush=True)
    out = write_results(res, args.json or RESULTS / f"topk_launch_{'h200' if cuda else 'cpu'}.json")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
