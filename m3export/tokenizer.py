"""A byte-level tokenizer for the embedded tiny default, built with the ``tokenizers`` library.

Token i < 256 is byte i, so any text round-trips and random-weight models still produce decodable output;
bos / eos / pad take the config's special ids right after the bytes. Real checkpoints ship their own
``tokenizer.json`` and never use this.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from .config import M3Config

SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")


def _byte_alphabet() -> list[str]:
    """The printable stand-in character for each byte value that byte-level BPE uses (byte order)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def byte_level_tokenizer(cfg: M3Config) -> Tokenizer:
    ids = (cfg.bos_token_id, cfg.eos_token_id[0], cfg.pad_token_id)
    if list(ids) != [256, 257, 258] or cfg.vocab_size < 259:
        raise ValueError("the byte-level tokenizer needs bos/eos/pad ids 256/257/258 and vocab_size >= 259; "
                         f"this config has {ids} and vocab_size {cfg.vocab_size}")
    vocab = {c: i for i, c in enumerate(_byte_alphabet())}
    vocab.update({s: 256 + i for i, s in enumerate(SPECIALS)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def tokenizer_config(cfg: M3Config) -> dict:
    """The small ``tokenizer_config.json`` that names the special tokens (what transformers-style tools read)."""
    return {"bos_token": SPECIALS[0], "eos_token": SPECIALS[1], "pad_token": SPECIALS[2],
            "model_max_length": cfg.max_position_embeddings, "tokenizer_class": "PreTrainedTokenizerFast"}
