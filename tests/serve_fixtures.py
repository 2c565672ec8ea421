"""Shared pieces of the serving tests: an M3-style chat template and an engine whose replies the test controls.

``TEST_TEMPLATE`` exercises what M3's template does (role markers, ``thinking_mode`` pre-opening or closing the
reasoning block, tools rendered into the system turn, assistant tool calls in M3's markup, tool results); it is
written for these tests, not taken from the release.

``ScriptedEngine`` is the real tiny engine (paging, batching, detokenizing, stop handling all run) except that a
prompt containing ``SCRIPT[key]`` gets the byte tokens of ``scripts[key]`` followed by EOS instead of sampled
tokens: with the byte-level tokenizer any text, markup included, is a token sequence the test can force. It keeps
the decoded prompt of every scripted request (``prompts``), so a test can check what the engine was given.
"""

from __future__ import annotations

import re

from m3export.runtime import Engine

TEST_TEMPLATE = """\
{%- set ns = namespace(system='') -%}
{{- bos_token -}}
{%- if tools -%}
]~b]system
# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor -%}
[e~[
{% endif -%}
{%- for message in messages -%}
{%- if message['role'] == 'assistant' -%}
]~b]ai
{% if message.get('reasoning_content') %}<mm:think>{{ message['reasoning_content'] }}</mm:think>
{% endif %}{{ message['content'] or '' }}
{%- for call in message.get('tool_calls') or [] -%}
]<]minimax[>[<tool_call>
]<]minimax[>[<invoke name="{{ call['function']['name'] }}">
{% for k, v in call['function']['arguments'].items() %}]<]minimax[>[<{{ k }}>{{ v }}]<]minimax[>[</{{ k }}>
{% endfor %}]<]minimax[>[</invoke>
]<]minimax[>[</tool_call>
{%- endfor -%}
[e~[
{% elif message['role'] == 'tool' -%}
]~b]tool
{{ message['content'] }}[e~[
{% else -%}
]~b]{{ message['role'] }}
{{ message['content'] }}[e~[
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
]~b]ai
{% if thinking_mode is defined and thinking_mode == 'enabled' %}<mm:think>
{% elif thinking_mode is defined and thinking_mode == 'disabled' %}<mm:think></mm:think>
{% endif -%}
{%- endif -%}
"""

_DIRECTIVE = re.compile(r"SCRIPT\[(\w+)\]")


class ScriptedEngine(Engine):
    """Forces the reply of prompts that name a script; other prompts sample as usual."""

    assert hasattr(Engine, "_next_tokens"), "Engine._next_tokens (the hook this test engine overrides) is gone"

    def __init__(self, *args, scripts: dict[str, str], **kwargs):
        super().__init__(*args, **kwargs)
        self.scripts = scripts
        self._forced: dict[str, list[int] | None] = {}
        self.prompts: list[str] = []  # decoded prompts of the scripted requests, in arrival order

    def _script_for(self, req) -> list[int] | None:
        if req.request_id not in self._forced:
            keys = _DIRECTIVE.findall(self.tokenizer.decode(req.prompt_token_ids))
            if keys:
                self.prompts.append(self.tokenizer.decode(req.prompt_token_ids, skip_special_tokens=False))
            self._forced[req.request_id] = (self.tokenizer.encode(self.scripts[keys[-1]])
                                            + [self.config.eos_token_id[0]]) if keys else None
        return self._forced[req.request_id]

    def _next_tokens(self, req, s, rows):
        forced = self._script_for(req)
        if forced is None or s.drafts:
            return super()._next_tokens(req, s, rows)
        n = len(req.output_token_ids)
        return [forced[min(n, len(forced) - 1)]]
