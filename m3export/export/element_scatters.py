"""Graph pass: each cache write (``ScatterND`` of a step's new rows into a pool) indexed per element instead of per
row, applied to the decode-only step graphs (``decode_graph.py``; recorded as ``graph_passes`` ``cache_scatter``).

The traced model writes a step's K / V / index-key rows with ``ScatterND(pool [pages, page, *rest], index [T, 2]
(page, offset), rows [T, *rest])``. ONNX Runtime's CUDA kernel runs one thread per index, and that thread copies
its whole row alone, element after element: ``Hkv x D`` = 512 for `mini`'s K / V rows. On the H200 each of the
`mini` decode graph's 11 cache writes took 13.5 us at batch 1 (149 us a step, 2026-12-01 13:37 UTC,
``bench/ort_kernels.py``), for 1 KB written. The pass gives the same scatter an index per element, ``[T, *rest, 2 +
len(rest)]`` (page, offset, then the element's own coordinates), built once per step from the graph's own index
and shared by every write of the same row shape: one thread per element. The same values land in the same places
(a copy either way), the pool stays the node's data input and its output the graph's ``*_out`` (so a runtime that
binds the two to one buffer still writes in place); only rows the same slot receives twice (the CUDA-graph runtime's
padding sequences, all on one scratch slot) may now mix their elements, in a slot nothing real reads.
"""

from __future__ import annotations

import numpy as np
import onnx

from .fused_norms import export_like

PASS = "cache_scatter"


def _gs():
    from .lowering import _gs as gs

    return gs()


def element_scatters(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """``model`` with every row-indexed ``ScatterND`` into a graph-input pool (index ``[T, 2]``, static row shape)
    indexed per element (module docstring) -> (the graph, how many were rewritten)."""
    gs = _gs()
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = gs.import_onnx(inferred)
    pools = {t.name for t in graph.inputs}
    indices, count = {}, 0
    for node in list(graph.nodes):
        if node.op != "ScatterND" or node.attrs.get("reduction", "none") != "none" or len(node.inputs) != 3:
            continue
        data, index, _ = node.inputs
        if data.name not in pools or data.shape is None or index.shape is None:
            continue
        rest = list(data.shape[2:])
        if (len(index.shape) != 2 or index.shape[-1] != 2 or index.dtype != np.int64 or not rest
                or not all(isinstance(d, int) for d in rest)):
            continue
        key = (index.name, tuple(rest))
        if key not in indices:
            indices[key] = _per_element(gs, graph, index, rest, f"cache_scatter_index_{len(indices)}")
        node.inputs[1] = indices[key]
        count += 1
    if not count:
        return model, 0
    return export_like(graph, model, model.graph.value_info), count


def _per_element(gs, graph, index, rest: list[int], p: str):
    """``index`` [T, 2] -> [T, *rest, 2 + len(rest)]: each row's (page, offset) followed by every element's
    coordinates within the row."""
    k = len(rest)
    coords = np.stack(np.meshgrid(*[np.arange(d, dtype=np.int64) for d in rest], indexing="ij"), axis=-1)
    lifted, rows, lead, shape, elements, out = (gs.Variable(f"{p}/{n}") for n in
                                                ("lifted", "rows", "lead", "shape", "elements", "index"))
    graph.nodes += [
        gs.Node("Unsqueeze", f"{p}/Unsqueeze", {}, [index, gs.Constant(f"{p}/axes", np.arange(1, k + 1))], [lifted]),
        gs.Node("Expand", f"{p}/ExpandRows", {}, [lifted, gs.Constant(f"{p}/row_shape",
                                                                        np.array([1, *rest, 2], np.int64))], [rows]),
        gs.Node("Shape", f"{p}/Shape", {"end": 1}, [index], [lead]),
        gs.Node("Concat", f"{p}/ConcatShape", {"axis": 0},
                [lead, gs.Constant(f"{p}/element_shape", np.array([*rest, k], np.int64))], [shape]),
        gs.Node("Expand", f"{p}/ExpandElements", {}, [gs.Constant(f"{p}/coords", coords), shape], [elements]),
        gs.Node("Concat", f"{p}/Concat", {"axis": -1}, [rows, elements], [out]),
    ]
    return out
