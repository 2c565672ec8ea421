"""Speculative verification: which draft tokens the target model accepts, and the token that follows them.

Greedy requests accept drafts while they equal the target's argmax. Sampling requests use rejection sampling:
accept draft d with probability min(1, p_t(d) / p_d(d)); on the first rejection emit a token drawn from
norm(max(0, p_t - p_d)). Every emitted token is then distributed exactly as p_t, whatever the drafter proposed.
A draft drawn greedily counts as a one-hot p_d. When all drafts are accepted the target's distribution after
the last one gives a bonus token, so a step always emits between 1 and k + 1 tokens.
"""

from __future__ import annotations

import torch

from .params import SamplingParams
from .sampling import draw, filtered_probs


def accept_greedy(target_logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """target_logits [k + 1, V] at the positions of the last token and each draft -> emitted tokens."""
    best = torch.argmax(target_logits, dim=-1).tolist()
    out = []
    for i, d in enumerate(drafts):
        out.append(best[i])
        if d != best[i]:
            return out
    out.append(best[len(drafts)])
    return out


def accept_sampled(target_probs: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                   generator: torch.Generator) -> list[int]:
    """target_probs [k + 1, V]; draft_probs [k, V] the distributions the drafts were drawn from (None: one-hot)."""
    out = []
    for i, d in enumerate(drafts):
        p_t = target_probs[i]
        p_d_of_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u * p_d_of_d < float(p_t[d]):
            out.append(d)
            continue
        if draft_probs is None:
            residual = p_t.clone()
            residual[d] = 0.0
        else:
            residual = (p_t - draft_probs[i].to(p_t.dtype)).clamp(min=0.0)
        # A zero residual means p_t <= p_d everywhere, i.e. p_t == p_d, where rejection has probability 0;
        # only rounding gets here, and p_t itself is then the right distribution.
        out.append(draw(residual if residual.sum() > 0 else p_t, generator))
        return out
    out.append(draw(target_probs[len(drafts)], generator))
    return out


def accept(target_logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
           params: SamplingParams, generator: torch.Generator) -> list[int]:
    if params.greedy:
        return accept_greedy(target_logits, drafts)
    return accept_sampled(filtered_probs(target_logits, params), drafts, draft_probs, generator)
