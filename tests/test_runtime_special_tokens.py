"""skip_special_tokens is a per-request choice; a stop token ends a request without becoming text either way."""

import pytest

from m3export.runtime import SamplingParams
from tests.serve_fixtures import ScriptedEngine


@pytest.fixture(scope="module")
def engine():
    # "<|bos|>" is one special token of the byte-level tokenizer; the script ends with EOS (another special).
    return ScriptedEngine.from_checkpoint("tiny", scripts={"s": "a<|bos|>b"}, max_model_len=64)


def test_special_tokens_kept_only_when_asked(engine):
    bos, eos = engine.config.bos_token_id, engine.config.eos_token_id[0]
    kept, dropped = engine.generate(["SCRIPT[s]"] * 2, [SamplingParams(max_tokens=10, skip_special_tokens=False),
                                                         SamplingParams(max_tokens=10)])
    assert kept.token_ids == dropped.token_ids == [ord("a"), bos, ord("b"), eos]
    assert kept.text == "a<|bos|>b" and dropped.text == "ab"
    assert kept.finish_reason == dropped.finish_reason == "stop"


def test_stop_token_ids_never_become_text(engine):
    out = engine.generate(["SCRIPT[s]"], SamplingParams(max_tokens=10, skip_special_tokens=False,
                                                        stop_token_ids=[ord("b")]))[0]
    assert out.token_ids[-1] == ord("b") and out.text == "a<|bos|>" and out.finish_reason == "stop"


def test_skip_special_tokens_must_be_a_bool():
    with pytest.raises(ValueError, match="skip_special_tokens must be a bool"):
        SamplingParams(skip_special_tokens="no")
