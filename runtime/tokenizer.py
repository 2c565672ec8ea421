"""Text in and out: a thin wrapper over a ``tokenizers.Tokenizer`` with the two calls the engine needs.

Where the tokenizer comes from: ``tokenizer.json`` next to the weights (artifact or checkpoint); for the ``tiny``
preset, the byte-level tokenizer ``m3export.tokenizer`` builds from the config. Without either the engine works
on token ids only.
"""

from __future__ import annotations

from pathlib import Path

from m3export.config import M3Config
from m3export.sources import PRESET, source_kind


class TextTokenizer:
    def __init__(self, tokenizer):
        self._tok = tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Special tokens (BOS/EOS/PAD, role markers) are dropped by default: they are control, not text."""
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Ids this tokenizer knows, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def special_tokens(self) -> frozenset[str]:
        """The text of every special token (those ``decode`` drops by default)."""
        return frozenset(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special)

    @classmethod
    def from_file(cls, path: str | Path) -> TextTokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))


def find_tokenizer(source: str | Path, config: M3Config) -> TextTokenizer | None:
    """``source``: a directory that may hold ``tokenizer.json``, or a preset name."""
    kind = source_kind(source)
    if kind != PRESET:
        file = Path(source) / "tokenizer.json"
        return TextTokenizer.from_file(file) if file.exists() else None
    if str(source) == "tiny":
        from m3export.tokenizer import byte_level_tokenizer

        return TextTokenizer(byte_level_tokenizer(config))
    return None
