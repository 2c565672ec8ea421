"""Every index the cache readers' ONNX bodies feed to a Gather / GatherND / GatherElements / ScatterND /
ScatterElements lies in ``[0, dim)``, on adversarial batches: block tables padded with page ids past the pool,
selections holding -1, duplicates and ids past the sequence, sequences with no new token, pages smaller than blocks.

Why: ONNX Runtime's CPU kernels reject an out-of-range index (or wrap a negative one), its CUDA kernels read
whatever the address holds, so a body that relied on either would pass on the CPU and corrupt or crash on the GPU
(the first H200 run died with an illegal memory access inside ``SparsePagedAttention``'s body). The bodies redirect
every padded or masked slot to a valid one; this checks it on the values ORT actually computes: the inlined body
with every intermediate made a graph output.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from m3export.ops import conformance as conf
from tests.onnx_body_values import run_every_value

INDEXED = {"Gather", "GatherElements", "GatherND", "ScatterND", "ScatterElements"}


def out_of_range(node: onnx.NodeProto, values: dict[str, np.ndarray]) -> str | None:
    """What is wrong with ``node``'s indices (None when every one is in ``[0, dim)``)."""
    data, idx = values[node.input[0]], values[node.input[1]]
    if idx.size == 0:
        return None
    if node.op_type in ("Gather", "GatherElements", "ScatterElements"):
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0) % data.ndim
        low, high, dim = int(idx.min()), int(idx.max()), data.shape[axis]
        return None if 0 <= low and high < dim else f"indices {low} .. {high} on an axis of {dim}"
    m = idx.shape[-1]  # GatherND / ScatterND (batch_dims 0): the last axis indexes data's first m axes
    flat = idx.reshape(-1, m)
    for i in range(m):
        low, high, dim = int(flat[:, i].min()), int(flat[:, i].max()), data.shape[i]
        if low < 0 or high >= dim:
            return f"indices {low} .. {high} on axis {i} of {dim}"
    return None


CASES = ["LightningIndexer/nan-tails-empty-shared-batch", "LightningIndexer/page-smaller-than-block",
         "PagedAttention/nan-tails-empty-shared-batch", "PagedAttention/page-smaller-than-block",
         "SparsePagedAttention/nan-tails-empty-shared-batch-random",
         "SparsePagedAttention/nan-tails-empty-shared-batch-indexer",
         "SparsePagedAttention/page-smaller-than-block-random", "SparsePagedAttention/6k-tiny-dims-random"]


@pytest.mark.parametrize("case_id", CASES)
def test_every_body_index_is_in_range(case_id):
    case = conf.CASES[case_id]
    inputs, attrs = case.inputs(torch.float32)
    model, values = run_every_value(case.op, inputs, conf.scalar_attributes(attrs))
    checked, bad = 0, []
    for node in model.graph.node:
        if node.op_type not in INDEXED:
            continue
        assert node.input[0] in values and node.input[1] in values, f"{node.name}: untyped operands"
        checked += 1
        why = out_of_range(node, values)
        if why:
            bad.append(f"{node.op_type} {node.name}: {why}")
    assert checked >= 3 and not bad, bad


def test_the_check_catches_a_padded_id_used_as_an_index():
    """The same check on a body that gathers a -1 padded selection as a page index fails (the check can fail)."""
    pool = np.zeros((5, 4), np.float32)
    node = helper.make_node("Gather", ["pool", "ids"], ["rows"], axis=0)
    assert out_of_range(node, {"pool": pool, "ids": np.array([0, -1, 3])}) == "indices -1 .. 3 on an axis of 5"
    assert out_of_range(node, {"pool": pool, "ids": np.array([0, 5])}) == "indices 0 .. 5 on an axis of 5"
    nd = helper.make_node("GatherND", ["pool", "at"], ["rows"])
    assert out_of_range(nd, {"pool": pool, "at": np.array([[4, 3], [0, 4]])}) == "indices 3 .. 4 on axis 1 of 4"


@pytest.mark.gpu
@pytest.mark.skipif("CUDAExecutionProvider" not in __import__("onnxruntime").get_available_providers(),
                    reason="needs onnxruntime-gpu and a CUDA device")
@pytest.mark.parametrize("case_id", [c.id for op in ("SparsePagedAttention", "PagedAttention")
                                     for c in conf.cases_for(op) if not c.fp8])
def test_cache_reader_bodies_on_the_cuda_ep_match_the_reference(case_id):
    """The same adversarial batches (and the 16k cases the CPU skips) through ORT's CUDA kernels, fp32 with TF32
    off: within the conformance suite's tolerance of the reference. An index the CPU wraps or rejects would read
    another row (or fault) here."""
    case = conf.CASES[case_id]
    inputs, attrs = case.inputs(torch.float32)
    got = conf.run_onnx(case.op, inputs, conf.scalar_attributes(attrs), torch.float32,
                        providers=[("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"])
    verdict = conf.compare(case, torch.float32, got, inputs, attrs, conf.oracle(case, torch.float32))
    assert verdict.ok, verdict.failures[:5]

