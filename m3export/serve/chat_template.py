"""The model's chat template, rendered with Jinja the way ``transformers``' ``apply_chat_template`` renders it.

Where it comes from: ``chat_template.jinja`` next to the weights, else the ``chat_template`` entry of
``tokenizer_config.json`` (a string, or a list of named templates: ``tool_use`` when tools are given, else
``default``), else a file given explicitly. Rendering matches ``transformers`` so that a prompt built here is the
prompt the model was trained on: a sandboxed environment with ``trim_blocks`` / ``lstrip_blocks`` and loop
controls; ``tojson`` without HTML escaping; ``raise_exception`` and ``strftime_now``; the special tokens of
``tokenizer_config.json`` (``bos_token``, ``eos_token``, ...) as variables; ``messages``, ``tools``,
``add_generation_prompt`` and any extra keyword (a request's ``chat_template_kwargs``) as variables too. A
message's reasoning (``reasoning_content``, ``reasoning`` or ``thinking``) is also visible as ``reasoning_content``
and ``thinking``, as transformers aliases it.

M3's template reads ``thinking_mode`` (``enabled`` / ``adaptive`` / ``disabled``); clients that only know the
boolean ``enable_thinking`` get it mapped (``template_kwargs``).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from ..errors import M3Error

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
THINKING_MODES = ("enabled", "adaptive", "disabled")
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


class ChatTemplateError(M3Error):
    """No usable template, or the template refused the conversation (its ``raise_exception``)."""


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts ({"content": ...})."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_tokens(config: dict) -> dict[str, str]:
    out = {}
    for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        text = _token_text(config.get(key))
        if text is not None:
            out[key] = text
    return out


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's ``chat_template_kwargs`` with ``enable_thinking`` mapped to M3's ``thinking_mode``."""
    out = dict(kwargs or {})
    if "thinking_mode" in out:
        if out["thinking_mode"] not in THINKING_MODES:
            raise ChatTemplateError(f"chat_template_kwargs.thinking_mode must be one of {', '.join(THINKING_MODES)}, "
                                    f"got {out['thinking_mode']!r}")
    elif "enable_thinking" in out:
        if not isinstance(out["enable_thinking"], bool):
            raise ChatTemplateError(f"chat_template_kwargs.enable_thinking must be a boolean, "
                                    f"got {out['enable_thinking']!r}")
        out["thinking_mode"] = "enabled" if out["enable_thinking"] else "disabled"
    return out


class ChatTemplate:
    def __init__(self, source: str, where: str, special_tokens: dict[str, str] | None = None,
                 tool_source: str | None = None):
        """``source``: the Jinja text; ``where``: a description for messages (a path); ``tool_source``: a
        separate template for requests that carry tools (tokenizer_config.json's ``tool_use``)."""
        self.source = source
        self.where = where
        self.special_tokens = dict(special_tokens or {})
        self._tool_source = tool_source

    # ------------------------------------------------------------------ finding it
    @classmethod
    def from_model_dir(cls, path: str | Path) -> ChatTemplate | None:
        """The template a model directory (artifact or checkpoint) ships, or None if it has none."""
        path = Path(path)
        config = cls._read_config(path / TOKENIZER_CONFIG) if (path / TOKENIZER_CONFIG).is_file() else {}
        specials = _special_tokens(config)
        if (path / TEMPLATE_FILE).is_file():
            return cls((path / TEMPLATE_FILE).read_text(encoding="utf-8"), str(path / TEMPLATE_FILE), specials)
        entry = config.get("chat_template")
        where = f"{path / TOKENIZER_CONFIG} (chat_template)"
        if isinstance(entry, str):
            return cls(entry, where, specials)
        if isinstance(entry, list):
            named = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
            if not isinstance(named.get("default"), str):
                raise ChatTemplateError(f"{where}: a list of templates needs one named 'default'; "
                                        f"found {sorted(str(k) for k in named)}")
            tool_use = named.get("tool_use")
            return cls(named["default"], where, specials, tool_use if isinstance(tool_use, str) else None)
        if entry is not None:
            raise ChatTemplateError(f"{where}: expected a string or a list of {{name, template}}, "
                                    f"got {type(entry).__name__}")
        return None

    @classmethod
    def from_file(cls, file: str | Path, model_dir: str | Path | None = None) -> ChatTemplate:
        """An explicit template file; the special tokens still come from the model's tokenizer_config.json."""
        file = Path(file)
        if not file.is_file():
            raise ChatTemplateError(f"{file}: no such chat template file")
        config_path = Path(model_dir) / TOKENIZER_CONFIG if model_dir is not None else None
        config = cls._read_config(config_path) if config_path is not None and config_path.is_file() else {}
        return cls(file.read_text(encoding="utf-8"), str(file), _special_tokens(config))

    @staticmethod
    def _read_config(path: Path) -> dict:
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ChatTemplateError(f"{path}: cannot read it as JSON ({e})") from None
        if not isinstance(config, dict):
            raise ChatTemplateError(f"{path}: expected a JSON object, got {type(config).__name__}")
        return config

    # ------------------------------------------------------------------ rendering
    @cached_property
    def _environment(self):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env

    def _compiled(self, tools: bool):
        import jinja2

        source = self._tool_source if tools and self._tool_source else self.source
        cache = self.__dict__.setdefault("_cache", {})
        if source not in cache:
            try:
                cache[source] = self._environment.from_string(source)
            except jinja2.TemplateSyntaxError as e:
                raise ChatTemplateError(f"{self.where}: not a valid Jinja template (line {e.lineno}: {e.message})") \
                    from None
        return cache[source]

    def render(self, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        """The prompt text for ``messages``; extra keywords become template variables (they override the
        special tokens of the same name, as in transformers)."""
        import jinja2

        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ChatTemplateError("messages must be a list of objects")
        variables = {**self.special_tokens, **kwargs}
        try:
            return self._compiled(bool(tools)).render(
                messages=[_with_reasoning_aliases(m) for m in messages], tools=tools or None,
                add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template ({self.where}) rejected the conversation: {e}") from None


def _with_reasoning_aliases(message: dict) -> dict:
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}
