"""Engine-side state of one request: its tokens, how much of them the caches hold, its pages and its drafts.

A request is always "the tokens known so far" plus "how many of them have K/V in the pools"
(``num_computed``). Prefill, chunked prefill, decode and recompute after preemption are all the same thing:
compute positions ``num_computed .. len(tokens) - 1``; when that reaches the end, sample the next token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .detokenizer import IncrementalDetokenizer
from .device_drafts import PendingDrafts
from .media import RequestMedia
from .outputs import sampled_logprob_sum
from .params import SamplingParams
from .sampling import PositionalRandom


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    rng: PositionalRandom  # every uniform of the request, addressed by (position, purpose)
    detokenizer: IncrementalDetokenizer
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None  # the sum of the sampled tokens' logprobs, kept with ``logprobs``
    status: Status = Status.WAITING
    finish_reason: str | None = None
    # Cache coverage: main/index K/V hold positions [0, num_computed); each MTP module's cache holds final
    # entries for positions [0, num_mtp_computed). MTP at position t needs token t + 1, so within a step it
    # trails the target until the drafter catches up; between steps the two are equal (when speculating).
    num_computed: int = 0
    num_mtp_computed: int = 0
    pages: list[int] = field(default_factory=list)
    page_digests: list[bytes] = field(default_factory=list)  # of the leading full pages already published
    # Speculation: draft tokens for the positions after the last token (``drafts``, ``num_drafts``,
    # ``pending_drafts``), and (sampling only) the distributions they were drawn from, a [len(drafts), vocab]
    # tensor or a list of [vocab] rows (the drafter's, stacked once where they are used); None for greedy drafts,
    # which act as one-hot. A step verifies a prefix of them (as many as fit its pages and budget); the rest stay
    # here for the next step, and survive preemption (they are a function of the tokens and the seed, so
    # recompute would draft the same ones).
    draft_probs: torch.Tensor | list[torch.Tensor] | None = None
    # Output bookkeeping: what the last RequestOutput already reported.
    reported_tokens: int = 0
    # Images / video: embeddings for the prompt's placeholder positions, and media digests for the prefix cache.
    media: RequestMedia | None = None
    #: Token ids that end the request (its stop_token_ids, plus the model's EOS ids unless ignore_eos): made
    #: once when the request is added, not at every token.
    stop_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.logprobs is not None and self.cumulative_logprob is None:
            self.cumulative_logprob = sampled_logprob_sum(self.logprobs)
        self._tokens = list(self.prompt_token_ids) + self.output_token_ids
        self._drafts: list[int] = []
        self._pending: PendingDrafts | None = None  # drafts whose values are still only on the device

    @property
    def drafts(self) -> list[int]:
        """The draft tokens' values (the list itself: appending to it adds a draft). Drafts the drafter left on the
        device (``pending_drafts``) are read first, one counted read for their whole round
        (``device_drafts``): the engine's own path never asks for them, it takes them where they are."""
        if self._pending is not None:
            self._drafts, self._pending = self._pending.host(), None
        return self._drafts

    @drafts.setter
    def drafts(self, tokens: list[int]) -> None:
        self._drafts, self._pending = list(tokens), None

    @property
    def num_drafts(self) -> int:
        return self._pending.count if self._pending is not None else len(self._drafts)

    @property
    def pending_drafts(self) -> PendingDrafts | None:
        """The drafts when their values are still only on the device, else None (they are in ``drafts``)."""
        return self._pending

    def set_pending_drafts(self, pending: PendingDrafts | None) -> None:
        self._drafts, self._pending = [], pending

    def drop_drafts(self, n: int) -> None:
        """Forget the first ``n`` drafts (verified by a step) and their distributions; the rest stay."""
        if self._pending is not None:
            self._pending = self._pending.drop(n)
        else:
            self._drafts = self._drafts[n:]
        probs = self.draft_probs
        self.draft_probs = None if probs is None or not self.num_drafts else probs[n:]

    @property
    def tokens(self) -> list[int]:
        """Prompt + generated tokens (read-only view: extend with ``append_token``)."""
        return self._tokens

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def append_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self._tokens.append(token)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def clear_drafts(self) -> None:
        self._drafts, self._pending = [], None
        self.draft_probs = None
