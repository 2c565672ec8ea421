"""The manifest's parameter map: where each parameter's bytes are, as one range or as pieces to assemble.

Every range is a ``TensorEntry`` (``m3export.safetensors_io``) into a safetensors file: the artifact's own weight
file (written by ``write_safetensors``, shared by every graph, so the embedding and lm_head are stored once) or,
for a zero-copy export, a checkpoint shard. The same ranges are the graphs' ONNX external-data references.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import BY_NAME
from ..errors import ArtifactError
from ..safetensors_io import TensorEntry


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
            entry = cls(str(d["dtype"]), tuple(int(s) for s in d["shape"]), pieces)
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(f"manifest.json: tensor {name!r} has a malformed piece list ({e!r})") from None
        if entry.dtype not in BY_NAME:  # as TensorEntry.from_json checks each piece's
            raise ArtifactError(f"manifest.json: tensor {name!r} has unknown dtype {entry.dtype!r}")
        return entry
