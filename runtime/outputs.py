"""What the engine hands back for a request after every step that moved it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Deferred:
    """A cumulative field's value made only when it is read: ``make`` returns it (e.g. a copy of the first n items
    of a list that only grows). Why: an output is made at every step of every running request, and copying the
    whole generated ids, text and logprobs into each one made a step's host work grow with the output's length
    (a batch of 32 requests with logprobs: 0.9 ms of engine work a step at 1k generated tokens, 6.9 ms at 7k, on
    the CPU machine, ``docs/performance.md``), while a streaming consumer reads only the deltas."""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[], Any]):
        self.make = make



def sampled_logprob_sum(logprobs: list[dict[int, float]]) -> float:
    """The sum of the sampled tokens' logprobs (each dict's first value), in order: the one definition of a
    request's ``cumulative_logprob``, which the engine keeps running by the same additions."""
    return sum(next(iter(lp.values())) for lp in logprobs)


class RequestOutput:
    """Cumulative state plus the delta since the previous output of the same request.

    ``token_ids``, ``text`` and ``logprobs`` are the request's whole generated ids, text and per-token logprobs up
    to this output; the engine makes them when they are first read (``Deferred``), so a consumer that reads only
    ``new_token_ids`` / ``new_text`` / ``new_logprobs`` costs nothing per step for what came before.
    ``logprobs`` (when requested) is aligned with ``token_ids``: one ``{token_id: logprob}`` dict per generated
    token, the sampled token first, then the requested number of most likely tokens; ``new_logprobs`` those of
    ``new_token_ids``; ``cumulative_logprob`` the sum of the sampled tokens' logprobs so far (None without
    logprobs).
    ``finish_reason``: ``"stop"`` (EOS, a stop token id or a stop string), ``"length"`` (max_tokens or the
    model's length limit) or ``"abort"``.
    ``prompt_token_ids`` is the request's own list, shared by all its outputs (copying a long prompt at every
    step made output cost grow with the context): read it, copy it before changing it.
    """

    __slots__ = ("request_id", "prompt_token_ids", "_token_ids", "_text", "new_token_ids", "new_text", "finished",
                 "finish_reason", "_logprobs", "new_logprobs", "cumulative_logprob")

    def __init__(self, request_id: str, prompt_token_ids: list[int], token_ids: list[int] | Deferred,
                 text: str | Deferred, new_token_ids: list[int], new_text: str, finished: bool,
                 finish_reason: str | None, logprobs: list[dict[int, float]] | Deferred | None = None,
                 new_logprobs: list[dict[int, float]] | None = None, cumulative_logprob: float | None = None):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._token_ids = token_ids
        self._text = text
        self.new_token_ids = new_token_ids
        self.new_text = new_text
        self.finished = finished
        self.finish_reason = finish_reason
        self._logprobs = logprobs
        if new_logprobs is None and isinstance(logprobs, list):  # built from whole lists: the delta is their tail
            new_logprobs = logprobs[len(logprobs) - len(new_token_ids):]
        self.new_logprobs = new_logprobs
        if cumulative_logprob is None and isinstance(logprobs, list):
            cumulative_logprob = sampled_logprob_sum(logprobs)
        self.cumulative_logprob = cumulative_logprob

    def _read(self, slot: str):
        value = getattr(self, slot)
        if isinstance(value, Deferred):
            value = value.make()
            setattr(self, slot, value)
        return value

    @property
    def token_ids(self) -> list[int]:
        return self._read("_token_ids")

    @property
    def text(self) -> str:
        return self._read("_text")

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self._read("_logprobs")

    def _fields(self) -> tuple:
        return (self.request_id, self.prompt_token_ids, self.token_ids, self.text, self.new_token_ids,
                self.new_text, self.finished, self.finish_reason, self.logprobs)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RequestOutput):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # mutable, as the dataclass it replaces

    def __repr__(self) -> str:
        names = ("request_id", "prompt_token_ids", "token_ids", "text", "new_token_ids", "new_text", "finished",
                 "finish_reason", "logprobs")
        return f"RequestOutput({', '.join(f'{n}={getattr(self, n)!r}' for n in names)})"
