"""The RMSNorm fusion pass (``m3export/export/fused_norms.py``) on the CPU EP: the traced node pattern (as the
exporter writes M3's RMSNorm: cast to fp32, Pow, ReduceMean, Add eps, Sqrt, Reciprocal, Mul, the gain's Cast /
Add 1, Mul, cast back) becomes one ``SimplifiedLayerNormalization`` whose output stays within a few fp32 ulps of a
float64 reference, and whatever is not that pattern is left alone."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper

from m3export.export.fused_norms import OP, fuse_rms_norms

EPS = 1e-6
HIDDEN = 256
DTYPES = {"float32": (TP.FLOAT, np.float32), "float16": (TP.FLOAT16, np.float16),
          "bfloat16": (TP.BFLOAT16, ml_dtypes.bfloat16)}


def _norm_graph(dtype: str, gemma: bool = True, exponent: float = 2.0, axis: int = -1) -> onnx.ModelProto:
    """One traced RMSNorm over x [T, HIDDEN] of ``dtype`` (gain ``1 + w`` when ``gemma``, else ``w``)."""
    elem, np_dtype = DTYPES[dtype]
    w = (np.random.default_rng(1).standard_normal(HIDDEN) * 0.3).astype(np_dtype)

    def const(name, value):
        return h.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, np.float32), name))

    nodes = [const("two", exponent), const("eps", EPS), const("one", 1.0),
             h.make_node("Constant", [], ["axes"], value=numpy_helper.from_array(np.array([axis], np.int64), "axes")),
             h.make_node("Cast", ["x"], ["xf"], to=TP.FLOAT),
             h.make_node("Pow", ["xf", "two"], ["sq"]),
             h.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
             h.make_node("Add", ["ms", "eps"], ["mse"]),
             h.make_node("Sqrt", ["mse"], ["rms"]),
             h.make_node("Reciprocal", ["rms"], ["inv"]),
             h.make_node("Mul", ["xf", "inv"], ["normed"]),
             h.make_node("Cast", ["w"], ["wf"], to=TP.FLOAT)]
    if gemma:
        nodes.append(h.make_node("Add", ["wf", "one"], ["gain"]))
    nodes += [h.make_node("Mul", ["normed", "gain" if gemma else "wf"], ["yf"]),
              h.make_node("Cast", ["yf"], ["y"], to=elem)]
    io = elem
    if dtype == "bfloat16":  # onnxruntime's Python binding feeds no bf16 arrays: fp32 in and out, bf16 inside
        io = TP.FLOAT
        nodes = [h.make_node("Cast", ["x_io"], ["x"], to=elem)] + nodes + [h.make_node("Cast", ["y"], ["y_io"],
                                                                                        to=TP.FLOAT)]
    names = ("x_io", "y_io") if dtype == "bfloat16" else ("x", "y")
    graph = h.make_graph(nodes, "norm", [h.make_tensor_value_info(names[0], io, ["T", HIDDEN])],
                         [h.make_tensor_value_info(names[1], io, ["T", HIDDEN])],
                         initializer=[numpy_helper.from_array(w, "w")])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 20)])


def _run(model: onnx.ModelProto, x: np.ndarray, provider: str = "CPUExecutionProvider") -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=[provider])
    assert sess.get_providers()[0] == provider
    return sess.run(None, {sess.get_inputs()[0].name: x.astype(np.float32) if x.dtype == ml_dtypes.bfloat16
                           else x})[0]


def _reference(model: onnx.ModelProto, x: np.ndarray, gemma: bool) -> np.ndarray:
    """M3's RMSNorm in float64 (before the final rounding)."""
    w = numpy_helper.to_array(model.graph.initializer[0]).astype(np.float64)
    xd = x.astype(np.float64)
    y = xd / np.sqrt((xd * xd).mean(-1, keepdims=True) + EPS)
    return y * ((1.0 + w) if gemma else w)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("gemma", [True, False])
def test_fused_norm_is_one_node_within_the_bound(dtype, gemma):
    model = _norm_graph(dtype, gemma)
    fused, count = fuse_rms_norms(model)
    ops = [n.op_type for n in fused.graph.node]
    assert count == 1 and ops.count(OP) == 1 and "Pow" not in ops and "Reciprocal" not in ops, ops
    node = next(n for n in fused.graph.node if n.op_type == OP)
    attrs = {a.name: h.get_attribute_value(a) for a in node.attribute}
    assert attrs["axis"] == -1 and attrs["stash_type"] == 1 and np.isclose(attrs["epsilon"], EPS, rtol=1e-7)
    _assert_within_bound(model, fused, dtype, gemma)


@pytest.mark.gpu
@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(), reason="needs onnxruntime-gpu")
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fused_norm_within_the_bound_on_the_cuda_ep(dtype):
    """ORT's CUDA kernel (``x * rsqrt``, its own reduction) on the 12 rows of the CPU test: the same bound."""
    model = _norm_graph(dtype, True)
    _assert_within_bound(model, fuse_rms_norms(model)[0], dtype, True, "CUDAExecutionProvider")


def _assert_within_bound(model, fused, dtype: str, gemma: bool, provider: str = "CPUExecutionProvider") -> None:
    rng = np.random.default_rng(0)
    np_dtype = DTYPES[dtype][1]
    # rows at three scales: 1e-3 makes mean(x^2) ~ eps, so a wrong or missing epsilon moves the output by ~30 %
    x = np.concatenate([rng.standard_normal((4, HIDDEN)) * s for s in (1e-3, 1.0, 30.0)]).astype(np_dtype)
    want = _reference(model, x, gemma)
    got = _run(fused, x, provider).astype(np.float64)
    traced = _run(model, x, provider).astype(np.float64)
    scale = np.abs(want).max(-1, keepdims=True)
    if dtype == "float32":
        # fp32 both ways: the sum of 256 positive squares (relative error <= 255 u, u = 2^-24, as a bound; its
        # square root halves it), the sqrt / reciprocal / divide and two multiplies, a few u each: 2^-14 relative to
        # the row's largest element is that worst case with room, and 1000x below the eps check's 30 %
        assert (np.abs(got - want) / scale).max() <= 2.0 ** -14
    else:
        # one rounding to the 16-bit type of a value a few fp32 ulps from the reference's: the fused output is the
        # traced graph's own or one ulp of the type away (a value that lies within those ulps of a rounding
        # boundary); ulp of |y| in the type: 2^(floor(log2 |y|) - mantissa bits)
        bits = 10 if dtype == "float16" else 7
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(traced), 1e-30))) - bits)
        assert (np.abs(got - traced) <= ulp).all()
        assert (got != traced).mean() <= 0.02  # rare: the fp32 difference is ~2^-13 of the 16-bit ulp


@pytest.mark.parametrize("change", [{"exponent": 3.0}, {"axis": 0}])
def test_what_is_not_an_rms_norm_is_left_alone(change):
    model = _norm_graph("float32", **change)
    fused, count = fuse_rms_norms(model)
    assert count == 0 and sorted(n.op_type for n in fused.graph.node) == sorted(n.op_type for n in model.graph.node)
