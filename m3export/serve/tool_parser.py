"""M3's tool-call markup -> OpenAI ``tool_calls``, streamed.

Every structural tag carries the namespace marker ``]<]minimax[>[`` in front of it::

    ]<]minimax[>[<tool_call>
    ]<]minimax[>[<invoke name="get_weather">
    ]<]minimax[>[<city>Paris]<]minimax[>[</city>
    ]<]minimax[>[<days>]<]minimax[>[<item>1]<]minimax[>[</item>]<]minimax[>[<item>2]<]minimax[>[</item>
    ]<]minimax[>[</days>
    ]<]minimax[>[</invoke>
    ]<]minimax[>[</tool_call>

Parameters are named by their own tags; nested tags are objects, repeated ``<item>`` children are arrays, an empty
tag is an empty value. A block may hold several invokes; text may come before and after it. Values are typed by
the tool's JSON schema (integer, number, boolean, array, object, string); without one a value that parses as JSON
is that JSON value, else the raw string (inner whitespace and unicode kept).

Streaming: a call's name goes out as soon as its ``<invoke name=...>`` tag is complete, and its ``arguments`` grow
one top-level parameter at a time (``{"city": "Paris"``, then ``, "days": [1, 2]``, then ``}``), so the deltas
of one call always concatenate to the JSON object of all its parameters. A partial marker at the end of a chunk
is held back, so any chunking of the same text yields the same calls and content. Markup that turns out
malformed, or is cut off by the end of the output, never raises: the part not yet reported as a call goes back
as content (a call already announced is closed with what it had) and ``errors`` says what went wrong.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .reasoning_parser import partial_marker_suffix

NAMESPACE = "]<]minimax[>["
TOOL_CALL_START = NAMESPACE + "<tool_call>"
TOOL_CALL_END = NAMESPACE + "</tool_call>"
INVOKE_START = NAMESPACE + "<invoke"
INVOKE_END = NAMESPACE + "</invoke>"
ELEMENT_START = NAMESPACE + "<"
ELEMENT_END = NAMESPACE + "</"
ARRAY_ITEM = "item"



def forced_call_prefix(name: str | None = None) -> str:
    """The start of a tool call block that a prompt may end with, so that the reply can only continue a call.

    This is how ``tool_choice`` "required" (``name`` None: the model still picks the function, the prefix stops
    inside ``<invoke name="``) and a named function (the whole ``<invoke name="NAME">`` tag) are enforced without
    guided decoding. The layout (a newline after each tag) is the one of the markup example above.
    """
    head = f"{TOOL_CALL_START}\n{INVOKE_START} name=\""
    return head if name is None else f"{head}{name}\">\n"


_INVOKE_HEADER = re.compile(r"""<invoke\s+name\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s>"']+))\s*>""")
_TAG_NAME = re.compile(r"[^\s<>/]+")


@dataclass
class ToolCallDelta:
    """A piece of call ``index``: the name (first piece only) and/or more ``arguments`` text."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolParseDelta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass
class _Element:
    name: str
    text: str = ""
    children: list[_Element] = field(default_factory=list)


class _Malformed(Exception):
    pass


def tool_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """OpenAI ``tools`` (``{"type": "function", "function": {"name", "parameters"}}``) -> name -> parameters."""
    out = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


def _schema_type(schema: dict | None) -> str | None:
    if not isinstance(schema, dict):
        return None
    t = schema.get("type")
    if isinstance(t, list):  # ["integer", "null"]: the first non-null type decides
        t = next((x for x in t if x != "null"), None)
    if t is None and isinstance(schema.get("properties"), dict):
        return "object"
    return t if isinstance(t, str) else None


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _scalar(text: str, kind: str | None) -> Any:
    """A text-only element's value for a schema type (None: no schema)."""
    stripped = text.strip()
    if kind == "string":
        return text
    if not stripped:
        return {"array": [], "object": {}}.get(kind, "") if kind else ""
    try:
        if kind == "integer":
            return int(stripped)
        if kind == "number":
            value = float(stripped)
            return int(value) if value.is_integer() and re.fullmatch(r"-?\d+", stripped) else value
        if kind == "boolean":
            if stripped.lower() in ("true", "false"):
                return stripped.lower() == "true"
            raise ValueError
        if kind in ("array", "object"):
            value = json.loads(stripped)
            if isinstance(value, list if kind == "array" else dict):
                return value
            raise ValueError
        if kind == "null" and stripped.lower() in ("null", "none"):
            return None
    except ValueError:
        pass
    return _json_or_text(stripped) if kind not in (None, "string") else _json_or_text(text)


def _value(el: _Element, schema: dict | None) -> Any:
    kind = _schema_type(schema)
    if not el.children:
        return _scalar(el.text, kind)
    if el.text.strip():
        raise _Malformed(f"parameter <{el.name}> mixes text {el.text.strip()[:40]!r} with nested tags")
    is_array = kind == "array" or (kind is None and all(c.name == ARRAY_ITEM for c in el.children))
    if is_array:
        item_schema = schema.get("items") if isinstance(schema, dict) else None
        return [_value(c, item_schema) for c in el.children]
    props = schema.get("properties", {}) if isinstance(schema, dict) else {}
    extra = schema.get("additionalProperties") if isinstance(schema, dict) else None
    out: dict[str, Any] = {}
    for c in el.children:
        v = _value(c, props.get(c.name, extra if isinstance(extra, dict) else None))
        if c.name in out:  # a repeated tag inside an object is a list of its values
            out[c.name] = (out[c.name] if isinstance(out[c.name], list) else [out[c.name]]) + [v]
        else:
            out[c.name] = v
    return out


class ToolCallParser:
    """Feed generated content (reasoning already split off); get content and tool-call deltas back."""

    def __init__(self, tools: list[dict] | None = None):
        self._schemas = tool_schemas(tools)
        self._buffer = ""
        self._state = "text"  # text | block | invoke
        self._num_calls = 0
        self._block_has_calls = False
        self._block_raw = ""  # the block's markup consumed while nothing of it was reported as a call
        self._call_name = ""
        self._num_params = 0
        self._stack: list[_Element] = []
        self._param_raw = ""  # markup of the top-level parameter being read

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def feed(self, text: str) -> ToolParseDelta:
        out = ToolParseDelta()
        self._buffer += text
        self._drain(out)
        return out

    def finish(self) -> ToolParseDelta:
        """End of output: held-back text is content; an unfinished block is reported as truncated (and what
        follows its failure point is read as text again, which may open and cut off another block)."""
        out = ToolParseDelta()
        while self._state != "text":
            self._recover(out, f"the output ended inside a tool call block ({self._state})")
            self._drain(out)
        out.content += self._buffer
        self._buffer = ""
        return out

    def _drain(self, out: ToolParseDelta) -> None:
        """Consume what the buffer allows; malformed markup becomes content and parsing goes on after it."""
        while True:
            try:
                while self._step(out):
                    pass
                return
            except _Malformed as e:
                self._recover(out, str(e))

    # ------------------------------------------------------------------ states
    def _step(self, out: ToolParseDelta) -> bool:
        """Consume what the buffer allows; False when more text is needed."""
        if self._state == "text":
            return self._text(out)
        if self._state == "block":
            return self._block(out)
        return self._invoke(out)

    def _text(self, out: ToolParseDelta) -> bool:
        at = self._buffer.find(TOOL_CALL_START)
        if at < 0:
            keep = partial_marker_suffix(self._buffer, TOOL_CALL_START)
            out.content += self._buffer[:len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return False
        out.content += self._buffer[:at]
        self._consume(at + len(TOOL_CALL_START))
        self._block_raw, self._block_has_calls = TOOL_CALL_START, False
        self._state = "block"
        return True

    def _block(self, out: ToolParseDelta) -> bool:
        body = self._buffer.lstrip()
        if not body:
            return False
        if body.startswith(TOOL_CALL_END):
            self._consume(len(self._buffer) - len(body) + len(TOOL_CALL_END))
            self._state = "text"
            return True
        if body.startswith(INVOKE_START):
            close = body.find(">", len(NAMESPACE))
            if close < 0:
                return self._need_more(body)
            header = _INVOKE_HEADER.fullmatch(body[len(NAMESPACE):close + 1])
            if header is None or not next(g for g in header.groups() if g is not None).strip():
                raise _Malformed(f"bad invoke tag {body[:close + 1]!r}")
            self._consume(len(self._buffer) - len(body) + close + 1)
            self._call_name = next(g for g in header.groups() if g is not None).strip()
            out.calls.append(ToolCallDelta(self._num_calls, name=self._call_name))
            self._num_calls += 1
            self._block_has_calls, self._block_raw = True, ""
            self._num_params, self._stack, self._param_raw = 0, [], ""
            self._state = "invoke"
            return True
        if TOOL_CALL_END.startswith(body) or INVOKE_START.startswith(body):
            return False
        raise _Malformed(f"expected an invoke or the end of the tool call block, got {body[:40]!r}")

    def _invoke(self, out: ToolParseDelta) -> bool:
        if not self._stack:  # between top-level parameters
            body = self._buffer.lstrip()
            if not body:
                return False
            if body.startswith(INVOKE_END):
                self._consume(len(self._buffer) - len(body) + len(INVOKE_END))
                out.calls.append(ToolCallDelta(self._num_calls - 1, arguments="}" if self._num_params else "{}"))
                self._state = "block"
                return True
            if not body.startswith(ELEMENT_START):
                if ELEMENT_START.startswith(body):
                    return False
                raise _Malformed(f"expected a parameter tag in invoke {self._call_name!r}, got {body[:40]!r}")
            self._consume(len(self._buffer) - len(body))
        at = self._buffer.find(NAMESPACE)
        if at < 0:
            keep = partial_marker_suffix(self._buffer, NAMESPACE)
            self._add_text(self._buffer[:len(self._buffer) - keep])
            self._consume(len(self._buffer) - keep)
            return False
        self._add_text(self._buffer[:at])
        self._consume(at)
        close = self._buffer.find(">", len(NAMESPACE))
        if close < 0:
            return self._need_more(self._buffer)
        tag = self._buffer[len(NAMESPACE) + 1:close]
        closing = tag.startswith("/")
        name = tag[1:] if closing else tag
        if not _TAG_NAME.fullmatch(name):
            raise _Malformed(f"bad tag {self._buffer[:close + 1]!r} in invoke {self._call_name!r}")
        self._consume(close + 1)
        if not closing:
            self._stack.append(_Element(name))
            return True
        if not self._stack or self._stack[-1].name != name:
            expected = f"</{self._stack[-1].name}>" if self._stack else "a parameter"
            raise _Malformed(f"closing tag </{name}> where {expected} was expected in invoke {self._call_name!r}")
        el = self._stack.pop()
        if self._stack:
            self._stack[-1].children.append(el)
            return True
        schema = self._schemas.get(self._call_name, {})
        value = _value(el, schema.get("properties", {}).get(el.name) if isinstance(schema, dict) else None)
        sep = ", " if self._num_params else "{"
        out.calls.append(ToolCallDelta(self._num_calls - 1,
                                       arguments=f"{sep}{json.dumps(el.name, ensure_ascii=False)}: "
                                                 f"{json.dumps(value, ensure_ascii=False)}"))
        self._num_params += 1
        self._param_raw = ""
        return True

    # ------------------------------------------------------------------ helpers
    def _add_text(self, text: str) -> None:
        if text:
            if not self._stack:
                raise _Malformed(f"text {text[:40]!r} outside any parameter in invoke {self._call_name!r}")
            self._stack[-1].text += text

    def _need_more(self, body: str) -> bool:
        """An incomplete tag at the end of the buffer: wait, unless it is already too long to be a tag."""
        if len(body) > 4096:
            raise _Malformed(f"unterminated tag {body[:40]!r}")
        return False

    def _consume(self, n: int) -> None:
        """Drop ``n`` characters of the buffer, remembering the markup they were (to give it back if it fails)."""
        taken, self._buffer = self._buffer[:n], self._buffer[n:]
        if self._state == "block":
            self._block_raw += taken
        elif self._state == "invoke":
            self._param_raw += taken

    def _recover(self, out: ToolParseDelta, reason: str) -> None:
        """Give back as content the markup not yet reported as a call, close an announced call, go on as text."""
        out.errors.append(reason)
        if self._state == "invoke":
            out.calls.append(ToolCallDelta(self._num_calls - 1, arguments="}" if self._num_params else "{}"))
            out.content += self._param_raw
        elif self._state == "block" and not self._block_has_calls:
            out.content += self._block_raw
        self._state, self._stack, self._param_raw, self._block_raw = "text", [], "", ""
