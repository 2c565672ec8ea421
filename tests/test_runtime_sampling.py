"""Sampling parameters, filtered distributions, per-request random streams and speculative acceptance rules."""

import math

import pytest
import torch

from m3export.runtime import SamplingParams
from m3export.runtime.acceptance import accept_greedy, accept_sampled
from m3export.runtime.sampling import draw, filtered_probs, sample, token_logprobs


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
    ("top_k", 2.5), ("max_tokens", 0), ("seed", "7"), ("stop", [""]), ("stop_token_ids", [-1]),
    ("stop_token_ids", "12"), ("ignore_eos", 1), ("logprobs", -2), ("seed", 2**64), ("seed", -1),
])
def test_params_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_subnormal_temperature_is_clamped_not_overflowed():
    """1e-320 made logits / T overflow to inf and every sampled token the last id; it is clamped like vLLM."""
    with pytest.warns(UserWarning, match="temperature"):
        params = SamplingParams(temperature=1e-320)
    logits = torch.tensor([0.0, 5.0, 1.0, -3.0])
    probs = filtered_probs(logits, params)
    assert torch.isfinite(probs).all() and int(probs.argmax()) == 1
    gen = torch.Generator().manual_seed(0)
    assert {sample(logits, params, gen) for _ in range(20)} == {1}


def test_params_normalise():
    p = SamplingParams(stop="END", stop_token_ids=[3, 4], temperature=0)
    assert p.stop == ("END",) and p.stop_token_ids == (3, 4) and p.greedy


def test_filters():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    p = filtered_probs(logits, SamplingParams(top_k=2))
    assert (p[2:] == 0).all() and math.isclose(float(p.sum()), 1.0)
    full = torch.softmax(logits.double(), -1)
    p = filtered_probs(logits, SamplingParams(top_p=float(full[0] + full[1]) - 1e-6))
    assert (p[:2] > 0).all() and (p[2:] == 0).all()  # the smallest set whose mass reaches top_p
    p = filtered_probs(logits, SamplingParams(top_p=0.01))
    assert p[0] == 1.0  # the most likely token always stays
    hot = filtered_probs(logits, SamplingParams(temperature=100.0))
    assert float(hot.max() - hot.min()) < 0.02


def test_draw_uses_one_uniform_and_is_reproducible():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a = [draw(probs, g1) for _ in range(50)]
    b = [draw(probs, g2) for _ in range(50)]
    assert a == b and 1 not in a
    g3 = torch.Generator().manual_seed(5)
    for _ in range(50):
        torch.rand((), generator=g3, dtype=torch.float64)
    assert torch.equal(torch.rand(3, generator=g1), torch.rand(3, generator=g3))


def test_greedy_and_logprobs():
    logits = torch.tensor([0.5, 2.0, 2.0, -1.0])
    assert sample(logits, SamplingParams(temperature=0), torch.Generator()) == 1  # first index on ties
    lp = token_logprobs(logits, 3, top_n=2)
    assert next(iter(lp)) == 3 and set(lp) == {3, 1, 2}
    assert math.isclose(lp[3], float(torch.log_softmax(logits, -1)[3]), rel_tol=1e-6)


def test_accept_greedy_rules():
    logits = torch.eye(5)[[2, 3, 4]] * 5  # target argmax: 2, then 3, then 4
    assert accept_greedy(logits, [2, 3]) == [2, 3, 4]  # both accepted + bonus
    assert accept_greedy(logits, [2, 0]) == [2, 3]  # mismatch: the target's token replaces the draft
    assert accept_greedy(logits, [1, 3]) == [2]


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = counts.sum() * p
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_rejection_sampling_preserves_the_target_distribution():
    """Drafts from q, verification against p: every emitted token must be distributed as p."""
    p = torch.tensor([[0.05, 0.40, 0.05, 0.30, 0.20, 0.00],
                      [0.25, 0.05, 0.30, 0.10, 0.10, 0.20],
                      [0.10, 0.10, 0.10, 0.10, 0.10, 0.50]], dtype=torch.float64)
    q = torch.tensor([[0.40, 0.05, 0.25, 0.05, 0.05, 0.20],
                      [0.05, 0.50, 0.05, 0.20, 0.10, 0.10]], dtype=torch.float64)
    assert _tv(q[0], p[0]) > 0.4  # the drafter is far off: a broken rule would show
    g = torch.Generator().manual_seed(1234)
    n = 20000
    first = torch.zeros(6, dtype=torch.float64)
    second = torch.zeros(6, dtype=torch.float64)
    third = torch.zeros(6, dtype=torch.float64)
    for _ in range(n):
        drafts = [draw(q[0], g), draw(q[1], g)]
        out = accept_sampled(p, drafts, q, g)
        first[out[0]] += 1
        if len(out) > 1:  # token 2 is emitted only after draft 1 was accepted; it must still follow p[1]
            second[out[1]] += 1
        if len(out) > 2:
            third[out[2]] += 1
    assert _tv(first, p[0]) < 0.02
    for counts, target in ((first, p[0]), (second, p[1]), (third, p[2])):
        assert counts.sum() > 1000
        assert _chi2(counts, target) < 25.0  # df <= 5: exceeded with probability < 1e-4 if the rule is right
    assert first[5] == 0  # a token the target rules out never appears


def test_rejection_sampling_with_greedy_drafts():
    """A draft proposed greedily counts as one-hot p_d; the output must still follow p."""
    p = torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.2, 0.2]], dtype=torch.float64)
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(3, dtype=torch.float64)
    for _ in range(20000):
        counts[accept_sampled(p, [2], None, g)[0]] += 1
    assert _tv(counts, p[0]) < 0.02 and _chi2(counts, p[0]) < 20.0
