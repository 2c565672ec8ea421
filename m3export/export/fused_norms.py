"""Graph pass: each traced RMSNorm body as ONE ``SimplifiedLayerNormalization`` node (ONNX Runtime's own kernel,
registered in the default domain on the CPU and CUDA providers), applied to the decode-only step graphs.

The traced model writes M3's RMSNorm (``m3export/model/norm.py``: fp32 inside, ``x * rsqrt(mean(x^2) + eps)``,
times ``1 + w`` (Gemma) or ``w``, one rounding back to the activation dtype) as nine nodes: ``Pow(x, 2)``,
``ReduceMean`` (last axis), ``Add(eps)``, ``Sqrt``, ``Reciprocal``, ``Mul(x, .)``, the gain's ``Cast`` / ``Add(1)``
and ``Mul(., gain)``; ONNX Runtime's own fusion does not match the Reciprocal / Mul form, so each ran as seven
kernels per step (the gain's nodes read only initializers and are folded at load). The pass replaces the seven
with ``SimplifiedLayerNormalization(x, gain, axis=-1, epsilon=eps, stash_type=1)`` on the same fp32 ``x`` and the
same fp32 gain (the graph's own ``1 + w`` in fp32, folded at load: the value the reference multiplies by); the
casts into and out of fp32 stay, so the output is rounded to the activation dtype exactly where it was.

Not bit-equal, and the bound: ORT's kernel sums the squares in another order and computes ``x / sqrt(ms + eps)``
(CPU) or ``x * rsqrt(ms + eps)`` (CUDA) where the traced graph computes ``x * (1 / sqrt(ms + eps))``: a few fp32
ulps of the fp32 result (relative <= ~2^-21 for hidden sizes in the thousands), so the rounded bf16 / fp16 output
equals the reference's except where the fp32 value lies within those ulps of a rounding boundary (one ulp of the
activation dtype there). ``tests/test_ort_fused_norms.py`` checks the bound against a float64 reference.

The residual add is not fused (``SkipSimplifiedLayerNormalization`` normalises the unrounded fp32 sum where M3
normalises the sum rounded to the activation dtype): not exact, so not done.
"""

from __future__ import annotations

import numpy as np
import onnx

PASS = "rms_norm"  # the name the manifest's flavour record lists under ``graph_passes``
OP = "SimplifiedLayerNormalization"


def _gs():
    from .lowering import _gs as gs  # the one import of onnx-graphsurgeon, with its install hint

    return gs()


def constant_value(tensor):
    """The constant value of a graphsurgeon tensor (an initializer or a ``Constant`` node's output), else None."""
    gs = _gs()
    if isinstance(tensor, gs.Constant):
        return tensor.values
    if len(tensor.inputs) == 1 and tensor.inputs[0].op == "Constant":
        attrs = tensor.inputs[0].attrs
        for key in ("value_ints", "value_int", "value_floats", "value_float"):
            if key in attrs:
                return np.asarray(attrs[key])
        v = attrs.get("value")
        return None if v is None else (v.values if hasattr(v, "values") else np.asarray(v))
    return None


def _only_consumer(tensor, op: str):
    """The single node consuming ``tensor`` if it is an ``op``, else None."""
    return tensor.outputs[0] if len(tensor.outputs) == 1 and tensor.outputs[0].op == op else None


def _constant_derived(tensor, depth: int = 4) -> bool:
    """``tensor`` computed from constants only (initializers / ``Constant`` nodes through a few nodes): a gain ORT
    folds at load."""
    if isinstance(tensor, _gs().Constant) or constant_value(tensor) is not None:
        return True
    if depth == 0 or len(tensor.inputs) != 1:
        return False
    return all(_constant_derived(t, depth - 1) for t in tensor.inputs[0].inputs)


def _is_float32(tensor) -> bool:
    return tensor.dtype is not None and np.dtype(tensor.dtype) == np.float32


def _match(pow_node):
    """The traced RMSNorm starting at ``Pow(x, 2)`` -> (x, eps, gain, the nodes to remove, the output), else None."""
    if len(pow_node.inputs) != 2 or len(pow_node.outputs) != 1:
        return None
    x, exponent = pow_node.inputs
    e = constant_value(exponent)
    if e is None or np.asarray(e).size != 1 or float(np.asarray(e).reshape(())) != 2.0:
        return None
    mean = _only_consumer(pow_node.outputs[0], "ReduceMean")
    if mean is None or mean.attrs.get("keepdims", 1) != 1 or len(mean.inputs) != 2:
        return None
    axes = constant_value(mean.inputs[1])
    if axes is None or np.asarray(axes).reshape(-1).tolist() not in ([-1], [len(x.shape) - 1] if x.shape else [-1]):
        return None
    add = _only_consumer(mean.outputs[0], "Add")
    if add is None:
        return None
    eps = constant_value(add.inputs[1] if add.inputs[0] is mean.outputs[0] else add.inputs[0])
    if eps is None or np.asarray(eps).size != 1:
        return None
    sqrt = _only_consumer(add.outputs[0], "Sqrt")
    recip = sqrt and _only_consumer(sqrt.outputs[0], "Reciprocal")
    scale = recip and _only_consumer(recip.outputs[0], "Mul")
    if scale is None or x not in scale.inputs:
        return None
    gain_mul = _only_consumer(scale.outputs[0], "Mul")
    if gain_mul is None:
        return None
    gain = gain_mul.inputs[1] if gain_mul.inputs[0] is scale.outputs[0] else gain_mul.inputs[0]
    if not _constant_derived(gain) or not (_is_float32(x) and _is_float32(gain)):
        return None
    if gain.shape is not None and x.shape is not None and (len(gain.shape) != 1 or gain.shape[0] != x.shape[-1]):
        return None
    return x, float(np.asarray(eps).reshape(())), gain, (pow_node, mean, add, sqrt, recip, scale, gain_mul), \
        gain_mul.outputs[0]


def fuse_rms_norms(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """``model`` with every traced RMSNorm of its main graph as one ``SimplifiedLayerNormalization`` node (fp32 in,
    fp32 gain, fp32 out, ``stash_type`` 1) -> (the graph, how many were fused). Initializers, inputs and outputs
    unchanged; function bodies untouched."""
    gs = _gs()
    model = onnx.shape_inference.infer_shapes(model)
    graph = gs.import_onnx(model)
    fused = []
    for node in [n for n in graph.nodes if n.op == "Pow"]:
        m = _match(node)
        if m is None:
            continue
        x, eps, gain, nodes, out = m
        for n in nodes:
            n.outputs.clear()
            n.inputs.clear()
        fused.append((out.name, x.shape))
        graph.nodes.append(gs.Node(OP, f"{out.name}/{OP}", {"axis": -1, "epsilon": eps, "stash_type": 1},
                                   [x, gain], [out]))
    # what shape inference added goes; the fused outputs' types stay declared (ONNX's inference does not know ORT's
    # op, and the nodes after it would otherwise have untyped inputs)
    out_model = export_like(graph, model, [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape)
                                           for name, shape in fused])
    return out_model, len(fused)


def export_like(graph, model: onnx.ModelProto, value_info) -> onnx.ModelProto:
    """The rewritten graphsurgeon ``graph`` as a model with ``model``'s opset imports, functions and IR version
    (graphsurgeon re-derives the first and drops the functions' value infos) and exactly ``value_info``."""
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    out = _gs().export_onnx(graph, do_type_check=False)
    del out.opset_import[:]
    out.opset_import.extend(model.opset_import)
    del out.functions[:]
    out.functions.extend(model.functions)
    out.ir_version = model.ir_version
    del out.graph.value_info[:]
    out.graph.value_info.extend(value_info)
    return out
