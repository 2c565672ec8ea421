"""The served model's request contract without a server: Triton's vLLM-backend names, defaults and errors."""

import json

import numpy as np
import pytest

from m3export.runtime import RequestOutput, SamplingParams
from m3export.serve.protocol import (
    GenerateRequest,
    RequestError,
    chunk_for,
    parse_request,
    prompt_text,
    sampling_params,
)


def text(s: str) -> np.ndarray:
    return np.array([s.encode()], dtype=np.object_)


def flag(v: bool) -> np.ndarray:
    return np.array([v])


def test_text_request_defaults_follow_vllm():
    req = parse_request({"text_input": text("héllo")})
    assert req.prompt == "héllo" and not req.stream and not req.exclude_input and req.sampling == {}
    streaming = parse_request({"text_input": text("x"), "stream": flag(True)})
    assert streaming.stream and streaming.exclude_input  # streamed responses carry only new text


def test_token_ids_request():
    req = parse_request({"input_ids": np.array([[1, 2, 3]], dtype=np.int64)})
    assert req.prompt == [1, 2, 3]
    with pytest.raises(RequestError, match="INT64"):
        parse_request({"input_ids": np.array([1.5])})


@pytest.mark.parametrize("inputs, match", [
    ({}, "neither"),
    ({"stream": flag(True)}, "neither"),
    ({"text_input": text("a"), "input_ids": np.array([1])}, "both"),
    ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "exactly one element"),
    ({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}, "UTF-8"),
    ({"text_input": text("a"), "stream": flag(True), "exclude_input_in_output": flag(False)}, "streaming"),
    ({"text_input": text("a"), "sampling_parameters": text("{max_tokens: 3")}, "not valid JSON"),
    ({"text_input": text("a"), "sampling_parameters": text("[1, 2]")}, "JSON object"),
    ({"text_input": text("a"), "sampling_parameters": text('{"max_token": 3}')}, "unknown key.*'max_token'"),
    ({"text_input": text("a"), "sampling_parameters": text('{"max_tokens": "many"}')}, "'max_tokens' must be an"),
    ({"text_input": text("a"), "sampling_parameters": text('{"temperature": true}')}, "'temperature' must be a"),
    ({"text_input": text("a"), "sampling_parameters": text('{"stop": [1]}')}, "'stop' must be a string"),
])
def test_bad_requests_are_request_errors(inputs, match):
    with pytest.raises(RequestError, match=match):
        parse_request(inputs)


def test_sampling_parameters_coercion_and_precedence():
    """Request parameters (how the generate endpoint passes extra JSON fields) may be strings and may hold
    fields that are not ours; the sampling_parameters input wins over them; vLLM's top_k=-1 means 'off' (0)."""
    params = json.dumps({"max_tokens": "5", "temperature": "0.5", "id": "client-7", "priority": 1})
    sp = json.dumps({"temperature": 0.25, "top_k": -1, "stop": "\n", "seed": 7, "ignore_eos": "true"})
    req = parse_request({"text_input": text("a"), "sampling_parameters": text(sp)}, params)
    assert req.sampling == {"max_tokens": 5, "temperature": 0.25, "top_k": 0, "stop": ("\n",), "seed": 7,
                            "ignore_eos": True}
    assert sampling_params(req) == SamplingParams(max_tokens=5, temperature=0.25, stop="\n", seed=7, ignore_eos=True)
    with pytest.raises(RequestError, match="request parameters: 'seed' must be an integer"):
        parse_request({"text_input": text("a")}, json.dumps({"seed": "x"}))


def test_out_of_range_values_fail_at_sampling_params():
    req = parse_request({"text_input": text("a"), "sampling_parameters": text('{"top_p": 1.5}')})
    with pytest.raises(RequestError, match="top_p"):
        sampling_params(req)


def _out(finished, new_ids, new_text, ids=(5, 6), txt="ab"):
    return RequestOutput("r", [1, 2], list(ids), txt, list(new_ids), new_text, finished,
                         "length" if finished else None)


def test_chunks_stream_deltas_and_final_flag():
    req = GenerateRequest("hi", {}, stream=True, exclude_input=True)
    c = chunk_for(req, _out(False, [5], "a"), "")
    assert (c.text, c.token_ids, c.final) == ("a", [5], False)
    last = chunk_for(req, _out(True, [], ""), "")
    assert (last.text, last.token_ids, last.final) == ("", [], True)  # the final flag always goes out
    assert chunk_for(req, _out(False, [], ""), "") is None


def test_non_streaming_sends_once_with_or_without_prompt():
    with_prompt = GenerateRequest("hi", {}, stream=False, exclude_input=False)
    assert chunk_for(with_prompt, _out(False, [5], "a"), "hi") is None
    c = chunk_for(with_prompt, _out(True, [6], "b"), "hi")
    assert (c.text, c.token_ids, c.final) == ("hiab", [1, 2, 5, 6], True)
    c = chunk_for(GenerateRequest("hi", {}, stream=False, exclude_input=True), _out(True, [6], "b"), "hi")
    assert (c.text, c.token_ids) == ("ab", [5, 6])


def test_prompt_text_for_token_prompts():
    class Tok:
        def decode(self, ids):
            return "".join(chr(96 + i) for i in ids)

    assert prompt_text(GenerateRequest("as sent", {}, False, False), [9], Tok()) == "as sent"
    assert prompt_text(GenerateRequest([1, 2], {}, False, False), [1, 2], Tok()) == "ab"
    assert prompt_text(GenerateRequest([1, 2], {}, False, False), [1, 2], None) == ""
