"""Throughput and speculation counters of one engine.

A step that computed any prompt (or recompute) tokens is a prefill step and its wall time counts towards
prefill throughput; every other step is a decode step. In a mixed continuous batch this attributes the decode
tokens of mixed steps to neither rate, which keeps both numbers conservative rather than double-counted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    prefill_time: float = 0.0
    decode_tokens: int = 0
    decode_time: float = 0.0
    verify_steps: int = 0  # request-steps that verified at least one draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    preemptions: int = 0

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_tokens / self.prefill_time if self.prefill_time else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time else 0.0

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verification (accepted drafts + the target's own token); None without drafts."""
        return 1.0 + self.accepted_tokens / self.verify_steps if self.verify_steps else None

    def summary(self) -> str:
        acc = self.mean_acceptance_length
        spec = (f"acceptance length {acc:.2f} ({self.accepted_tokens}/{self.draft_tokens} drafts accepted)"
                if acc is not None else "acceptance length n/a (no speculation)")
        return (f"prefill {self.prefill_tok_s:.1f} tok/s ({self.prefill_tokens} tok), "
                f"decode {self.decode_tok_s:.1f} tok/s ({self.decode_tokens} tok), {spec}")
