"""Speculative verification: which draft tokens the target model accepts, and the token that follows them.

Greedy requests accept drafts while they equal the target's argmax. Sampling requests use rejection sampling:
accept draft d with probability min(1, p_t(d) / p_d(d)); on the first rejection emit a token drawn from
norm(max(0, p_t - p_d)). Every emitted token is then distributed exactly as p_t, whatever the drafter proposed.
A draft drawn greedily counts as a one-hot p_d.

A step need not verify every draft. Its rows are the target's distributions at the position after the last
known token and after each draft it computed: with j of the k drafts computed there are j + 1 rows, which verify
drafts 1 .. j + 1. Only when all k drafts were computed (k + 1 rows) and accepted does the last row give a bonus
token; otherwise the drafts past the rows stay for the next step. The rule per position is unchanged (the target
distribution at a position is the same whichever step computes it), so the output distribution is still p_t;
with no drafts at all the one row is a plain sample.

Each uniform is addressed by (seed, position, purpose) (``sampling.PositionalRandom``): the draft, its acceptance
test and its residual resample at a position use three independent numbers, none of which depends on the tokens
before the position, so the acceptance test is independent of the draft and of the context as the proof needs.
"""

from __future__ import annotations

import torch

from .params import SamplingParams
from .sampling import PositionalRandom, Purpose, draw, filtered_probs


def accept_greedy(target_logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """target_logits [n, V] at the last token and the first n - 1 drafts -> emitted tokens: drafts[:n] verified,
    then (only when n > len(drafts) and all were accepted) the bonus argmax."""
    best = torch.argmax(target_logits, dim=-1).tolist()
    out = []
    for i, b in enumerate(best):
        out.append(b)
        if i == len(drafts) or drafts[i] != b:
            break
    return out


def accept_sampled(target_probs: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                   rng: PositionalRandom, position: int) -> list[int]:
    """target_probs [n, V], row i the target's distribution for the token at ``position + i``; draft_probs
    [len(drafts), V] the distributions the drafts were drawn from (None: one-hot). Verifies drafts[:n]; the
    bonus is drawn only from a row past the last draft."""
    out = []
    for i in range(len(target_probs)):
        p_t, pos = target_probs[i], position + i
        if i == len(drafts):
            out.append(draw(p_t, rng.uniform(pos, Purpose.SAMPLE)))
            break
        d = drafts[i]
        p_d_of_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if rng.uniform(pos, Purpose.ACCEPT) * p_d_of_d < float(p_t[d]):
            out.append(d)
            continue
        if draft_probs is None:
            residual = p_t.clone()
            residual[d] = 0.0
        else:
            residual = (p_t - draft_probs[i].to(p_t.dtype)).clamp(min=0.0)
        # A zero residual means p_t <= p_d everywhere, i.e. p_t == p_d, where rejection has probability 0;
        # only rounding gets here, and p_t itself is then the right distribution.
        out.append(draw(residual if residual.sum() > 0 else p_t, rng.uniform(pos, Purpose.RESIDUAL)))
        break
    return out


def accept(target_logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
           params: SamplingParams, rng: PositionalRandom, position: int) -> list[int]:
    """``position``: where the token decided by the first row goes (the request's length before the step)."""
    if params.greedy:
        return accept_greedy(target_logits, drafts)
    return accept_sampled(filtered_probs(target_logits, params), drafts, draft_probs, rng, position)
