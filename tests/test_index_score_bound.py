"""The indexer's near-tie bound (``m3export/ops/index_score_bound.py``) against summation orders that reach it.

An IEEE fp32 implementation may sum a score's D products in any order. The order built here rounds one block's score
down by almost half a unit at every add and another's up, so the fp32 implementation keeps the block float64 ranks
second, 0.98 of the bound apart: the conformance rule must excuse that swap (a rule 3 % narrower does not), and must
catch a swap 1.3 bounds apart, which no IEEE summation order makes (the rule before excused up to 4 bounds). A
truncating accumulation (tensor cores round toward zero) moves a score about twice as far as the IEEE bound
allows: the 16-bit operands' bound covers it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from m3export.ops import conformance as conf, index_score_bound
from m3export.ops.indexer import select_blocks

D = 128
ULP = 2.0**-23  # of scores in [1, 2)
DOWN, UP = 2.0**-24 * (1 - 2.0**-10), 2.0**-24 * (1 + 2.0**-10)  # just under / over half an ulp: exact in fp32


def sequential(products: np.ndarray, rounding: str = "nearest") -> float:
    """The products summed in index order, one fp32 add at a time: IEEE round-to-nearest (numpy's float32), or
    truncation (round toward zero), as tensor cores accumulate."""
    acc = np.float32(0)
    for p in products.astype(np.float32):
        exact = float(acc) + float(p)  # exact in float64: both are fp32 of nearby magnitude
        acc = np.float32(exact)
        if rounding == "truncate" and abs(float(acc)) > abs(exact):
            acc = np.nextafter(acc, np.float32(0))
    return float(acc)


def two_blocks(lead_a: int):
    """One token over three blocks of one key (pages of one key), query all ones, top-1: block a = 1 + lead_a ulps
    then D - 1 products just under half an ulp (sequential round-to-nearest drops each), block b = 1 then D - 1 just
    over half an ulp (each rounds up), block 2 = 0. float64 ranks a first for lead_a >= 1."""
    a = torch.tensor([1 + lead_a * ULP] + [DOWN] * (D - 1), dtype=torch.float32)
    b = torch.tensor([1.0] + [UP] * (D - 1), dtype=torch.float32)
    pool = torch.stack([a, b, torch.zeros(D)]).view(3, 1, D)
    inputs = [torch.ones(1, 1, D), pool, torch.tensor([[0, 1, 2]], dtype=torch.int32),
              torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), torch.tensor([2])]
    attrs = dict(block_size=1, topk_blocks=1, local_blocks=0, init_blocks=0)
    case = conf.Case("two-blocks-near-tie", "LightningIndexer", frozenset({"small"}), lambda gen: (inputs, attrs))
    return case, inputs, attrs, conf.reference_function(case.op)(*conf.upcast(inputs), *attrs.values())


def gap_over_bound(inputs) -> float:
    q, pool = inputs[0][0, 0].double(), inputs[1][:, 0].double()
    exact = pool @ q
    beta = index_score_bound.dot_error_factor(D, ieee_fp32=True) * (pool.abs() @ q.abs())
    return float((exact[0] - exact[1]) / (beta[0] + beta[1]))


def test_an_ieee_fp32_swap_at_098_of_the_bound_is_excused_and_a_narrower_bound_fails_it(monkeypatch):
    case, inputs, attrs, want = two_blocks(D - 2)
    assert want[0, 0].tolist() == [0]  # float64: block a
    pool = inputs[1][:, 0].numpy()
    scores = [sequential(pool[i]) for i in range(3)]  # a legitimate fp32 implementation's block scores
    assert scores[0] == 1 + (D - 2) * ULP and scores[1] == 1 + (D - 1) * ULP  # every add rounded as designed
    got = select_blocks(torch.tensor(scores, dtype=torch.float64).view(1, 1, 3), inputs[5], 1, 1, 0, 0)
    assert got[0, 0].tolist() == [1]  # it keeps block b
    assert 0.97 < gap_over_bound(inputs) < 0.99
    v = conf.compare(case, torch.float32, got, inputs, attrs, want)
    assert v.ok and len(v.near_ties) == 1, v.failures
    factor = index_score_bound.dot_error_factor
    monkeypatch.setattr(index_score_bound, "dot_error_factor", lambda d, ieee_fp32: 0.97 * factor(d, ieee_fp32))
    assert not conf.compare(case, torch.float32, got, inputs, attrs, want).ok


@pytest.mark.parametrize("lead_a", [168, 500])
def test_a_swap_beyond_the_bound_is_caught(lead_a):
    """1.3 and 3.9 bounds apart: no fp32 summation order keeps b (here fp32 sums a to 1 + lead_a ulps, above b's
    1 + (D - 1)); the rule before (2 D eps32 per unit of the two blocks' A) excused both."""
    case, inputs, attrs, want = two_blocks(lead_a)
    assert 1.2 < gap_over_bound(inputs) < 4.0
    got = want.clone()
    got[0, 0, 0] = 1
    v = conf.compare(case, torch.float32, got, inputs, attrs, want)
    assert not v.ok and not v.near_ties


def test_truncating_accumulation_needs_the_tensor_core_bound():
    """Round-toward-zero adds of D - 1 products just under one ulp: the score falls (D - 1)(1 - 2^-8) ulps short,
    about twice the IEEE bound; within the bound of 16-bit operands (bf16-exact products, as tensor cores take)."""
    products = np.array([1.0] + [ULP * (1 - 2.0**-8)] * (D - 1))
    assert torch.tensor(products).bfloat16().double().tolist() == products.tolist()
    exact, a = float(products.sum()), float(np.abs(products).sum())
    err = exact - sequential(products, "truncate")
    assert err == pytest.approx((D - 1) * (1 - 2.0**-8) * ULP, rel=1e-6)
    assert err > 1.9 * index_score_bound.dot_error_factor(D, ieee_fp32=True) * a
    assert err <= index_score_bound.dot_error_factor(D, ieee_fp32=False) * a
    assert sequential(products) == pytest.approx(exact, abs=index_score_bound.dot_error_factor(D, True) * a)
