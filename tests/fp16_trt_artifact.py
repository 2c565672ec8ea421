"""One float16 export with the TensorRT flavour, shared by the session (``conftest.py`` imports it): the fp16
ONNX Runtime engine test (``test_runtime_paths.py``) and the exporter's ``--flavour tensorrt`` test
(``test_tensorrt_build.py``) each exported the tiny preset once for themselves, and an export is most of either
test's time. The flavour only adds ``<graph>.trt.onnx`` files and their manifest record beside the plain graphs,
which ONNX Runtime runs as before; float16 is a dtype the TensorRT plugins take."""

from __future__ import annotations

import pytest

from m3export.export.exporter import export_artifact


@pytest.fixture(scope="session")
def fp16_trt_artifact(tmp_path_factory):
    """The tiny preset (one MTP module) in float16, pages of 8 tokens, with the TensorRT flavour."""
    return export_artifact("tiny", tmp_path_factory.mktemp("art") / "tiny-fp16-trt", dtype="float16", page_size=8,
                           flavour="tensorrt", progress=False)
