"""Sharded loading: what each rank of a tensor-parallel group reads and holds, against one process.

Two parts:

1. The release (``full``, MXFP8 as shipped), computed on the ``meta`` device from the shard models
   (``m3export.parallel.build_shard``): bytes resident per rank at TP 1 / 2 / 4 / 8, with and without expert
   parallelism (no weights are built).
2. Measured: a synthetic checkpoint (``mini`` dims, fewer layers / experts and a 32k vocabulary so that it is a
   couple of GB; ``--fmt`` mxfp8 or bf16, ``--layout``) loaded by 1 process and by ``--tp`` ranks (gloo, CPU):
   bytes each rank copies out of the shards, its peak RSS (``VmHWM``: interpreter + torch + the shard + the page
   cache of the mapped shards it touched), its anonymous RSS after loading, and the wall time (each load in its
   own process).

  python bench/parallel_load.py [--tp 2] [--fmt mxfp8] [--layout original] [--dir /tmp/m3-parallel-ckpt]
  # table + bench/results/parallel_load_<fmt>.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import RESULTS, write_results  # noqa: E402

from m3export.config import preset  # noqa: E402
from m3export.parallel import ParallelConfig, build_shard, load_model_shard  # noqa: E402
from m3export.parallel.loading import LoadStats  # noqa: E402
from m3export.parallel.spawn import run_ranks  # noqa: E402


def bench_config():
    return dataclasses.replace(preset("mini"), vocab_size=32000, num_hidden_layers=2, layer_types=preset("mini")
                               .layer_types[:2], mlp_layer_types=["dense", "sparse"], num_local_experts=8,
                               bos_token_id=1, eos_token_id=[2]).validate()


def release_per_rank() -> list[dict]:
    cfg = preset("full")
    rows = []
    for tp, ep in ((1, False), (2, False), (4, False), (8, False), (2, True), (4, True), (8, True)):
        model = build_shard(cfg, ParallelConfig(tp, ep), 0, torch.bfloat16, "meta", mxfp8=True,
                            num_mtp_modules=cfg.num_mtp_modules)
        rows.append(dict(tp=tp, ep=ep, bytes_per_rank=sum(p.numel() * p.element_size() for p in model.parameters())))
    return rows


def rank_load(rank: int, world: int, ckpt: str, ep: bool, out: str) -> None:
    """One rank, in its own process (so its peak memory is its own); world 1 is plain ``load_model``."""
    start = time.perf_counter()
    model = load_model_shard(ckpt, ParallelConfig(world, ep), rank, dtype=torch.bfloat16)
    stats = getattr(model, "load_stats", None)
    if stats is None:  # one process: load_model, which reads every tensor whole
        stats = LoadStats(bytes_read=None)
        stats.measure_memory()
    Path(out, f"rank{rank}.json").write_text(json.dumps({**stats.to_dict(), "seconds": time.perf_counter() - start}))
    del model


def measured(ckpt: Path, tp: int) -> list[dict]:
    rows = []
    for world, ep in ((1, False), (tp, False), (tp, True)):
        with tempfile.TemporaryDirectory() as tmp:
            run_ranks(rank_load, world, str(ckpt), ep, tmp, timeout_s=1800)
            for r in range(world):
                rows.append(dict(tp=world, ep=ep, rank=r, **json.loads(Path(tmp, f"rank{r}.json").read_text())))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--fmt", choices=("mxfp8", "bf16"), default="mxfp8")
    ap.add_argument("--layout", choices=("original", "hf"), default="original")
    ap.add_argument("--dir", default=None, help="where the synthetic checkpoint is (written if missing)")
    args = ap.parse_args()
    from m3export.checkpoint.writer import write_checkpoint

    cfg = bench_config()
    ckpt = Path(args.dir or Path(tempfile.gettempdir()) / f"m3-parallel-ckpt-{args.fmt}-{args.layout}")
    if not (ckpt / "config.json").exists():
        write_checkpoint(ckpt, cfg, layout=args.layout, fmt=args.fmt, progress=False, with_tokenizer=False)
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    release = release_per_rank()
    rows = measured(ckpt, args.tp)
    res = dict(config=dict(hidden_size=cfg.hidden_size, layers=cfg.num_hidden_layers, experts=cfg.num_local_experts,
                           vocab=cfg.vocab_size, fmt=args.fmt, layout=args.layout), checkpoint_bytes=size,
               release_mxfp8_per_rank=release, measured=rows)
    path = write_results(res, RESULTS / f"parallel_load_{args.fmt}.json")
    print("The release (full, MXFP8), resident bytes per rank (meta):")
    print(f"{'tp':>3} {'ep':>5} {'GB per rank':>12}")
    for r in release:
        print(f"{r['tp']:>3} {str(r['ep']):>5} {r['bytes_per_rank'] / 1e9:>12.1f}")
    print(f"\nMeasured, synthetic checkpoint of {size / 1e9:.2f} GB ({args.fmt}, {args.layout} layout), "
          "loaded in bf16:")
    print(f"{'tp':>3} {'ep':>5} {'rank':>4} {'read GB':>8} {'share':>6} {'peak RSS GB':>11} {'anon RSS GB':>11} "
          f"{'s':>6}")
    for r in rows:
        read = "-" if r["bytes_read"] is None else f"{r['bytes_read'] / 1e9:.2f}"
        share = "-" if r["bytes_read"] is None else f"{r['bytes_read'] / size:.2f}"
        print(f"{r['tp']:>3} {str(r['ep']):>5} {r['rank']:>4} {read:>8} {share:>6} {r['peak_rss_bytes'] / 1e9:>11.2f} "
              f"{r['anon_rss_bytes'] / 1e9:>11.2f} {r['seconds']:>6.1f}")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
