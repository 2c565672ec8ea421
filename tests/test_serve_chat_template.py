"""Chat templates render exactly as transformers' ``apply_chat_template`` renders them (the oracle), and are found
where models ship them."""

import json

import pytest

from m3export.config import preset
from m3export.serve.chat_template import ChatTemplate, ChatTemplateError, template_kwargs
from m3export.tokenizer import byte_level_tokenizer
from tests.serve_fixtures import TEST_TEMPLATE

transformers = pytest.importorskip("transformers", reason="transformers (dev extra) is the rendering oracle")

SPECIALS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ünïcode ✓ 東京"}],
    [{"role": "user", "content": "Weather in Oslo?"},
     {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
      "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": {"city": "Oslo"}}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
     {"role": "user", "content": "And tomorrow?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning": "older field name"},
     {"role": "user", "content": "c"}],
]


def oracle(template: str):
    tok = byte_level_tokenizer(preset("tiny"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **SPECIALS)


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("tools", [None, [WEATHER]])
@pytest.mark.parametrize("kwargs", [{}, {"thinking_mode": "enabled"}, {"thinking_mode": "disabled"},
                                    {"add_generation_prompt": False}])
def test_renders_like_transformers(conversation, tools, kwargs):
    messages = CONVERSATIONS[conversation]
    kwargs = dict(kwargs)
    add = kwargs.pop("add_generation_prompt", True)
    ours = ChatTemplate(TEST_TEMPLATE, "test", SPECIALS).render(messages, tools=tools, add_generation_prompt=add,
                                                                **kwargs)
    theirs = oracle(TEST_TEMPLATE).apply_chat_template(messages, tools=tools, add_generation_prompt=add,
                                                       tokenize=False, **kwargs)
    assert ours == theirs


def test_found_in_model_directories(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    assert ChatTemplate.from_model_dir(a) is None
    config = {"bos_token": {"content": "<s>"}, "chat_template": "X{{ bos_token }}"}
    (a / "tokenizer_config.json").write_text(json.dumps(config))
    t = ChatTemplate.from_model_dir(a)
    assert t.render([{"role": "user", "content": "q"}]) == "X<s>"
    (a / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]}))
    t = ChatTemplate.from_model_dir(a)
    assert t.render([]) == "D" and t.render([], tools=[WEATHER]) == "T"
    (a / "chat_template.jinja").write_text("J{{ messages | length }}")  # the file wins over the config entry
    assert ChatTemplate.from_model_dir(a).render([{"role": "user", "content": "q"}]) == "J1"


def test_clear_errors():
    with pytest.raises(ChatTemplateError, match="rejected the conversation: no system"):
        ChatTemplate("{{ raise_exception('no system') }}", "t").render([])
    with pytest.raises(ChatTemplateError, match="not a valid Jinja template"):
        ChatTemplate("{% if %}", "t").render([])
    with pytest.raises(ChatTemplateError, match="thinking_mode must be one of"):
        template_kwargs({"thinking_mode": "sometimes"})
    # The sandbox refuses what untrusted templates must not do.
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ ''.__class__.__mro__ }}{{ [].append(1) }}", "t").render([])


def test_enable_thinking_maps_to_thinking_mode():
    assert template_kwargs({"enable_thinking": True}) == {"enable_thinking": True, "thinking_mode": "enabled"}
    assert template_kwargs({"enable_thinking": False})["thinking_mode"] == "disabled"
    assert template_kwargs({"enable_thinking": False, "thinking_mode": "adaptive"})["thinking_mode"] == "adaptive"
