"""The OpenAI-compatible server over real HTTP on 127.0.0.1, driven by the official ``openai`` client.

The engine is the real tiny engine; prompts that name a script get a reply the test wrote (``ScriptedEngine``),
so reasoning and tool-call markup come out of the server exactly as a model would emit them. Plain prompts are
compared with the engine's own generation (a fresh engine, same parameters).
"""

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from m3export.runtime import Engine, SamplingParams
from m3export.serve.chat_template import ChatTemplate
from m3export.serve.tool_parser import INVOKE_END, INVOKE_START, TOOL_CALL_END, TOOL_CALL_START, forced_call_prefix
from tests.serve_fixtures import TEST_TEMPLATE, ScriptedEngine

openai = pytest.importorskip("openai", reason="the openai client comes with the dev extra")
httpx = pytest.importorskip("httpx", reason="httpx comes with the openai client")
uvicorn = pytest.importorskip("uvicorn", reason="uvicorn comes with the serve extra")

MODEL = "m3-test"
MAX_MODEL_LEN = 1024
SPECIALS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}
NS = "]<]minimax[>["


def el(name, body):
    return f"{NS}<{name}>{body}{NS}</{name}>"


TOOL_BLOCK = (f"{TOOL_CALL_START}\n{INVOKE_START} name=\"get_weather\">\n{el('city', 'Zürich')}\n{el('days', '3')}\n"
              f"{INVOKE_END}\n{INVOKE_START} name=\"get_time\">\n{el('zone', 'CET')}\n{INVOKE_END}\n{TOOL_CALL_END}")
SCRIPTS = {
    "reason": "<mm:think>Paris is in France.</mm:think>\n\nThe capital is Paris.",
    "tool": "<mm:think>Need the weather.</mm:think>\nChecking. " + TOOL_BLOCK,
    "preopened": "Quick thought.</mm:think>\nAnswer: 42 ✓",
    "truncated": f"Calling {TOOL_CALL_START}{INVOKE_START} name=\"get_weather\">{el('city', 'Oslo')}{NS}<days>",
    "long": "z" * 400,
    # Continuations of a forced call start (tool_choice required / named): what follows the prompt's prefix.
    "required": f"get_weather\">\n{el('city', 'Bern')}\n{el('days', '2')}\n{INVOKE_END}\n{TOOL_CALL_END}",
    "named": f"{el('zone', 'UTC')}\n{INVOKE_END}\n{TOOL_CALL_END}",
    "nocall": "I would rather not",
    **{f"c{i}": f"client {i} says " + "abcdefghij"[:i % 10] * (1 + i % 4) for i in range(16)},
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}


class Live:
    """A running server: its URL, engine and what the engine saw."""

    def __init__(self, url, engine, server):
        self.url, self.engine, self.server = url, engine, server
        self.aborted: list[str] = []
        self.max_running = 0

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kw)

    def wait_idle(self, timeout=60.0):
        """Until the engine holds no request (a deadline only so that a bug fails instead of hanging)."""
        deadline = time.monotonic() + timeout
        while self.engine.has_unfinished() or self.server.driver.running:
            assert time.monotonic() < deadline, "the engine never went idle"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def live():
    from m3export.serve.openai_server import OpenAIServer

    engine = ScriptedEngine.from_checkpoint("tiny", scripts=SCRIPTS, max_model_len=MAX_MODEL_LEN)
    server = OpenAIServer(engine, MODEL, chat_template=ChatTemplate(TEST_TEMPLATE, "test", SPECIALS),
                          cancel_poll_s=0.0, disconnect_poll_s=0.1)
    state = Live(None, engine, server)
    step, abort = engine.step, engine.abort

    def recording_step():
        state.max_running = max(state.max_running, len(engine.scheduler.running))
        return step()

    def recording_abort(rid):
        state.aborted.append(rid)
        return abort(rid)

    engine.step, engine.abort = recording_step, recording_abort
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    state.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    http = uvicorn.Server(uvicorn.Config(server.app, log_level="warning"))
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not http.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield state
    http.should_exit = True
    thread.join(30)
    assert server.driver is None  # the lifespan closed the driver


def chat(text):
    return [{"role": "user", "content": f"SCRIPT[{text}]"}]


chat_messages = chat


def n_tokens(engine, text):
    return len(engine.tokenizer.encode(text))


def test_models_health_and_completion_equal_the_engine(live):
    c = live.client()
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert httpx.get(live.url + "/health").status_code == 200
    r = c.completions.create(model=MODEL, prompt="Hello there", max_tokens=9, temperature=0)
    ref = Engine.from_checkpoint("tiny").generate(["Hello there"], SamplingParams(temperature=0, max_tokens=9))[0]
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 9)
    echoed = c.completions.create(model=MODEL, prompt="Hello there", max_tokens=9, temperature=0, echo=True)
    assert echoed.choices[0].text == "Hello there" + ref.text


def test_logprobs_equal_the_engine(live):
    c = live.client()
    r = c.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, temperature=0, logprobs=3)
    ref = Engine.from_checkpoint("tiny").generate(["Hello there"], SamplingParams(temperature=0, max_tokens=4,
                                                                                  logprobs=3))[0]
    lp = r.choices[0].logprobs
    text = [live.engine.tokenizer.decode([t], skip_special_tokens=False) for t in ref.token_ids]
    assert lp.tokens == [s if s and "\ufffd" not in s else f"token_id:{t}" for s, t in zip(text, ref.token_ids)]
    # Same weights and arithmetic; 1e-5 allows for a different float summation order inside a batch.
    assert lp.token_logprobs == pytest.approx([d[t] for t, d in zip(ref.token_ids, ref.logprobs)], abs=1e-5)
    assert [len(top) for top in lp.top_logprobs] == [3] * 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(4)]
    assert r.choices[0].text == ref.text
    streamed = list(c.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, temperature=0,
                                         logprobs=3, stream=True))
    assert [t for ch in streamed for t in ch.choices[0].logprobs.tokens] == lp.tokens
    chat = c.chat.completions.create(model=MODEL, messages=chat_messages("c4"), logprobs=True, top_logprobs=2,
                                     max_tokens=50)
    content = chat.choices[0].logprobs.content
    assert "".join(e.token for e in content[:-1]) == SCRIPTS["c4"] and len(content) == chat.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
               and e.logprob <= e.top_logprobs[0].logprob for e in content)
    with pytest.raises(openai.BadRequestError, match="logprobs must be in"):
        c.completions.create(model=MODEL, prompt="x", logprobs=21)


def test_streamed_completion_with_usage_equals_the_plain_one(live):
    c = live.client()
    kw = {"model": MODEL, "prompt": "SCRIPT[reason]", "max_tokens": 200, "temperature": 0}
    whole = c.completions.create(**kw)
    chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text == SCRIPTS["reason"]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n_tokens(live.engine,
                                                                                        SCRIPTS["reason"]) + 1
    assert all(ch.usage is None for ch in chunks[:-1])  # usage comes once, at the end


def test_chat_splits_reasoning(live):
    r = live.client().chat.completions.create(model=MODEL, messages=chat("reason"))
    m = r.choices[0].message
    assert (m.reasoning_content, m.content) == ("Paris is in France.", "The capital is Paris.")
    assert r.choices[0].finish_reason == "stop" and not m.tool_calls
    prompt = ChatTemplate(TEST_TEMPLATE, "t", SPECIALS).render(chat("reason"))
    assert r.usage.prompt_tokens == n_tokens(live.engine, prompt)
    assert r.usage.completion_tokens == n_tokens(live.engine, SCRIPTS["reason"]) + 1  # + EOS


def test_chat_reasoning_pre_opened_by_the_template(live):
    c = live.client()
    r = c.chat.completions.create(model=MODEL, messages=chat("preopened"),
                                  extra_body={"chat_template_kwargs": {"thinking_mode": "enabled"}})
    m = r.choices[0].message
    assert (m.reasoning_content, m.content) == ("Quick thought.", "Answer: 42 ✓")
    stream = c.chat.completions.create(model=MODEL, messages=chat("preopened"), stream=True,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    deltas = [ch.choices[0].delta for ch in stream]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Quick thought."
    assert "".join(d.content or "" for d in deltas) == "Answer: 42 ✓"


def parallel(*calls):
    """Run the calls at once (the server batches them, so slow decodes overlap) and return their results."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def collect_stream(chunks):
    """Streamed chat chunks -> (content, reasoning, calls as {index: (id, name, [argument pieces])}, reasons)."""
    content = reasoning = ""
    calls, reasons = {}, []
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        reasons.append(ch.choices[0].finish_reason)
        for t in d.tool_calls or []:
            entry = calls.setdefault(t.index, [None, None, []])
            if t.id:
                assert entry[0] is None, "a call's id and name come once"
                entry[0], entry[1] = t.id, t.function.name
            entry[2].append(t.function.arguments or "")
    return content, reasoning, calls, reasons


def test_chat_tool_calls_plain_and_streamed(live):
    c = live.client()
    kw = {"model": MODEL, "messages": chat("tool"), "tools": [WEATHER, CLOCK]}
    plain, chunks = parallel(lambda: c.chat.completions.create(**kw),
                             lambda: list(c.chat.completions.create(**kw, stream=True,
                                                                    stream_options={"include_usage": True})))
    expected = [("get_weather", {"city": "Zürich", "days": 3}), ("get_time", {"zone": "CET"})]
    choice = plain.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking. " and choice.message.reasoning_content == "Need the weather."
    calls = choice.message.tool_calls
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == expected
    assert {t.type for t in calls} == {"function"} and len({t.id for t in calls}) == 2
    assert all(t.id.startswith("call_") for t in calls)

    assert chunks[0].choices[0].delta.role == "assistant"
    content, reasoning, streamed, reasons = collect_stream(chunks)
    assert (content, reasoning) == ("Checking. ", "Need the weather.")
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}
    assert [(name, json.loads("".join(args))) for _, name, args in streamed.values()] == expected
    assert len(streamed[0][2]) >= 3, "arguments grow over several deltas"
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens == n_tokens(
        live.engine, SCRIPTS["tool"]) + 1


def test_tool_choice_none_and_truncated_markup(live):
    c = live.client()
    none, truncated = parallel(
        lambda: c.chat.completions.create(model=MODEL, messages=chat("truncated"), tools=[WEATHER],
                                          tool_choice="none"),
        lambda: c.chat.completions.create(model=MODEL, messages=chat("truncated"), tools=[WEATHER]))
    assert none.choices[0].finish_reason == "stop" and not none.choices[0].message.tool_calls
    assert none.choices[0].message.content == SCRIPTS["truncated"]  # not parsed: returned as text
    m = truncated.choices[0].message  # the call announced before the cut keeps what it had; the rest is content
    assert m.content == "Calling " + f"{NS}<days>" and truncated.choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [
        ("get_weather", {"city": "Oslo"})]


NAMED_CLOCK = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("key, tool_choice, expected, prefix, shown", [
    ("required", "required", ("get_weather", {"city": "Bern", "days": 2}), forced_call_prefix(), [WEATHER, CLOCK]),
    ("named", NAMED_CLOCK, ("get_time", {"zone": "UTC"}), forced_call_prefix("get_time"), [CLOCK]),
])
def test_tool_choice_required_and_named_are_forced(live, key, tool_choice, expected, prefix, shown):
    """The prompt ends with the start of a call, the model (here: the script) continues it, and the reply is
    that call, parsed as if the model had written the prefix too. ``shown``: the tools the template sees (a named
    choice shows only that one)."""
    c = live.client()
    kw = {"model": MODEL, "messages": chat(key), "tools": [WEATHER, CLOCK], "tool_choice": tool_choice}
    live.engine.prompts.clear()
    plain, chunks = parallel(lambda: c.chat.completions.create(**kw),
                             lambda: list(c.chat.completions.create(**kw, stream=True,
                                                                    stream_options={"include_usage": True})))
    rendered = ChatTemplate(TEST_TEMPLATE, "t", SPECIALS).render(chat(key), tools=shown)
    assert live.engine.prompts == [rendered + prefix] * 2  # what the engine was given, both requests
    assert not rendered.endswith(prefix)

    choice = plain.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls] == [expected]
    assert plain.usage.prompt_tokens == n_tokens(live.engine, rendered + prefix)
    assert plain.usage.completion_tokens == n_tokens(live.engine, SCRIPTS[key]) + 1  # + EOS; the prefix is prompt

    content, reasoning, streamed, reasons = collect_stream(chunks)
    assert (content, reasoning) == ("", "")
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}
    assert [(name, json.loads("".join(args))) for _, name, args in streamed.values()] == [expected]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_forced_call_comes_after_reasoning_the_template_pre_opens(live):
    """With thinking enabled the template opens a think block; a forced call is rendered with thinking disabled
    (the template's own closed block) so the call is not read as reasoning."""
    c = live.client()
    live.engine.prompts.clear()
    r = c.chat.completions.create(model=MODEL, messages=chat("required"), tools=[WEATHER], tool_choice="required",
                                  extra_body={"chat_template_kwargs": {"thinking_mode": "enabled"}})
    template = ChatTemplate(TEST_TEMPLATE, "t", SPECIALS)
    assert template.render(chat("required"), tools=[WEATHER], thinking_mode="enabled").endswith("<mm:think>\n")
    disabled = template.render(chat("required"), tools=[WEATHER], thinking_mode="disabled")
    assert live.engine.prompts == [disabled + forced_call_prefix()]
    m = r.choices[0].message
    assert m.reasoning_content is None and m.content is None and r.choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [
        ("get_weather", {"city": "Bern", "days": 2})]


def test_forced_call_the_model_does_not_finish_is_returned_as_content(live, caplog):
    """A forced start the model continues with no valid call is malformed markup: returned as text and logged."""
    c = live.client()
    with caplog.at_level("WARNING", logger="m3export.serve.openai"):
        r = c.chat.completions.create(model=MODEL, messages=chat("nocall"), tools=[WEATHER], tool_choice="required")
        chunks = list(c.chat.completions.create(model=MODEL, messages=chat("nocall"), tools=[WEATHER],
                                                tool_choice="required", stream=True))
    assert r.choices[0].message.content == forced_call_prefix() + SCRIPTS["nocall"]
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
    content, _, streamed, reasons = collect_stream(chunks)
    assert (content, streamed, reasons[-1]) == (forced_call_prefix() + SCRIPTS["nocall"], {}, "stop")
    assert any("tool-call markup returned as content" in rec.getMessage() for rec in caplog.records)


def test_sixteen_concurrent_streams(live):
    async def one(client, i):
        stream = await client.chat.completions.create(model=MODEL, messages=chat(f"c{i}"), stream=True)
        text, reason = "", None
        async for ch in stream:
            text += ch.choices[0].delta.content or ""
            reason = ch.choices[0].finish_reason or reason
        return text, reason

    async def main():
        client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(client, i) for i in range(16)))

    live.max_running = 0
    results = asyncio.run(main())
    assert results == [(SCRIPTS[f"c{i}"], "stop") for i in range(16)]
    assert live.max_running > 1, "requests were batched together"
    live.wait_idle()
    assert live.engine.blocks.num_free == live.engine.blocks.num_pages


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_pages(live, stream):
    live.aborted.clear()
    body = {"model": MODEL, "prompt": "SCRIPT[long]", "max_tokens": 400, "stream": stream}
    with httpx.Client(timeout=30) as http:
        if stream:
            with http.stream("POST", live.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
        else:
            with pytest.raises(httpx.ReadTimeout):  # give up long before 400 tokens are done
                http.post(live.url + "/v1/completions", json=body, timeout=1.0)
    live.wait_idle()
    assert len(live.aborted) == 1, "the request was aborted, not run to the end"
    assert live.engine.blocks.num_free == live.engine.blocks.num_pages
    r = live.client().completions.create(model=MODEL, prompt="SCRIPT[c3]", max_tokens=50)
    assert r.choices[0].text == SCRIPTS["c3"]  # and the server keeps serving


@pytest.mark.parametrize("body, status, match", [
    ('{"model": "nope", "prompt": "a"}', 404, "does not exist"),
    ('{"model": "m3-test", "prompt": "a", ', 400, "not valid JSON"),
    ('{"model": "m3-test", "prompt": "a", "max_tokens": -1}', 400, "max_tokens"),
    ('{"model": "m3-test", "prompt": "a", "n": 2}', 400, "'n'=2 is not supported"),
    ('{"model": "m3-test", "prompt": "' + "a" * MAX_MODEL_LEN + '"}', 400, "maximum context length is 1024"),
    ('{"model": "m3-test", "prompt": ""}', 400, "empty"),
    ('{"model": "m3-test", "prompt": "a", "temperature": "hot"}', 400, "temperature"),
    ('{"model": "m3-test"}', 400, "prompt"),
    ('{"model": "m3-test", "messages": []}', 400, "messages"),
    ('{"model": "m3-test", "messages": [{"content": "x"}]}', 400, "role"),
    ('{"model": "m3-test", "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}', 400,
     "input_audio"),
    ('{"model": "m3-test", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}', 400,
     "needs tools"),
    ('{"model": "m3-test", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
     '"function": {"name": "get_time"}}], "tool_choice": {"type": "function", "function": {"name": "nope"}}}', 400,
     "'nope', which is not in tools"),
    ('{"model": "m3-test", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
     '"function": {"name": "get_time"}}], "tool_choice": "required", "add_generation_prompt": false}', 400,
     "needs add_generation_prompt"),
])
def test_bad_requests_get_openai_errors(live, body, status, match):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    for stream in (False, True):
        text = body if not stream or body.endswith(", ") else body[:-1] + ', "stream": true}'
        r = httpx.post(live.url + path, content=text, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["code"] == status and err["type"] and match in err["message"], err
    ok = live.client().completions.create(model=MODEL, prompt="SCRIPT[c1]", max_tokens=50)
    assert ok.choices[0].text == SCRIPTS["c1"]


def test_bad_requests_through_the_client(live):
    c = live.client()
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="other", prompt="a")
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        c.completions.create(model=MODEL, prompt="a", presence_penalty=2.5)  # out of OpenAI's [-2, 2]
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        c.completions.create(model=MODEL, prompt="a", extra_body={"min_tokens": 3})
    neutral = c.completions.create(model=MODEL, prompt="SCRIPT[c2]", max_tokens=50, n=1, presence_penalty=0,
                                   frequency_penalty=0)
    assert neutral.choices[0].text == SCRIPTS["c2"]


def metric_values(text):
    """Prometheus text -> {'name{labels}': value}."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_metrics(live):
    live.client().completions.create(model=MODEL, prompt="SCRIPT[c5]", max_tokens=50)
    values = metric_values(httpx.get(live.url + "/metrics").text)
    label = f'model_name="{MODEL}"'
    for name in ("time_to_first_token_seconds_count", "time_per_output_token_seconds_count",
                 "e2e_request_latency_seconds_count", "prompt_tokens_total", "generation_tokens_total"):
        assert values[f"m3export:{name}{{{label}}}"] > 0, name
    assert values[f'm3export:request_success_total{{finished_reason="stop",{label}}}'] >= 1
    for name in ("num_requests_running", "num_requests_waiting", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total"):
        assert f"m3export:{name}{{{label}}}" in values, name


def test_speculation_metrics_follow_the_engine():
    """The speculative-decoding series are the engine's own counters, read when Prometheus scrapes."""
    from m3export.serve.openai_metrics import ServerMetrics

    engine = Engine.from_checkpoint("tiny", num_speculative_tokens=2, max_model_len=64)
    metrics = ServerMetrics(engine, "spec")
    engine.generate(["speculate"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    values, stats = metric_values(metrics.exposition().decode()), engine.stats
    assert stats.draft_tokens > 0
    label = '{model_name="spec"}'
    assert values["m3export:spec_decode_num_draft_tokens_total" + label] == stats.draft_tokens
    assert values["m3export:spec_decode_num_accepted_tokens_total" + label] == stats.accepted_tokens
    assert values["m3export:spec_decode_mean_acceptance_length" + label] == pytest.approx(
        stats.mean_acceptance_length)
    assert values["m3export:num_speculative_tokens" + label] == 2


@pytest.mark.slow  # a fresh process: imports, model load and warm-up (12-30 s on the shared CI machine)
def test_serve_command_starts_prints_its_url_and_serves(tmp_path):
    """The CLI as a user runs it: progress, the URL, then answers; Ctrl-C stops it."""
    proc = subprocess.Popen([sys.executable, "-m", "m3export.cli", "serve", "tiny", "--port", "0",
                             "--max-model-len", "128", "--served-model-name", "tiny-m3", "--log-level", "warning"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    guard = threading.Timer(120, proc.kill)  # a server that never comes up fails the test instead of hanging it
    guard.start()
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "serving" in line:
                break
        assert [ln[:5] for ln in lines] == ["[1/3]", "[2/3]", "[3/3]"], lines
        url = lines[-1].split(" at ")[1].split()[0]
        c = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["tiny-m3"]
        r = c.completions.create(model="tiny-m3", prompt="Hi", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    finally:
        guard.cancel()
        proc.send_signal(2)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


def test_serve_command_listens_before_it_prints_the_url(monkeypatch, capsys):
    """A client may connect the moment the URL is printed: the socket must already listen (a bound socket that
    does not listen refuses connections, which is how a fast client failed before uvicorn called listen)."""
    import argparse
    import socket
    import types

    import uvicorn

    from m3export.commands import serve as serve_command

    seen = {}

    def run_instead(self, sockets):
        (sock,) = sockets
        seen["listening"] = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        with socket.create_connection(sock.getsockname()[:2], timeout=5):
            seen["connected"] = True
        sock.close()

    closed = []
    fake = types.SimpleNamespace(model_name="m", app=None, engine=types.SimpleNamespace(close=lambda: closed.append(1)))
    monkeypatch.setattr(serve_command, "build_server", lambda args: fake)
    monkeypatch.setattr(uvicorn.Server, "run", run_instead)
    args = argparse.Namespace(host="127.0.0.1", port=0, log_level="warning")
    assert serve_command.run(args) == 0
    assert seen == {"listening": 1, "connected": True} and closed == [1]
    assert "[3/3] serving 'm' at http://127.0.0.1:" in capsys.readouterr().err


def test_serve_takes_an_execution_provider(tiny_artifact, monkeypatch):  # noqa: F811
    """``serve --provider`` as ``generate`` / ``triton-repo`` take it: refused without the onnxruntime backend before
    anything loads, else checked and handed to the engine (its ``provider`` argument)."""
    from m3export.cli import build_parser
    from m3export.commands import serve as serve_command
    from m3export.errors import M3Error
    from m3export.serve import repo

    args = build_parser().parse_args(["serve", str(tiny_artifact), "--provider", "cuda:enable_cuda_graph=1"])
    with pytest.raises(M3Error, match="add --backend onnxruntime"):
        serve_command.build_server(args)  # the default torch backend

    class Loaded(Exception):
        pass

    def capture(parameters, version_dir):
        raise Loaded(json.loads(parameters["engine_args"]))

    monkeypatch.setattr(repo, "load_engine", capture)
    args = build_parser().parse_args(["serve", str(tiny_artifact), "--backend", "onnxruntime", "--provider",
                                      "cuda:enable_cuda_graph=1"])
    with pytest.raises(Loaded) as got:
        serve_command.build_server(args)
    assert got.value.args[0]["provider"] == "CUDAExecutionProvider:enable_cuda_graph=1"
