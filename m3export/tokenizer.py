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


# ---------------------------------------------------------------------------------------------- byte-level BPE
# M3's control tokens, spelled as in the release's chat format (docs/serving-formats.md). Control markers are
# *special* (dropped when decoding text for a user); the reasoning and tool-call markers are whole tokens that
# stay in decoded text, because the reasoning and tool-call parsers downstream read them there.
BOS, EOS, ROLE = "]~!b[", "[e~[", "]~b]"
THINK_OPEN, THINK_CLOSE, TOOL_NAMESPACE = "<mm:think>", "</mm:think>", "]<]minimax[>["
CONTROL_TOKENS = (BOS, EOS, ROLE)
TEXT_MARKERS = (THINK_OPEN, THINK_CLOSE, TOOL_NAMESPACE)

# Roles go after the role marker as plain text (``]~b]user``), as in the release's template; the assistant is "ai".
CHAT_TEMPLATE = """\
{{- bos_token -}}
{%- for message in messages -%}
]~b]{{ 'ai' if message['role'] == 'assistant' else message['role'] }}
{{ message['content'] }}[e~[
{% endfor -%}
{%- if add_generation_prompt -%}
]~b]ai
{% if thinking_mode is defined and thinking_mode == 'enabled' %}<mm:think>
{% elif thinking_mode is defined and thinking_mode == 'disabled' %}<mm:think>
</mm:think>

{% endif -%}
{%- endif -%}
"""


def train_bpe_tokenizer(texts, vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 pre-tokenisation, no normaliser: every byte string round-trips) trained on
    ``texts``; the M3 control tokens and markers take the last ids, after the learned vocabulary, as in the
    release. ``vocab_size`` counts them."""
    from tokenizers import AddedToken, trainers

    n_added = len(CONTROL_TOKENS) + len(TEXT_MARKERS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - n_added, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(list(CONTROL_TOKENS))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_MARKERS])
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"BPE training reached {tok.get_vocab_size()} tokens, asked for {vocab_size}: "
                         "the corpus is too small for that vocabulary")
    return tok


def bpe_tokenizer_config(tok: Tokenizer, model_max_length: int) -> dict:
    """``tokenizer_config.json`` in the release's shape: named specials and ``added_tokens_decoder`` by id."""
    added = {str(tok.token_to_id(t)): {"content": t, "special": t in CONTROL_TOKENS, "normalized": False,
                                       "lstrip": False, "rstrip": False, "single_word": False}
             for t in CONTROL_TOKENS + TEXT_MARKERS}
    return {"bos_token": BOS, "eos_token": EOS, "pad_token": None, "unk_token": None,
            "added_tokens_decoder": added, "model_max_length": model_max_length,
            "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
