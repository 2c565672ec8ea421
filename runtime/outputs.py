"""What the engine hands back for a request after every step that moved it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    """Cumulative state plus the delta since the previous output of the same request.

    ``logprobs`` (when requested) is aligned with ``token_ids``: one ``{token_id: logprob}`` dict per generated
    token, the sampled token first, then the requested number of most likely tokens.
    ``finish_reason``: ``"stop"`` (EOS, a stop token id or a stop string), ``"length"`` (max_tokens or the
    model's length limit) or ``"abort"``.
    ``prompt_token_ids`` is the request's own list, shared by all its outputs (copying a long prompt at every
    step made output cost grow with the context): read it, copy it before changing it.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
