"""Full-size export benchmark: the release's shapes and dtypes, from sparse files, on a small machine.

Creates a synthetic checkpoint with every tensor of the full configuration (valid safetensors headers, real
shapes and dtypes, data regions left as holes so it takes no disk), exports it in place (zero copy), and
reports wall time, peak RSS and the bytes the export wrote, next to what a materialising export would need.
Prints a table and writes JSON (bench/results/export_full.json by default).

  python bench/export_full.py                       # full release, original layout, MXFP8 + 7 MTP modules
  python bench/export_full.py --preset mini --keep  # smaller, keep the directory for inspection
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write_results  # noqa: E402  (bench/results_file.py)


def allocated(path: Path) -> int:
    """Bytes actually on disk (holes excluded) under ``path``."""
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def apparent(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", choices=["full", "mini"])
    ap.add_argument("--layout", default="original", choices=["original", "hf"])
    ap.add_argument("--format", default="mxfp8", choices=["mxfp8", "bf16"])
    ap.add_argument("--dtype", default="bfloat16", help="graph dtype passed to m3export export")
    ap.add_argument("--workdir", help="where to create the sparse checkpoint (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint + artifact afterwards")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "export_full.json"))
    args = ap.parse_args()

    from m3export.checkpoint.sparse import write_sparse_checkpoint
    from m3export.config import preset

    work = Path(args.workdir or tempfile.mkdtemp(prefix="m3-export-full-"))
    ckpt = work / "checkpoint"
    try:
        t0 = time.perf_counter()
        write_sparse_checkpoint(ckpt, preset(args.preset), args.layout, args.format)
        t_synth = time.perf_counter() - t0
        before_alloc, ckpt_bytes = allocated(ckpt), apparent(ckpt)
        before = {p.name for p in ckpt.iterdir()}

        cmd = [sys.executable, "-m", "m3export.cli", "export", "--checkpoint", str(ckpt), "--in-place",
               "--dtype", args.dtype]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            print(proc.stderr[-4000:], file=sys.stderr)
            return proc.returncode
        peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        new = [ckpt / n for n in sorted({p.name for p in ckpt.iterdir()} - before)]
        written = sum(p.stat().st_size for p in new)
        grown = allocated(ckpt) - before_alloc - sum(p.stat().st_blocks * 512 for p in new)
        graph_bytes = sum(p.stat().st_size for p in new if p.suffix == ".onnx")
        result = {
            "preset": args.preset, "layout": args.layout, "format": args.format, "dtype": args.dtype,
            "checkpoint_bytes": ckpt_bytes, "synth_seconds": round(t_synth, 2),
            "export_seconds": round(wall, 1), "peak_rss_bytes": peak_rss,
            "written_bytes": written, "graph_bytes": graph_bytes, "written_besides_graphs": written - graph_bytes,
            "checkpoint_bytes_touched": max(grown, 0),
            "ratios": {
                "peak_rss_over_checkpoint": peak_rss / ckpt_bytes,
                "written_over_checkpoint": written / ckpt_bytes,
            },
            "targets": {"peak_rss_bytes": 4 << 30, "export_seconds": 900, "written_besides_graphs": 1 << 30},
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "node": platform.node()},
            "files": {p.name: p.stat().st_size for p in new},
        }
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    rows = [
        ("checkpoint (apparent)", f"{ckpt_bytes / 1e9:.1f} GB", ""),
        ("export wall time", f"{wall:.1f} s", "target < 900 s"),
        ("peak RSS", f"{peak_rss / 2**30:.2f} GiB", f"{result['ratios']['peak_rss_over_checkpoint']:.2e} of ckpt; target < 4 GiB"),
        ("written: graphs", f"{graph_bytes / 1e6:.1f} MB", ""),
        ("written besides graphs", f"{(written - graph_bytes) / 1e6:.2f} MB", "target < 1 GB"),
        ("checkpoint bytes touched", f"{max(grown, 0)}", "zero copy: 0"),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"\nfull-size export ({args.preset}, {args.layout}, {args.format} -> {args.dtype} graphs)")
    for name, value, note in rows:
        print(f"  {name:<{w}}  {value:>14}  {note}")
    write_results(result, args.json)
    print(f"wrote {args.json}")
    ok = peak_rss < (4 << 30) and wall < 900 and written - graph_bytes < (1 << 30)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
