"""What a step graph leaves for ONNX Runtime to share or fold, so that a decode step runs as few nodes as it can.

Why: on a GPU provider ORT spends a few microseconds of host time per executed node (the H200, `mini` bf16, batch
1 / 4k: 1436 nodes, ~8 us each, the step host-bound at 11.1 ms), so a node that is computed once per layer where
once per step would do, or at run time where a constant would do, is the step's cost (issue 16). ORT merges equal
nodes across the inlined bodies of every layer (its common-subexpression pass) only when their inputs are the
same values, and folds a node only when its inputs are constants. These tests pin the properties that let it:

* the exported graph holds each small constant once (ORT keys initializers by name: two equal ones keep two
  copies of every node they feed, e.g. the ``slot // page_size`` arithmetic of each cache write);
* every ``Range`` of the indexer and MoE bodies depends only on the step's batch inputs or on attributes and
  static weight shapes, never on the layer's activations, so its bookkeeping is computed once per step
  (or folded), and every ``TopK`` takes a constant K;
* no size a body feeds to ``Reshape`` / ``Expand`` / ``Range`` / ``TopK`` / ``Pad`` / ``Slice`` mixes values read
  from the device with the layer's own shapes (on a GPU provider such a size is a copy pair and a device wait per
  layer: 31 + 30 Memcpy nodes in the H200 profile of a 4-layer step), except the sparse body's one N.

``bench/ort_step_host.py --nodes`` counts the nodes per origin; the bodies' values are the conformance suite's.
"""

from __future__ import annotations

from collections import Counter

import onnx
import pytest
from onnx import numpy_helper

from m3export.export import functions
from m3export.export.schemas import SPEC_BY_NAME
from m3export.model import Batch

BATCH = set(Batch.input_names())


def inputs_reached(fn: onnx.FunctionProto) -> dict[str, set[str]]:
    """For every value of ``fn``'s body (subgraphs included as opaque nodes reading their outer-scope names), the
    function inputs it depends on; attributes and constants depend on none."""
    deps: dict[str, set[str]] = {name: {name} for name in fn.input}

    def outer_names(graph: onnx.GraphProto) -> set[str]:
        made = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
        used = {i for n in graph.node for i in n.input if i}
        for n in graph.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    used |= outer_names(a.g)
        return used - made

    for node in fn.node:
        read = set(node.input)
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                read |= outer_names(a.g)
        reached = set().union(*(deps.get(i, set()) for i in read if i))
        for o in node.output:
            deps[o] = reached
    return deps


# inputs a node reads as a size on the host (ONNX Runtime's CUDA kernels take them in host memory)
SIZE_INPUTS = {"Reshape": (1,), "Expand": (1,), "Range": (0, 1, 2), "TopK": (1,), "Pad": (1,), "Slice": (1, 2, 3, 4),
               "Tile": (1,), "ConstantOfShape": (0,)}
# the one size read from a layer's own values by design: the sparse body's N, how many blocks a (sequence, head)
# selected, which sizes its gather (docs/ops.md §9)
INHERENT = {("SparsePagedAttention", "TopK")}


def reads(fn: onnx.FunctionProto) -> dict[str, tuple[set[str], set[str]]]:
    """For every value of ``fn``'s body: (inputs whose values it depends on, inputs whose shapes it depends on)."""
    out: dict[str, tuple[set[str], set[str]]] = {name: ({name}, set()) for name in fn.input}
    for node in fn.node:
        ins = [out.get(i, (set(), set())) for i in node.input if i]
        if node.op_type == "Shape":
            data, shape = set(), ins[0][0] | ins[0][1]
        else:
            data = set().union(*(d for d, _ in ins)) if ins else set()
            shape = set().union(*(s for _, s in ins)) if ins else set()
        for o in node.output:
            out[o] = (data, shape)
    return out


@pytest.mark.parametrize("op", ["LightningIndexer", "PagedAttention", "SparsePagedAttention", "MoE"])
def test_no_size_mixes_device_values_with_a_layer_own_shape(op):
    """A size computed from values lives on the device and reaches the host through a copy (a device wait);
    ORT shares it between layers only if it depends on the step's batch inputs alone. A size built from this
    layer's ``Shape`` stays on the host. Mixing the two makes a host -> device -> host copy pair per layer."""
    fn = functions.body(op)
    values = reads(fn)
    static = {"router_weight"}
    checked = 0
    for n in fn.node:
        for i in SIZE_INPUTS.get(n.op_type, ()):
            if i >= len(n.input) or not n.input[i] or (op, n.op_type) in INHERENT:
                continue
            data, shape = values.get(n.input[i], (set(), set()))
            checked += 1
            assert not data or (data | shape) <= BATCH | static, (
                f"{op}: {n.name} input {i} reads the values of {sorted(data)} and the shapes of "
                f"{sorted(shape - BATCH)}: a per-layer size that waits for the device")
    assert checked > 5


@pytest.mark.parametrize("op", ["LightningIndexer", "MoE", "MoEMXFP8"])
def test_ranges_and_topk_sizes_depend_on_no_activation(op):
    fn = functions.body(op)
    deps = inputs_reached(fn)
    spec = SPEC_BY_NAME[op]
    static = {"router_weight"}  # an initializer of static shape: ORT folds its Shape
    allowed = BATCH | static
    ranges = [n for n in fn.node if n.op_type == "Range"]
    assert ranges, f"{op}: no Range to check"
    for n in ranges:
        assert deps[n.output[0]] <= allowed, (
            f"{op}: {n.name} depends on {sorted(deps[n.output[0]] - allowed)}: computed per layer, not per step")
    for n in (n for n in fn.node if n.op_type == "TopK"):
        assert deps[n.input[1]] <= static, f"{op}: {n.name}'s K depends on {sorted(deps[n.input[1]])}"
    assert {p.name for p in spec.inputs} - BATCH - static, "the check must have activations to exclude"


def test_exported_graph_holds_each_small_constant_once(tiny_artifact):
    model = onnx.load(str(tiny_artifact / "model.onnx"), load_external_data=False)
    small = [t for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    keys = Counter()
    for t in small:
        a = numpy_helper.to_array(t)
        if a.size <= 64:
            keys[(a.dtype.str, a.shape, a.tobytes())] += 1
    assert len(keys) > 5, "too few small constants for this check to mean anything"
    repeated = {k: n for k, n in keys.items() if n > 1}
    assert not repeated, f"{len(repeated)} small constants stored more than once, e.g. {next(iter(repeated.items()))}"


def test_cache_writes_share_one_slot_index(tiny_artifact):
    """Every pool's ScatterND of a step writes the same rows: one [page, row] index tensor for all of them."""
    model = onnx.load(str(tiny_artifact / "model.onnx"), load_external_data=False)
    outputs = {o.name for o in model.graph.output}
    writes = [n for n in model.graph.node if n.op_type == "ScatterND" and n.output[0] in outputs]
    pools = [i for i in model.graph.input if i.name.split(".")[0].endswith("cache")]
    assert len(writes) == len(pools) > 2
    assert len({n.input[1] for n in writes}) == 1, "cache writes computing their own slot index"
