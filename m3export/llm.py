"""Offline inference in vLLM's shape: ``LLM(path).generate(prompts, SamplingParams)`` and ``LLM.chat(messages)``.

Scripts written against vLLM's offline API run unchanged for what this runtime supports::

    from m3export import LLM, SamplingParams
    llm = LLM("art/m3", backend="onnxruntime")
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text, out[0].outputs[0].finish_reason)
    reply = llm.chat([{"role": "user", "content": "Weather in Paris?"}], tools=[...])[0].outputs[0]
    print(reply.reasoning_content, reply.content, reply.tool_calls)

Every call runs its prompts together through the paged engine (continuous batching) and returns one output per
prompt, in order. Chat outputs keep the raw ``text`` as vLLM does and add what the server's parsers make of it
(``reasoning_content``, ``content``, ``tool_calls``), so offline and served results agree.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    # Chat only: the text split by M3's reasoning and tool-call parsers.
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class GenerationOutput:
    """One prompt's result, shaped like vLLM's ``RequestOutput``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


class LLM:
    def __init__(self, model: str | Path, *, backend: str = "torch", chat_template: str | Path | None = None,
                 **engine_kwargs: Any):
        """``model``: an artifact directory, a checkpoint directory or a preset name (as ``m3export serve``
        takes); ``chat_template``: a Jinja file replacing the model's own; ``engine_kwargs`` go to the engine
        (``max_model_len``, ``num_speculative_tokens``, ``device``, ``dtype``, ...)."""
        from .serve.chat_template import ChatTemplate
        from .serve.repo import load_engine, resolve_source

        src = resolve_source(str(model), backend)
        if "dtype" in engine_kwargs and not isinstance(engine_kwargs["dtype"], str):
            engine_kwargs["dtype"] = str(engine_kwargs["dtype"]).removeprefix("torch.")
        self.engine = load_engine({"source_kind": src.kind, "source": src.location, "backend": backend,
                                   "engine_args": json.dumps(engine_kwargs)}, Path.cwd())
        model_dir = src.location if src.kind != "preset" else None
        if chat_template is not None:
            self.chat_template = ChatTemplate.from_file(chat_template, model_dir)
        else:
            self.chat_template = ChatTemplate.from_model_dir(model_dir) if model_dir else None

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params=None) -> list[GenerationOutput]:
        """``prompts``: a string, token ids, ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``, or a list
        of those; ``sampling_params``: one SamplingParams for all, or one per prompt. A dict may carry
        ``"multi_modal_data": {"image": images, "video": videos}`` (one or a list each: PIL images, uint8 arrays or
        encoded bytes; videos as [T, H, W, C] frames or a video file's bytes), placed at the prompt's
        ``]<]image[>[`` / ``]<]video[>[`` and preprocessed as the model directory's preprocessor configs say."""
        items = _prompt_list(prompts)
        prompts_in, media = [], []
        for (p, _), data in zip(items, _multi_modal(prompts, len(items))):
            if data:
                from .serve.media import media_settings, prepare_media

                p, m = prepare_media(self.engine.config, p, _as_list(data.get("image")), _as_list(data.get("video")),
                                     settings=media_settings(self.engine))
                media.append(m)
            else:
                media.append(None)
            prompts_in.append(p)
        results = self.engine.generate(prompts_in, sampling_params, media=media)
        return [GenerationOutput(r.request_id, text, list(r.prompt_token_ids),
                                 [CompletionOutput(0, r.text, list(r.token_ids), r.finish_reason, r.logprobs)])
                for (_, text), r in zip(items, results)]

    def chat(self, messages, sampling_params=None, *, tools: list[dict] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
             ) -> list[GenerationOutput]:
        """``messages``: one conversation (a list of message dicts) or a list of conversations."""
        from .serve.chat_template import template_kwargs
        from .serve.reasoning_parser import ReasoningParser, starts_in_reasoning
        from .serve.tool_parser import ToolCallParser

        if self.chat_template is None:
            raise ValueError("this model has no chat template (chat_template.jinja or tokenizer_config.json); "
                             "pass LLM(..., chat_template=FILE)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        kwargs = template_kwargs(chat_template_kwargs)
        texts = [self.chat_template.render(c, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
                 for c in conversations]
        outputs = self.generate(texts, sampling_params)
        for prompt, out in zip(texts, outputs):
            o = out.outputs[0]
            reasoning = ReasoningParser(starts_in_reasoning(prompt))
            r, end = reasoning.feed(o.text), reasoning.finish()
            content = r.content + end.content
            o.reasoning_content = (r.reasoning + end.reasoning) or None
            if tools:
                parser = ToolCallParser(tools)
                t, tail = parser.feed(content), parser.finish()
                content = t.content + tail.content
                calls: dict[int, dict] = {}
                for c in t.calls + tail.calls:
                    entry = calls.setdefault(c.index, {"name": None, "arguments": ""})
                    entry["name"] = c.name or entry["name"]
                    entry["arguments"] += c.arguments
                o.tool_calls = [calls[i] for i in sorted(calls)]
                if o.tool_calls and o.finish_reason == "stop":
                    o.finish_reason = "tool_calls"
            o.content = content
        return outputs


def _as_list(x) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _multi_modal(prompts, n: int) -> list[dict | None]:
    """Each prompt's ``multi_modal_data`` (None for plain prompts), in ``_prompt_list`` order."""
    one = isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts
                                               and all(isinstance(t, int) for t in prompts))
    listed = [prompts] if one else list(prompts)
    out = [p.get("multi_modal_data") if isinstance(p, dict) else None for p in listed]
    if len(out) != n:  # pragma: no cover - both walk the same list
        raise AssertionError("prompt list mismatch")
    for d in out:
        if d is not None and (not isinstance(d, dict) or set(d) - {"image", "video"}):
            raise ValueError(f"multi_modal_data takes 'image' and 'video', got {d!r:.80}")
    return out


def _prompt_list(prompts) -> list[tuple[str | list[int], str | None]]:
    """Normalize to [(prompt for the engine, prompt text or None)]."""
    def one(p):
        if isinstance(p, str):
            return p, p
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                return list(p["prompt_token_ids"]), p.get("prompt")
            if "prompt" in p:
                return p["prompt"], p["prompt"]
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(p)}")
        if isinstance(p, Sequence) and all(isinstance(t, int) for t in p):
            return list(p), None
        raise ValueError(f"a prompt is a string, token ids or a dict, got {type(p).__name__}")

    if isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts
                                            and all(isinstance(t, int) for t in prompts)):
        return [one(prompts)]
    return [one(p) for p in prompts]
