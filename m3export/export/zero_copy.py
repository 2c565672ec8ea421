"""Weights straight from the checkpoint: the artifact references the checkpoint's own safetensors bytes.

safetensors stores each tensor as raw row-major bytes at a known offset, which is exactly what an ONNX
external-data entry is (file, offset, length). ONNX Runtime and ``onnx.checker`` only accept data files inside
the model's directory (symbolic links are resolved and refused), so the checkpoint's shards are *hard-linked*
into the artifact: no byte is copied, and deleting the checkpoint later does not break the artifact.

Each of our parameters is made of one or more checkpoint tensors (``Layout.pieces``: e.g. the original
layout stores every expert's w1 / w3 / w2 separately, while we stack them). A piece whose dtype already is
the graph's is referenced in place; any other piece is converted and streamed, one piece at a time, into the
artifact's own weight file. The graph reassembles multi-piece parameters with standard Concat / Unsqueeze
nodes (see ``assemble``), which runtimes fold once at load.

Linked shards are identified by size and a hash of their safetensors header, never by hashing gigabytes.
"""

from __future__ import annotations

import errno
import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir
import torch

from ..checkpoint.layout import Layout, Piece
from ..checkpoint.shards import Checkpoint
from ..errors import ArtifactError, CheckpointError
from ..model import M3ForCausalLM
from ..ops import mxfp8 as mx
from .weights import DTYPES, TensorEntry

LINK_DIR = "checkpoint"


def shard_identity(path: Path) -> dict:
    """Size plus sha256 of the safetensors header: cheap, and changes whenever tensors, dtypes or shapes do."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = f.read(n)
    return {"bytes": path.stat().st_size, "header_sha256": hashlib.sha256(header).hexdigest()}


@dataclass(frozen=True)
class PieceEntry:
    """One checkpoint tensor filling ``index`` (ints and (start, stop) row ranges) of a parameter."""

    index: tuple
    entry: TensorEntry

    def to_json(self) -> dict:
        return {"index": [list(i) if isinstance(i, tuple) else i for i in self.index], **self.entry.to_json()}

    @classmethod
    def from_json(cls, name: str, d: dict) -> "PieceEntry":
        index = tuple(tuple(i) if isinstance(i, list) else int(i) for i in d.get("index", []))
        return cls(index, TensorEntry.from_json(name, d))

    def torch_index(self) -> tuple:
        return tuple(slice(*i) if isinstance(i, tuple) else i for i in self.index)


def _plain_index(piece: Piece) -> tuple:
    return tuple((i.start, i.stop) if isinstance(i, slice) else i for i in piece.index)


@dataclass
class WeightPlan:
    """Every parameter's pieces, which pieces must be converted, and the shards to link."""

    pieces: dict[str, list[PieceEntry]]
    convert: list[tuple[str, torch.dtype, tuple[int, ...]]]  # (checkpoint tensor, target dtype, shape)
    shards: dict[str, Path]  # artifact-relative link name -> checkpoint shard


def plan(ckpt: Checkpoint, layout: Layout, model: M3ForCausalLM, converted_file: str) -> WeightPlan:
    """Decide, piece by piece, whether the checkpoint bytes can be used as they are (``model`` on ``meta`` gives
    the dtype and shape each parameter has in the graph). Converted pieces get provisional entries in
    ``converted_file``; their offsets are filled in once that file is written."""
    pieces: dict[str, list[PieceEntry]] = {}
    convert: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    shards: dict[str, Path] = {}
    for name, p in model.named_parameters():
        out = []
        for piece in layout.pieces(name):
            info = ckpt.tensors.get(piece.name)
            if info is None:
                raise CheckpointError(f"{ckpt.dir}: tensor {piece.name!r} (for {name}) is missing")
            want_shape = tuple(p[piece.index].shape)
            if tuple(info.shape) != want_shape:
                raise CheckpointError(f"{info.file}: tensor {piece.name!r} has shape {list(info.shape)}, expected "
                                      f"{list(want_shape)}")
            if info.dtype == p.dtype:
                link = f"{LINK_DIR}/{info.file.name}"
                shards[link] = info.file
                entry = TensorEntry(link, info.offset, info.length, DTYPES[p.dtype][1], want_shape)
            else:
                if p.dtype in (torch.float8_e4m3fn, torch.uint8):
                    raise CheckpointError(f"{info.file}: tensor {piece.name!r} is {info.dtype}; an MXFP8 export needs "
                                          "an MXFP8 checkpoint (or export with --weights bf16)")
                convert.append((piece.name, p.dtype, want_shape))
                entry = TensorEntry(converted_file, -1, 0, DTYPES[p.dtype][1], want_shape)
            out.append(PieceEntry(_plain_index(piece), entry))
        pieces[name] = out
    return WeightPlan(pieces, convert, shards)


def converted_value(ckpt: Checkpoint, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint tensor in the graph's dtype (MXFP8 weights are dequantised with their scales)."""
    t = ckpt.get(name)
    if t.dtype == torch.float8_e4m3fn:
        t = mx.dequantize(t, ckpt.get(name + "_scale_inv"))
    return t.to(dtype)


def link_shards(shards: dict[str, Path], dest: Path) -> dict[str, dict]:
    """Hard-link each referenced shard into ``dest``; returns {link name: shard identity} for the manifest."""
    out = {}
    for link, src in sorted(shards.items()):
        target = dest / link
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, target)
        except OSError as e:
            if e.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise ArtifactError(
                    f"{src}: cannot hard-link into {dest} ({e.strerror}); zero-copy export needs the artifact on the "
                    "same filesystem as the checkpoint — choose another --out, or pass --copy-weights") from None
            raise ArtifactError(f"{src}: cannot link into the artifact ({e.strerror})") from None
        out[link] = shard_identity(target)
    return out


def assemble(graph: ir.Graph, name: str, parts: list[tuple[tuple, ir.Value]], shape: tuple[int, ...]
             ) -> tuple[ir.Value, list[ir.Node]]:
    """Build ``name`` (of ``shape``) from pieces with Concat / Unsqueeze; returns the value and the new nodes."""
    nodes: list[ir.Node] = []
    counter = iter(range(1 << 30))

    def const_axes(axis: int) -> ir.Value:
        v = ir.Value(name=f"{name}.axes{next(counter)}", const_value=ir.tensor([axis], dtype=ir.DataType.INT64))
        graph.register_initializer(v)
        return v

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
                node = ir.node("Unsqueeze", [sub, const_axes(0)], num_outputs=1,
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

    value = build(parts, shape)
    return value, nodes
