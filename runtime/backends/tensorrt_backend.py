"""TensorRT backend: only the availability check exists so far.

TensorRT cannot be installed on the CPU development machine, the M3 TensorRT plugins and the engine build
(``m3export build-engine``) are not written yet, and so there is no engine format to run. Asking for this
backend therefore fails with ``BackendUnavailable`` saying exactly what is missing, instead of pretending.
"""

from __future__ import annotations

from pathlib import Path

from m3export.errors import BackendUnavailable

INSTALL_HINT = ("pip install 'm3export[trt]' (tensorrt>=10.9 from NVIDIA's package index) on a machine with an "
                "NVIDIA GPU and driver")


def require_tensorrt():
    """The ``tensorrt`` module, or BackendUnavailable naming what to install."""
    try:
        import tensorrt
    except ImportError as e:
        raise BackendUnavailable(f"the tensorrt backend needs TensorRT, which is not installed ({e}): "
                                 f"{INSTALL_HINT}") from e
    return tensorrt


def open_artifact(path: str | Path, device: str = "cuda"):
    """The TensorRT backend for an artifact: today always BackendUnavailable, with the reason."""
    trt = require_tensorrt()
    raise BackendUnavailable(
        f"TensorRT {trt.__version__} is installed, but this runtime cannot run TensorRT engines yet: the M3 "
        f"plugins and the engine build are not implemented, so {path} holds no engine to run; use "
        "backend='onnxruntime' or 'torch'")
