"""Images and video through a real tritonserver: a tiny VL checkpoint served from the repository ``m3export
triton-repo`` writes, an ``image`` (base64 PNG) and a ``video`` (base64 GIF, and the same frames as a JSON list)
in one gRPC request, equal to the runtime run in this process on the same media."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from m3export.checkpoint.writer import write_checkpoint
from m3export.config import preset
from m3export.preprocess.prompt import IMAGE_TOKEN, VIDEO_TOKEN, VISION_END, VISION_START
from m3export.runtime import Engine, SamplingParams
from m3export.serve.media import prepare_media
from m3export.serve.repo import write_repository
from m3export.serve.server import TritonServer
from m3export.tokenizer import byte_level_tokenizer

from .test_serve_media import VISION, _png
from .test_serve_video import _animated, _frames, _png_of
from .test_triton_server import MODEL, grpc_stream, grpcclient, inputs, skip_without_tritonserver

pytestmark = pytest.mark.server  # one tritonserver start-up: ~17 s for the module on the CI machine
PROMPT = f"look {IMAGE_TOKEN} and {VIDEO_TOKEN} now"
SAMPLING = {"temperature": 0, "max_tokens": 5, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny VL checkpoint whose tokenizer knows the media markers as single tokens (as the release's does)."""
    cfg = preset("tiny").replace(num_mtp_modules=0, vision=VISION)
    ckpt = write_checkpoint(tmp_path_factory.mktemp("vl") / "ckpt", cfg, "original", "fp32", progress=False,
                            with_tokenizer=False)
    tok = byte_level_tokenizer(cfg)
    tok.add_special_tokens([IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END])
    tok.save(str(ckpt / "tokenizer.json"))
    return ckpt


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    skip_without_tritonserver()
    repo = tmp_path_factory.mktemp("triton-vl")
    write_repository(str(checkpoint), repo, name=MODEL, instances=1)
    with TritonServer(repo, startup_timeout=300) as s:
        yield s


def _media_inputs(image: bytes, video: bytes) -> list:
    ins = inputs(text=PROMPT, sampling=SAMPLING, stream=False)
    for name, value in (("image", image), ("video", video)):
        t = grpcclient.InferInput(name, [1], "BYTES")
        t.set_data_from_numpy(np.array([value], dtype=np.object_))
        ins.append(t)
    return ins


def test_image_and_video_through_tritonserver_equal_the_runtime(server, checkpoint):
    frames = _frames(7)
    png, gif = _png(3), _animated(frames, "GIF")
    frame_list = json.dumps([base64.b64encode(_png_of(f)).decode() for f in frames]).encode()
    got = grpc_stream(server, {"file": _media_inputs(base64.b64encode(png), base64.b64encode(gif)),
                               "frames": _media_inputs(base64.b64encode(png), frame_list)})
    # an error carries no request id on a stream: alone
    broken = grpc_stream(server, {"broken": _media_inputs(base64.b64encode(png), base64.b64encode(b"GIF89a?"))})
    engine = Engine.from_checkpoint(checkpoint)
    params = SamplingParams(**SAMPLING)
    for rid, video in (("file", gif), ("frames", frames)):
        prompt, items = prepare_media(engine.config, PROMPT, [png], [video])
        want = engine.generate([prompt], params, media=[items])[0]
        assert got[rid].error is None and got[rid].ids[-SAMPLING["max_tokens"]:] == want.token_ids
    assert "video 0: " in broken["broken"].error
