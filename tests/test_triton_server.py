"""A real tritonserver (from the nvidia-pytriton wheel) serving the repository ``m3export triton-repo tiny``
writes, driven with tritonclient over gRPC and through Triton's HTTP generate endpoints.

Every served result is checked against the runtime run directly in this process with the same seeds: the
server's engines and this one load the same deterministic ``tiny`` weights, and each request samples from its
own seeded stream, so batching across requests changes nothing. One server (two model instances) per module.
"""

import json
import queue
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from m3export.errors import BackendUnavailable
from m3export.runtime import Engine, SamplingParams
from m3export.serve.repo import write_repository
from m3export.serve.server import ServerError, TritonServer, find_tritonserver
from m3export.serve.stubenv import libpython_dir, stub_env

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")

pytestmark = pytest.mark.server
MODEL = "m3"


def skip_without_tritonserver():
    try:
        find_tritonserver()
        libpython_dir()
    except BackendUnavailable as e:
        pytest.skip(f"tritonserver cannot run here: {e}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    skip_without_tritonserver()
    repo = tmp_path_factory.mktemp("triton-repo")
    write_repository("tiny", repo, name=MODEL, instances=2)
    with TritonServer(repo, startup_timeout=300) as s:
        yield s


@pytest.fixture(scope="module")
def engine():
    return Engine.from_checkpoint("tiny")


def expect(engine, prompt, **sampling):
    return engine.generate([prompt], SamplingParams(**sampling))[0]


# ---------------------------------------------------------------------------------------------- clients
def inputs(text=None, ids=None, stream=None, sampling=None, exclude=None, raw_sampling=None):
    out = []

    def add(name, array, dtype):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        out.append(t)

    if text is not None:
        add("text_input", np.array([text.encode()], dtype=np.object_), "BYTES")
    if ids is not None:
        add("input_ids", np.array(ids, dtype=np.int64), "INT64")
    if stream is not None:
        add("stream", np.array([stream]), "BOOL")
    if exclude is not None:
        add("exclude_input_in_output", np.array([exclude]), "BOOL")
    if sampling is not None or raw_sampling is not None:
        s = raw_sampling if raw_sampling is not None else json.dumps(sampling)
        add("sampling_parameters", np.array([s.encode()], dtype=np.object_), "BYTES")
    return out


class Collected:
    def __init__(self):
        self.texts, self.ids, self.error, self.final = [], [], None, False

    @property
    def text(self):
        return "".join(self.texts)


def grpc_stream(server, requests, timeout=120.0):
    """Send ``{request_id: inputs}`` together on one gRPC stream; collect each request's responses until its
    final flag. Errors carry no request id on a stream, so only single requests may expect one."""
    results = {rid: Collected() for rid in requests}
    events = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        for rid, ins in requests.items():
            client.async_stream_infer(MODEL, ins, request_id=rid, enable_empty_final_response=True)
        pending, deadline = set(requests), time.monotonic() + timeout
        while pending:
            result, error = events.get(timeout=max(0.1, deadline - time.monotonic()))
            if error is not None:
                assert len(requests) == 1, f"error on a shared stream: {error}"
                rid = next(iter(requests))
                results[rid].error = str(error)
                pending.discard(rid)
                continue
            resp = result.get_response()
            c = results[resp.id]
            if resp.outputs:
                c.texts.append(result.as_numpy("text_output")[0].decode())
                c.ids.extend(result.as_numpy("output_ids").tolist())
            if resp.parameters["triton_final_response"].bool_param:
                c.final = True
                pending.discard(resp.id)
    finally:
        client.stop_stream()
        client.close()
    return results


def grpc_one(server, **kw):
    return grpc_stream(server, {"only": inputs(**kw)})["only"]


def http_post(server, path, body, timeout=60):
    req = urllib.request.Request(f"{server.http_url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def as_list(v):
    return v if isinstance(v, list) else [v]  # Triton's JSON writes a one-element tensor as a scalar


def sse_events(body):
    return [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]


def metric(server, name, **labels):
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    total, found = 0.0, False
    for line in text.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total, found = total + float(m.group(2)), True
    assert found, f"metric {name} {labels} not exported"
    return total


# ---------------------------------------------------------------------------------------------- tests
def test_ready_only_with_the_model_loaded(server):
    client = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(MODEL)
    config = client.get_model_config(MODEL)
    assert config["model_transaction_policy"]["decoupled"] is True
    assert len(config["instance_group"]) == 1 and config["instance_group"][0]["count"] == 2
    meta = client.get_model_metadata(MODEL)
    assert {i["name"] for i in meta["inputs"]} >= {"text_input", "stream", "sampling_parameters",
                                                    "exclude_input_in_output", "input_ids"}
    assert {o["name"] for o in meta["outputs"]} == {"text_output", "output_ids", "finish_reason", "num_input_tokens",
                                                     "num_output_tokens", "logprobs", "cumulative_logprob"}


def test_grpc_streaming_equals_the_runtime(server, engine):
    sampling = {"temperature": 0.8, "top_p": 0.9, "seed": 11, "max_tokens": 12}
    got = grpc_one(server, text="Hello, Triton", stream=True, sampling=sampling)
    want = expect(engine, "Hello, Triton", **sampling)
    assert got.error is None and got.final and len(got.texts) > 1  # really streamed
    assert (got.text, got.ids) == (want.text, want.token_ids)


def test_grpc_single_response_includes_the_prompt_by_default(server, engine):
    sampling = {"temperature": 0.5, "seed": 2, "max_tokens": 7, "top_k": 20}
    want = expect(engine, "abc", **sampling)
    got = grpc_one(server, text="abc", sampling=sampling)
    assert len(got.texts) == 1 and got.text == "abc" + want.text
    assert got.ids == want.prompt_token_ids + want.token_ids
    got = grpc_one(server, text="abc", sampling=sampling, exclude=True)
    assert (got.text, got.ids) == (want.text, want.token_ids)


def test_token_ids_in_token_ids_out(server, engine):
    prompt = [7, 300, 42, 99, 1]
    sampling = {"temperature": 0, "max_tokens": 9, "ignore_eos": True}
    got = grpc_one(server, ids=prompt, stream=True, sampling=sampling)
    want = expect(engine, prompt, **sampling)
    assert got.error is None and got.ids == want.token_ids and len(got.ids) == 9


def http_stream(server, prompt, sampling):
    status, body = http_post(server, f"/v2/models/{MODEL}/generate_stream",
                             {"text_input": prompt, "stream": True, "sampling_parameters": json.dumps(sampling)})
    events = sse_events(body)
    assert status == 200 and all("error" not in e for e in events), body
    return "".join(e["text_output"] for e in events), [t for e in events for t in as_list(e["output_ids"])]


def test_sixteen_concurrent_streams(server, engine):
    """Eight requests on one gRPC stream and eight HTTP generate_stream connections, all at once."""
    cases = {f"req-{i}": (f"concurrent prompt number {i}", {"temperature": 1.0, "seed": 100 + i,
                                                             "max_tokens": 8 + i})
             for i in range(16)}
    over_http = {rid for i, rid in enumerate(cases) if i % 2}
    with ThreadPoolExecutor(len(over_http)) as pool:
        http = {rid: pool.submit(http_stream, server, *cases[rid]) for rid in over_http}
        got = grpc_stream(server, {rid: inputs(text=p, stream=True, sampling=s)
                                   for rid, (p, s) in cases.items() if rid not in over_http})
        for rid, future in http.items():
            got[rid] = Collected()
            text, got[rid].ids = future.result()
            got[rid].texts, got[rid].final = [text], True
    want = engine.generate([p for p, _ in cases.values()], [SamplingParams(**s) for _, s in cases.values()])
    for (rid, _), w in zip(cases.items(), want):
        assert got[rid].final and got[rid].error is None, rid
        assert (got[rid].text, got[rid].ids) == (w.text, w.token_ids), rid


def test_http_generate_endpoints(server, engine):
    want = expect(engine, "generate me", temperature=0.7, seed=5, max_tokens=10)
    status, body = http_post(server, f"/v2/models/{MODEL}/generate",
                             {"text_input": "generate me", "parameters": {"temperature": 0.7, "seed": 5,
                                                                          "max_tokens": 10}})
    assert status == 200, body
    out = json.loads(body)
    assert out["text_output"] == "generate me" + want.text
    assert as_list(out["output_ids"]) == want.prompt_token_ids + want.token_ids

    assert http_stream(server, "generate me", {"temperature": 0.7, "seed": 5, "max_tokens": 10}) == (
        want.text, want.token_ids)


@pytest.mark.parametrize("kw, match", [
    ({"stream": True}, "exactly one of 'text_input'"),
    ({"text": "x", "raw_sampling": "{not json"}, "sampling_parameters is not valid JSON"),
    ({"text": "x", "sampling": {"max_tokenz": 3}}, "unknown key"),
    ({"text": "x", "sampling": {"temperature": -1}}, "temperature"),
    ({"text": "x" * 5000, "sampling": {"max_tokens": 2}}, "allows at most"),
    ({"text": "x", "stream": True, "exclude": False}, "not supported when streaming"),
])
def test_bad_requests_get_their_own_error(server, kw, match):
    got = grpc_one(server, **kw)
    assert got.error is not None and re.search(match, got.error), got.error
    assert grpc_one(server, text="still fine", sampling={"max_tokens": 3}).error is None


def test_wrong_dtype_is_rejected_by_triton(server):
    wrong = grpcclient.InferInput("text_input", [1], "INT32")
    wrong.set_data_from_numpy(np.array([3], dtype=np.int32))
    got = grpc_stream(server, {"only": [wrong]})["only"]
    assert "data-type is 'INT32'" in got.error and "expects 'BYTES'" in got.error, got.error
    status, body = http_post(server, f"/v2/models/{MODEL}/generate",
                             {"text_input": "x", "sampling_parameters": "{broken"})
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]
    assert grpc_one(server, text="after errors", sampling={"max_tokens": 2}).error is None


def wait_until_idle(server, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(server, "m3_requests_running", model=MODEL) == 0:
            return True
        time.sleep(0.2)
    return False


def test_client_disconnect_mid_stream_aborts_only_that_request(server, engine):
    long = {"max_tokens": 3000, "ignore_eos": True, "temperature": 1.0, "seed": 1}
    # HTTP: read the first streamed event, then hang up.
    body = json.dumps({"text_input": "never read", "stream": True, "sampling_parameters": json.dumps(long)}).encode()
    with socket.create_connection((server.host, server.http_port), timeout=30) as s:
        s.sendall(f"POST /v2/models/{MODEL}/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while b"text_output" not in received:
            chunk = s.recv(65536)
            assert chunk, f"the server closed the stream early: {received!r}"
            received += chunk
    # gRPC: cancel the stream after the first response.
    client = grpcclient.InferenceServerClient(server.grpc_url)
    first = queue.Queue()
    client.start_stream(callback=lambda result, error: first.put((result, error)))
    client.async_stream_infer(MODEL, inputs(text="cancel me", stream=True, sampling=long), request_id="c")
    _, error = first.get(timeout=60)
    assert error is None
    client.stop_stream(cancel_requests=True)
    client.close()

    assert wait_until_idle(server), "aborted requests are still running in the engine"
    sampling = {"temperature": 0.3, "seed": 9, "max_tokens": 6}
    got, want = grpc_one(server, text="next", stream=True, sampling=sampling), expect(engine, "next", **sampling)
    assert (got.text, got.ids) == (want.text, want.token_ids)


def test_metrics(server):
    """Counters grow by this test's own request, whatever ran before it (or nothing: the test runs alone too)."""
    def current(name):
        try:
            return metric(server, name, model=MODEL)
        except AssertionError:  # not exported until the first request
            return 0.0

    before = {n: current(n) for n in ("nv_inference_request_success", "m3_generated_tokens_total")}
    got = grpc_one(server, ids=[5, 6, 7], sampling={"temperature": 0, "max_tokens": 5, "ignore_eos": True})
    assert got.error is None and len(got.ids) == 3 + 5
    assert metric(server, "nv_inference_request_success", model=MODEL) >= before["nv_inference_request_success"] + 1
    assert metric(server, "m3_generated_tokens_total", model=MODEL) >= before["m3_generated_tokens_total"] + 5


def test_a_model_that_cannot_load_fails_startup_with_its_log(tmp_path):
    """Triton never reports ready without a loaded engine: startup fails and says why."""
    skip_without_tritonserver()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    write_repository(str(ckpt), tmp_path / "repo")
    (ckpt / "config.json").unlink()
    ckpt.rmdir()
    with pytest.raises(ServerError, match=r"(?s)exited during startup.*the checkpoint this model serves is missing"), \
            TritonServer(tmp_path / "repo", startup_timeout=120):
        pass


def test_stub_python_sees_this_environment_with_numpy_1():
    """What the stub gets: run isolated (-I) like the stub's embedded interpreter, it imports our runtime, and
    the numpy its C++ side was built for."""
    skip_without_tritonserver()
    python = stub_env() / "bin" / "python3"
    code = "import numpy, m3export.runtime, m3export.serve.triton_model; print(numpy.__version__)"
    done = subprocess.run([str(python), "-I", "-c", code], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("1."), done.stdout


def test_missing_tritonserver_says_how_to_install(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(BackendUnavailable, match="pip install --no-deps nvidia-pytriton==0.7.0"):
        find_tritonserver()


# ---------------------------------------------------------------------------------------------- safety
def test_a_10_mb_request_body_does_not_take_the_server_down(server, engine, tmp_path):
    """tritonserver 2.51 overflows its thread stack on HTTP bodies of ~3-5 MB (an alloca of the body's buffer
    segments; a segfault that drops every client); we start it with a 64 MiB stack limit. curl is the client
    because it delivers the body in the many segments that trigger the crash (one large sendall does not)."""
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed (the crash needs a client that sends the body in many segments)")
    body = tmp_path / "body.json"
    body.write_bytes(b'{"text_input":"hi","max_tokens":2' + b" " * (10 << 20) + b"}")
    done = subprocess.run([curl, "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H", "Expect:", "-X", "POST",
                           f"{server.http_url}/v2/models/{MODEL}/generate", "--data-binary", f"@{body}"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout == "200", (done.returncode, done.stdout, server.log_tail())
    sampling = {"temperature": 0.0, "max_tokens": 3}
    got = grpc_one(server, text="after", sampling=sampling, exclude=True)
    want = expect(engine, "after", **sampling)
    assert got.error is None and got.ids == want.token_ids


def test_readiness_from_a_server_that_is_not_ours_is_not_trusted(server, tmp_path):
    """A second server on the first one's ports fails to bind (gRPC: address already in use), the way a restart
    fails beside an orphan; the first one's 200 on /v2/health/ready must not make the second look started."""
    with pytest.raises(ServerError, match="exited during startup"):
        with TritonServer(server.repository, http_port=server.http_port, grpc_port=server.grpc_port,
                          metrics_port=server.metrics_port, startup_timeout=120):
            pass
    assert urllib.request.urlopen(f"{server.http_url}/v2/health/ready", timeout=10).status == 200


def test_killing_the_wrapper_kills_tritonserver(tmp_path):
    """SIGKILL on `python -m m3export.serve.server` leaves no orphan holding the ports: the children die with it."""
    skip_without_tritonserver()
    write_repository("tiny", tmp_path / "repo", name=MODEL)
    ports = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    wrapper = subprocess.Popen(
        [sys.executable, "-m", "m3export.serve.server", str(tmp_path / "repo"), "--http-port", str(ports[0]),
         "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = wrapper.stdout.readline()  # printed once the server and its model are ready
        assert first.startswith("serving"), first + wrapper.stdout.read()
        wrapper.kill()
        wrapper.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/v2/health/live", timeout=2)
            except (urllib.error.URLError, OSError):
                break
            time.sleep(0.25)
        else:
            pytest.fail("tritonserver still answers after its wrapper was killed")
    finally:
        wrapper.kill()


def test_serving_never_installs_the_stub_environment(tmp_path, monkeypatch):
    """The stub's numpy<2 environment is prepared at install time; serving with none prepared is one clear error
    (it would otherwise pip-install over the network at the first start)."""
    monkeypatch.setenv("M3EXPORT_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(BackendUnavailable, match="python -m m3export.serve.stubenv"):
        stub_env()
    assert not (tmp_path / "empty-cache").exists()
