"""Graph pass: each traced partial NeoX RoPE in four nodes instead of ten, bit-exact, applied to the decode-only
step graphs (``decode_graph.py``; recorded as ``graph_passes`` ``rope``).

The traced model rotates the first ``rd`` of a head's ``D`` dims (pairs ``i``, ``i + rd/2``) as three ``Slice``
(low half, high half, the unrotated rest), four ``Mul``, a ``Sub``, an ``Add`` and a ``Concat``:
``[lo*cos - hi*sin, hi*cos + lo*sin, rest]``. The pass writes ``x * C + Gather(x, perm, axis=-1) * S`` with
``perm`` = the halves swapped (the rest in place), ``C = [cos, cos, 1...]`` and ``S = [-sin, sin, 0...]``: tables
built once per step from the graph's own ``cos`` / ``sin`` (shared by every layer). Every element gets the same
roundings in the activation dtype: ``lo*cos`` and ``hi*cos`` are the same products, ``hi*(-sin)`` is
``-(hi*sin)`` exactly (round-to-nearest is symmetric), ``a + (-b)`` is ``a - b``, and on the rest ``x*1 + x'*0``
is ``x`` (a ``-0`` rest element may come out ``+0``; finite activations assumed, as ``x*0`` of an infinity is
NaN). ``tests/test_ort_fused_norms.py`` checks bit equality on the CPU EP.
"""

from __future__ import annotations

import numpy as np
import onnx

from .fused_norms import constant_value, export_like

PASS = "rope"


def _gs():
    from .lowering import _gs as gs

    return gs()


def _const(tensor):

    v = constant_value(tensor)
    return None if v is None else np.asarray(v).reshape(-1).tolist()


def _slice_range(node, x) -> tuple[int, int] | None:
    """(start, end) of a Slice of ``x`` along its last axis with step 1, else None."""
    if node.op != "Slice" or node.inputs[0] is not x or len(node.inputs) < 4:
        return None
    starts, ends, axes = (_const(t) for t in node.inputs[1:4])
    steps = _const(node.inputs[4]) if len(node.inputs) > 4 else [1]
    rank = len(x.shape) if x.shape is not None else None
    if None in (starts, ends, axes, steps, rank) or len(starts) != 1 or steps != [1]:
        return None
    if axes[0] not in (-1, rank - 1):
        return None
    return starts[0], ends[0]


def _match(concat):
    """A traced RoPE ending at ``Concat(lo', hi', rest)`` -> (x, cos, sin, half, out), else None."""
    if concat.op != "Concat" or len(concat.inputs) != 3:
        return None
    sub, add, rest = (t.inputs[0] if len(t.inputs) == 1 else None for t in concat.inputs)
    if sub is None or add is None or rest is None or sub.op != "Sub" or add.op != "Add" or rest.op != "Slice":
        return None
    x = rest.inputs[0]
    if x.shape is None or not isinstance(x.shape[-1], int) or concat.attrs.get("axis") not in (-1, len(x.shape) - 1):
        return None
    muls = [t.inputs[0] if len(t.inputs) == 1 else None for t in (*sub.inputs, *add.inputs)]
    if any(m is None or m.op != "Mul" or len(m.inputs) != 2 for m in muls):
        return None
    (lo, c1), (hi, s1), (hi2, c2), (lo2, s2) = (m.inputs for m in muls)
    if not (lo is lo2 and hi is hi2 and c1 is c2 and s1 is s2) or lo.inputs == [] or hi.inputs == []:
        return None
    rl, rh, rr = _slice_range(lo.inputs[0], x), _slice_range(hi.inputs[0], x), _slice_range(rest, x)
    d = x.shape[-1]
    if None in (rl, rh, rr):
        return None
    half = rl[1]
    if rl[0] != 0 or rh != (half, 2 * half) or rr[0] != 2 * half or rr[1] < d or half <= 0 or 2 * half > d:
        return None
    if any(len(t.outputs) != 1 for t in (sub.outputs[0], add.outputs[0])):
        return None
    return x, c1, s1, half, concat.outputs[0], (concat, sub, add, *(m for m in muls), rest,
                                                lo.inputs[0], hi.inputs[0])


def compact_ropes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """``model`` with every traced partial RoPE of its main graph rewritten as four nodes (module docstring) ->
    (the graph, how many were rewritten)."""
    gs = _gs()
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = gs.import_onnx(inferred)
    tables, count = {}, 0
    for node in list(graph.nodes):
        m = _match(node)
        if m is None:
            continue
        x, cos, sin, half, out, nodes = m
        d = x.shape[-1]
        key = (cos.name, sin.name, half, d)
        if key not in tables:
            tables[key] = _tables(gs, graph, cos, sin, d - 2 * half, f"rope_tables_{len(tables)}")
        big_c, big_s = tables[key]
        perm = np.concatenate([np.arange(half, 2 * half), np.arange(half), np.arange(2 * half, d)]).astype(np.int64)
        p = f"{out.name}/rope"
        swapped = gs.Variable(f"{p}/swapped")
        xc, xs = gs.Variable(f"{p}/xc"), gs.Variable(f"{p}/xs")
        for n in nodes:
            n.outputs.clear()
            n.inputs.clear()
        graph.nodes += [gs.Node("Gather", f"{p}/Gather", {"axis": -1}, [x, gs.Constant(f"{p}/perm", perm)],
                                [swapped]),
                        gs.Node("Mul", f"{p}/MulC", {}, [x, big_c], [xc]),
                        gs.Node("Mul", f"{p}/MulS", {}, [swapped, big_s], [xs]),
                        gs.Node("Add", f"{p}/Add", {}, [xc, xs], [out])]
        count += 1
    if not count:
        return model, 0
    out_model = export_like(graph, model, model.graph.value_info)
    return out_model, count


def _tables(gs, graph, cos, sin, tail: int, p: str):
    """``C = [cos, cos, 1 x tail]`` and ``S = [-sin, sin, 0 x tail]`` along the last axis, in cos's dtype."""
    neg = gs.Variable(f"{p}/neg_sin")
    big_c, big_s = gs.Variable(f"{p}/C"), gs.Variable(f"{p}/S")
    graph.nodes.append(gs.Node("Neg", f"{p}/Neg", {}, [sin], [neg]))
    if tail == 0:
        graph.nodes += [gs.Node("Concat", f"{p}/ConcatC", {"axis": -1}, [cos, cos], [big_c]),
                        gs.Node("Concat", f"{p}/ConcatS", {"axis": -1}, [neg, sin], [big_s])]
        return big_c, big_s
    lead, tail_shape = gs.Variable(f"{p}/lead"), gs.Variable(f"{p}/tail_shape")
    one, zero = gs.Variable(f"{p}/one"), gs.Variable(f"{p}/zero")
    ones, zeros = gs.Variable(f"{p}/ones"), gs.Variable(f"{p}/zeros")
    graph.nodes += [
        gs.Node("Shape", f"{p}/Shape", {"end": -1}, [cos], [lead]),
        gs.Node("Concat", f"{p}/ConcatShape", {"axis": 0}, [lead, gs.Constant(f"{p}/tail", np.array([tail],
                                                                                                  np.int64))],
                [tail_shape]),
        gs.Node("CastLike", f"{p}/One", {}, [gs.Constant(f"{p}/one_f", np.array(1.0, np.float32)), cos], [one]),
        gs.Node("CastLike", f"{p}/Zero", {}, [gs.Constant(f"{p}/zero_f", np.array(0.0, np.float32)), cos], [zero]),
        gs.Node("Expand", f"{p}/Ones", {}, [one, tail_shape], [ones]),
        gs.Node("Expand", f"{p}/Zeros", {}, [zero, tail_shape], [zeros]),
        gs.Node("Concat", f"{p}/ConcatC", {"axis": -1}, [cos, cos, ones], [big_c]),
        gs.Node("Concat", f"{p}/ConcatS", {"axis": -1}, [neg, sin, zeros], [big_s]),
    ]
    return big_c, big_s
