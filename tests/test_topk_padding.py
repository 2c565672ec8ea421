"""The indexer and sparse-attention bodies give the reference's result under a ``TopK`` that pads its axis with
float32's lowest value, as ONNX Runtime's CUDA ``TopK`` does.

Why: ORT's CUDA ``TopK`` sorts axes of up to 256 entries with a bitonic network over the axis padded to a power
of two; the padding holds ``lowest()`` = -3.40e38 at ids past the axis, which outranks a real -inf. The bodies
once marked "nothing to rank" with -inf, so wherever a top k reached into those entries (tokens seeing fewer
blocks than top-k, a (sequence, head) reading fewer blocks than the step's widest) the CUDA provider returned
padding ids and -3.40e38: on the H200 only 85 % of the tiny model's block selections (54 % of `mini`'s) equalled
the reference's. Here each ``TopK`` runs on its input padded with as many lowest() entries as it has (at least
what a power-of-two pad adds), on the CPU provider, and the bodies' outputs must still equal the reference's.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from m3export.export import functions
from m3export.ops import conformance as conf
from tests.topk_rewrite import constant, rewrite_topk

LOWEST = float(np.finfo(np.float32).min)


def lowest_padded_topk(fn: onnx.FunctionProto) -> onnx.FunctionProto:
    """``fn`` with each ``TopK(x, k)`` (axis -1) run on ``x`` with ``x.shape[-1]`` lowest() entries appended."""

    def padded_topk(n, p):
        x, k = n.input
        return [
            constant(f"{p}_low", LOWEST, np.float32),
            helper.make_node("Shape", [x], [f"{p}_n"], start=-1),
            helper.make_node("Shape", [x], [f"{p}_lead"], end=-1),
            helper.make_node("Concat", [f"{p}_lead", f"{p}_n"], [f"{p}_shape"], axis=0),
            helper.make_node("Expand", [f"{p}_low", f"{p}_shape"], [f"{p}_fill"]),
            helper.make_node("Concat", [x, f"{p}_fill"], [f"{p}_x"], axis=-1),
            helper.make_node("TopK", [f"{p}_x", k], list(n.output), axis=-1, largest=1, sorted=1),
        ]

    return rewrite_topk(fn, padded_topk)


INDEXER = ["prefill-selects", "mixed-prefill-decode", "nan-tails-empty-shared-batch", "page-smaller-than-block",
           "page16"]
SPARSE = ["prefill-selects-indexer", "mixed-prefill-decode-random", "nan-tails-empty-shared-batch-random",
          "verify-multi-token-indexer", "page16-indexer"]


@pytest.fixture
def padded_topk(monkeypatch):
    plain = functions.body
    monkeypatch.setattr(functions, "body", lambda op, kv_fp8=False, decode=None: lowest_padded_topk(plain(op, kv_fp8, decode)))


@pytest.mark.parametrize("name", INDEXER)
def test_indexer_selections_under_a_padding_topk(name, padded_topk):
    case = conf.CASES[f"LightningIndexer/{name}"]
    inputs, attrs = case.inputs(torch.float32)
    want = conf.oracle(case, torch.float32)
    assert (want < 0).any(), f"{name}: every slot holds a block, the padding is never reached"
    got = conf.run_onnx("LightningIndexer", inputs, conf.scalar_attributes(attrs), torch.int32)
    verdict = conf.compare(case, torch.float32, got, inputs, attrs, want)
    assert verdict.ok, verdict.failures[:5]


@pytest.mark.parametrize("name", SPARSE)
def test_sparse_attention_under_a_padding_topk(name, padded_topk):
    case = conf.CASES[f"SparsePagedAttention/{name}"]
    inputs, attrs = case.inputs(torch.float32)
    got = conf.run_onnx("SparsePagedAttention", inputs, conf.scalar_attributes(attrs), torch.float32)
    verdict = conf.compare(case, torch.float32, got, inputs, attrs, conf.oracle(case, torch.float32))
    assert verdict.ok, verdict.failures[:5]
