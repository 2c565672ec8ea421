"""Full-size synthetic checkpoints as sparse files: real headers, shapes and dtypes; data regions left as holes.

A 444 GB MXFP8 release then costs a few megabytes of disk, which is what the full-size export benchmark and
its CI twin need: every byte offset is real, so an export that references checkpoint bytes can be checked
exactly, while reading a tensor yields zeros.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import torch

from ..config import M3Config, QuantConfig
from ..errors import CheckpointError
from ..model import M3ForCausalLM
from .layout import Layout
from .shards import INDEX_FILE, TORCH_TO_ST
from .writer import piece_format, quantized_names

ALIGN = 8


def planned_tensors(cfg: M3Config, layout: str, fmt: str, n_mtp: int):
    """Yield (checkpoint name, dtype, shape) in parameter order, exactly as ``write_checkpoint`` would write."""
    lay = Layout(layout, cfg)
    quantized = quantized_names(cfg, n_mtp) if fmt == "mxfp8" else set()
    with torch.device("meta"):
        model = M3ForCausalLM(cfg, num_mtp_modules=n_mtp)
    for name, p in model.named_parameters():
        how = piece_format(name, fmt, name in quantized)
        for piece in lay.pieces(name):
            shape = tuple(p[piece.index].shape)
            if how == "mxfp8":
                yield piece.name, torch.float8_e4m3fn, shape
                yield piece.name + "_scale_inv", torch.uint8, (*shape[:-1], shape[-1] // 32)
            else:
                yield piece.name, how, shape


def write_sparse_checkpoint(out_dir: str | os.PathLike, cfg: M3Config, layout: str = "original", fmt: str = "mxfp8",
                            shard_bytes: int = 5 << 30, n_mtp: int | None = None) -> Path:
    out = Path(out_dir)
    if out.exists():
        raise CheckpointError(f"{out}: output directory already exists")
    if fmt == "mxfp8":
        cfg = cfg.replace(quantization=QuantConfig())
    n_mtp = cfg.num_mtp_modules if n_mtp is None else n_mtp
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        groups: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[]]
        size = 0
        for name, dtype, shape in planned_tensors(cfg, layout, fmt, n_mtp):
            nbytes = _nbytes(dtype, shape)
            if groups[-1] and size + nbytes > shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append((name, dtype, shape))
            size += nbytes
        weight_map, total = {}, 0
        for i, group in enumerate(groups, 1):
            fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            total += _write_sparse_shard(tmp / fname, group)
            weight_map.update(dict.fromkeys((n for n, _, _ in group), fname))
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        config = cfg.to_original_dict() if layout == "original" else cfg.to_hf_dict()
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for s in shape:
        n *= s
    return n


def _write_sparse_shard(path: Path, tensors) -> int:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in tensors:
        n = _nbytes(dtype, shape)
        header[name] = {"dtype": TORCH_TO_ST[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)  # the data region is a hole: no blocks on disk
    return offset
