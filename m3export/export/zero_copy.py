"""Weights straight from the checkpoint: the graphs reference the checkpoint's own safetensors bytes.

safetensors stores each tensor as raw row-major bytes at a known offset, which is exactly what an ONNX
external-data entry is (file, offset, length). ONNX Runtime and ``onnx.checker`` accept data files only inside
the model's directory (links are resolved and refused, hard links flagged as an attack), so a zero-copy export
writes its graphs *into the checkpoint directory* (``m3export export --checkpoint DIR --in-place``): nothing
existing is modified, and no tensor byte is copied.

Each of our parameters is made of one or more checkpoint tensors (``Layout.pieces``: e.g. the original
layout stores every expert's w1 / w3 / w2 separately, while we stack them). A piece whose dtype already is
the graph's is referenced where it is; any other piece is converted and streamed, one piece at a time, into the
artifact's own weight file. The graph reassembles multi-piece parameters with standard Concat / Unsqueeze
nodes (see ``assemble``), which runtimes fold once at load.

Referenced shards are identified at start-up by size and a hash of their safetensors header (cheap); the export
also records each shard's full sha256, which ``m3export verify`` checks (a same-size corruption of the data
leaves the header alone).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir
import torch

from ..checkpoint.layout import Layout, Piece
from ..checkpoint.loader import check_finite, check_tensors
from ..checkpoint.shards import Checkpoint
from ..dtypes import of_torch
from ..errors import ArtifactError
from ..model import M3ForCausalLM
from ..ops import mxfp8 as mx
from ..safetensors_io import TensorEntry, header_sha256
from .weights import ParamEntry, PieceEntry

AXES0 = "m3export.axes0"  # the one [0] constant every Unsqueeze of an assembly shares


def shard_identity(path: Path) -> dict:
    """Size plus sha256 of the safetensors header (cheap, checked at every start-up: changes whenever tensors,
    dtypes or shapes do) and of the whole file (checked by verify)."""
    from .manifest import sha256_file

    return {"bytes": path.stat().st_size, "header_sha256": header_sha256(path), "sha256": sha256_file(path)}


def _plain_index(piece: Piece) -> tuple:
    return tuple((i.start, i.stop) if isinstance(i, slice) else i for i in piece.index)


@dataclass
class WeightPlan:
    """Every parameter's pieces, which pieces must be converted, and the shards to link."""

    params: dict[str, ParamEntry]
    convert: list[tuple[str, torch.dtype, tuple[int, ...]]]  # (checkpoint tensor, target dtype, shape)
    shards: dict[str, Path]  # name relative to the checkpoint directory -> shard
    referenced: list[str] = dataclasses.field(default_factory=list)  # checkpoint tensors used where they are


def plan(ckpt: Checkpoint, layout: Layout, model: M3ForCausalLM, converted_file: str, zero_copy: bool = True
         ) -> WeightPlan:
    """Decide, piece by piece, whether the checkpoint bytes can be used as they are (``model`` on ``meta`` gives
    the dtype and shape each parameter has in the graph). Other pieces (all of them without ``zero_copy``) are
    converted into ``converted_file``; their entries get real offsets once that file is written (``resolve``)."""
    # what loading the checkpoint would check: no tensor missing, every shape, MXFP8 pieces only from MXFP8 bytes;
    # so below only the choice between referencing and converting is left
    check_tensors(ckpt, layout, dict(model.named_parameters()))
    params: dict[str, ParamEntry] = {}
    convert: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    shards: dict[str, Path] = {}
    referenced: list[str] = []
    for name, p in model.named_parameters():
        out = []
        for piece in layout.pieces(name):
            info = ckpt.tensors[piece.name]
            want_shape = tuple(p[piece.index].shape)
            if zero_copy and info.torch_dtype == p.dtype:
                shard = Path(info.file)
                if shard.is_symlink():
                    raise ArtifactError(f"{shard}: is a symbolic link (as every shard of the Hugging Face cache "
                                        "is); ONNX Runtime and onnx.checker refuse external data through links, so "
                                        "export this checkpoint with --out DIR instead of --in-place")
                rel = shard.relative_to(ckpt.dir).as_posix()
                shards[rel] = shard
                referenced.append(piece.name)
                entry = TensorEntry(rel, info.offset, info.length, info.dtype, want_shape)
            else:
                convert.append((piece.name, p.dtype, want_shape))
                entry = TensorEntry(converted_file, -1, 0, of_torch(p.dtype).name, want_shape)
            out.append(PieceEntry(_plain_index(piece), entry))
        params[name] = ParamEntry(of_torch(p.dtype).name, tuple(p.shape), tuple(out))
    return WeightPlan(params, convert, shards, referenced)


def resolve(wp: WeightPlan, written: dict[str, TensorEntry]) -> dict[str, ParamEntry]:
    """Replace provisional converted-piece entries by their ranges in the written weight file."""
    names = iter(name for name, _, _ in wp.convert)
    out = {}
    for pname, e in wp.params.items():
        pieces = tuple(PieceEntry(pc.index, written[next(names)]) if pc.entry.offset < 0 else pc for pc in e.pieces)
        out[pname] = ParamEntry(e.dtype, e.shape, pieces)
    return out


def converted_value(ckpt: Checkpoint, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor in the graph's dtype (MXFP8 weights are dequantised with their scales), checked finite
    as loading checks it."""
    where = f"{ckpt.tensors[name].file}: tensor {name!r}"
    t = ckpt.get(name)
    if t.dtype != dtype:
        if t.dtype == torch.float8_e4m3fn:
            t = mx.dequantize(t, ckpt.get(name + "_scale_inv"))
        t = t.to(dtype)
    return check_finite(t, where)


def check_referenced_finite(ckpt: Checkpoint, wp: WeightPlan) -> None:
    """The checkpoint tensors the graphs reference in place hold no NaN or infinity, as converted ones are checked
    when they are written (each read once, memory-mapped)."""
    for name in wp.referenced:
        check_finite(ckpt.get(name), f"{ckpt.tensors[name].file}: tensor {name!r}")


def shard_files(shards: dict[str, Path]) -> dict[str, dict]:
    """Manifest entries for the referenced shards: {name: {"bytes", "header_sha256", "sha256"}}, hashed in
    parallel (hashlib releases the GIL on large buffers; shards are read once each)."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    names = sorted(shards)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return dict(zip(names, pool.map(lambda n: shard_identity(shards[n]), names)))


def assemble(graph: ir.Graph, name: str, parts: list[tuple[tuple, ir.Value]], shape: tuple[int, ...]
             ) -> tuple[ir.Value, list[ir.Node]]:
    """Build ``name`` (of ``shape``) from pieces with Concat / Unsqueeze; returns the value and the new nodes."""
    nodes: list[ir.Node] = []
    counter = iter(range(1 << 30))
    axes = graph.initializers.get(AXES0)
    if axes is None:
        axes = ir.Value(name=AXES0, const_value=ir.tensor([0], dtype=ir.DataType.INT64))
        graph.register_initializer(axes)

    def build(items: list[tuple[tuple, ir.Value]], depth_shape: tuple[int, ...]) -> ir.Value:
        if len(items) == 1 and items[0][0] == ():
            return items[0][1]
        heads = [idx[0] for idx, _ in items]
        if all(isinstance(h, int) for h in heads):
            groups: dict[int, list] = {}
            for idx, v in items:
                groups.setdefault(idx[0], []).append((idx[1:], v))
            if sorted(groups) != list(range(depth_shape[0])):
                raise ArtifactError(f"{name}: pieces do not cover dimension 0 ({sorted(groups)[:5]}...)")
            subs = []
            for i in range(depth_shape[0]):
                sub = build(groups[i], depth_shape[1:])
                node = ir.node("Unsqueeze", [sub, axes], num_outputs=1,
                               outputs=[ir.Value(name=f"{name}.u{next(counter)}")])
                nodes.append(node)
                subs.append(node.outputs[0])
            return concat(subs)
        if all(isinstance(h, tuple) for h in heads):
            ordered = sorted(items, key=lambda it: it[0][0][0])
            edges = [it[0][0] for it in ordered]
            if edges[0][0] != 0 or edges[-1][1] != depth_shape[0] or any(a[1] != b[0] for a, b in zip(edges, edges[1:])):
                raise ArtifactError(f"{name}: row ranges {edges} do not tile {depth_shape[0]} rows")
            if any(len(it[0]) != 1 for it in ordered):
                raise ArtifactError(f"{name}: nested pieces inside a row range are not supported")
            return concat([v for _, v in ordered])
        raise ArtifactError(f"{name}: pieces mix whole-index and row-range forms")

    def concat(values: list[ir.Value]) -> ir.Value:
        if len(values) == 1:
            return values[0]
        node = ir.node("Concat", values, attributes={"axis": 0}, num_outputs=1,
                       outputs=[ir.Value(name=f"{name}.c{next(counter)}")])
        nodes.append(node)
        return node.outputs[0]

    def cast(v: ir.Value, to: ir.DataType) -> ir.Value:
        node = ir.node("Cast", [v], attributes={"to": to}, num_outputs=1, outputs=[ir.Value(name=f"{name}.t{next(counter)}")])
        nodes.append(node)
        return node.outputs[0]

    fp8 = parts[0][1].const_value is not None and parts[0][1].const_value.dtype == ir.DataType.FLOAT8E4M3FN
    if fp8 and len(parts) > 1:
        # Concat takes no float8 in any opset: assemble in float16, which holds every E4M3 value exactly.
        parts = [(idx, cast(v, ir.DataType.FLOAT16)) for idx, v in parts]
        return cast(build(parts, shape), ir.DataType.FLOAT8E4M3FN), nodes
    return build(parts, shape), nodes
