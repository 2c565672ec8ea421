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


def test_vllm_keys_accepted_at_their_neutral_values_only():
    """What Triton's OpenAI frontend and vLLM clients send by default must pass; anything that would need a
    feature this runtime lacks must be refused, naming the key."""
    neutral = {"n": 1, "best_of": None, "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
               "min_p": 0.0, "min_tokens": 0, "use_beam_search": False, "include_stop_str_in_output": False,
               "skip_special_tokens": False, "logprobs": None, "max_tokens": 3}
    req = parse_request({"text_input": text("a"), "sampling_parameters": text(json.dumps(neutral))})
    assert req.sampling == {"skip_special_tokens": False, "logprobs": None, "max_tokens": 3, "presence_penalty": 0.0,
                            "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0}
    assert sampling_params(req) == SamplingParams(max_tokens=3, skip_special_tokens=False)
    for key, value in [("n", 2), ("min_tokens", 4), ("use_beam_search", True), ("n", True), ("best_of", 3)]:
        with pytest.raises(RequestError, match=f"'{key}'=.*not supported by this model"):
            parse_request({"text_input": text("a"), "sampling_parameters": text(json.dumps({key: value}))})
    # Triton's generate endpoint hands non-input JSON fields over as request parameters, often as strings.
    assert parse_request({"text_input": text("a")}, {"n": "1", "frequency_penalty": "0", "max_tokens": 2}).sampling \
        == {"max_tokens": 2, "frequency_penalty": 0.0}
    with pytest.raises(RequestError, match="'n'=2"):
        parse_request({"text_input": text("a")}, {"n": "2"})


def test_min_p_and_penalties_reach_the_sampler():
    """min_p and vLLM's three penalties are sampling keys now (strings as request parameters, null = default);
    out-of-range values are the request's error, naming the field."""
    raw = {"min_p": 0.05, "repetition_penalty": "1.1", "presence_penalty": 0.5, "frequency_penalty": None}
    req = parse_request({"text_input": text("a"), "sampling_parameters": text(json.dumps(raw))})
    assert sampling_params(req) == SamplingParams(min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5)
    for key, value in [("min_p", 1.5), ("presence_penalty", 3), ("repetition_penalty", 0)]:
        req = parse_request({"text_input": text("a"), "sampling_parameters": text(json.dumps({key: value}))})
        with pytest.raises(RequestError, match=f"SamplingParams.{key}"):
            sampling_params(req)


def test_return_inputs_select_outputs_that_chunks_carry():
    req = parse_request({"text_input": text("a"), "stream": flag(True), "return_finish_reason": flag(True),
                         "return_num_output_tokens": flag(True), "return_cumulative_logprob": flag(True),
                         "return_num_input_tokens": flag(False)})
    assert req.returns == {"finish_reason", "num_output_tokens", "cumulative_logprob"}
    assert req.sampling["logprobs"] == 0  # the cumulative logprob needs the sampled tokens' logprobs
    out = RequestOutput("r", [1, 2, 3], [5, 6], "ab", [6], "b", True, "stop",
                        logprobs=[{5: -0.5}, {6: -0.25, 7: -1.0}])
    c = chunk_for(req, out, "")
    assert (c.finish_reason, c.num_input_tokens, c.num_output_tokens) == ("stop", 3, 1)
    assert c.logprobs == [{6: -0.25, 7: -1.0}] and c.cumulative_logprob == -0.75
    whole = chunk_for(GenerateRequest("a", {}, stream=False, exclude_input=True), out, "")
    assert whole.num_output_tokens == 2 and whole.logprobs == out.logprobs
    running = chunk_for(req, RequestOutput("r", [1], [5], "a", [5], "a", False, None), "")
    assert running.finish_reason is None and running.cumulative_logprob is None


def test_optional_output_tensors_have_the_vllm_backend_types():
    from m3export.serve.triton_model import _optional_outputs
    from m3export.serve.protocol import Chunk, OPTIONAL_OUTPUTS

    chunk = Chunk("b", [6], True, "length", 3, 1, [{6: -0.25}], -0.75)
    arrays = _optional_outputs(chunk, frozenset(o.name for o in OPTIONAL_OUTPUTS))
    numpy_of = {"TYPE_STRING": np.object_, "TYPE_FP32": np.float32, "TYPE_UINT32": np.uint32}
    assert {o.name: numpy_of[o.dtype] for o in OPTIONAL_OUTPUTS} == {k: v.dtype.type for k, v in arrays.items()}
    assert arrays["finish_reason"][0] == b"length" and arrays["num_output_tokens"].tolist() == [1]
    assert json.loads(arrays["logprobs"][0]) == [{"6": {"logprob": -0.25}}]
    assert arrays["cumulative_logprob"].tolist() == [-0.75]
