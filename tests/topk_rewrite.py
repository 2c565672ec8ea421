"""Rewrite every ``TopK`` node of an ONNX function body, to run the body under another provider's ``TopK``
behaviour on ONNX Runtime's CPU provider (tests/test_indexer_tie_order.py, tests/test_topk_padding.py)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import NodeProto, helper, numpy_helper


def constant(name: str, value, dtype) -> NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, dtype=dtype)))


def rewrite_topk(fn: onnx.FunctionProto, expand: Callable[[NodeProto, str], list[NodeProto]]) -> onnx.FunctionProto:
    """``fn`` with each ``TopK`` (axis -1) replaced by ``expand(node, prefix)``: nodes that produce the TopK's
    outputs, their intermediate names starting with ``prefix``."""
    out = onnx.FunctionProto()
    out.CopyFrom(fn)
    nodes = []
    for n in fn.node:
        if n.op_type != "TopK":
            nodes.append(n)
            continue
        assert helper.get_node_attr_value(n, "axis") == -1
        nodes += expand(n, f"{n.name}_topk")
    assert len(nodes) > len(fn.node), "the body has no TopK to rewrite"
    del out.node[:]
    out.node.extend(nodes)
    return out
