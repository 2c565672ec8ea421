"""The offline API in vLLM's shape, against the engine it wraps; chat parsing equals the server's parsers."""

import json

import pytest

import m3export
from m3export import LLM, SamplingParams
from m3export.runtime import Engine
from tests.serve_fixtures import TEST_TEMPLATE


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "chat_template.jinja"
    template.write_text(TEST_TEMPLATE)
    return LLM("tiny", chat_template=template, max_model_len=256)


def test_generate_matches_the_engine(llm):
    params = [SamplingParams(temperature=0, max_tokens=7), SamplingParams(temperature=0.8, seed=3, max_tokens=5)]
    outs = llm.generate(["Once upon", {"prompt_token_ids": [5, 6, 7]}], params)
    ref = Engine.from_checkpoint("tiny", max_model_len=256).generate(["Once upon", [5, 6, 7]], params)
    assert [o.prompt for o in outs] == ["Once upon", None]
    for o, r in zip(outs, ref):
        c = o.outputs[0]
        assert (c.text, c.token_ids, c.finish_reason) == (r.text, r.token_ids, r.finish_reason)
        assert o.prompt_token_ids == r.prompt_token_ids and o.finished
    assert m3export.SamplingParams is SamplingParams
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([{"text": "x"}])


def test_chat_renders_the_template_and_parses(llm, monkeypatch):
    """With generation replaced by a fixed reply, chat must render the prompt and split reasoning and tools."""
    reply = ("<mm:think>Use it.</mm:think>\nOK ]<]minimax[>[<tool_call>]<]minimax[>[<invoke name=\"f\">"
             "]<]minimax[>[<n>2]<]minimax[>[</n>]<]minimax[>[</invoke>]<]minimax[>[</tool_call>")
    seen = []

    def fake_generate(prompts, params=None):
        seen.extend(prompts)
        from m3export.llm import CompletionOutput, GenerationOutput

        return [GenerationOutput("x", p, [], [CompletionOutput(0, reply, [], "stop")]) for p in prompts]

    monkeypatch.setattr(llm, "generate", fake_generate)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}}}}}]
    out = llm.chat([{"role": "user", "content": "hi"}], tools=tools,
                   chat_template_kwargs={"thinking_mode": "disabled"})[0].outputs[0]
    assert seen[0].endswith("]~b]user\nhi[e~[\n]~b]ai\n<mm:think></mm:think>\n") and '"name": "f"' in seen[0]
    assert (out.reasoning_content, out.content, out.finish_reason) == ("Use it.", "OK ", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in out.tool_calls] == [("f", {"n": 2})]
    assert out.text == reply


def test_chat_runs_end_to_end(llm):
    out = llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
                   SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]


def test_chat_without_a_template_says_so():
    with pytest.raises(ValueError, match="no chat template"):
        LLM("tiny", max_model_len=64).chat([{"role": "user", "content": "x"}])
