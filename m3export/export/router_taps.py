"""A verify-only variant of an artifact graph whose MoE router inputs are also graph outputs.

Which experts ONNX Runtime chose is decided inside each ``m3`` MoE node (``functions._moe``) and is not a graph
output. Its deciding input is: the node's first input ``x`` (the activations entering the MoE op), routed in fp32
through the node's router weight and correction bias. ``verify`` reads ONNX Runtime's own ``x`` of every MoE node
(``routing_ties``) from a copy of the graph that adds one ``Identity`` of it as an output per node
(onnx-graphsurgeon on the loaded ModelProto; nothing else in the graph changes, so ORT runs the same nodes). The
copy is kept in memory and handed to ``PagedSession`` as bytes; its weights keep loading from the artifact's own
files (ORT's external-initializer folder option), and the artifact itself is never modified.

Each tap also carries the router weight and bias the node reads (from the artifact's files, as ORT reads them), so
ORT's routing is recomputed from ORT's own operands.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import ArtifactError, BackendUnavailable
from .manifest import GraphInfo, TensorSig

MOE_OPS = ("MoE", "MoEMXFP8")
PREFIX = "router_input."


@dataclass
class RouterTap:
    """One MoE node: its router input as graph output ``output``, the reference module it matches (``module``,
    the router weight's tensor name less ``.gate.weight``), and the router parameters ORT reads (float64)."""

    output: str
    module: str
    weight: np.ndarray  # [E, D]
    bias: np.ndarray  # [E]


@dataclass
class TappedGraph:
    """The variant: its ModelProto as bytes, its signature (the artifact graph's plus one output per tap)."""

    model: bytes
    graph: GraphInfo
    taps: list[RouterTap]


def tap_router_inputs(artifact, name: str) -> TappedGraph:
    """Graph ``name`` of ``artifact`` with every ``m3`` MoE node's router input also an output (module docstring).
    A graph without MoE nodes comes back with no taps."""
    try:
        import onnx_graphsurgeon as gs
    except ImportError as e:
        raise BackendUnavailable("verify reads ONNX Runtime's router inputs through a graph copy made with "
                                 "onnx-graphsurgeon: pip install onnx-graphsurgeon") from e

    path = artifact.path(name)
    proto = onnx.load(str(path), load_external_data=False)
    graph = gs.import_onnx(proto)
    info = artifact.graphs[name]
    tokens = info.inputs[[t.name for t in info.inputs].index("input_ids")].shape[0]
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
    model = gs.export_onnx(graph)
    return TappedGraph(model.SerializeToString(), replace(info, outputs=(*info.outputs, *sigs)), taps)


def _initializer(proto: onnx.ModelProto, name: str, path, root) -> np.ndarray:
    """An fp32 initializer of the graph as float64, read from the artifact's files where it is external."""
    for t in proto.graph.initializer:
        if t.name == name:
            if t.data_type != onnx.TensorProto.FLOAT:
                raise ArtifactError(f"{path}: router tensor {name} is {onnx.TensorProto.DataType.Name(t.data_type)}"
                                    ", not FLOAT (the router runs in fp32)")
            return numpy_helper.to_array(t, base_dir=str(root)).astype(np.float64)
    raise ArtifactError(f"{path}: no initializer {name}")
