"""Full-size synthetic checkpoints as sparse files: real headers, shapes and dtypes; data regions left as holes.

A 444 GB MXFP8 release then costs a few megabytes of disk, which is what the full-size export benchmark and
its CI twin need: every byte offset is real, so an export that references checkpoint bytes can be checked
exactly, while reading a tensor yields zeros.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import M3Config, QuantConfig
from ..errors import CheckpointError
from .layout import Layout
from .writer import planned_tensors, write_shards


def write_sparse_checkpoint(out_dir: str | os.PathLike, cfg: M3Config, layout: str = "original", fmt: str = "mxfp8",
                            shard_bytes: int = 5 << 30, n_mtp: int | None = None) -> Path:
    """The checkpoint ``write_checkpoint`` would write (always sharded, with an index), data left as holes."""
    out = Path(out_dir)
    if out.exists():
        raise CheckpointError(f"{out}: output directory already exists")
    if fmt == "mxfp8":
        cfg = cfg.replace(quantization=QuantConfig())
    n_mtp = cfg.num_mtp_modules if n_mtp is None else n_mtp
    lay = Layout(layout, cfg)
    return write_shards(out, cfg, lay, planned_tensors(cfg, lay, fmt, n_mtp), shard_bytes, value=None,
                        single_file=False, progress=False)
