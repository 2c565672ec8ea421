"""Logits -> next token, per request, with randomness that is a function of (seed, position, purpose).

Each random draw is one uniform number fed through the inverse CDF, and each uniform is a counter-based hash of
the request's seed, the absolute position of the token it decides and what it is for (a plain or bonus sample, a
draft, a draft's acceptance test, a residual resample). No draw depends on how many draws came before it, so
what a seeded request samples depends only on its own logits: not on the batch around it, not on drafts the
scheduler could not fit this step, not on preemption and recompute. The same filtered distribution
(temperature, then top-k, then top-p) serves plain sampling, drafting and speculative verification, which is
what makes rejection sampling preserve it exactly.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .params import SamplingParams

_MASK64 = (1 << 64) - 1


class Purpose(enum.IntEnum):
    """What a uniform decides at its position; each purpose gets its own independent stream."""

    SAMPLE = 0  # a plain sample, or the bonus token after every draft was accepted
    DRAFT = 1  # the draft proposed for the position
    ACCEPT = 2  # the acceptance test of the position's draft
    RESIDUAL = 3  # the resample from the residual after the position's draft was rejected


def _splitmix64(x: int) -> int:
    """The SplitMix64 output function: a bijection of 64-bit words in which every input bit flips about half the
    output bits, so consecutive counters give unrelated words."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(frozen=True)
class PositionalRandom:
    """A request's random numbers, addressed by (position, purpose) instead of drawn in sequence.

    Why: the token at a position may be decided in different steps depending on the scheduler (drafts cut for
    lack of pages or budget, preemption and recompute); a sequential stream would then hand it a different
    number. Here the uniform for (position, purpose) is the same whenever and however often it is asked for.
    """

    seed: int

    def uniform(self, position: int, purpose: Purpose) -> float:
        """A float64 in [0, 1) with 53 random bits."""
        h = _splitmix64(self.seed & _MASK64)
        h = _splitmix64(h ^ (position & _MASK64))
        h = _splitmix64(h ^ int(purpose))
        return (h >> 11) * 2.0**-53


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> the distribution the request samples from [..., V] (float64; not for greedy)."""
    x = logits.double() / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))  # ties at the k-th value are all kept: deterministic
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p  # mass before it already reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, u: float) -> int:
    """One token from ``probs`` [V] (need not be normalised) for the uniform ``u`` in [0, 1) (inverse CDF)."""
    cdf = probs.double().cumsum(-1)
    idx = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    # u * total can round up to total; the last token with mass is then the right answer.
    return min(idx, int(torch.nonzero(probs).max()))


def sample(logits: torch.Tensor, params: SamplingParams, rng: PositionalRandom, position: int) -> int:
    """logits [V] -> the token at ``position`` (argmax for temperature 0, first index on ties)."""
    if params.greedy:
        return int(torch.argmax(logits))
    return draw(filtered_probs(logits, params), rng.uniform(position, Purpose.SAMPLE))


def token_logprobs(logits: torch.Tensor, token: int, top_n: int) -> dict[int, float]:
    """The sampled token's log-probability under the raw model distribution, then the ``top_n`` best."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = {token: float(lp[token])}
    if top_n:
        values, ids = torch.topk(lp, min(top_n, lp.shape[-1]))
        for v, i in zip(values.tolist(), ids.tolist()):
            out.setdefault(i, v)
    return out
