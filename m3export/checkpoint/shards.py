"""Sharded safetensors checkpoints: validated headers, the index file, and tensor-by-tensor reads.

Headers are parsed and checked against the file size before any tensor is touched, so a truncated or corrupt
shard is reported with its file and tensor name instead of failing deep inside a read. Nothing here unpickles.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER = 512 * 1024 * 1024

DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
    "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1), "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1), "I16": (torch.int16, 2), "I32": (torch.int32, 4), "I64": (torch.int64, 8),
    "BOOL": (torch.bool, 1),
}
TORCH_TO_ST = {v[0]: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    length: int


def read_header(path: Path) -> tuple[dict[str, TensorInfo], int]:
    """Parse and check one shard's header -> ({name: TensorInfo}, header length)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: corrupt or truncated safetensors header (claims {n} bytes, "
                                      f"file has {size})")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    data_size = size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dt, shape, (start, end) = meta["dtype"], tuple(int(s) for s in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {meta!r}") from None
        if dt not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dt!r}")
        torch_dt, item = DTYPES[dt]
        numel = 1
        for s in shape:
            numel *= s
        if not (0 <= start <= end) or end - start != numel * item:
            raise CheckpointError(f"{path}: tensor {name!r}: data_offsets {[start, end]} do not match "
                                  f"shape {list(shape)} x {item} bytes")
        if end > data_size:
            raise CheckpointError(f"{path}: tensor {name!r} ends at byte {8 + n + end} but the file has {size} "
                                  "bytes (truncated shard?)")
        out[name] = TensorInfo(path, name, torch_dt, shape, 8 + n + start, end - start)
    return out, n


class Checkpoint:
    """A checkpoint directory: config, shards and where each tensor is."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: checkpoint directory does not exist")
        self.tensors: dict[str, TensorInfo] = {}
        for shard in self._shards():
            infos, _ = read_header(shard)
            for name, info in infos.items():
                if name in self.tensors:
                    raise CheckpointError(f"{shard}: tensor {name!r} also appears in {self.tensors[name].file.name}")
                self.tensors[name] = info
        self._check_index()
        self._open: dict[Path, object] = {}

    def _shards(self) -> list[Path]:
        index = self.dir / INDEX_FILE
        if index.exists():
            self.weight_map = self._read_index(index)
            return sorted({self.dir / f for f in self.weight_map.values()})
        self.weight_map = None
        single = self.dir / "model.safetensors"
        shards = [single] if single.exists() else sorted(set(self.dir.glob("*.safetensors")) - self._artifact_files())
        if not shards:
            raise CheckpointError(f"{self.dir}: no *.safetensors files and no {INDEX_FILE}")
        return shards

    def _artifact_files(self) -> set[Path]:
        """Files an in-place m3export artifact added to this directory (its own weight file is no shard)."""
        manifest = self.dir / "manifest.json"
        try:
            files = json.loads(manifest.read_text()).get("files", {}) if manifest.exists() else {}
        except (OSError, json.JSONDecodeError, AttributeError):
            return set()
        return {self.dir / name for name, meta in files.items() if isinstance(meta, dict) and "sha256" in meta}

    def _read_index(self, index: Path) -> dict[str, str]:
        try:
            data = json.loads(index.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index}: cannot parse ({e})") from None
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"{index}: missing or empty 'weight_map'")
        root = self.dir.resolve()
        for name, file in wm.items():
            if not isinstance(file, str) or not file:
                raise CheckpointError(f"{index}: tensor {name!r} maps to {file!r}, not a file name")
            target = (self.dir / file).resolve()
            if os.path.isabs(file) or root not in target.parents:
                raise CheckpointError(f"{index}: tensor {name!r} points outside the checkpoint directory ({file})")
            if not target.exists():
                raise CheckpointError(f"{index}: tensor {name!r} is in {file}, which does not exist")
        return wm

    def _check_index(self) -> None:
        if self.weight_map is None:
            return
        for name, file in self.weight_map.items():
            info = self.tensors.get(name)
            if info is None or info.file.name != Path(file).name:
                raise CheckpointError(f"{self.dir / INDEX_FILE}: lists tensor {name!r} in {file}, but that shard "
                                      "does not hold it")
        unlisted = sorted(set(self.tensors) - set(self.weight_map))
        if unlisted:
            raise CheckpointError(f"{self.dir / INDEX_FILE}: shards hold tensors the index does not list, e.g. "
                                  f"{unlisted[:3]}")

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (memory-mapped; only this tensor's bytes are touched)."""
        info = self.tensors[name]
        handle = self._open.get(info.file)
        if handle is None:
            try:
                handle = safe_open(str(info.file), framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own types
                raise CheckpointError(f"{info.file}: cannot open as safetensors ({e})") from None
            self._open[info.file] = handle
        try:
            return handle.get_tensor(name)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{info.file}: tensor {name!r} cannot be read ({e})") from None

    def close(self) -> None:
        self._open.clear()
