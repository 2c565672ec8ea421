"""The artifact's weight file: one ``.safetensors`` file written tensor by tensor, shared by every graph.

safetensors stores raw row-major bytes after a JSON header, so each tensor is also a valid ONNX external-data
range (file, offset, length): ``model.onnx`` and every ``mtp{k}.onnx`` point into the same file (the embedding
and lm_head are stored once), the manifest's tensor map is the same ranges, and any safetensors reader can open
the file too. The header is written first from shapes alone, so no more than one tensor is ever in memory.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import ArtifactError

# torch dtype -> (safetensors code, manifest name, ONNX TensorProto element type)
DTYPES = {
    torch.float32: ("F32", "float32", 1),
    torch.float16: ("F16", "float16", 10),
    torch.bfloat16: ("BF16", "bfloat16", 16),
    torch.float8_e4m3fn: ("F8_E4M3", "float8_e4m3fn", 17),
    torch.uint8: ("U8", "uint8", 2),
    torch.int32: ("I32", "int32", 6),
    torch.int64: ("I64", "int64", 7),
}
BY_NAME = {name: dt for dt, (_, name, _) in DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    """Where one parameter's bytes live: absolute byte range in ``file`` (relative to the artifact)."""

    file: str
    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]

    def to_json(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_json(cls, name: str, d: dict) -> "TensorEntry":
        try:
            entry = cls(str(d["file"]), int(d["offset"]), int(d["length"]), str(d["dtype"]),
                        tuple(int(s) for s in d["shape"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(f"manifest.json: tensor {name!r} has a malformed entry ({e!r})") from None
        if entry.dtype not in BY_NAME:
            raise ArtifactError(f"manifest.json: tensor {name!r} has unknown dtype {entry.dtype!r}")
        if entry.length != math.prod(entry.shape) * BY_NAME[entry.dtype].itemsize:
            raise ArtifactError(f"manifest.json: tensor {name!r}: length {entry.length} does not match "
                                f"shape {list(entry.shape)} x {entry.dtype}")
        return entry

    @property
    def torch_dtype(self) -> torch.dtype:
        return BY_NAME[self.dtype]


@dataclass(frozen=True)
class PieceEntry:
    """One stored tensor filling ``index`` of a parameter: ints pick along a dimension, (start, stop) pairs are
    row ranges; ``()`` is the whole parameter. Checkpoints store stacked parameters as pieces (one expert's w1)."""

    index: tuple
    entry: TensorEntry

    def torch_index(self) -> tuple:
        return tuple(slice(*i) if isinstance(i, tuple) else i for i in self.index)

    def to_json(self) -> dict:
        return {"index": [list(i) if isinstance(i, tuple) else i for i in self.index], **self.entry.to_json()}


@dataclass(frozen=True)
class ParamEntry:
    """Where one parameter's bytes are: a single range (most parameters) or several pieces to assemble."""

    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[PieceEntry, ...]

    @classmethod
    def whole(cls, e: TensorEntry) -> "ParamEntry":
        return cls(e.dtype, e.shape, (PieceEntry((), e),))

    @property
    def single(self) -> TensorEntry | None:
        """The one range holding the whole parameter, or None when it is assembled from pieces."""
        return self.pieces[0].entry if len(self.pieces) == 1 and self.pieces[0].index == () else None

    @property
    def torch_dtype(self) -> torch.dtype:
        return BY_NAME[self.dtype]

    def to_json(self) -> dict:
        if self.single is not None:
            return self.single.to_json()
        return {"dtype": self.dtype, "shape": list(self.shape), "pieces": [p.to_json() for p in self.pieces]}

    @classmethod
    def from_json(cls, name: str, d: dict) -> "ParamEntry":
        if not isinstance(d, dict):
            raise ArtifactError(f"manifest.json: tensor {name!r} has a malformed entry")
        if "pieces" not in d:
            return cls.whole(TensorEntry.from_json(name, d))
        try:
            pieces = tuple(
                PieceEntry(tuple(tuple(i) if isinstance(i, list) else int(i) for i in p["index"]),
                           TensorEntry.from_json(name, p))
                for p in d["pieces"])
            return cls(str(d["dtype"]), tuple(int(s) for s in d["shape"]), pieces)
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(f"manifest.json: tensor {name!r} has a malformed piece list ({e!r})") from None


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def write_safetensors(path: Path, specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                      value: Callable[[str], torch.Tensor], progress: bool = True) -> dict[str, TensorEntry]:
    """Write ``specs`` (name, dtype, shape; file order) fetching each tensor with ``value(name)``.

    Returns the tensor map. Deterministic: the header is compact JSON with sorted keys.
    """
    specs = list(specs)
    header: dict[str, dict] = {}
    pos = 0
    for name, dtype, shape in specs:
        if dtype not in DTYPES:
            raise ArtifactError(f"tensor {name!r}: dtype {dtype} cannot be stored in the artifact")
        n = _nbytes(dtype, shape)
        header[name] = {"dtype": DTYPES[dtype][0], "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as the format recommends
    base = 8 + len(raw)
    entries = {}
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, dtype, shape in tqdm(specs, desc=f"writing {path.name}", unit="tensor", disable=not progress,
                                       leave=False):
            t = value(name)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ArtifactError(f"tensor {name!r}: got {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)}")
            data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            start = header[name]["data_offsets"][0]
            if f.tell() != base + start:
                raise AssertionError(f"{path}: write position drifted at tensor {name!r}")
            f.write(np.ascontiguousarray(data).data)
            entries[name] = TensorEntry(path.name, base + start, data.nbytes, DTYPES[dtype][1], tuple(shape))
    return entries


def read_tensor(root: Path, name: str, entry: TensorEntry) -> torch.Tensor:
    """One tensor of the tensor map, memory-mapped copy-on-write (the file is never modified)."""
    path = root / entry.file
    try:
        mm = np.memmap(path, dtype=np.uint8, mode="c", offset=entry.offset, shape=(entry.length,))
    except (OSError, ValueError) as e:
        raise ArtifactError(f"{path}: cannot read tensor {name!r} at offset {entry.offset} ({e})") from None
    flat = torch.frombuffer(mm, dtype=torch.uint8) if entry.length else torch.empty(0, dtype=torch.uint8)
    return flat.view(entry.torch_dtype).reshape(entry.shape)
