"""An exported artifact served by tritonserver on the ONNX Runtime backend, from a repository that holds its
own copy (the exported original is deleted before the server starts): results equal the runtime's on that copy."""

import json
import shutil

import pytest

from m3export.runtime import Engine, SamplingParams
from m3export.serve.repo import write_repository
from m3export.serve.server import TritonServer

from .test_triton_server import as_list, grpc_one, http_post, skip_without_tritonserver

pytestmark = [pytest.mark.server, pytest.mark.slow]
pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_artifact):
    skip_without_tritonserver()
    tmp = tmp_path_factory.mktemp("artifact")
    art = shutil.copytree(tiny_artifact, tmp / "art")  # the session's tiny export, a copy this test may delete
    model_dir = write_repository(str(art), tmp / "repo", backend="onnxruntime", copy=True)
    shutil.rmtree(art)
    engine = Engine.from_artifact(model_dir / "1" / "artifact", backend="onnxruntime")
    with TritonServer(tmp / "repo", startup_timeout=300) as server:
        yield server, engine


def test_streaming_over_grpc(served):
    server, engine = served
    sampling = {"temperature": 0.9, "seed": 21, "max_tokens": 10}
    want = engine.generate(["from the artifact"], SamplingParams(**sampling))[0]
    got = grpc_one(server, text="from the artifact", stream=True, sampling=sampling)
    assert got.error is None and (got.text, got.ids) == (want.text, want.token_ids)


def test_generate_endpoint(served):
    server, engine = served
    want = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    status, body = http_post(server, "/v2/models/m3/generate",
                             {"input_ids": [5, 6, 7], "exclude_input_in_output": True,
                              "sampling_parameters": json.dumps({"temperature": 0, "max_tokens": 6,
                                                                 "ignore_eos": True})})
    assert status == 200, body
    assert as_list(json.loads(body)["output_ids"]) == want.token_ids
