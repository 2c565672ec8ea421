"""The RoPE pass (``m3export/export/compact_rope.py``) on the CPU EP: the traced partial NeoX rotation (three
Slice, four Mul, Sub, Add, Concat per tensor) becomes Gather + two Mul + Add against tables built once from the
graph's cos / sin, and its output is bit-equal to the traced nodes' in fp32, fp16 and bf16."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper

from m3export.export.compact_rope import compact_ropes

HEADS, D = 3, 32
TYPES = {"float32": TP.FLOAT, "float16": TP.FLOAT16, "bfloat16": TP.BFLOAT16}


def _rope_graph(dtype: str, rotary: int) -> onnx.ModelProto:
    """q and k [T, HEADS, D] (fed as fp32, cast to ``dtype``) rotated on their first ``rotary`` dims by cos / sin
    [T, 1, rotary / 2] of ``dtype`` (fed as fp32), the way the exporter traces M3's RoPE; outputs cast to fp32."""
    elem, half = TYPES[dtype], rotary // 2

    def ints(name, values):
        return h.make_node("Constant", [], [name], value_ints=list(values))

    nodes = [ints("s0", [0]), ints("s1", [half]), ints("s2", [rotary]), ints("end", [2 ** 63 - 1]), ints("ax", [2]),
             ints("one", [1]),
             h.make_node("Cast", ["cos_in"], ["cos"], to=elem), h.make_node("Cast", ["sin_in"], ["sin"], to=elem)]
    outs = []
    for t in ("q", "k"):
        nodes += [h.make_node("Cast", [f"{t}_in"], [t], to=elem),
                  h.make_node("Slice", [t, "s0", "s1", "ax", "one"], [f"{t}_lo"]),
                  h.make_node("Slice", [t, "s1", "s2", "ax", "one"], [f"{t}_hi"]),
                  h.make_node("Slice", [t, "s2", "end", "ax", "one"], [f"{t}_rest"]),
                  h.make_node("Mul", [f"{t}_lo", "cos"], [f"{t}_m1"]),
                  h.make_node("Mul", [f"{t}_hi", "sin"], [f"{t}_m2"]),
                  h.make_node("Mul", [f"{t}_hi", "cos"], [f"{t}_m3"]),
                  h.make_node("Mul", [f"{t}_lo", "sin"], [f"{t}_m4"]),
                  h.make_node("Sub", [f"{t}_m1", f"{t}_m2"], [f"{t}_a"]),
                  h.make_node("Add", [f"{t}_m3", f"{t}_m4"], [f"{t}_b"]),
                  h.make_node("Concat", [f"{t}_a", f"{t}_b", f"{t}_rest"], [f"{t}_rot"], axis=-1),
                  h.make_node("Cast", [f"{t}_rot"], [f"{t}_out"], to=TP.FLOAT)]
        outs.append(h.make_tensor_value_info(f"{t}_out", TP.FLOAT, ["T", HEADS, D]))
    inputs = [h.make_tensor_value_info(n, TP.FLOAT, ["T", HEADS, D]) for n in ("q_in", "k_in")]
    inputs += [h.make_tensor_value_info(n, TP.FLOAT, ["T", 1, half]) for n in ("cos_in", "sin_in")]
    return h.make_model(h.make_graph(nodes, "rope", inputs, outs), opset_imports=[h.make_opsetid("", 20)])


def _run(model, feeds, provider: str = "CPUExecutionProvider"):
    sess = ort.InferenceSession(model.SerializeToString(), providers=[provider])
    assert sess.get_providers()[0] == provider
    return sess.run(None, feeds)


def _feeds(t: int, rotary: int, seed: int = 0) -> dict:
    """q / k and the cos / sin of ``t`` tokens at different positions."""
    rng = np.random.default_rng(seed)
    positions = rng.integers(0, 100_000, t).astype(np.float64)
    freqs = 1.0 / (10_000.0 ** (np.arange(rotary // 2) / (rotary // 2)))
    angles = (positions[:, None] * freqs[None, :])[:, None, :]
    return {"q_in": (rng.standard_normal((t, HEADS, D)) * 4).astype(np.float32),
            "k_in": (rng.standard_normal((t, HEADS, D)) * 4).astype(np.float32),
            "cos_in": np.cos(angles).astype(np.float32), "sin_in": np.sin(angles).astype(np.float32)}


@pytest.mark.parametrize("dtype", list(TYPES))
@pytest.mark.parametrize("rotary", [16, D])  # M3's partial rotation, and a full one (no unrotated rest)
def test_compact_rope_is_bit_equal(dtype, rotary):
    model = _rope_graph(dtype, rotary)
    compact, count = compact_ropes(model)
    ops = [n.op_type for n in compact.graph.node]
    assert count == 2 and "Slice" not in ops and "Sub" not in ops and ops.count("Gather") == 2, ops
    feeds = _feeds(5, rotary)
    if dtype != "float32":
        # 16-bit types: structure only here. ORT's CPU EP has no bf16 Mul, and no fp16 one: its cast insertion runs
        # fp16 chains in fp32 and drops the Cast pairs around them (the graph's own rounding of the input to fp16
        # included), so neither form rounds where the graph says on this EP. Per-node rounding, the CUDA EP's, is
        # checked exactly by the test below; the decode graphs' fp16 / bf16 GPU tests run the real thing.
        return
    for w, g in zip(_run(model, feeds), _run(compact, feeds)):
        assert np.array_equal(w, g), np.abs(w - g).max()  # the same roundings (module docstring): bit-equal


@pytest.mark.gpu
@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(), reason="needs onnxruntime-gpu")
@pytest.mark.parametrize("dtype", list(TYPES))
@pytest.mark.parametrize("rotary", [16, D])
def test_compact_rope_is_bit_equal_on_the_cuda_ep(dtype, rotary):
    """The CUDA EP rounds every node to its type (no cast insertion), so the 16-bit forms are checked on ORT's own
    kernels too; 8 tokens at different positions (issue 16's batch-8 decode step)."""
    model = _rope_graph(dtype, rotary)
    compact, _ = compact_ropes(model)
    feeds = _feeds(8, rotary, seed=2)
    for w, g in zip(_run(model, feeds, "CUDAExecutionProvider"), _run(compact, feeds, "CUDAExecutionProvider")):
        assert np.array_equal(w, g), np.abs(w - g).max()


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_rewrite_is_exact_with_per_node_rounding(dtype):
    """Each op rounded to the type (numpy / ml_dtypes round every operation): lo*cos - hi*sin, hi*cos + lo*sin and
    the rest equal x*C + Gather(x, perm)*S with the pass's tables, bit for bit."""
    rng = np.random.default_rng(1)
    half, rest = 8, D - 16
    x = (rng.standard_normal((64, D)) * 4).astype(dtype)
    angles = rng.uniform(0, 1000, (64, half))
    cos, sin = np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)
    lo, hi = x[:, :half], x[:, half:2 * half]
    traced = np.concatenate([lo * cos - hi * sin, hi * cos + lo * sin, x[:, 2 * half:]], axis=-1)
    big_c = np.concatenate([cos, cos, np.ones((64, rest), dtype)], axis=-1)
    big_s = np.concatenate([-sin, sin, np.zeros((64, rest), dtype)], axis=-1)
    perm = np.concatenate([np.arange(half, 2 * half), np.arange(half), np.arange(2 * half, D)])
    compact = x * big_c + x[:, perm] * big_s
    assert compact.dtype == traced.dtype
    assert np.array_equal(compact.astype(np.float64), traced.astype(np.float64))


def test_a_rotation_of_other_pairs_is_left_alone():
    """Slices that are not the halves of the rotated dims (here the high half one element short) are not RoPE."""
    model = _rope_graph("float32", 16)
    for n in model.graph.node:
        if n.output[0] == "s2":
            n.attribute[0].ints[:] = [15]
    compact, count = compact_ropes(model)
    assert count == 0 and compact is model
