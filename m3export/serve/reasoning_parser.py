"""M3's reasoning markup: the text between ``<mm:think>`` and ``</mm:think>`` is the model's chain of thought.

Served responses carry it in ``reasoning_content`` and the rest in ``content`` (vLLM's and SGLang's
``--reasoning-parser`` convention). The parser works on generated text decoded *with* special tokens kept
(``skip_special_tokens=False``): in the release's tokenizer both markers are whole special tokens, so with the
default decoding they would vanish and the split would be lost. It is a streaming state machine: any chunking of
the same text gives the same reasoning and content, because a chunk that ends in a partial marker (``</mm:th``)
is held back until the next chunk or the end says what it is.

With ``thinking_mode=enabled`` M3's chat template opens the block itself, so generation starts inside reasoning
with no opening marker: ``starts_in_reasoning(prompt)`` tells from the rendered prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<mm:think>"
THINK_END = "</mm:think>"


def starts_in_reasoning(prompt: str) -> bool:
    """True when the rendered prompt leaves a reasoning block open (the template pre-opened it)."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


def partial_marker_suffix(text: str, marker: str) -> int:
    """Length of the longest proper prefix of ``marker`` that ``text`` ends with (what must be held back)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Splits M3 output into reasoning and content, chunk by chunk.

    Every ``<mm:think>`` ... ``</mm:think>`` span is reasoning (M3 may think again between tool calls); the
    markers themselves appear in neither part. Whitespace right after a closing marker is dropped from the
    content (the model separates its answer from its thoughts with newlines). A block left open at the end
    (truncated output) stays reasoning.
    """

    def __init__(self, in_reasoning: bool = False):
        self._in_reasoning = in_reasoning
        self._buffer = ""
        self._strip_content = False  # just left a reasoning block: drop leading whitespace of the content

    @property
    def in_reasoning(self) -> bool:
        return self._in_reasoning

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        self._buffer += text
        while self._buffer:
            marker = THINK_END if self._in_reasoning else THINK_START
            at = self._buffer.find(marker)
            if at < 0:
                keep = partial_marker_suffix(self._buffer, marker)
                self._emit(out, self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            self._emit(out, self._buffer[:at])
            self._buffer = self._buffer[at + len(marker):]
            self._strip_content = self._in_reasoning
            self._in_reasoning = not self._in_reasoning
        return out

    def finish(self) -> ReasoningDelta:
        """The end of the output: a held-back partial marker was text after all."""
        out = ReasoningDelta()
        self._emit(out, self._buffer)
        self._buffer = ""
        return out

    def _emit(self, out: ReasoningDelta, text: str) -> None:
        if self._in_reasoning:
            out.reasoning += text
            return
        if self._strip_content:
            stripped = text.lstrip()
            if not stripped:
                return
            self._strip_content = False
            text = stripped
        out.content += text
