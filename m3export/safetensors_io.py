"""safetensors files, read and written at the byte level: the one header parser and the one streaming writer.

A safetensors file is an 8-byte little-endian header length, a JSON header (per tensor: dtype code, shape and
``data_offsets`` into the data section), then the raw row-major bytes. Knowing each tensor's absolute byte range
is what lets a checkpoint be loaded tensor by tensor, and lets an ONNX graph reference a checkpoint's bytes in
place (an external-data entry is the same file, offset and length). Both the checkpoint side (shards, sparse
full-size checkpoints) and the export side (the artifact's weight file, zero-copy references) go through here;
``TensorEntry`` is the one record of where a tensor's bytes are. Reading values goes through the ``safetensors``
library (``Checkpoint.get``) or a memory map of a known range (``read_tensor``); nothing here unpickles.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .dtypes import BY_NAME, BY_SAFETENSORS, known_torch, of_torch
from .errors import ArtifactError, CheckpointError, M3Error

MAX_HEADER = 512 * 1024 * 1024
ALIGN = 8  # the data section starts 8-byte aligned, as the format recommends


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: ``length`` bytes at absolute byte ``offset`` of the safetensors ``file``,
    holding ``dtype`` (an ``m3export.dtypes`` name) of ``shape``. ``file`` is relative to an artifact in its
    manifest, and the shard's path on the checkpoint side."""

    file: str
    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return BY_NAME[self.dtype].torch

    def to_json(self) -> dict:
        return {"file": self.file, "offset": self.offset, "length": self.length, "dtype": self.dtype,
                "shape": list(self.shape)}

    @classmethod
    def from_json(cls, name: str, d: dict) -> TensorEntry:
        try:
            entry = cls(str(d["file"]), int(d["offset"]), int(d["length"]), str(d["dtype"]),
                        tuple(int(s) for s in d["shape"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(f"manifest.json: tensor {name!r} has a malformed entry ({e!r})") from None
        if entry.dtype not in BY_NAME:
            raise ArtifactError(f"manifest.json: tensor {name!r} has unknown dtype {entry.dtype!r}")
        if entry.offset < 0 or any(s < 0 for s in entry.shape):
            raise ArtifactError(f"manifest.json: tensor {name!r} has a negative offset or dimension "
                                f"(offset {entry.offset}, shape {list(entry.shape)})")
        if entry.length != nbytes(entry.torch_dtype, entry.shape):
            raise ArtifactError(f"manifest.json: tensor {name!r}: length {entry.length} does not match "
                                f"shape {list(entry.shape)} x {entry.dtype}")
        return entry


def nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def require_regular_file(path: Path, error: type[M3Error] = CheckpointError) -> os.stat_result:
    """``path``'s stat (links followed) if it is a regular file; anything else raises ``error`` naming it.

    Opening a FIFO blocks until a writer appears and a device can be endless, so every file this project reads
    as data (shards, weight files, graphs, manifests, indexes) is checked here before it is opened.
    """
    try:
        st = path.stat()
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: not a regular file (a directory, FIFO, socket or device cannot hold data)")
    return st


def raw_header(path: Path, error: type[M3Error] = CheckpointError) -> bytes:
    """The JSON header's bytes, after checking its length against the file size; problems raise ``error``."""
    size = require_regular_file(path, error).st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise error(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise error(f"{path}: corrupt or truncated safetensors header (claims {n} bytes, file has {size})")
            return f.read(n)
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror})") from None


def header_sha256(path: Path, error: type[M3Error] = CheckpointError) -> str:
    """sha256 of a file's safetensors header: changes whenever its tensors, dtypes, shapes or offsets do."""
    return hashlib.sha256(raw_header(path, error)).hexdigest()


def _is_count(x) -> bool:
    """A JSON non-negative integer (safetensors' usize): not a bool, a float or a string."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_header(path: Path, error: type[M3Error] = CheckpointError) -> dict[str, TensorEntry]:
    """Parse and check one file's header -> {tensor name: TensorEntry} (``file`` is ``str(path)``).

    Every entry is checked against its shape and the file size before any tensor is touched, so a truncated or
    corrupt file is reported with its name and the tensor's instead of failing deep inside a read. The checks are
    the ``safetensors`` library's own (integer offsets and shapes; tensors that tile the data section in order,
    without gaps or overlaps, up to its last byte), so a file is accepted here exactly when the library would
    load it, whichever path (loading, copying export, zero-copy references) reads it.
    """
    raw = raw_header(path, error)
    data_size = path.stat().st_size - 8 - len(raw)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise error(f"{path}: safetensors header is not a JSON object")
    out: dict[str, TensorEntry] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dt, shape, (start, end) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise error(f"{path}: tensor {name!r} has a malformed header entry {meta!r}") from None
        if not all(_is_count(d) for d in shape) or not (_is_count(start) and _is_count(end)):
            raise error(f"{path}: tensor {name!r}: shape {meta['shape']!r} and data_offsets {meta['data_offsets']!r} "
                        "must be non-negative integers")
        if not isinstance(dt, str) or dt not in BY_SAFETENSORS:
            raise error(f"{path}: tensor {name!r} has unsupported dtype {dt!r}")
        dtype = BY_SAFETENSORS[dt]
        if not (0 <= start <= end) or end - start != nbytes(dtype.torch, shape):
            raise error(f"{path}: tensor {name!r}: data_offsets {[start, end]} do not match "
                        f"shape {list(shape)} x {dtype.itemsize} bytes")
        if end > data_size:
            raise error(f"{path}: tensor {name!r} ends at byte {8 + len(raw) + end} but the file has "
                        f"{8 + len(raw) + data_size} bytes (truncated shard?)")
        out[name] = TensorEntry(str(path), 8 + len(raw) + start, end - start, dtype.name, shape)
    pos = 0  # as the library requires: in offset order, each tensor starts where the previous one ended
    for name, e in sorted(out.items(), key=lambda kv: (kv[1].offset, kv[1].offset + kv[1].length)):
        start = e.offset - 8 - len(raw)
        if start != pos:
            raise error(f"{path}: tensor {name!r} starts at data byte {start}, expected {pos} (tensors overlap or "
                        "leave a gap; the safetensors library rejects such a file)")
        pos = start + e.length
    if pos != data_size:
        raise error(f"{path}: the tensors cover {pos} of the {data_size} data bytes (the safetensors library "
                    "rejects a file with trailing bytes)")
    return out


def write_safetensors(path: Path, specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                      value: Callable[[str], torch.Tensor] | None = None, progress: bool = True
                      ) -> dict[str, TensorEntry]:
    """Write ``specs`` (name, dtype, shape; file order), fetching each tensor with ``value(name)``.

    The header is written first, from shapes alone, so no more than one tensor is ever in memory. Without
    ``value`` the file is sparse: a real header over a data region left as a hole (full-size synthetic
    checkpoints cost megabytes; reading a tensor yields zeros). Deterministic: compact JSON, sorted keys.
    Returns {name: TensorEntry} with ``file`` = ``path.name``.
    """
    specs = list(specs)
    header: dict[str, dict] = {}
    pos = 0
    for name, dtype, shape in specs:
        if not known_torch(dtype):
            raise ArtifactError(f"tensor {name!r}: dtype {dtype} cannot be stored in a safetensors file")
        n = nbytes(dtype, shape)
        header[name] = {"dtype": of_torch(dtype).safetensors, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % ALIGN)
    base = 8 + len(raw)
    entries = {name: TensorEntry(path.name, base + header[name]["data_offsets"][0], nbytes(dtype, shape),
                                 of_torch(dtype).name, tuple(shape)) for name, dtype, shape in specs}
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        if value is None:
            f.truncate(base + pos)  # the data region is a hole: no blocks on disk
            return entries
        for name, dtype, shape in tqdm(specs, desc=f"writing {path.name}", unit="tensor", disable=not progress,
                                       leave=False):
            t = value(name)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ArtifactError(f"tensor {name!r}: got {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)}")
            data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            if f.tell() != entries[name].offset:
                raise AssertionError(f"{path}: write position drifted at tensor {name!r}")
            f.write(np.ascontiguousarray(data).data)
    return entries


def read_tensor(root: Path, name: str, entry: TensorEntry) -> torch.Tensor:
    """One tensor at ``root / entry.file``, memory-mapped copy-on-write (the file is never modified)."""
    path = root / entry.file
    try:
        mm = np.memmap(path, dtype=np.uint8, mode="c", offset=entry.offset, shape=(entry.length,))
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{path}: cannot read tensor {name!r} at offset {entry.offset} ({e})") from None
    flat = torch.frombuffer(mm, dtype=torch.uint8) if entry.length else torch.empty(0, dtype=torch.uint8)
    return flat.view(entry.torch_dtype).reshape(entry.shape)
