"""``manifest.json``: what an artifact holds and how to run it, written by the exporter, checked by every loader.

The manifest is the single place a backend learns the config, the graph signatures (names, dtypes, symbolic
shapes, which cache outputs update which cache inputs), the page size the graphs were built for, where every
parameter's bytes are, and the checksum of every file. It carries no timestamps, so exports are reproducible.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import ConfigError, M3Config
from ..dtypes import BY_ONNX
from ..errors import ArtifactError
from ..sources import MANIFEST
from .weights import ParamEntry

if TYPE_CHECKING:
    import onnx

FORMAT = "m3export.artifact"
KV_FP8 = "float8_e4m3fn"  # kv_cache_dtype of an FP8 cache (m3export.dtypes' name of torch.float8_e4m3fn)
# An FP8 cache's float32 row-scale pools, named as the ops' scale inputs; graph inputs ``<name>.<layer>`` beside
# ``k_cache.<layer>``, ... (export/graphs.py)
SCALE_POOLS = ("k_scale", "v_scale", "index_k_scale")
FORMAT_VERSION = 1


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class TensorSig:
    name: str
    dtype: str  # an m3export.dtypes name: float32, bfloat16, int64, ...
    shape: tuple[int | str, ...]  # ints are static, strings name dynamic dimensions

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class GraphInfo:
    file: str
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    aliases: dict[str, str]  # output -> input it may share a buffer with (in-place cache writes)

    def to_json(self) -> dict:
        return {"file": self.file, "inputs": [t.to_json() for t in self.inputs],
                "outputs": [t.to_json() for t in self.outputs], "aliases": dict(self.aliases)}

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]


def signature_of(proto: onnx.ModelProto, file: str, aliases: dict[str, str]) -> GraphInfo:
    """Read a graph's signature from the final ModelProto, so the manifest states what the file really holds."""

    def sig(v: onnx.ValueInfoProto) -> TensorSig:
        t = v.type.tensor_type
        if t.elem_type not in BY_ONNX:
            raise ArtifactError(f"{file}: {v.name} has ONNX element type {t.elem_type}, which m3export.dtypes lacks")
        dims = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim)
        return TensorSig(v.name, BY_ONNX[t.elem_type].name, dims)

    return GraphInfo(file, tuple(sig(v) for v in proto.graph.input), tuple(sig(v) for v in proto.graph.output),
                     dict(aliases))


@dataclass
class Manifest:
    config: M3Config
    dtype: str
    mxfp8: bool
    page_size: int
    mtp_modules: int
    source: str
    opset: dict[str, Any]
    graphs: dict[str, GraphInfo]
    tensors: dict[str, ParamEntry]
    files: dict[str, dict[str, Any]]  # name -> {"sha256": ..., "bytes": ...}
    tools: dict[str, str]
    # split export: the graphs that together equal "model", in order, with their layer ranges
    parts: list[dict[str, Any]] = field(default_factory=list)
    # other flavours of the graphs written beside them, e.g. "tensorrt" (m3export/export/tensorrt_flavour.py)
    flavours: dict[str, Any] = field(default_factory=dict)
    # the cache pools' dtype (an m3export.dtypes name; None: the model dtype). "float8_e4m3fn" (export
    # --kv-cache-dtype fp8): the graphs carry each pool as uint8 E4M3 codes with a float32 scale pool per row
    # (docs/ops.md §1 and §9); artifacts written before the field have model-dtype pools.
    kv_cache_dtype: str | None = None

    @property
    def cache_dtype(self) -> str:
        """The dtype the cache pools hold (what ``--kv-cache-dtype auto`` means for this artifact)."""
        return self.kv_cache_dtype or self.dtype

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "config": self.config.to_text_dict(),
            "dtype": self.dtype,
            "mxfp8": self.mxfp8,
            "page_size": self.page_size,
            "mtp_modules": self.mtp_modules,
            "source": self.source,
            "opset": self.opset,
            "graphs": {k: g.to_json() for k, g in self.graphs.items()},
            "tensors": {k: e.to_json() for k, e in self.tensors.items()},
            "files": self.files,
            "tools": self.tools,
            "parts": self.parts,
            "flavours": self.flavours,
            "kv_cache_dtype": self.cache_dtype,
        }

    @classmethod
    def from_json(cls, raw: Any, where: str = MANIFEST) -> "Manifest":
        if not isinstance(raw, dict):
            raise ArtifactError(f"{where}: expected a JSON object")
        if raw.get("format") != FORMAT:
            raise ArtifactError(f"{where}: not an m3export artifact (format {raw.get('format')!r})")
        if raw.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(f"{where}: format_version {raw.get('format_version')!r} is not supported "
                                f"(this m3export reads version {FORMAT_VERSION}); re-export the artifact")

        def field(name: str, kind: type | tuple[type, ...]):
            if name not in raw:
                raise ArtifactError(f"{where}: missing field {name!r}")
            value = raw[name]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise ArtifactError(f"{where}: field {name!r} has the wrong type ({type(value).__name__})")
            return value

        try:
            config = M3Config.from_dict(field("config", dict), source=f"{where}: config")
        except ConfigError as e:
            raise ArtifactError(str(e)) from None
        graphs = {}
        for gname, g in field("graphs", dict).items():
            try:
                graphs[gname] = GraphInfo(
                    str(g["file"]),
                    tuple(TensorSig(t["name"], t["dtype"], tuple(t["shape"])) for t in g["inputs"]),
                    tuple(TensorSig(t["name"], t["dtype"], tuple(t["shape"])) for t in g["outputs"]),
                    dict(g["aliases"]),
                )
            except (KeyError, TypeError) as e:
                raise ArtifactError(f"{where}: graph {gname!r} has a malformed entry ({e!r})") from None
        tensors = {name: ParamEntry.from_json(name, e) for name, e in field("tensors", dict).items()}
        page_size = field("page_size", int)
        if page_size < 1:
            raise ArtifactError(f"{where}: page_size must be >= 1, got {page_size}")
        return cls(
            config=config, dtype=field("dtype", str), mxfp8=field("mxfp8", bool), page_size=page_size,
            mtp_modules=field("mtp_modules", int), source=field("source", str), opset=field("opset", dict),
            graphs=graphs, tensors=tensors, files=field("files", dict), tools=field("tools", dict),
            parts=_parts(raw.get("parts", []), graphs, config.num_hidden_layers, where),
            flavours=_flavours(raw.get("flavours", {}), where),
            kv_cache_dtype=_kv_cache_dtype(raw.get("kv_cache_dtype"), where),
        )


def _kv_cache_dtype(value: Any, where: str) -> str | None:
    """A model dtype or ``float8_e4m3fn``; absent (older artifacts): None, the model dtype."""
    from ..dtypes import MODEL_DTYPES

    allowed = (*MODEL_DTYPES, KV_FP8)
    if value is not None and value not in allowed:
        raise ArtifactError(f"{where}: kv_cache_dtype {value!r} is not one of {', '.join(allowed)}")
    return value


def _flavours(flavours: Any, where: str) -> dict[str, Any]:
    """Each flavour maps a graph name to a record naming its ``file`` (which ``load_artifact`` then requires to be
    a checksummed file of the artifact, as every graph file is: a flavour's file is loaded and run too)."""
    if not isinstance(flavours, dict) or not all(isinstance(v, dict) for v in flavours.values()):
        raise ArtifactError(f"{where}: field 'flavours' must map a flavour name to its graphs")
    for fname, graphs in flavours.items():
        for gname, record in graphs.items():
            if not isinstance(record, dict) or not isinstance(record.get("file"), str):
                raise ArtifactError(f"{where}: flavours[{fname!r}][{gname!r}] must be a record with a 'file' name")
    return flavours


def _parts(parts: Any, graphs: dict[str, GraphInfo], n_layers: int, where: str) -> list[dict[str, Any]]:
    """Parts must name existing graphs and tile the layers in order (each part's hidden feeds the next)."""
    if not isinstance(parts, list):
        raise ArtifactError(f"{where}: field 'parts' must be a list")
    end = 0
    for p in parts:
        layers = p.get("layers") if isinstance(p, dict) else None
        if (layers is None or p.get("graph") not in graphs or not isinstance(layers, list) or len(layers) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers) or layers[0] >= layers[1]):
            raise ArtifactError(f"{where}: malformed part {p!r} (expected {{'graph': NAME, 'layers': [start, stop]}})")
        if p["layers"][0] != end:
            raise ArtifactError(f"{where}: part {p['graph']} starts at layer {p['layers'][0]}, expected {end}")
        end = p["layers"][1]
    if parts and end != n_layers:
        raise ArtifactError(f"{where}: parts cover layers [0, {end}) of {n_layers}")
    return parts
