"""A real tritonserver driven the way clients of Triton's vLLM backend drive it (its OpenAI frontend among them):
neutral vLLM sampling keys pass, others are refused by name, and the optional return_* outputs come back."""

import json
import queue
import urllib.error
import urllib.request

import numpy as np
import pytest

from m3export.errors import BackendUnavailable
from m3export.runtime import Engine, SamplingParams
from m3export.serve.repo import write_repository
from m3export.serve.server import TritonServer, find_tritonserver
from m3export.serve.stubenv import libpython_dir

grpcclient = pytest.importorskip("tritonclient.grpc")

pytestmark = pytest.mark.server
MODEL = "m3"
RETURNS = ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens")
# What Triton's OpenAI frontend sends along with every request.
NEUTRAL = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "best_of": None}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    try:
        find_tritonserver()
        libpython_dir()
    except BackendUnavailable as e:
        pytest.skip(f"tritonserver cannot run here: {e}")
    repo = tmp_path_factory.mktemp("repo")
    write_repository("tiny", repo, name=MODEL, instances=1)
    with TritonServer(repo, startup_timeout=300) as s:
        yield s


def stream(server, prompt, sampling):
    """One streamed gRPC request with every return_* input set; its responses as dicts of numpy outputs."""
    ins = []
    for name, array, dtype in [("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
                               ("stream", np.array([True]), "BOOL"),
                               ("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_),
                                "BYTES")] + [(f"return_{r}", np.array([True]), "BOOL") for r in RETURNS]:
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        ins.append(t)
    events = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    responses, error = [], None
    try:
        client.async_stream_infer(MODEL, ins, enable_empty_final_response=True)
        while True:
            result, error = events.get(timeout=120)
            if error is not None:
                break
            resp = result.get_response()
            if resp.outputs:
                responses.append({o.name: result.as_numpy(o.name) for o in resp.outputs})
            if resp.parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    return responses, None if error is None else str(error)


def test_return_outputs_over_grpc(server):
    sampling = {**NEUTRAL, "temperature": 0, "max_tokens": 5, "ignore_eos": True}
    responses, error = stream(server, "count on me", sampling)
    assert error is None
    want = Engine.from_checkpoint("tiny").generate(["count on me"], SamplingParams(temperature=0, max_tokens=5,
                                                                                   ignore_eos=True, logprobs=0))[0]
    assert all(set(RETURNS) <= set(r) for r in responses)
    assert [r["finish_reason"][0].decode() for r in responses][-1] == "length"
    assert {int(r["num_input_tokens"][0]) for r in responses} == {len(want.prompt_token_ids)}
    assert sum(int(r["num_output_tokens"][0]) for r in responses) == 5
    assert [t for r in responses for t in r["output_ids"].tolist()] == want.token_ids
    streamed = [lp for r in responses for lp in json.loads(r["logprobs"][0])]
    assert [list(lp) for lp in streamed] == [[str(t)] for t in want.token_ids]
    # fp32 output of a sum of five fp32 logprobs of magnitude ~6: 1e-4 absolute covers the rounding.
    expected = sum(next(iter(lp.values())) for lp in want.logprobs)
    assert abs(float(responses[-1]["cumulative_logprob"][0]) - expected) < 1e-4


def test_non_neutral_vllm_keys_are_refused_by_name(server):
    responses, error = stream(server, "x", {"n": 2, "max_tokens": 2})
    assert responses == [] and error is not None and "'n'=2 is not supported" in error
    responses, error = stream(server, "x", {**NEUTRAL, "max_tokens": 2})
    assert error is None and sum(int(r["num_output_tokens"][0]) for r in responses) >= 1


def test_return_outputs_over_the_http_generate_endpoint(server):
    # Triton's JSON request parameters hold only int, bool and string values (no null, no float here).
    body = {"text_input": "hi", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "n": 1, "presence_penalty": 0,
            "return_finish_reason": True, "return_num_output_tokens": True, "return_num_input_tokens": True}
    req = urllib.request.Request(f"{server.http_url}/v2/models/{MODEL}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(e.read().decode()) from None
    value = lambda v: v[0] if isinstance(v, list) else v  # noqa: E731 - Triton writes [x] or x
    assert value(out["finish_reason"]) == "length" and value(out["num_output_tokens"]) == 3
    assert value(out["num_input_tokens"]) == 2 and "logprobs" not in out  # only what was asked for
