"""Logits -> next token, per request, with the request's own random stream.

Every random draw comes from the request's ``torch.Generator`` and each draw is one uniform number fed through
the inverse CDF, so what a seeded request samples depends only on its own logits, never on the batch around it.
The same filtered distribution (temperature, then top-k, then top-p) serves plain sampling, drafting and
speculative verification, which is what makes rejection sampling preserve it exactly.
"""

from __future__ import annotations

import torch

from .params import SamplingParams


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


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from ``probs`` [V] (need not be normalised) using exactly one uniform from ``generator``."""
    u = torch.rand((), generator=generator, dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    idx = int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True))
    # u * total can round up to total; the last token with mass is then the right answer.
    return min(idx, int(torch.nonzero(probs).max()))


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """logits [V] -> token id (argmax for temperature 0, first index on ties)."""
    if params.greedy:
        return int(torch.argmax(logits))
    return draw(filtered_probs(logits, params), generator)


def token_logprobs(logits: torch.Tensor, token: int, top_n: int) -> dict[int, float]:
    """The sampled token's log-probability under the raw model distribution, then the ``top_n`` best."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = {token: float(lp[token])}
    if top_n:
        values, ids = torch.topk(lp, min(top_n, lp.shape[-1]))
        for v, i in zip(values.tolist(), ids.tolist()):
            out.setdefault(i, v)
    return out
