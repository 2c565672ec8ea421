"""A verify-only variant of an artifact graph whose MoE router inputs are also graph outputs.

Which experts ONNX Runtime chose is decided inside each ``m3`` MoE node (``functions._moe``) and is not a graph
output. Its deciding input is: the node's first input ``x`` (the activations entering the MoE op), routed in fp32
through the node's router weight and correction bias. ``verify`` reads ONNX Runtime's own ``x`` of every MoE node
(``routing_ties``) from a copy of the graph that adds one ``Identity`` of it as an output per node
(onnx-graphsurgeon on the loaded ModelProto; nothing else in the graph changes, so ORT runs the same nodes). The
copy is kept in memory and handed to ``PagedSession`` as bytes; its weights keep loading from the artifact's own
files (ORT's external-initializer folder option), and the artifact itself is never modified.

Each tap also carries the router weight and bias the node reads (from the artifact's files, as ORT reads them), so
ORT's routing is recomputed from ORT's own operands. Where the MoE function body has the router's known shape (its
routing weights are a ``GatherElements`` of the router's ``Sigmoid`` scores at the chosen ids), the copy also makes
those ids a second output of the function, and of every MoE node, and a graph output: the experts ONNX Runtime
really chose (its fp32 ``TopK``), which ``routing_ties`` checks against the recomputation and forces the reference
to. The body's nodes are unchanged; an internal value only becomes visible.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import ArtifactError, BackendUnavailable
from .manifest import GraphInfo, TensorSig

MOE_OPS = ("MoE", "MoEMXFP8")
PREFIX = "router_input."
EXPERTS_PREFIX = "router_experts."


@dataclass
class RouterTap:
    """One MoE node: its router input as graph output ``output``, the reference module it matches (``module``,
    the router weight's tensor name less ``.gate.weight``), the router parameters ORT reads (float64), and the
    graph output of the expert ids ORT chose ([T, k] int64; None where the body could not be tapped)."""

    output: str
    module: str
    weight: np.ndarray  # [E, D]
    bias: np.ndarray  # [E]
    experts: str | None = None


@dataclass
class TappedGraph:
    """The variant: its ModelProto as bytes, its signature (the artifact graph's plus one output per tap)."""

    model: bytes
    graph: GraphInfo
    taps: list[RouterTap]


def tap_router_inputs(artifact, name: str, path: Path | None = None) -> TappedGraph:
    """Graph ``name`` of ``artifact`` with every ``m3`` MoE node's router input also an output (module docstring).
    A graph without MoE nodes comes back with no taps. ``path``: another file of that graph (a flavour's, e.g.
    the decode graph: the same nodes, inputs and outputs) to tap instead of the artifact's own."""
    try:
        import onnx_graphsurgeon as gs
    except ImportError as e:
        raise BackendUnavailable("verify reads ONNX Runtime's router inputs through a graph copy made with "
                                 "onnx-graphsurgeon: pip install onnx-graphsurgeon") from e

    path = artifact.path(name) if path is None else Path(path)
    proto = onnx.load(str(path), load_external_data=False)
    graph = gs.import_onnx(proto)
    info = artifact.graphs[name]
    tokens = info.inputs[[t.name for t in info.inputs].index("input_ids")].shape[0]
    top_k = artifact.config.num_experts_per_tok
    tapped_bodies = {f.name for f in graph.functions if f.domain == "m3" and f.name in MOE_OPS and _tap_ids(gs, f)}
    taps, sigs = [], []
    for node in graph.nodes:
        if node.domain != "m3" or node.op not in MOE_OPS:
            continue
        x, weight, bias = node.inputs[:3]
        if not isinstance(weight, gs.Constant) or not weight.name.endswith(".gate.weight"):
            raise ArtifactError(f"{path}: MoE node {node.name}'s router weight {weight.name!r} is not an "
                                "initializer named <module>.gate.weight")
        module = weight.name[:-len(".gate.weight")]
        out_name = f"{PREFIX}{module}"
        out = gs.Variable(out_name, dtype=x.dtype, shape=[tokens, artifact.config.hidden_size])
        graph.nodes.append(gs.Node("Identity", name=f"tap_{module}", inputs=[x], outputs=[out]))
        graph.outputs.append(out)
        taps.append(RouterTap(out_name, module, _initializer(proto, weight.name, path, artifact.root),
                              _initializer(proto, bias.name, path, artifact.root)))
        sigs.append(TensorSig(out_name, artifact.manifest.dtype, (tokens, artifact.config.hidden_size)))
        if node.op in tapped_bodies and len(node.outputs) == 1:
            ids = gs.Variable(f"{EXPERTS_PREFIX}{module}", dtype=np.int64, shape=[tokens, top_k])
            node.outputs.append(ids)
            graph.outputs.append(ids)
            taps[-1].experts = ids.name
            sigs.append(TensorSig(ids.name, "int64", (tokens, top_k)))
    model = gs.export_onnx(graph)
    return TappedGraph(model.SerializeToString(), replace(info, outputs=(*info.outputs, *sigs)), taps)


def _tap_ids(gs, body) -> bool:
    """Make the chosen expert ids of an MoE function body its second output (module docstring); False (body
    unchanged) where the body does not have the router's known shape."""
    if len(body.outputs) != 1:
        return False
    found = [n for n in body.nodes if n.op == "GatherElements" and _made_by(n.inputs[0], "Sigmoid")
             and _made_by(n.inputs[0].inputs[0].inputs[0], "MatMul")]
    if len(found) != 1:
        return False
    ids = gs.Variable("routed_experts", dtype=np.int64)
    body.nodes.append(gs.Node("Identity", name="tap_routed_experts", inputs=[found[0].inputs[1]], outputs=[ids]))
    body.outputs.append(ids)
    return True


def _made_by(tensor, op: str) -> bool:
    return len(tensor.inputs) == 1 and tensor.inputs[0].op == op


def _initializer(proto: onnx.ModelProto, name: str, path, root) -> np.ndarray:
    """An fp32 initializer of the graph as float64, read from the artifact's files where it is external."""
    for t in proto.graph.initializer:
        if t.name == name:
            if t.data_type != onnx.TensorProto.FLOAT:
                raise ArtifactError(f"{path}: router tensor {name} is {onnx.TensorProto.DataType.Name(t.data_type)}"
                                    ", not FLOAT (the router runs in fp32)")
            return numpy_helper.to_array(t, base_dir=str(root)).astype(np.float64)
    raise ArtifactError(f"{path}: no initializer {name}")
