"""The cache-scatter graph pass (``m3export/export/element_scatters.py``): each row-indexed ``ScatterND`` into a pool
indexed per element, on ONNX Runtime's CPU EP: the same pool bytes and the same outputs as the graph without it
(K / V pools [pages, page, Hkv, D] and an index-key pool [pages, page, D], fp16 and fp32, written from one shared
(page, offset) index as the traced model writes them), one per-element index per row shape, and nothing rewritten
where the index is not a (page, offset) row index."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper as h

from m3export.export.element_scatters import element_scatters

ort = pytest.importorskip("onnxruntime")
PAGES, PAGE, HKV, D, DI = 6, 4, 2, 8, 16


def _model(elem: int) -> onnx.ModelProto:
    """Three cache writes as the traced step graph has them: index [T, 2] = (slot // page, slot % page)."""
    page = h.make_tensor("page", TP.INT64, [], [PAGE])
    axis = h.make_tensor("axis", TP.INT64, [1], [1])
    nodes = [h.make_node("Div", ["slot_mapping", "page"], ["p"]), h.make_node("Mod", ["slot_mapping", "page"], ["o"]),
             h.make_node("Unsqueeze", ["p", "axis"], ["pu"]), h.make_node("Unsqueeze", ["o", "axis"], ["ou"]),
             h.make_node("Concat", ["pu", "ou"], ["index"], axis=1)]
    for pool in ("k_cache", "v_cache", "index_k_cache"):
        nodes.append(h.make_node("ScatterND", [pool, "index", f"{pool}_rows"], [f"{pool}_out"]))
    rows = {"k_cache": [HKV, D], "v_cache": [HKV, D], "index_k_cache": [DI]}
    inputs = [h.make_tensor_value_info("slot_mapping", TP.INT64, ["T"])]
    inputs += [h.make_tensor_value_info(p, elem, ["pages", PAGE, *r]) for p, r in rows.items()]
    inputs += [h.make_tensor_value_info(f"{p}_rows", elem, ["T", *r]) for p, r in rows.items()]
    outputs = [h.make_tensor_value_info(f"{p}_out", elem, ["pages", PAGE, *r]) for p, r in rows.items()]
    graph = h.make_graph(nodes, "writes", inputs, outputs, initializer=[page, axis])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 20)], ir_version=10)


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("elem,dtype", [(TP.FLOAT, np.float32), (TP.FLOAT16, np.float16)])
def test_per_element_writes_are_the_row_writes(elem, dtype):
    model = _model(elem)
    rewritten, count = element_scatters(model)
    assert count == 3
    scatters = [n for n in rewritten.graph.node if n.op_type == "ScatterND"]
    assert len({n.input[1] for n in scatters}) == 2  # one per-element index per row shape ([Hkv, D] and [Di])
    rng = np.random.default_rng(0)
    slots = np.array([5, 17, 0, 22, 9], dtype=np.int64)  # distinct slots of the pool, unsorted
    feeds = {"slot_mapping": slots}
    for pool, rest in (("k_cache", [HKV, D]), ("v_cache", [HKV, D]), ("index_k_cache", [DI])):
        feeds[pool] = rng.standard_normal((PAGES, PAGE, *rest)).astype(dtype)
        feeds[f"{pool}_rows"] = rng.standard_normal((len(slots), *rest)).astype(dtype)
    for want, got in zip(_run(model, feeds), _run(rewritten, feeds), strict=True):
        assert want.tobytes() == got.tobytes()


def test_a_non_row_index_is_left_alone():
    """A ScatterND whose index is not [T, 2] (here a per-page index [T, 1]) is not a cache-row write this pass knows."""
    nodes = [h.make_node("ScatterND", ["pool", "index", "rows"], ["pool_out"])]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("pool", TP.FLOAT, ["pages", PAGE, D]),
                                      h.make_tensor_value_info("index", TP.INT64, ["T", 1]),
                                      h.make_tensor_value_info("rows", TP.FLOAT, ["T", PAGE, D])],
                         [h.make_tensor_value_info("pool_out", TP.FLOAT, ["pages", PAGE, D])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 20)], ir_version=10)
    assert element_scatters(model) == (model, 0)
