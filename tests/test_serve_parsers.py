"""M3's reasoning and tool-call parsers on hand-written model outputs, split at every possible chunk boundary.

The oracle for each case is written by hand (the expected calls and content); streaming is checked by the
property that every chunking of the same text aggregates to that same expectation.
"""

import json

import pytest

from m3export.serve.reasoning_parser import ReasoningParser, starts_in_reasoning
from m3export.serve.tool_parser import INVOKE_END, INVOKE_START, NAMESPACE, TOOL_CALL_END, TOOL_CALL_START, \
    ToolCallParser

NS = NAMESPACE


def el(name, body):
    return f"{NS}<{name}>{body}{NS}</{name}>"


def invoke(name, *params, quote='"'):
    return f"{INVOKE_START} name={quote}{name}{quote}>\n" + "\n".join(params) + f"\n{INVOKE_END}"


def block(*invokes):
    return f"{TOOL_CALL_START}\n" + "\n".join(invokes) + f"\n{TOOL_CALL_END}"


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "hours": {"type": "array",
                                                                              "items": {"type": "number"}}}}}}
ORDER = {"type": "function", "function": {"name": "create_order", "parameters": {
    "type": "object", "properties": {
        "user_id": {"type": "integer"},
        "zip": {"type": "string"},
        "shipping": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}}},
        "items": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string"},
                                                                                "qty": {"type": "integer"}}}},
        "note": {"type": ["string", "null"]}}}}}
TOOLS = [WEATHER, ORDER]


def run_tools(chunks, tools=TOOLS):
    """Feed the chunks, then finish; return (content, [(name, arguments as parsed JSON)], errors)."""
    parser = ToolCallParser(tools)
    content, calls, errors = "", {}, []
    for chunk in list(chunks) + [None]:
        d = parser.feed(chunk) if chunk is not None else parser.finish()
        content += d.content
        errors += d.errors
        for c in d.calls:
            entry = calls.setdefault(c.index, [None, ""])
            if c.name is not None:
                assert entry[0] is None, "a call's name is sent once"
                entry[0] = c.name
            entry[1] += c.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))], errors


def every_split(text):
    """Every two-chunk split, every character alone, and three-chunk splits on a stride."""
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    for i in range(0, len(text) + 1, 5):
        for j in range(i, len(text) + 1, 11):
            yield [text[:i], text[i:j], text[j:]]


CASES = {
    "one call, typed by schema": (
        block(invoke("get_weather", el("city", "Paris"), el("days", "3"), el("metric", "true"))),
        "", [("get_weather", {"city": "Paris", "days": 3, "metric": True})]),
    "text before and after": (
        "Let me look that up. " + block(invoke("get_weather", el("city", "Zürich"))) + "\nDone.",
        "Let me look that up. \nDone.", [("get_weather", {"city": "Zürich"})]),
    "several invokes in one block": (
        block(invoke("get_weather", el("city", "Oslo")), invoke("get_weather", el("city", "Rome"), el("days", "2"))),
        "", [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome", "days": 2})]),
    "nested objects and arrays of objects": (
        block(invoke("create_order", el("user_id", "42"),
                     el("shipping", el("city", "Singapore") + el("zip", "018956")),
                     el("items", el("item", el("sku", "book-001") + el("qty", "2"))
                        + el("item", el("sku", "pen-007") + el("qty", "5"))),
                     el("zip", "018956"))),
        "", [("create_order", {"user_id": 42, "shipping": {"city": "Singapore", "zip": 18956},
                               "items": [{"sku": "book-001", "qty": 2}, {"sku": "pen-007", "qty": 5}],
                               "zip": "018956"})]),
    "array of numbers by schema": (
        block(invoke("get_weather", el("hours", el("item", "1.5") + el("item", "2")))),
        "", [("get_weather", {"hours": [1.5, 2]})]),
    "strings keep whitespace, markup and unicode": (
        block(invoke("get_weather", el("city", "  São Paulo <b>&</b> 東京\n"))),
        "", [("get_weather", {"city": "  São Paulo <b>&</b> 東京\n"})]),
    "empty tags are empty values": (
        block(invoke("create_order", el("note", ""), el("items", ""))),
        "", [("create_order", {"note": "", "items": []})]),
    "no schema: JSON when it parses, else the string": (
        block(invoke("unknown_tool", el("n", "7"), el("flag", "false"), el("obj", '{"a": [1, 2]}'),
                     el("word", "hello world"), el("list", el("item", "x") + el("item", "3")))),
        "", [("unknown_tool", {"n": 7, "flag": False, "obj": {"a": [1, 2]}, "word": "hello world",
                               "list": ["x", 3]})]),
    "value contradicting its schema falls back": (
        block(invoke("get_weather", el("days", "a few"))),
        "", [("get_weather", {"days": "a few"})]),
    "single-quoted and unquoted names": (
        block(invoke("get_weather", el("city", "A"), quote="'"), invoke("get_weather", el("city", "B"), quote="")),
        "", [("get_weather", {"city": "A"}), ("get_weather", {"city": "B"})]),
    "an invoke without parameters": (
        block(invoke("get_weather")), "", [("get_weather", {})]),
    "two blocks": (
        block(invoke("get_weather", el("city", "X"))) + " and " + block(invoke("get_weather", el("city", "Y"))),
        " and ", [("get_weather", {"city": "X"}), ("get_weather", {"city": "Y"})]),
    "plain text that looks a bit like markup": (
        "a ]<]mini b ]<]minimax[>[ c <tool_call> d", "a ]<]mini b ]<]minimax[>[ c <tool_call> d", []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tool_calls_at_every_chunk_boundary(name):
    text, content, calls = CASES[name]
    for chunks in every_split(text):
        got = run_tools(chunks)
        assert got == (content, calls, []), chunks


MALFORMED = {
    # (text, content expected, calls expected): what was not reported as a call comes back as content
    "block cut off before any invoke": (
        "Sure. " + TOOL_CALL_START + "\n" + INVOKE_START + ' name="get_we',
        "Sure. " + TOOL_CALL_START + "\n" + INVOKE_START + ' name="get_we', []),
    "invoke cut off inside a parameter": (
        TOOL_CALL_START + invoke("get_weather", el("city", "Oslo"))[:-len(INVOKE_END) - 1].replace(
            el("city", "Oslo"), el("city", "Oslo") + f"{NS}<days>4"),
        f"{NS}<days>4", [("get_weather", {"city": "Oslo"})]),
    "missing </invoke> and </tool_call>": (
        TOOL_CALL_START + f"{INVOKE_START} name=\"get_weather\">" + el("city", "Lima"),
        "", [("get_weather", {"city": "Lima"})]),
    "mismatched closing tag": (
        block(invoke("get_weather", f"{NS}<city>Oslo{NS}</town>")) + " tail",
        f"\n{NS}<city>Oslo{NS}</town>\n{INVOKE_END}\n{TOOL_CALL_END} tail", [("get_weather", {})]),
    "garbage where an invoke belongs": (
        TOOL_CALL_START + "\nhello" + TOOL_CALL_END,
        TOOL_CALL_START + "\nhello" + TOOL_CALL_END, []),
    "invoke without a name": (
        TOOL_CALL_START + f"{INVOKE_START}>" + INVOKE_END + TOOL_CALL_END,
        TOOL_CALL_START + f"{INVOKE_START}>" + INVOKE_END + TOOL_CALL_END, []),
    "good call, then a broken one": (
        block(invoke("get_weather", el("city", "Oslo")), f"{NS}<oops>"),
        f"\n{NS}<oops>\n{TOOL_CALL_END}", [("get_weather", {"city": "Oslo"})]),
    "text mixed with nested tags": (
        block(invoke("create_order", el("shipping", "to " + el("city", "Oslo")))),
        f"\n{NS}<shipping>to {el('city', 'Oslo')}{NS}</shipping>\n{INVOKE_END}\n{TOOL_CALL_END}",
        [("create_order", {})]),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_markup_comes_back_as_content(name):
    text, content, calls = MALFORMED[name]
    one_shot = run_tools([text])
    assert one_shot[:2] == (content, calls)
    assert one_shot[2], "the failure is reported"
    for chunks in every_split(text):
        got = run_tools(chunks)
        assert got[:2] == one_shot[:2] and got[2], chunks  # the message may name less of the text


def test_arguments_grow_one_parameter_at_a_time():
    """Streaming clients see each top-level parameter as soon as its closing tag arrives."""
    parser = ToolCallParser(TOOLS)
    head = TOOL_CALL_START + f'{INVOKE_START} name="get_weather">'
    d = parser.feed(head)
    assert [(c.index, c.name, c.arguments) for c in d.calls] == [(0, "get_weather", "")]
    assert [c.arguments for c in parser.feed(el("city", "Oslo")).calls] == ['{"city": "Oslo"']
    assert [c.arguments for c in parser.feed(el("days", "2")).calls] == [', "days": 2']
    assert [c.arguments for c in parser.feed(INVOKE_END + TOOL_CALL_END).calls] == ["}"]


def run_reasoning(chunks, pre=False):
    parser = ReasoningParser(pre)
    reasoning = content = ""
    for chunk in list(chunks) + [None]:
        d = parser.feed(chunk) if chunk is not None else parser.finish()
        reasoning += d.reasoning
        content += d.content
    return reasoning, content


REASONING = {
    "block then answer": ("<mm:think>Paris is in France.</mm:think>\n\nThe answer is Paris.", False,
                          "Paris is in France.", "The answer is Paris."),
    "pre-opened by the template": ("Let me think…\n</mm:think>\nDone.", True, "Let me think…\n", "Done."),
    "no reasoning at all": ("Just an answer with < and > and </mm:thin", False, "",
                            "Just an answer with < and > and </mm:thin"),
    "empty block (thinking disabled)": ("<mm:think></mm:think>\n\nHi", False, "", "Hi"),
    "truncated inside reasoning": ("<mm:think>still thinking <mm:th", False, "still thinking <mm:th", ""),
    "thinks again between answers": ("<mm:think>a</mm:think>x <mm:think>b</mm:think> y", False, "ab", "x y"),
    "unicode and tool markup stay in content": ("<mm:think>数</mm:think>" + block(invoke("f", el("a", "é"))),
                                                False, "数", block(invoke("f", el("a", "é")))),
}


@pytest.mark.parametrize("name", list(REASONING))
def test_reasoning_at_every_chunk_boundary(name):
    text, pre, reasoning, content = REASONING[name]
    for chunks in every_split(text):
        assert run_reasoning(chunks, pre) == (reasoning, content), chunks


def test_prompt_that_pre_opens_reasoning():
    assert starts_in_reasoning("]~b]ai\n<mm:think>\n")
    assert not starts_in_reasoning("]~b]ai\n<mm:think>\n</mm:think>\n\n")
    assert not starts_in_reasoning("]~b]ai\n")


FRAGMENTS = [NS, "<tool_call>", "</tool_call>", '<invoke name="get_weather">', '<invoke name=f>', "</invoke>",
             "<city>", "</city>", "<days>", "</days>", "<item>", "</item>", "<", ">", "/", "Oslo", "42", " ", "\n",
             "é", "<mm:think>", "</mm:think>", TOOL_CALL_START, TOOL_CALL_END, INVOKE_END, "]<]mini"]


@pytest.mark.parametrize("seed", range(200))
def test_random_markup_never_raises_and_ignores_chunking(seed):
    """Seeded random soups of markup fragments: the parsers never raise, every call's arguments are one JSON
    object, and a random chunking gives what the whole text gives."""
    import random

    rng = random.Random(seed)
    text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 40)))
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 8))))
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    whole = run_tools([text])
    assert run_tools(chunks)[:2] == whole[:2]
    assert all(isinstance(args, dict) for _, args in whole[1])
    assert run_reasoning(chunks) == run_reasoning([text])
