"""The OpenAI-compatible HTTP server (``m3export serve``): FastAPI on uvicorn over the paged runtime.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (server-sent events when
``stream`` is true, with a final usage chunk under ``stream_options.include_usage``), ``GET /health`` and
Prometheus ``GET /metrics``.

Concurrency: one ``EngineDriver`` thread owns the engine and batches every request in flight continuously (the
same driver the Triton model uses); HTTP handlers run on the event loop and receive each request's chunks
through an asyncio queue. A client that goes away (a dropped stream, or a closed connection while a non-streaming
request runs) marks its request cancelled; the driver aborts it and its pages are freed at once.

Chat: the model's chat template renders the messages (``chat_template``), the prompt is tokenized here (so an
empty or oversize prompt is a 400 before anything runs), and the generated text goes through M3's reasoning
parser (``reasoning_content``) and then its tool-call parser (``tool_calls``, ``finish_reason: "tool_calls"``).
Both parsers read the decoded text; when the tokenizer makes their markers special tokens, such requests are
decoded with ``skip_special_tokens=False`` so the markers reach them.

Errors are OpenAI's error body with a 4xx status for client mistakes (unknown model 404, everything else the
client can fix 400) and 500 for server faults; the server keeps serving others.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..errors import MediaError
from ..preprocess import decode_data_url
from ..preprocess.prompt import IMAGE_TOKEN, VIDEO_TOKEN
from .chat_template import ChatTemplate, ChatTemplateError, template_kwargs
from .driver import EngineDriver
from .media import media_settings, prepare_media
from .openai_metrics import CONTENT_TYPE, ServerMetrics
from .openai_protocol import ChatRequest, CompletionRequest, NamedToolChoice, error_body
from .protocol import Chunk, GenerateRequest, RequestError, sampling_kwargs, sampling_params
from .reasoning_parser import THINK_END, THINK_START, ReasoningParser, starts_in_reasoning
from .tool_parser import NAMESPACE, ToolCallParser, forced_call_prefix

log = logging.getLogger("m3export.serve.openai")

MAX_LOGPROBS = 20  # most likely tokens a request may ask for per position (OpenAI's and vLLM's limit)


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


class _Failed:
    def __init__(self, message: str):
        self.message = message


class _AsyncSink:
    """A driver Sink that hands chunks to the event loop; ``cancel()`` tells the driver the client left."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self._cancelled = False

    def _put(self, item) -> None:
        self._loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def send(self, chunk: Chunk) -> None:
        self._put(chunk)

    def fail(self, message: str) -> None:
        self._put(_Failed(message))

    def close(self) -> None:
        self._put(None)

    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        self._cancelled = True


@dataclass
class _Prompt:
    ids: list[int]
    text: str | None  # for echo, and for chat: the rendered prompt
    sampling: dict[str, Any]
    media: tuple = ()  # images / videos (runtime MediaItem) whose placeholders ``ids`` already holds


@dataclass
class _Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


@dataclass
class _ChatState:
    """Per-choice parsing state of a chat response."""

    reasoning: ReasoningParser | None
    tools: ToolCallParser | None
    include_reasoning: bool
    top_logprobs: int | None  # None: no logprobs in the response
    forced: str = ""  # the start of a tool call the prompt ends with: parsed as if generated, before the reply
    call_ids: dict[int, str] = field(default_factory=dict)
    num_calls: int = 0


class OpenAIServer:
    def __init__(self, engine, model_name: str, *, chat_template: ChatTemplate | None = None,
                 reasoning_parser: bool = True, tool_call_parser: bool = True, cancel_poll_s: float = 0.05,
                 disconnect_poll_s: float = 0.5):
        self.engine = engine
        self.model_name = model_name
        self.chat_template = chat_template
        self.reasoning_parser = reasoning_parser
        self.tool_call_parser = tool_call_parser
        self.metrics = ServerMetrics(engine, model_name)
        self._disconnect_poll_s = disconnect_poll_s
        self._cancel_poll_s = cancel_poll_s
        # chat prompts with images / video are decoded, preprocessed and tokenized on the driver's media threads
        # (EngineDriver.media_executor), off the event loop
        self.driver: EngineDriver | None = None
        self.created = int(time.time())
        tok = engine.tokenizer
        specials = tok.special_tokens() if tok is not None and hasattr(tok, "special_tokens") else frozenset()
        #: The parsers' markers are special tokens of this tokenizer: decode parsed requests with them kept.
        self.markers_are_special = bool(specials & {THINK_START, THINK_END, NAMESPACE})
        self.app = self._build_app()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.driver is None:
            self.driver = EngineDriver(self.engine, self.metrics, name="openai", cancel_poll_s=self._cancel_poll_s)

    def close(self) -> None:
        if self.driver is not None:
            self.driver.close()
            self.driver = None

    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app):
            self.start()
            try:
                yield
            finally:
                self.close()

        app = FastAPI(title="m3export", lifespan=lifespan)

        @app.exception_handler(ApiError)
        async def _api_error(request: Request, e: ApiError):
            return JSONResponse(error_body(str(e), e.status, e.param), status_code=e.status)

        @app.exception_handler(RequestValidationError)
        async def _invalid(request: Request, e: RequestValidationError):
            errors = e.errors()
            if any(err.get("type") == "json_invalid" for err in errors):
                detail = next(err for err in errors if err.get("type") == "json_invalid").get("ctx", {})
                message = f"the request body is not valid JSON ({detail.get('error', 'JSON decode error')})"
            else:
                message = "invalid request: " + "; ".join(
                    f"{'.'.join(str(p) for p in err.get('loc', ()) if p != 'body') or 'body'}: {err.get('msg')}"
                    for err in errors[:5])
            return JSONResponse(error_body(message, 400), status_code=400)

        @app.exception_handler(HTTPException)
        async def _http(request: Request, e: HTTPException):
            return JSONResponse(error_body(str(e.detail), e.status_code), status_code=e.status_code)

        @app.exception_handler(Exception)
        async def _bug(request: Request, e: Exception):  # a server fault still answers in OpenAI's shape
            log.error("request %s %s failed", request.method, request.url.path, exc_info=e)
            return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", 500), status_code=500)

        @app.get("/health")
        async def health():
            alive = self.driver is not None and self.driver.alive
            return Response(status_code=200 if alive else 503)

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{
                "id": self.model_name, "object": "model", "created": self.created, "owned_by": "m3export",
                "root": self.model_name, "max_model_len": self.engine.max_model_len}]}

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request):
            return await self._completions(body, request)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatRequest, request: Request):
            return await self._chat(body, request)

        return app

    # ------------------------------------------------------------------ shared request handling
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(f"The model `{model}` does not exist; this server serves `{self.model_name}`", 404,
                           "model")

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise ApiError("this model has no tokenizer (tokenizer.json): send the prompt as token ids", 400,
                               "prompt")
            ids = self.engine.tokenizer.encode(prompt)
        else:
            vocab = self.engine.config.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ApiError(f"prompt token ids must be in [0, {vocab}); got {bad[0]}", 400, "prompt")
            ids = list(prompt)
        if not ids:
            raise ApiError("the prompt is empty", 400, "prompt")
        limit = self.engine.max_model_len
        if len(ids) >= limit:
            raise ApiError(f"This model's maximum context length is {limit} tokens; the prompt has {len(ids)} "
                           "tokens, which leaves no room to generate", 400, "prompt")
        return ids

    def _sampling(self, body, ids: list[int], max_tokens: int | None, extra: dict | None = None) -> dict[str, Any]:
        raw = body.sampling_fields()
        raw["max_tokens"] = max_tokens if max_tokens is not None else self.engine.max_model_len - len(ids)
        raw.update(extra or {})
        try:
            sampling = sampling_kwargs(raw, "request")
            sampling_params(GenerateRequest(ids, sampling, True, True))  # range checks, now rather than later
        except RequestError as e:
            raise ApiError(str(e), 400) from None
        if sampling.get("stop") and self.engine.tokenizer is None:
            raise ApiError("stop strings need a tokenizer; this model has none (use stop_token_ids)", 400, "stop")
        return sampling

    async def _run(self, prompt: _Prompt, request, stream: bool) -> AsyncIterator[Chunk]:
        """Submit one prompt and yield its chunks; on exit (finished, failed or abandoned) the request is gone."""
        if self.driver is None:
            raise ApiError("the server is not running", 503)
        sink = _AsyncSink(asyncio.get_running_loop())
        self.driver.submit(GenerateRequest(prompt.ids, prompt.sampling, True, True, media=prompt.media), sink)
        arrival, first, num_out = time.monotonic(), None, 0
        checked = arrival
        try:
            while True:
                if stream:  # Starlette cancels this generator when the client drops the stream
                    item = await sink.queue.get()
                else:  # nobody cancels a plain response: look at the connection now and then
                    try:
                        item = await asyncio.wait_for(sink.queue.get(), self._disconnect_poll_s)
                    except asyncio.TimeoutError:
                        item = False
                    if time.monotonic() - checked >= self._disconnect_poll_s:
                        checked = time.monotonic()
                        if await request.is_disconnected():
                            log.info("client disconnected; aborting its request")
                            return
                    if item is False:
                        continue
                if item is None:
                    return
                if isinstance(item, _Failed):
                    raise ApiError(item.message, 500)
                if item.num_output_tokens and first is None:
                    first = time.monotonic()
                num_out += item.num_output_tokens
                if item.final:
                    self.metrics.request_done(arrival=arrival, first=first, last=time.monotonic(),
                                              num_prompt=item.num_input_tokens, num_output=num_out,
                                              finish_reason=item.finish_reason or "unknown")
                yield item
                if item.final:
                    return
        finally:
            sink.cancel()

    async def _merged(self, prompts: list[_Prompt], request, stream: bool) -> AsyncIterator[tuple[int, Chunk]]:
        """Several prompts (a batched completion) run concurrently; their chunks in arrival order."""
        if len(prompts) == 1:
            async with aclosing(self._run(prompts[0], request, stream)) as chunks:
                async for c in chunks:
                    yield 0, c
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, p: _Prompt):
            try:
                async with aclosing(self._run(p, request, stream)) as chunks:
                    async for c in chunks:
                        await queue.put((i, c))
            except Exception as e:  # noqa: BLE001 - handed to the consumer below
                await queue.put((i, e))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
        try:
            done = 0
            while done < len(tasks):
                i, item = await queue.get()
                if item is None:
                    done += 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def _sse(self, events: AsyncIterator[dict]) -> StreamingResponse:
        async def body():
            async with aclosing(events):
                try:
                    async for event in events:
                        yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
                except ApiError as e:
                    yield f"data: {json.dumps(error_body(str(e), e.status))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    @staticmethod
    async def _first_or_error(events: AsyncIterator[dict]) -> AsyncIterator[dict]:
        """Start the generator up to its first event, so that errors raised before any output (a prompt the
        engine refuses, a server that is not running) become a plain error response, not a broken stream."""
        first = await events.__anext__()

        async def chained():
            async with aclosing(events):
                yield first
                async for e in events:
                    yield e

        return chained()

    # ------------------------------------------------------------------ /v1/completions
    async def _completions(self, body: CompletionRequest, request):
        self._check_model(body.model)
        if body.suffix:
            raise ApiError("suffix is not supported by this model", 400, "suffix")
        top_n = body.logprobs
        if top_n is not None and not 0 <= top_n <= MAX_LOGPROBS:
            raise ApiError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {top_n}", 400, "logprobs")
        extra = {} if top_n is None else {"logprobs": top_n}
        raw = body.prompt
        batch = raw if isinstance(raw, list) and raw and isinstance(raw[0], (str, list)) else [raw]
        prompts = []
        for p in batch:
            ids = self._tokenize(p)
            text = p if isinstance(p, str) else None
            prompts.append(_Prompt(ids, text, self._sampling(body, ids, body.max_tokens, extra)))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def echo(i: int) -> str:
            if not body.echo:
                return ""
            p = prompts[i]
            return p.text if p.text is not None else self.engine.tokenizer.decode(p.ids) \
                if self.engine.tokenizer is not None else ""

        usage = [_Usage() for _ in prompts]
        offsets = [len(echo(i)) for i in range(len(prompts))]  # text_offset of the next token, per choice

        def choice(i, text, reason, ids=(), logprobs=None):
            lp = None
            if top_n is not None:
                lp = self._completion_logprobs(list(ids), logprobs or [], top_n, offsets[i])
                offsets[i] += sum(len(t) for t in lp["tokens"])
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def events():
                started = set()
                async for i, c in self._merged(prompts, request, stream=True):
                    usage[i].prompt_tokens = c.num_input_tokens
                    usage[i].completion_tokens += c.num_output_tokens
                    text = (echo(i) if i not in started else "") + c.text
                    if not text and not c.final and top_n is None:  # tokens that do not decode to text yet
                        continue
                    started.add(i)
                    event = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                             "choices": [choice(i, text, c.finish_reason if c.final else None, c.token_ids,
                                                c.logprobs)]}
                    if include_usage:
                        event["usage"] = None
                    yield event
                if include_usage:
                    yield {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                           "choices": [], "usage": _sum_usage(usage)}

            return self._sse(await self._first_or_error(events()))

        texts, reasons = [""] * len(prompts), [None] * len(prompts)
        ids, logprobs = [[] for _ in prompts], [[] for _ in prompts]
        async for i, c in self._merged(prompts, request, stream=False):
            texts[i] += c.text
            ids[i] += c.token_ids
            logprobs[i] += c.logprobs or []
            usage[i].prompt_tokens = c.num_input_tokens
            usage[i].completion_tokens += c.num_output_tokens
            if c.final:
                reasons[i] = c.finish_reason
        if any(r is None for r in reasons):  # the client left: nobody reads this
            return None
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": [choice(i, echo(i) + texts[i], reasons[i], ids[i], logprobs[i])
                            for i in range(len(prompts))],
                "usage": _sum_usage(usage)}

    # ------------------------------------------------------------------ /v1/chat/completions
    def _chat_prompt(self, body: ChatRequest) -> tuple[_Prompt, _ChatState]:
        if self.chat_template is None:
            raise ApiError("this model has no chat template (chat_template.jinja, or chat_template in "
                           "tokenizer_config.json); start the server with --chat-template FILE, or use "
                           "/v1/completions", 400)
        if body.top_logprobs is not None and not (body.logprobs and 0 <= body.top_logprobs <= MAX_LOGPROBS):
            raise ApiError(f"top_logprobs must be in [0, {MAX_LOGPROBS}] and needs logprobs: true", 400,
                           "top_logprobs")
        if body.response_format not in (None, {"type": "text"}):
            raise ApiError("response_format other than text is not supported by this server (no guided decoding)",
                           400, "response_format")
        tools = body.tools or None
        choice = body.tool_choice
        if isinstance(choice, NamedToolChoice):
            named = [t for t in tools or [] if (t.get("function") or {}).get("name") == choice.function.name]
            if not named:
                raise ApiError(f"tool_choice names '{choice.function.name}', which is not in tools", 400,
                               "tool_choice")
            tools = named
        elif choice == "required" and not tools:
            raise ApiError("tool_choice 'required' needs tools", 400, "tool_choice")
        parse_tools = self.tool_call_parser and tools is not None and choice != "none"
        forced = self._forced_call(body, parse_tools)
        parts: list[tuple[str, bytes]] = []
        try:
            kwargs = template_kwargs(body.chat_template_kwargs)
            messages = _template_messages(body.messages, parts)
            text = self.chat_template.render(messages, tools=tools, add_generation_prompt=body.add_generation_prompt,
                                             **kwargs)
            if forced and starts_in_reasoning(text):  # the call must not land inside a pre-opened think block
                text = self.chat_template.render(messages, tools=tools, add_generation_prompt=True,
                                                 **{**kwargs, "thinking_mode": "disabled"})
                if starts_in_reasoning(text):  # a template that ignores thinking_mode: close the block itself
                    text += THINK_END + "\n"
            text += forced
        except ChatTemplateError as e:
            raise ApiError(str(e), 400, "messages") from None
        media: tuple = ()
        if parts:  # markers -> one placeholder per image / video token, before tokenizing
            try:
                expanded, items = prepare_media(self.engine.config, text, [b for k, b in parts if k == "image"],
                                                [b for k, b in parts if k == "video"],
                                                settings=media_settings(self.engine))
            except MediaError as e:
                raise ApiError(str(e), 400, "messages") from None
            ids, media = self._tokenize(expanded), tuple(items)
        else:
            ids = self._tokenize(text)
        extra = {"logprobs": body.top_logprobs or 0} if body.logprobs else {}
        if self.markers_are_special and (self.reasoning_parser or parse_tools) \
                and "skip_special_tokens" not in body.model_fields_set:
            extra["skip_special_tokens"] = False
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        prompt = _Prompt(ids, text, self._sampling(body, ids, max_tokens, extra), media)
        state = _ChatState(ReasoningParser(starts_in_reasoning(text)) if self.reasoning_parser else None,
                           ToolCallParser(tools) if parse_tools else None, body.include_reasoning,
                           body.top_logprobs or 0 if body.logprobs else None, forced)
        return prompt, state

    def _forced_call(self, body: ChatRequest, parse_tools: bool) -> str:
        """``tool_choice`` "required" or a named function is enforced by ending the prompt with the start of a
        call (``forced_call_prefix``), so the model can only continue it; "" for auto / none."""
        choice = body.tool_choice
        if choice != "required" and not isinstance(choice, NamedToolChoice):
            return ""
        what = "'required'" if choice == "required" else f"naming '{choice.function.name}'"
        if not parse_tools:
            raise ApiError(f"tool_choice {what} needs the tool-call parser; this server runs with "
                           "--tool-call-parser none", 400, "tool_choice")
        if not body.add_generation_prompt:
            raise ApiError(f"tool_choice {what} starts the assistant's reply with a tool call and needs "
                           "add_generation_prompt: true", 400, "tool_choice")
        if choice == "required":
            return forced_call_prefix()
        name = choice.function.name
        if not name or any(ch in name for ch in '"<>\n'):
            raise ApiError(f"tool_choice names {name!r}, which cannot be written in M3's tool-call markup", 400,
                           "tool_choice")
        return forced_call_prefix(name)

    def _parse(self, state: _ChatState, text: str, final: bool) -> dict:
        """One chunk of generated text -> a delta: content, reasoning_content and/or tool_calls. A parser bug
        must not end the response: the text then goes out as plain content, unparsed from there on. A forced
        call start (``_forced_call``) goes in front of the first chunk, as if the model had written it."""
        if state.forced:
            text, state.forced = state.forced + text, ""
        try:
            return self._parse_unguarded(state, text, final)
        except Exception:  # noqa: BLE001
            log.exception("output parser failed; passing the rest of this response through as text")
            state.reasoning = state.tools = None
            return {"content": text} if text else {}

    def _parse_unguarded(self, state: _ChatState, text: str, final: bool) -> dict:
        delta: dict[str, Any] = {}
        content, reasoning = text, ""
        if state.reasoning is not None:
            d = state.reasoning.feed(text)
            if final:
                end = state.reasoning.finish()
                d.reasoning, d.content = d.reasoning + end.reasoning, d.content + end.content
            content, reasoning = d.content, d.reasoning
        if reasoning and state.include_reasoning:
            delta["reasoning_content"] = reasoning
        if state.tools is not None:
            t = state.tools.feed(content)
            if final:
                end = state.tools.finish()
                t.content, t.calls, t.errors = t.content + end.content, t.calls + end.calls, t.errors + end.errors
            for err in t.errors:
                log.warning("tool-call markup returned as content: %s", err)
            content = t.content
            calls = []
            for c in t.calls:
                entry: dict[str, Any] = {"index": c.index}
                if c.name is not None:
                    state.call_ids[c.index] = f"call_{uuid.uuid4().hex[:24]}"
                    state.num_calls += 1
                    entry.update(id=state.call_ids[c.index], type="function")
                    entry["function"] = {"name": c.name, "arguments": c.arguments}
                else:
                    entry["function"] = {"arguments": c.arguments}
                calls.append(entry)
            if calls:
                delta["tool_calls"] = calls
        if content:
            delta["content"] = content
        return delta

    def _token_text(self, token_id: int) -> str:
        """A token as text for logprobs; a token that is no text on its own (part of a UTF-8 character, or no
        tokenizer) is spelled ``token_id:N``, as vLLM's ``--return-tokens-as-token-ids`` does."""
        tok = self.engine.tokenizer
        text = tok.decode([token_id], skip_special_tokens=False) if tok is not None else ""
        return text if text and "\ufffd" not in text else f"token_id:{token_id}"

    def _completion_logprobs(self, ids: list[int], logprobs: list[dict[int, float]], top_n: int,
                             offset: int) -> dict:
        """The legacy completions shape: parallel lists of tokens, their logprobs, the top tokens, offsets."""
        tokens = [self._token_text(t) for t in ids]
        starts = [offset + sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [lp[t] for t, lp in zip(ids, logprobs)],
                "top_logprobs": [{self._token_text(k): v for k, v in _top(lp, top_n)} for lp in logprobs],
                "text_offset": starts}

    def _chat_logprobs(self, state: _ChatState, ids: list[int], logprobs: list[dict[int, float]] | None):
        """The chat shape: one entry per generated token with its top alternatives (raw tokens, before the
        reasoning and tool-call parsers, as vLLM reports them)."""
        if state.top_logprobs is None:
            return None

        def entry(token_id: int, value: float) -> dict:
            text = self._token_text(token_id)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        return {"content": [{**entry(t, lp[t]), "top_logprobs": [entry(k, v) for k, v in _top(lp, state.top_logprobs)]}
                            for t, lp in zip(ids, logprobs or [])]}

    @staticmethod
    def _finish_reason(state: _ChatState, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and state.num_calls else reason

    async def _chat(self, body: ChatRequest, request):
        self._check_model(body.model)
        driver = self.driver
        if driver is not None and _has_media(body.messages):  # long decodes: not on the event loop
            prompt, state = await asyncio.get_running_loop().run_in_executor(driver.media_executor,
                                                                             self._chat_prompt, body)
        else:
            prompt, state = self._chat_prompt(body)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        usage = _Usage(prompt_tokens=len(prompt.ids))

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def event(delta: dict, reason: str | None, logprobs: dict | None = None) -> dict:
                e = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                     "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}
                if include_usage:
                    e["usage"] = None
                return e

            async def events():
                async with aclosing(self._run(prompt, request, stream=True)) as chunks:
                    started = False
                    async for c in chunks:
                        if not started:  # only now: errors before any output stay plain HTTP errors
                            yield event({"role": "assistant", "content": ""}, None)
                            started = True
                        usage.completion_tokens += c.num_output_tokens
                        delta = self._parse(state, c.text, c.final)
                        lp = self._chat_logprobs(state, c.token_ids, c.logprobs)
                        if delta or (lp and lp["content"]):
                            yield event(delta, None, lp)
                        if c.final:
                            yield event({}, self._finish_reason(state, c.finish_reason))
                if include_usage:
                    yield {"id": rid, "object": "chat.completion.chunk", "created": created,
                           "model": self.model_name, "choices": [], "usage": usage.as_dict()}

            return self._sse(await self._first_or_error(events()))

        text, reason, ids, logprobs = "", None, [], []
        async with aclosing(self._run(prompt, request, stream=False)) as chunks:
            async for c in chunks:
                text += c.text
                ids += c.token_ids
                logprobs += c.logprobs or []
                usage.completion_tokens += c.num_output_tokens
                if c.final:
                    reason = c.finish_reason
        if reason is None:  # the client left
            return None
        delta = self._parse(state, text, True)
        if state.tools is not None and body.tool_choice not in (None, "auto", "none") and not state.num_calls:
            log.warning("tool_choice=%s forced the start of a call, but the model's markup did not make one "
                        "(returned as content)", body.tool_choice)
        message = {"role": "assistant", "content": delta.get("content") or (None if state.num_calls else ""),
                   "reasoning_content": delta.get("reasoning_content"),
                   "tool_calls": [{"id": c["id"], "type": "function", "function": c["function"]}
                                  for c in _merge_calls(delta.get("tool_calls", []))]}
        return {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": [{"index": 0, "message": message,
                             "logprobs": self._chat_logprobs(state, ids, logprobs),
                             "finish_reason": self._finish_reason(state, reason)}],
                "usage": usage.as_dict()}


def _merge_calls(deltas: list[dict]) -> list[dict]:
    """Tool-call deltas of one parse -> whole calls (name once, arguments concatenated)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        c = calls.setdefault(d["index"], {"id": None, "function": {"name": None, "arguments": ""}})
        if "id" in d:
            c["id"] = d["id"]
            c["function"]["name"] = d["function"]["name"]
        c["function"]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def _top(logprobs: dict[int, float], n: int) -> list[tuple[int, float]]:
    """The n most likely of a position's {token: logprob} (which also holds the sampled token)."""
    return sorted(logprobs.items(), key=lambda kv: -kv[1])[:n]


def _sum_usage(usage: list[_Usage]) -> dict:
    return _Usage(sum(u.prompt_tokens for u in usage), sum(u.completion_tokens for u in usage)).as_dict()


MEDIA_PARTS = {"image_url": ("image", IMAGE_TOKEN, ("image",)),
               "video_url": ("video", VIDEO_TOKEN, ("video", "image"))}  # an animated GIF / WebP is a video too


def _has_media(messages: list[dict]) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list) and
               any(isinstance(p, dict) and p.get("type") in MEDIA_PARTS for p in m["content"]) for m in messages)


def _template_messages(messages: list[dict], media: list[tuple[str, bytes]] | None = None) -> list[dict]:
    """OpenAI messages -> what chat templates read: text parts joined into one string, tool-call arguments
    parsed from their JSON string (templates iterate over them). ``image_url`` / ``video_url`` parts (vLLM's
    shape; data: URLs only) become the image / video marker in the text, (kind, bytes) appended to ``media``."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise ApiError(f"messages[{i}] needs a string 'role'", 400, "messages")
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if media is not None and kind in MEDIA_PARTS:
                    what, marker, mime = MEDIA_PARTS[kind]
                    url = part.get(kind)
                    url = url.get("url") if isinstance(url, dict) else url
                    try:
                        media.append((what, decode_data_url(url, f"messages[{i}].content {kind}", mime)))
                    except MediaError as e:
                        raise ApiError(str(e), 400, "messages") from None
                    texts.append(marker)
                    continue
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ApiError(f"messages[{i}].content: only text, image_url and video_url parts are supported, "
                                   f"got {kind!r}", 400,
                                   "messages")
                texts.append(part["text"])
            m["content"] = "\n".join(texts)
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for c in calls:
                c = dict(c) if isinstance(c, dict) else c
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        c["function"] = {**fn, "arguments": json.loads(fn["arguments"])}
                    except ValueError:
                        pass
                fixed.append(c)
            m["tool_calls"] = fixed
        out.append(m)
    return out
