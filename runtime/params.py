"""Per-request sampling parameters, validated once at the door so the engine loop never meets a bad value."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass


def _int_tuple(name: str, value: Iterable[int]) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"SamplingParams.{name} must be a sequence of token ids, got {value!r}")
    out = tuple(value)
    for v in out:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"SamplingParams.{name} must hold non-negative integers, got {v!r}")
    return out


def _str_tuple(name: str, value: str | Iterable[str]) -> tuple[str, ...]:
    out = (value,) if isinstance(value, str) else tuple(value)
    for v in out:
        if not isinstance(v, str) or not v:
            raise ValueError(f"SamplingParams.{name} must hold non-empty strings, got {v!r}")
    return out


# The smallest temperature sampled as such. Tiny positive temperatures overflow logits / temperature (1e-320 made
# every token the last id); vLLM clamps at this same value with a warning, so a request behaves alike on both.
MIN_TEMPERATURE = 1e-2


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature=0`` is greedy (top_p / top_k / seed are then irrelevant). ``top_k=0`` and ``top_p=1`` switch
    those filters off; ``min_p`` (0 = off) drops tokens less likely than ``min_p`` times the most likely one (after
    temperature, before top-k / top-p, as in vLLM). Penalties (vLLM's definitions, applied to the logits before
    everything else, greedy included): ``repetition_penalty`` divides the positive logits and multiplies the
    negative ones of every token in the prompt or the output (1 = off); ``frequency_penalty`` subtracts itself
    times the token's count in the output, ``presence_penalty`` itself once for a token the output holds (0 = off).
    ``seed`` gives the request its own random stream, so its samples do not depend on what
    else is in the batch. ``logprobs=n`` returns, per generated token, the sampled token's log-probability under
    the model (before temperature / top-k / top-p) plus the ``n`` most likely tokens'.
    ``skip_special_tokens`` (default True, as in vLLM) drops the tokenizer's special tokens from the text; turn
    it off to see markers that a downstream parser reads (a tokenizer that makes ``<mm:think>`` special).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] | str = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 < p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {p!r}")
        for name, low, high in (("min_p", 0.0, 1.0), ("presence_penalty", -2.0, 2.0),
                                ("frequency_penalty", -2.0, 2.0)):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not low <= v <= high:
                raise ValueError(f"SamplingParams.{name} must be in [{low}, {high}], got {v!r}")
            object.__setattr__(self, name, float(v))
        r = self.repetition_penalty
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not math.isfinite(r) or r <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be a finite number > 0, got {r!r}")
        object.__setattr__(self, "repetition_penalty", float(r))
        for name in ("top_k", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"SamplingParams.{name} must be an integer, got {v!r}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**64):
            raise ValueError(f"SamplingParams.seed must be None or an integer in [0, 2**64), got {self.seed!r}")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name} must be a bool, got {getattr(self, name)!r}")
        lp = self.logprobs
        if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or lp < 0):
            raise ValueError(f"SamplingParams.logprobs must be None or an integer >= 0, got {lp!r}")
        if 0 < t < MIN_TEMPERATURE:
            warnings.warn(f"SamplingParams.temperature {t!r} is below {MIN_TEMPERATURE}; using {MIN_TEMPERATURE} as vLLM "
                          "does (use 0 for greedy)", stacklevel=3)
            t = MIN_TEMPERATURE
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "stop", _str_tuple("stop", self.stop))
        object.__setattr__(self, "stop_token_ids", _int_tuple("stop_token_ids", self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether any penalty changes the logits (they then depend on the request's tokens so far)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
