"""Sharded safetensors checkpoints: the index file, where every tensor is, and tensor-by-tensor reads.

Each shard's header is parsed and checked by ``m3export.safetensors_io.read_header`` before any tensor is
touched, so a truncated or corrupt shard is reported with its file and tensor name instead of failing deep
inside a read. Nothing here unpickles.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from ..safetensors_io import TensorEntry, read_header, require_regular_file
from ..sources import MANIFEST

INDEX_FILE = "model.safetensors.index.json"


class Checkpoint:
    """A checkpoint directory: config, shards and where each tensor is."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: checkpoint directory does not exist")
        self.tensors: dict[str, TensorEntry] = {}  # file: the shard's path
        for shard in self._shards():
            for name, info in read_header(shard).items():
                if name in self.tensors:
                    raise CheckpointError(f"{shard}: tensor {name!r} also appears in "
                                          f"{Path(self.tensors[name].file).name}")
                self.tensors[name] = info
        self._check_index()
        self._open: dict[str, object] = {}

    def _shards(self) -> list[Path]:
        index = self.dir / INDEX_FILE
        if index.exists() or index.is_symlink():
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
        manifest = self.dir / MANIFEST
        try:
            files = json.loads(manifest.read_text()).get("files", {}) if manifest.exists() else {}
        except (OSError, json.JSONDecodeError, AttributeError):
            return set()
        return {self.dir / name for name, meta in files.items()
                if isinstance(meta, dict) and "sha256" in meta and "header_sha256" not in meta}

    def _read_index(self, index: Path) -> dict[str, str]:
        require_regular_file(index)
        try:
            data = json.loads(index.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index}: cannot parse ({e})") from None
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"{index}: missing or empty 'weight_map'")
        for name, file in wm.items():
            if not isinstance(file, str) or not file:
                raise CheckpointError(f"{index}: tensor {name!r} maps to {file!r}, not a file name")
            # The *name* must stay inside the directory; the file it names may be a symbolic link to elsewhere,
            # as every shard of the Hugging Face cache layout is (snapshots/REV/x.safetensors -> ../../blobs/SHA).
            if os.path.isabs(file) or ".." in Path(file).parts:
                raise CheckpointError(f"{index}: tensor {name!r} points outside the checkpoint directory ({file})")
            if not (self.dir / file).exists():
                raise CheckpointError(f"{index}: tensor {name!r} is in {file}, which does not exist")
        return wm

    def _check_index(self) -> None:
        if self.weight_map is None:
            return
        for name, file in self.weight_map.items():
            info = self.tensors.get(name)
            if info is None or Path(info.file).name != Path(file).name:
                raise CheckpointError(f"{self.dir / INDEX_FILE}: lists tensor {name!r} in {file}, but that shard "
                                      "does not hold it")
        unlisted = sorted(set(self.tensors) - set(self.weight_map))
        if unlisted:
            raise CheckpointError(f"{self.dir / INDEX_FILE}: shards hold tensors the index does not list, e.g. "
                                  f"{unlisted[:3]}")

    def _handle(self, file: str):
        handle = self._open.get(file)
        if handle is None:
            try:
                handle = safe_open(file, framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own types
                raise CheckpointError(f"{file}: cannot open as safetensors ({e})") from None
            self._open[file] = handle
        return handle

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (memory-mapped; only this tensor's bytes are touched)."""
        info = self.tensors[name]
        try:
            return self._handle(info.file).get_tensor(name)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{info.file}: tensor {name!r} cannot be read ({e})") from None

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Indices ``start:stop`` of dimension ``dim`` of one tensor; only those bytes are copied out of the
        memory map (a tensor-parallel rank's share, ``m3export.parallel``)."""
        info = self.tensors[name]
        if not (0 <= dim < len(info.shape) and 0 <= start <= stop <= info.shape[dim]):
            raise CheckpointError(f"{info.file}: tensor {name!r} of shape {list(info.shape)} has no slice "
                                  f"{start}:{stop} along dimension {dim}")
        try:
            return self._handle(info.file).get_slice(name)[(slice(None),) * dim + (slice(start, stop),)]
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{info.file}: tensor {name!r} cannot be read ({e})") from None

    def close(self) -> None:
        self._open.clear()
