"""TensorRT backend: finds the engines ``m3export build`` wrote and checks they fit this GPU and TensorRT.

Engines come from ``m3export build ARTIFACT --out DIR`` (the graphs' TensorRT flavour with the m3 plugins). What
exists: the checks that an engine directory is one, was built for this compute capability and this TensorRT
version, with a message saying what to do otherwise. What does not exist yet: running an engine step by step
(device pools bound by address, the cache-write nodes aliased in place); asking for it fails with
``BackendUnavailable`` saying so, instead of pretending. TensorRT cannot be installed on the development machine,
so none of this has run against a real engine.
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
        raise BackendUnavailable(f"TensorRT is not installed ({e}): {INSTALL_HINT}") from e
    return tensorrt


def open_artifact(path: str | Path, device: str = "cuda"):
    """The TensorRT backend for an engine directory (``m3export build``'s output)."""
    trt = require_tensorrt()
    from m3export.build.engine import BUILD_JSON, read_build
    from m3export.build.profiles import check_engine

    root = Path(path)
    if not (root / BUILD_JSON).is_file():
        raise BackendUnavailable(f"{path} holds no TensorRT engines: build them with 'm3export build {path} --out "
                                 "DIR' and pass DIR to the tensorrt backend")
    meta = read_build(root)
    import torch

    props = torch.cuda.get_device_properties(torch.device(device))
    check_engine(meta, trt.__version__, (props.major, props.minor), str(root))
    raise BackendUnavailable(
        f"{path}: engines for TensorRT {trt.__version__} on this GPU are present, but this runtime cannot run "
        "TensorRT engines yet (the step runner with device pools bound in place is not written); use "
        "backend='onnxruntime' or 'torch'")
