"""The tensorrt backend: a clear BackendUnavailable (what to install, or what is missing) instead of a crash."""

import importlib.util

import pytest

from m3export.errors import BackendUnavailable
from m3export.runtime.backends import create_backend

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None


@pytest.mark.skipif(HAS_TENSORRT, reason="TensorRT is installed here; the missing-package message cannot be seen")
def test_missing_tensorrt_says_what_to_install(tmp_path):
    with pytest.raises(BackendUnavailable, match=r"pip install 'm3export\[trt\]'"):
        create_backend("tensorrt", tmp_path)


@pytest.mark.skipif(not HAS_TENSORRT, reason="TensorRT is not installed (pip install 'm3export[trt]' on a GPU host)")
def test_a_directory_without_engines_says_how_to_build_them(tmp_path):
    with pytest.raises(BackendUnavailable, match="holds no TensorRT engines: build them with 'm3export build"):
        create_backend("tensorrt", tmp_path)


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="expected one of torch, onnxruntime, tensorrt"):
        create_backend("tvm", ".")
