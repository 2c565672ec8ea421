"""Greedy continuations against a cache-free reference, tolerant of near-ties only.

Two correct implementations that round differently may pick different tokens where the reference's two best
logits are closer than their rounding; from there on their continuations legitimately diverge. Any other
difference is a failure. Used by the 16-bit and MXFP8 engine tests and by the GPU tier (CUDA against CPU).
"""

from __future__ import annotations

import torch


def agreeing_prefix(reference, prompt: list[int], tokens: list[int], rel_margin: float) -> int:
    """How many of ``tokens`` (an engine's greedy output after ``prompt``) equal the argmax of ``reference``'s
    full recompute, up to the first near-tie; asserts that a difference is a near-tie: the reference's margin
    between its best token and the engine's is at most ``rel_margin`` of its largest logit magnitude."""
    ids = list(prompt)
    device = next(reference.parameters()).device
    with torch.no_grad():
        for i, token in enumerate(tokens):
            logits = reference(torch.tensor([ids], device=device))[0, -1].double().cpu()
            best = int(logits.argmax())
            if token != best:
                margin, bound = float(logits[best] - logits[token]), rel_margin * float(logits.abs().max())
                assert margin <= bound, (f"token {i}: engine {token}, reference {best}; the reference prefers it by "
                                         f"{margin:.3e} > {bound:.3e}: not a near-tie")
                return i
            ids.append(token)
    return len(tokens)
