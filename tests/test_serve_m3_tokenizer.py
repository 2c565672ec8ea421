"""The serving path with M3's own token vocabulary (a byte-level BPE carrying M3's control tokens and markers,
as the embedded default ships it): the template renders as transformers renders it, and generated token ids,
detokenized incrementally with the default skip_special_tokens, reach the parsers with their markers intact."""

import json
import sysconfig
from pathlib import Path

import pytest

from m3export.runtime.detokenizer import IncrementalDetokenizer
from m3export.runtime.tokenizer import TextTokenizer
from m3export.serve.chat_template import ChatTemplate
from m3export.serve.reasoning_parser import ReasoningParser, starts_in_reasoning
from m3export.serve.tool_parser import ToolCallParser
from m3export.tokenizer import CHAT_TEMPLATE, CONTROL_TOKENS, bpe_tokenizer_config, train_bpe_tokenizer

transformers = pytest.importorskip("transformers", reason="transformers (dev extra) is the rendering oracle")

NS = "]<]minimax[>["
REPLY = ("<mm:think>The user wants weather; call the tool.</mm:think>\n\nLet me check. "
         f"{NS}<tool_call>\n{NS}<invoke name=\"get_weather\">\n{NS}<city>São Paulo{NS}</city>\n"
         f"{NS}<days>3{NS}</days>\n{NS}</invoke>\n{NS}</tool_call>")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text() for name in ("json/decoder.py", "string.py", "textwrap.py")]
    tok = train_bpe_tokenizer(texts, vocab_size=600)
    d = tmp_path_factory.mktemp("m3tok")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(bpe_tokenizer_config(tok, 4096)))
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return d


@pytest.mark.parametrize("kwargs", [{}, {"thinking_mode": "enabled"}, {"thinking_mode": "disabled"}])
def test_template_renders_like_transformers(model_dir, kwargs):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Weather?"}]
    ours = ChatTemplate.from_model_dir(model_dir).render(messages, **kwargs)
    oracle = transformers.PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    assert ours == oracle.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert starts_in_reasoning(ours) == (kwargs.get("thinking_mode") == "enabled")


def test_generated_ids_reach_the_parsers_with_their_markers(model_dir):
    tok = TextTokenizer.from_file(model_dir / "tokenizer.json")
    assert tok.special_tokens() == set(CONTROL_TOKENS)  # the markers are text, so default decoding keeps them
    ids = tok.encode(REPLY)
    assert all(len(tok.encode(m)) == 1 for m in (NS, "<mm:think>", "</mm:think>"))  # whole tokens
    det = IncrementalDetokenizer(tok, ())
    reasoning, tools = ReasoningParser(), ToolCallParser([WEATHER])
    thought, content, calls = "", "", {}
    for i, t in enumerate(ids):
        det.append(t)
        r = reasoning.feed(det.release(i == len(ids) - 1))
        thought += r.reasoning
        d = tools.feed(r.content)
        content += d.content
        for c in d.calls:
            calls.setdefault(c.index, [c.name, ""])[1] += c.arguments
    r = reasoning.finish()
    thought += r.reasoning
    d = tools.feed(r.content)
    end = tools.finish()
    content += d.content + end.content
    assert thought == "The user wants weather; call the tool."
    assert content == "Let me check. "
    assert [(n, json.loads(a)) for n, a in calls.values()] == [("get_weather", {"city": "São Paulo", "days": 3})]
