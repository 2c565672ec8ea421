"""The embedded trained checkpoint (m3export/embedded/code-tiny): loads, matches the oracle, still has the quality
recorded at training time, generates deterministic Python-looking text, and its MTP modules draft usefully.

Reference values come from ``training.json``, written by ``scripts/train_tiny.py`` after it re-loaded the written
checkpoint, so the test and the record measure the same bytes through the same code.
"""

from __future__ import annotations

import json
import keyword
import math
import re
import string
from collections import Counter

import pytest
import torch

import m3export
from m3export.corpus import stdlib_files
from m3export.embedded import default_model
from m3export.runtime import Engine, SamplingParams
from m3export.tokenizer import BOS, CONTROL_TOKENS, EOS, TEXT_MARKERS
from m3export.training.objective import evaluate, heldout_slice, slice_digest

CKPT = default_model()
RECORD = json.loads((CKPT / "training.json").read_text())


@pytest.fixture(scope="module")
def model():
    return m3export.load_model(CKPT, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(CKPT / "tokenizer.json"))


@pytest.fixture(scope="module")
def windows(tokenizer):
    return heldout_slice(tokenizer)


def test_checkpoint_is_the_m3_architecture_and_small(model):
    cfg = model.config
    assert len(model.mtp) == cfg.num_mtp_modules == 2
    sparse = [cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers)]
    assert not sparse[0] and all(sparse[1:]) and any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    # Selection matters inside the trained context: a query past topk blocks cannot keep every block.
    assert RECORD["context"] // cfg.index_block_size > cfg.index_topk_blocks
    size = sum(p.stat().st_size for p in CKPT.iterdir())
    assert size < 10 << 20, f"embedded checkpoint is {size / 1e6:.1f} MB; the repository budget is 10 MB"


def test_logits_and_selections_match_transformers(model, tmp_path):
    from m3export.checkpoint.writer import write_checkpoint

    from .hf_oracle import MiniMaxM3VLForCausalLM, canonical_selection, hf_forward  # skips without transformers

    cfg = model.config.replace(num_mtp_modules=0)
    write_checkpoint(tmp_path, cfg, "hf", "fp32", model=model, with_mtp=False, with_tokenizer=False, progress=False,
                     hf_prefix="model.")  # the text-only class keeps the backbone under "model."
    ref = MiniMaxM3VLForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 96), generator=torch.Generator().manual_seed(3))
    want, want_sel = hf_forward(ref, ids)
    with torch.no_grad():
        got, got_sel = model(ids, return_selections=True)
    # fp32 on both sides, different summation orders: 1e-4 relative is ~100x the float32 noise on logits of this
    # size and far below any real mismatch (a wrong block or weight moves logits by O(1)).
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-4
    assert len(got_sel) == len(want_sel) == cfg.num_hidden_layers - 1
    for g, w in zip(got_sel, want_sel):
        assert torch.equal(canonical_selection(g, cfg.index_topk_blocks), canonical_selection(w, cfg.index_topk_blocks))


def test_heldout_quality_is_what_training_recorded(model, windows):
    rec = RECORD["test_slice"]
    got = evaluate(model, windows)
    if slice_digest(windows) == rec["digest"]:
        # Same tokens, same weights, fp32: only summation order differs (~1e-6 nats); argmax may flip on a
        # near-tie, so accuracy may move by a couple of tokens out of ~1500 (0.2 %).
        assert got["main"]["loss"] == pytest.approx(rec["main"]["loss"], abs=1e-3)
        assert got["main"]["accuracy"] >= rec["main"]["accuracy"] - 0.002
    else:
        # Another Python's stdlib: other held-out text. Per-file loss on the held-out set spreads by ~0.5 nats,
        # so only a regression larger than that is detectable here.
        assert got["main"]["loss"] <= RECORD["heldout"]["main"]["loss"] + 0.5


def test_model_beats_the_unigram_oracle(model, windows):
    """Independent of any record: the model must beat the best context-free predictor *of this very slice*
    (its own unigram entropy, which is optimistic for a unigram model) by a wide margin. A model that learned
    only token frequencies cannot pass; the trained one is ~2 nats better."""
    targets = windows[:, 1:-1].reshape(-1).tolist()
    counts = Counter(targets)
    unigram = -sum(c / len(targets) * math.log(c / len(targets)) for c in counts.values())
    got = evaluate(model, windows)["main"]["loss"]
    assert got < unigram - 1.0, (got, unigram)


def test_tokenizer_round_trips_heldout_files_and_keeps_specials_whole(tokenizer):
    for rel, text in stdlib_files("heldout"):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text, rel
    config = json.loads((CKPT / "tokenizer_config.json").read_text())
    assert config["bos_token"] == BOS and config["eos_token"] == EOS
    for token in CONTROL_TOKENS + TEXT_MARKERS:
        tid = tokenizer.token_to_id(token)
        assert config["added_tokens_decoder"][str(tid)]["content"] == token
        assert tokenizer.encode(f"x = 1{token}y", add_special_tokens=False).ids.count(tid) == 1, token
    cfg = m3export.M3Config.from_pretrained(CKPT)
    assert cfg.bos_token_id == tokenizer.token_to_id(BOS) and cfg.eos_token_id == [tokenizer.token_to_id(EOS)]
    # Reasoning and tool-call markers stay in user-visible text (their parsers read them there).
    ids = tokenizer.encode("<mm:think>a</mm:think>]<]minimax[>[<tool_call>[e~[", add_special_tokens=False).ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<mm:think>a</mm:think>]<]minimax[>[<tool_call>"


def test_chat_template_renders_with_m3_markers():
    from m3export.serve.chat_template import ChatTemplate

    text = ChatTemplate.from_model_dir(CKPT).render([{"role": "user", "content": "hi"}], thinking_mode="enabled")
    assert text == f"{BOS}]~b]user\nhi{EOS}\n]~b]ai\n<mm:think>\n"


PROMPT = "import os\n\n\nclass Config:\n    def __init__(self, path):\n"


def _generate(k: int) -> list[int]:
    engine = Engine.from_checkpoint(CKPT, dtype=torch.float32, num_speculative_tokens=k)
    return engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].token_ids


def test_greedy_generation_is_deterministic_readable_python(tokenizer):
    first, second = _generate(0), _generate(0)
    assert first == second
    assert _generate(2) == first  # speculation never changes greedy output
    text = tokenizer.decode(first)
    assert all(ch in string.printable for ch in text), repr(text)
    lines = (PROMPT + text).splitlines()
    # stdlib style: 4-space indentation; random tokens break it at once
    assert all((len(line) - len(line.lstrip(" "))) % 4 == 0 for line in lines[:-1]), text
    words = set(re.findall(r"[A-Za-z_]+", text))
    assert words & (set(keyword.kwlist) | {"self"}), text


def test_mtp_acceptance_through_the_runtime(windows):
    """Greedy speculative decoding with k = 2 on held-out prompts. Drafts from an untrained module match the
    target with probability ~1/vocab (acceptance length ~1.00); 1.5 means half the verification steps keep at
    least one draft, which only learned next-next-token prediction gives. Where the slice is the recorded one,
    the run is the recorded run (greedy, deterministic), so the number must match it too."""
    rec = RECORD["test_slice"]
    engine = Engine.from_checkpoint(CKPT, dtype=torch.float32, num_speculative_tokens=2, max_num_seqs=1)
    for w in windows:
        engine.generate([w[:rec["prompt_tokens"]].tolist()],
                        SamplingParams(temperature=0, max_tokens=rec["new_tokens"], ignore_eos=True))
    got = engine.stats.mean_acceptance_length
    assert got >= 1.5
    if slice_digest(windows) == rec["digest"]:
        # a near-tie argmax flip can change one verification step out of ~60: 0.05 in the mean
        assert got == pytest.approx(rec["acceptance_length_k2_greedy"], abs=0.05)
