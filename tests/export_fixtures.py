"""Artifacts shared by the export and verify tests: each tiny export runs once per test session."""

from __future__ import annotations

import pytest

from m3export.checkpoint.writer import write_checkpoint
from m3export.config import preset
from m3export.export.exporter import export_artifact


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory):
    """The tiny preset, float32, page size 16."""
    return export_artifact("tiny", tmp_path_factory.mktemp("art") / "tiny", progress=False)


@pytest.fixture(scope="session")
def fp8_artifact(tmp_path_factory):
    """The tiny preset, float32, page size 16, with an FP8 (E4M3) cache: uint8 code pools and fp32 scale pools."""
    return export_artifact("tiny", tmp_path_factory.mktemp("art") / "tiny-fp8", kv_cache_dtype="fp8",
                           progress=False)


@pytest.fixture(scope="session")
def bf16_artifact(tmp_path_factory):
    """The tiny preset in bfloat16, page size 16: the CUDA EP kernel-type checks of its graphs and decode graphs
    (``test_ort_cuda_kernel_types.py``, ``test_ort_decode_graph.py``) read it."""
    return export_artifact("tiny", tmp_path_factory.mktemp("art") / "tiny-bf16", dtype="bfloat16", progress=False)


@pytest.fixture(scope="session")
def mxfp8_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-mxfp8", preset("tiny"), "original", "mxfp8",
                            progress=False)


@pytest.fixture(scope="session")
def mxfp8_artifact(tmp_path_factory, mxfp8_checkpoint):
    """An MXFP8 checkpoint exported with its fp8 weights kept, page size 8 (two indexer blocks per page)."""
    return export_artifact(str(mxfp8_checkpoint), tmp_path_factory.mktemp("art") / "tiny-mxfp8", page_size=8,
                           progress=False)


@pytest.fixture(scope="session")
def vl_artifact(tmp_path_factory):
    """A tiny VL model (``vl_config.VISION``) with one MTP module, float32, pages of 4 tokens (one indexer block per
    page), its checkpoint's preprocessing settings copied beside the graphs; weights scaled as in
    ``test_runtime_media`` so that the media decide the greedy tokens. The onnxruntime media tests and the vision
    export test read it (a VL export is two dynamo exports, step and vision graphs); its checkpoint is the
    artifact's sibling ``ckpt``."""
    import json

    import torch

    from m3export.export.artifact import load_artifact
    from m3export.model import M3ForCausalLM
    from m3export.preprocess.settings import PREPROCESSOR_CONFIG

    from .test_runtime_media import media_weights
    from .vl_config import VISION

    tmp = tmp_path_factory.mktemp("vl-ort")
    torch.manual_seed(0)
    model = media_weights(M3ForCausalLM(preset("tiny").replace(num_mtp_modules=1, vision=VISION)).eval())
    write_checkpoint(tmp / "ckpt", model.config, "original", "fp32", model=model, progress=False,
                     with_tokenizer=False)
    (tmp / "ckpt" / PREPROCESSOR_CONFIG).write_text(json.dumps(VL_PREPROCESSING))  # export copies it
    return load_artifact(export_artifact(str(tmp / "ckpt"), tmp / "art", page_size=4, progress=False))


VL_PREPROCESSING = {"max_pixels": 32 * 32, "image_mean": [0.5, 0.5, 0.5]}


@pytest.fixture(scope="session")
def fp16_trt_artifact(tmp_path_factory):
    """The tiny preset (one MTP module) in float16, pages of 8 tokens, with the TensorRT flavour: the fp16 ONNX
    Runtime engine test (``test_runtime_paths.py``), the exporter's ``--flavour tensorrt`` test
    (``test_tensorrt_build.py``) and the fp16 decode-graph tests (``test_ort_decode_graph.py``) read it. The flavour
    only adds ``<graph>.trt.onnx`` files and their manifest record beside the plain graphs, which ONNX Runtime runs
    as before; float16 is a dtype the TensorRT plugins take."""
    return export_artifact("tiny", tmp_path_factory.mktemp("art") / "tiny-fp16-trt", dtype="float16", page_size=8,
                           flavour="tensorrt", progress=False)
