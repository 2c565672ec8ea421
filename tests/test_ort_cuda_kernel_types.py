"""Every node of a bfloat16 artifact's step graphs has a kernel in ONNX Runtime's CUDA execution provider for the
element types it is fed, so the whole step runs on the GPU.

Why: a node no EP has a kernel for is not just slow. ORT expands an ONNX op that has a function body (``Clip``
does) into that body, and the expansion's nodes can be unplaceable too: the first H200 run (2026-11-30) could not
load a bf16 artifact, "Provider type for Less node with name '' is not set", the ``Less`` of a bf16 ``Clip``'s body
(neither the CUDA nor the CPU EP has ``Clip`` or ``Less`` for bfloat16; ORT's CPU EP gives the same expansion on
this machine: "Could not find an implementation for Less(13) node with name ''"). A node only the CPU EP takes
runs, but copies its tensors device -> host -> device inside a step.

The graphs are read as ORT runs them: the ``m3`` function bodies inlined (``onnx.inliner``), types from ONNX shape
inference, ``Scan`` bodies included. Each op's input types are checked against the CUDA EP's registrations.
"""

from __future__ import annotations

import onnx
import pytest
from onnx import inliner, shape_inference


# ONNX Runtime's CUDA EP kernel registrations for the opset these graphs use (20), from ORT's generated table
# docs/OperatorKernels.md ("Operators implemented by CUDAExecutionProvider", written from the EP's kernel
# registry by tools/python/gen_opkernel_doc.py; github.com/microsoft/onnxruntime, read for onnxruntime 1.31):
# op -> (input positions checked, element types registered). Positions None: every input.
FIXED = {"BFLOAT16", "BOOL", "DOUBLE", "FLOAT", "FLOAT16", "INT16", "INT32", "INT64", "INT8", "UINT16", "UINT32",
         "UINT64", "UINT8"}
FP8 = {"FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ"}
FLOATS = {"BFLOAT16", "DOUBLE", "FLOAT", "FLOAT16"}
ARITH = FLOATS | {"INT16", "INT32", "INT64", "INT8", "UINT16", "UINT32", "UINT64", "UINT8"}  # Add/Sub/Mul/Div 14+
COMPARE = {"DOUBLE", "FLOAT", "FLOAT16", "INT32", "INT64", "UINT32", "UINT64"}  # Less/Greater 13+, *OrEqual 16+
MINMAX = FLOATS | {"INT32", "INT64", "UINT32", "UINT64"}  # Max/Min/Mod 13+
CUDA_EP = {
    "Abs": ((0,), ARITH),
    # ORT's own op in the default domain, registered 1+ (contrib LayerNorm<T, U, V, simplified>); the decode graphs
    # feed it fp32 X and scale only (m3export/export/fused_norms.py), the (float, float, float) registration
    "SimplifiedLayerNormalization": ((0, 1), {"DOUBLE", "FLOAT"}),
    "Add": ((0, 1), ARITH), "Sub": ((0, 1), ARITH), "Mul": ((0, 1), ARITH), "Div": ((0, 1), ARITH),
    "And": (None, {"BOOL"}), "Or": (None, {"BOOL"}), "Not": (None, {"BOOL"}),
    "Cast": ((0,), FIXED | FP8),  # 19-20
    "CastLike": ((0,), FIXED | FP8),  # no kernel: ORT expands its function body, one Cast
    "Clip": ((0,), {"DOUBLE", "FLOAT", "FLOAT16", "INT64", "INT8", "UINT64", "UINT8"}),  # 13+: no bfloat16
    "Concat": (None, FIXED),
    "Constant": ((), set()),
    "CumSum": ((0,), {"DOUBLE", "FLOAT", "INT32", "INT64"}),  # 14+ (the axis input lives on the host)
    "Cos": ((0,), {"DOUBLE", "FLOAT", "FLOAT16"}), "Sin": ((0,), {"DOUBLE", "FLOAT", "FLOAT16"}),
    "Equal": ((0, 1), COMPARE | {"BOOL"}),
    "Less": ((0, 1), COMPARE), "Greater": ((0, 1), COMPARE),
    "LessOrEqual": ((0, 1), COMPARE), "GreaterOrEqual": ((0, 1), COMPARE),
    "Expand": ((0,), FIXED),
    "Flatten": ((0,), FIXED),  # 13+: AllFixedSizeTensorTypes, an alias of its input as Reshape is (tensor/flatten.cc)
    "Gather": ((0,), FIXED), "GatherElements": ((0,), FIXED),
    "GatherND": ((0,), {"BFLOAT16", "BOOL", "DOUBLE", "FLOAT", "FLOAT16", "INT64"}),
    "Gemm": (None, FLOATS), "MatMul": (None, FLOATS),
    "Max": (None, MINMAX), "Min": (None, MINMAX), "Mod": ((0, 1), MINMAX),
    "Neg": ((0,), FLOATS | {"INT16", "INT32", "INT64", "INT8"}),
    "NonZero": ((0,), {"BOOL", "FLOAT", "FLOAT16", "INT32", "INT64", "UINT8"}),
    "Pad": ((0,), {"BOOL", "DOUBLE", "FLOAT", "FLOAT16"}),  # 18+: no integers
    "Pow": ((0, 1), FLOATS | {"INT32", "INT64"}),
    "Range": (None, {"DOUBLE", "FLOAT", "INT16", "INT32", "INT64"}),
    "Reciprocal": ((0,), {"DOUBLE", "FLOAT", "FLOAT16"}),
    "ReduceMax": ((0,), {"DOUBLE", "FLOAT", "FLOAT16", "INT32", "INT64"}),  # 18+
    "ReduceMean": ((0,), {"DOUBLE", "FLOAT", "FLOAT16", "INT32"}),  # 18+
    "ReduceSum": ((0,), FLOATS | {"INT32", "INT64"}),
    "Reshape": ((0,), FIXED | FP8), "Shape": ((0,), FIXED | FP8),  # 19-20
    "Scan": (None, FIXED | FP8),  # 19+
    "If": ((0,), {"BOOL"}),  # 19+: the condition is read on the host (a CPU input of the CUDA kernel)
    "ScatterND": ((0, 2), FIXED),  # 18+
    "ScatterElements": ((0, 2), FIXED),  # 18+
    "Sigmoid": ((0,), FLOATS), "Softmax": ((0,), FLOATS), "Sqrt": ((0,), FLOATS),
    "Slice": ((0,), FIXED), "Split": ((0,), FIXED),
    "Squeeze": ((0,), FIXED), "Unsqueeze": ((0,), FIXED), "Transpose": ((0,), FIXED),  # 13-20
    "TopK": ((0,), {"DOUBLE", "FLOAT", "FLOAT16", "INT32", "INT64"}),
    "Where": ((1, 2), FLOATS | {"INT32", "INT64", "UINT8"}),  # 16+
}


def typed_nodes(model: onnx.ModelProto):
    """(where, node, input element type names) for every node of ``model`` with its local functions inlined,
    ``Scan`` bodies included (their outer-scope names resolved)."""
    model = shape_inference.infer_shapes(inliner.inline_local_functions(model))

    def walk(graph, types, where):
        types = dict(types)
        for v in (*graph.input, *graph.value_info, *graph.output):
            if v.type.tensor_type.elem_type:
                types[v.name] = v.type.tensor_type.elem_type
        types.update((t.name, t.data_type) for t in graph.initializer)
        for node in graph.node:
            yield where, node, [onnx.TensorProto.DataType.Name(types[i]) if i in types else None for i in node.input]
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    yield from walk(a.g, types, f"{where}/{node.op_type}")

    yield from walk(model.graph, {}, "")


@pytest.fixture(scope="module")
def bf16_graphs(bf16_artifact):
    """The graphs of the session's tiny bf16 export (``tests/export_fixtures.py``)."""
    return {name: onnx.load(bf16_artifact / f"{name}.onnx", load_external_data=False) for name in GRAPHS}


# the step graphs and their decode forms (the ones an ORT CUDA graph captures: a node left to the CPU EP there is a
# copy inside the capture), with the graph passes and bodies the exporter writes
GRAPHS = ("model", "mtp0", "model.decode", "model.decode-all-experts", "mtp0.decode-all-experts")


@pytest.mark.parametrize("graph", GRAPHS)
def test_every_bf16_node_has_a_cuda_kernel_for_its_types(bf16_graphs, graph):
    missing, unknown, untyped, checked = set(), set(), set(), 0
    for where, node, types in typed_nodes(bf16_graphs[graph]):
        if node.domain not in ("", "ai.onnx"):
            unknown.add(f"{node.domain}::{node.op_type}")
            continue
        if node.op_type not in CUDA_EP:
            unknown.add(node.op_type)
            continue
        positions, allowed = CUDA_EP[node.op_type]
        for i in range(len(types)) if positions is None else positions:
            if i >= len(types) or not node.input[i]:
                continue  # an optional input left out
            if types[i] is None:
                untyped.add(f"{where}/{node.op_type}:{i}")
            elif types[i] not in allowed:
                missing.add(f"{where or '/'} {node.op_type} input {i}: {types[i]}")
            checked += 1
    assert checked > 500, "too few typed inputs for this check to mean anything"
    assert not unknown, f"ops this table lacks (add their CUDA EP registration): {sorted(unknown)}"
    assert not untyped, f"inputs shape inference left untyped: {sorted(untyped)}"
    assert not missing, f"nodes ORT's CUDA EP has no kernel for: {sorted(missing)}"
