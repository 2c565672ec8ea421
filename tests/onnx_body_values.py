"""An ``m3`` op's ONNX function body inlined and run by ONNX Runtime's CPU provider with every value it computes
made a graph output: what the body tests read (tensor sizes in ``test_onnx_function_cost.py``, gather / scatter
indices in ``test_onnx_body_indices.py``)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, inliner

from m3export.export.functions import body
from m3export.export.schemas import SPEC_BY_NAME, opset_imports, register_schemas
from m3export.ops import conformance as conf


def run_every_value(op: str, inputs, attrs) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The inlined body of ``m3::op`` (float pools) run on ``inputs`` (torch tensors) by ORT's CPU provider: the
    inlined model and every value it computes that shape inference types, the inputs included."""
    register_schemas()
    spec = SPEC_BY_NAME[op]
    names = [p.name for p in spec.inputs]
    graph = helper.make_graph(
        [helper.make_node(op, names, [spec.outputs[0].name], domain="m3", **attrs)], op,
        [helper.make_tensor_value_info(n, conf._onnx_type(t.dtype), list(t.shape)) for n, t in zip(names, inputs)],
        [helper.make_tensor_value_info(spec.outputs[0].name, onnx.TensorProto.UNDEFINED, None)],
    )
    model = helper.make_model(graph, opset_imports=opset_imports(), functions=[body(op)])
    model.ir_version = 10
    model = onnx.shape_inference.infer_shapes(inliner.inline_local_functions(model))
    typed = {v.name: v for v in model.graph.value_info}
    outs = [o for node in model.graph.node for o in node.output if o in typed]
    del model.graph.output[:]
    model.graph.output.extend(typed[o] for o in outs)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {n: t.numpy() for n, t in zip(names, inputs)}
    return model, {**feeds, **dict(zip(outs, sess.run(None, feeds)))}
