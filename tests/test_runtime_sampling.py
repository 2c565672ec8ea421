"""Sampling parameters, filtered distributions, per-request positional randomness and speculative acceptance."""

import math

import pytest
import torch

from m3export.runtime import SamplingParams
from m3export.runtime.acceptance import accept_greedy, accept_sampled
from m3export.runtime.sampling import PositionalRandom, Purpose, draw, filtered_probs, sample, token_logprobs


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
    rng = PositionalRandom(0)
    assert {sample(logits, params, rng, pos) for pos in range(20)} == {1}


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


def test_draw_is_the_inverse_cdf_of_one_uniform():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    # CDF 0.1, 0.1, 0.7, 1.0: u in [0, 0.1) -> 0, [0.1, 0.7) -> 2, [0.7, 1) -> 3; token 1 has no mass.
    assert [draw(probs, u) for u in (0.0, 0.0999, 0.1, 0.6999, 0.7, 0.999999)] == [0, 0, 2, 2, 3, 3]
    assert draw(probs * 7, 0.65) == 2  # unnormalised weights give the same tokens
    assert draw(torch.tensor([0.5, 0.5, 0.0]), 1.0 - 2**-53) == 1  # never a token without mass


def test_positional_uniforms_are_addressed_not_sequential():
    """The uniform for (position, purpose) is the same however many others were asked for before, and differs
    between seeds, positions and purposes."""
    a, b = PositionalRandom(5), PositionalRandom(5)
    first = a.uniform(7, Purpose.SAMPLE)
    for pos in range(100):
        b.uniform(pos, Purpose.DRAFT)
    assert b.uniform(7, Purpose.SAMPLE) == first
    values = {PositionalRandom(s).uniform(p, k) for s in (0, 5, 2**64 - 1) for p in (0, 7, 2**40) for k in Purpose}
    assert len(values) == 3 * 3 * len(Purpose) and all(0.0 <= v < 1.0 for v in values)


def test_positional_uniforms_are_uniform_and_independent():
    """20000 (seed, position) pairs: each purpose's values fill 20 equal bins evenly (chi-square), and the
    purposes at one position are uncorrelated with each other and with the next position's."""
    n, bins = 20000, 20
    u = torch.tensor([[PositionalRandom(s).uniform(p, k) for k in Purpose] for s in range(100) for p in range(200)],
                     dtype=torch.float64)
    for k in range(len(Purpose)):
        counts = torch.histc(u[:, k], bins=bins, min=0.0, max=1.0)
        chi2 = float(((counts - n / bins) ** 2 / (n / bins)).sum())
        assert chi2 < 50.0  # df = 19: exceeded with probability < 1e-4 for truly uniform numbers
    corr = torch.corrcoef(torch.cat([u[:-1], u[1:, :1]], 1).T)  # purposes at p, and SAMPLE at p + 1
    off_diagonal = corr - torch.eye(corr.shape[0], dtype=corr.dtype)
    assert float(off_diagonal.abs().max()) < 0.03  # ~4 standard errors (1 / sqrt(20000) = 0.007)


def test_greedy_and_logprobs():
    logits = torch.tensor([0.5, 2.0, 2.0, -1.0])
    assert sample(logits, SamplingParams(temperature=0), PositionalRandom(0), 0) == 1  # first index on ties
    lp = token_logprobs(logits, 3, top_n=2)
    assert next(iter(lp)) == 3 and set(lp) == {3, 1, 2}
    assert math.isclose(lp[3], float(torch.log_softmax(logits, -1)[3]), rel_tol=1e-6)


def test_accept_greedy_rules():
    logits = torch.eye(5)[[2, 3, 4]] * 5  # target argmax: 2, then 3, then 4
    assert accept_greedy(logits, [2, 3]) == [2, 3, 4]  # both accepted + bonus
    assert accept_greedy(logits, [2, 0]) == [2, 3]  # mismatch: the target's token replaces the draft
    assert accept_greedy(logits, [1, 3]) == [2]
    # Fewer rows than drafts (the step computed only some of them): the rows verify a prefix, no bonus.
    assert accept_greedy(logits[:1], [2, 3]) == [2]
    assert accept_greedy(logits[:2], [2, 3, 4]) == [2, 3]
    assert accept_greedy(logits[:2], [2, 0, 4]) == [2, 3]
    assert accept_greedy(logits[:1], []) == [2]  # no drafts: a plain (greedy) sample


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
    n = 20000
    first = torch.zeros(6, dtype=torch.float64)
    second = torch.zeros(6, dtype=torch.float64)
    third = torch.zeros(6, dtype=torch.float64)
    for trial in range(n):
        rng = PositionalRandom(1234 + trial)
        drafts = [draw(q[0], rng.uniform(10, Purpose.DRAFT)), draw(q[1], rng.uniform(11, Purpose.DRAFT))]
        out = accept_sampled(p, drafts, q, rng, 10)
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
    counts = torch.zeros(3, dtype=torch.float64)
    for trial in range(20000):
        counts[accept_sampled(p, [2], None, PositionalRandom(trial), 3)[0]] += 1
    assert _tv(counts, p[0]) < 0.02 and _chi2(counts, p[0]) < 20.0


def test_prefix_verification_preserves_the_target_distribution():
    """Drafts verified over two steps (the first step's rows cover draft 1 only, as when pages were short; the
    second verifies draft 2 and gives the bonus): each emitted token must still follow p, and the tokens must be
    exactly those of verifying both drafts in one step with the same uniforms."""
    p = torch.tensor([[0.05, 0.40, 0.05, 0.30, 0.20, 0.00],
                      [0.25, 0.05, 0.30, 0.10, 0.10, 0.20],
                      [0.10, 0.10, 0.10, 0.10, 0.10, 0.50]], dtype=torch.float64)
    q = torch.tensor([[0.40, 0.05, 0.25, 0.05, 0.05, 0.20],
                      [0.05, 0.50, 0.05, 0.20, 0.10, 0.10]], dtype=torch.float64)
    n = 8000  # ~900 trials reach the third token (acceptance rates 0.25 then 0.45)
    counts = [torch.zeros(6, dtype=torch.float64) for _ in range(3)]
    for trial in range(n):
        rng = PositionalRandom(trial)
        drafts = [draw(q[0], rng.uniform(4, Purpose.DRAFT)), draw(q[1], rng.uniform(5, Purpose.DRAFT))]
        out = accept_sampled(p[:1], drafts, q, rng, 4)  # one row: verifies draft 1, never a bonus
        assert len(out) == 1
        if out == drafts[:1]:
            out += accept_sampled(p[1:], drafts[1:], q[1:], rng, 5)
        assert out == accept_sampled(p, drafts, q, rng, 4)
        for i, tok in enumerate(out):
            counts[i][tok] += 1
    for c, target in zip(counts, p):
        assert c.sum() > 500 and _chi2(c, target) < 25.0  # df <= 5: exceeded with probability < 1e-4
