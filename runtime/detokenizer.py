"""Generated token ids -> text deltas, and stop-string detection on that text.

Byte-level tokens can split a UTF-8 character; decoding such a prefix gives U+FFFD. Text is therefore released
only once it decodes cleanly, and decoding works on a short trailing window of ids (not the whole output) so each
token costs O(1). With stop strings, the last ``len(longest stop) - 1`` characters are held back until the
request ends, so streamed deltas never contain text that a later stop match removes: the deltas of a request
always add up to its final text. The text lives as the released pieces plus a short unreleased tail, never as one
growing string: a string grown by ``+=`` (or sliced whole for each output) is copied at every token, which made a
step's host work grow with the output's length.
"""

from __future__ import annotations

from .tokenizer import TextTokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TextTokenizer | None, stop: tuple[str, ...], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._released: list[str] = []  # the text already reported, one piece per release (final: never cut)
        self._released_len = 0
        self._pending = ""  # decoded cleanly (after stop truncation), not yet reported: the holdback and the new text
        self._stopped = False

    def append(self, token_id: int) -> bool:
        """Add one generated token; True if the text now contains a stop string (the text is cut before it)."""
        if self._tokenizer is None:
            return False
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        before = len(self._pending)
        self._pending += full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if not self._stop:
            return False
        # A match may start in the last holdback characters before this token's text, all of them unreported
        # (a release keeps them back), so it is found within the pending text.
        start = max(0, before - self._holdback)
        hits = [i for i in (self._pending.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self._pending = self._pending[:min(hits)]
            self._stopped = True
        return self._stopped

    def _decode(self, ids: list[int]) -> str:
        if self._skip_special:  # the default of every tokenizer's decode (test doubles may take only ids)
            return self._tokenizer.decode(ids)
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    @property
    def text(self) -> str:
        """The text reported so far (joined when read)."""
        return self.released_text(self._released_len)

    def released_text(self, length: int) -> str:
        """The first ``length`` characters of the reported text (which a later token never changes). Joined at each
        read, never cached in place: an output may be read on another thread while the engine releases more."""
        return "".join(self._released)[:length]

    @property
    def released_length(self) -> int:
        return self._released_len

    def release(self, finished: bool) -> str:
        """The new text since the previous call. Once the request is finished that is all of it, including a
        trailing piece that does not decode cleanly (the output ended inside a character) unless a stop string
        ended it, so a finished text equals decoding all its tokens at once."""
        if finished and not self._stopped and self._read_offset < len(self._ids):
            done = self._decode(self._ids[self._prefix_offset:self._read_offset])
            self._pending += self._decode(self._ids[self._prefix_offset:])[len(done):]
            self._prefix_offset = self._read_offset = len(self._ids)
        end = len(self._pending) if finished else max(0, len(self._pending) - self._holdback)
        delta, self._pending = self._pending[:end], self._pending[end:]
        if delta:
            self._released.append(delta)
            self._released_len += len(delta)
        return delta
