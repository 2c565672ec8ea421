"""The LightningIndexer body's selections (and the MoE body's routing) do not depend on how ``TopK`` orders equal
values.

Why: ONNX says ``TopK`` puts the lower index first among equal values, and ONNX Runtime's CPU kernel does, but its
CUDA kernel does not (the first H200 run: block selections 85 % equal to the reference in every sparse layer,
every logit within 4e-6). Forced blocks (+inf, several per token) and equal block maxima are such ties. The body
re-derives each slot's id from the top-k *values* (``functions._lowest_ids_first``), so here its ``TopK`` is
swapped for one that gives the HIGHER index first among ties, on ONNX Runtime's CPU provider, and the selections
must still equal the reference exactly.
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

TIE_CASES = ["score-ties", "score-ties-no-forced", "forced-beyond-topk", "nan-tails-empty-shared-batch",
             "mixed-prefill-decode", "6k-tiny-dims"]


def tie_reversing_topk(fn: onnx.FunctionProto) -> onnx.FunctionProto:
    """``fn`` with each ``TopK(x, k)`` (axis -1) run on ``x`` reversed along its last axis, the ids mapped back:
    the same values, ties to the higher id (ORT's CPU TopK keeps the lower index of its reversed input)."""

    def reversed_topk(n, p):
        x, k = n.input
        values, ids = n.output
        return [
            constant(f"{p}_start", [-1], np.int64), constant(f"{p}_end", [np.iinfo(np.int64).min], np.int64),
            constant(f"{p}_axis", [-1], np.int64), constant(f"{p}_one", [1], np.int64),
            helper.make_node("Slice", [x, f"{p}_start", f"{p}_end", f"{p}_axis", f"{p}_start"], [f"{p}_x"]),
            helper.make_node("TopK", [f"{p}_x", k], [values, f"{p}_ids"], axis=-1, largest=1, sorted=1),
            helper.make_node("Shape", [x], [f"{p}_n"], start=-1),
            helper.make_node("Sub", [f"{p}_n", f"{p}_one"], [f"{p}_last"]),
            helper.make_node("Sub", [f"{p}_last", f"{p}_ids"], [ids]),
        ]

    return rewrite_topk(fn, reversed_topk)


def has_ties_in_selection(case: conf.Case) -> bool:
    """Whether some (token, head) selects two blocks that rank equal: two forced blocks (both +inf) or two
    blocks with the same float64 block score (what makes a tie-reversing TopK give other ids)."""
    inputs, attrs = case.inputs(torch.float64)
    scores, _ = conf.block_scores64(inputs, attrs)
    bs, local, init = attrs["block_size"], attrs["local_blocks"], attrs["init_blocks"]
    ids = torch.arange(scores.shape[-1])
    own = (inputs[5] // bs).view(-1, 1, 1)
    forced = (ids <= own) & ((ids > own - local) | (ids < init))
    key = scores.masked_fill(forced, float("inf"))
    want = conf.oracle(case, torch.float32).long()
    picked = torch.gather(key, -1, want.clamp(min=0)).masked_fill(want < 0, float("nan"))
    return bool((picked[..., 1:] == picked[..., :-1]).any())


def test_moe_routing_ignores_topk_tie_order(monkeypatch):
    """The MoE body's router TopK too: experts 1, 4 and 6 route identically and win, top-2 must be 1 and 4."""
    case = conf.CASES["MoE/routing-ties"]
    inputs, attrs = case.inputs(torch.float32)
    want = conf.oracle(case, torch.float32)
    plain = functions.body
    monkeypatch.setattr(functions, "body", lambda op, kv_fp8=False, decode=None: tie_reversing_topk(plain(op, kv_fp8, decode)))
    got = conf.run_onnx("MoE", inputs, conf.scalar_attributes(attrs), torch.float32)
    assert conf.compare(case, torch.float32, got, inputs, attrs, want).ok


@pytest.mark.parametrize("name", TIE_CASES)
def test_selection_ignores_topk_tie_order(name, monkeypatch):
    case = conf.CASES[f"LightningIndexer/{name}"]
    assert has_ties_in_selection(case), f"{name}: no tie among the selected blocks, nothing to test"
    inputs, attrs = case.inputs(torch.float32)
    want = conf.oracle(case, torch.float32)
    plain = functions.body
    monkeypatch.setattr(functions, "body", lambda op, kv_fp8=False, decode=None: tie_reversing_topk(plain(op, kv_fp8, decode)))
    got = conf.run_onnx("LightningIndexer", inputs, conf.scalar_attributes(attrs), torch.int32)
    assert torch.equal(got, want), (got != want).nonzero()[:5].tolist()


CUDA_EP = pytest.mark.skipif("CUDAExecutionProvider" not in __import__("onnxruntime").get_available_providers(),
                             reason="needs onnxruntime-gpu and a CUDA device")
ON_CUDA = [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]  # fp32 scores as the reference


@pytest.mark.gpu
@CUDA_EP
@pytest.mark.parametrize("case_id", [c.id for c in conf.cases_for("LightningIndexer") if c.cpu and not c.fp8]
                         + ["MoE/routing-ties"])
def test_bodies_on_the_cuda_ep_keep_the_tie_rule(case_id):
    """ORT's own CUDA TopK (the first H200 run: 85 % of selections) under the body: selections equal the
    reference's exactly (up to the suite's documented near ties), MoE within the suite's tolerance."""
    case = conf.CASES[case_id]
    inputs, attrs = case.inputs(torch.float32)
    out = torch.int32 if case.op == "LightningIndexer" else torch.float32
    got = conf.run_onnx(case.op, inputs, conf.scalar_attributes(attrs), out, providers=ON_CUDA)
    verdict = conf.compare(case, torch.float32, got, inputs, attrs, conf.oracle(case, torch.float32))
    assert verdict.ok, verdict.failures[:5]

