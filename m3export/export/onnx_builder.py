"""A small emitter for ONNX function bodies: op calls as Python, deterministic value names, attribute references.

Bodies are written as Python calls (``b.MatMul(q, k)``) so the pieces several ops share (sequence ids, the paged
gather, SwiGLU, MXFP8 dequantisation) are plain Python helpers rather than nested ONNX functions that every
consumer would have to resolve.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import AttributeProto, GraphProto, NodeProto, helper, numpy_helper


@dataclass(frozen=True)
class Ref:
    """A reference to an attribute of the enclosing function (``ref_attr_name``)."""

    name: str
    kind: int  # AttributeProto.INT / FLOAT


class Builder:
    def __init__(self, prefix: str):
        self.prefix = prefix
        self.nodes: list[NodeProto] = []
        self._count = 0

    def _fresh(self, hint: str) -> str:
        self._count += 1
        return f"{self.prefix}{hint}_{self._count}"

    def op(self, op_type: str, *inputs: str | None, n_out: int = 1, **attrs):
        """Append one node; ``None`` inputs are omitted optionals; returns the output name(s)."""
        outs = [self._fresh(op_type) for _ in range(n_out)]
        plain = {k: v for k, v in attrs.items() if not isinstance(v, Ref)}
        node = helper.make_node(op_type, ["" if i is None else i for i in inputs], outs, name=outs[0], **plain)
        for key, ref in sorted((k, v) for k, v in attrs.items() if isinstance(v, Ref)):
            node.attribute.append(helper.make_attribute_ref(key, ref.kind, ref_attr_name=ref.name))
        self.nodes.append(node)
        return outs[0] if n_out == 1 else tuple(outs)

    def __getattr__(self, op_type: str):
        if not op_type[:1].isupper():
            raise AttributeError(op_type)
        return lambda *inputs, **attrs: self.op(op_type, *inputs, **attrs)

    def const(self, value, dtype=np.int64) -> str:
        """A Constant tensor (scalars stay rank 0)."""
        return self.op("Constant", value=numpy_helper.from_array(np.asarray(value, dtype=dtype)))

    def attr(self, ref: Ref) -> str:
        """The value of a function attribute as a rank-0 tensor (int64 or float32)."""
        field = {AttributeProto.INT: "value_int", AttributeProto.FLOAT: "value_float"}[ref.kind]
        return self.op("Constant", **{field: ref})

    def graph(self, name: str, inputs: list[str], outputs: list[str]) -> GraphProto:
        """The nodes so far as a subgraph (Scan / Loop body); types come from the enclosing node."""
        return helper.make_graph(
            self.nodes, name, [helper.make_empty_tensor_value_info(i) for i in inputs],
            [helper.make_empty_tensor_value_info(o) for o in outputs],
        )
