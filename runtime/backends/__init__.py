"""Backends behind one interface (``Backend``): torch, onnxruntime and tensorrt, chosen by name."""

from __future__ import annotations

from pathlib import Path

import torch

from m3export.sources import BACKENDS

from .base import Backend


def make_torch_backend(model: torch.nn.Module, enforce_eager: bool = False) -> Backend:
    """The torch backend for ``model``. On a CUDA device decode steps are replayed from CUDA graphs (hundreds of
    small launches per step otherwise set its time at small batch) unless ``enforce_eager`` (vLLM's flag)."""
    from .torch_backend import TorchBackend

    if not enforce_eager and next(model.parameters()).device.type == "cuda":
        from .cuda_graph import GraphedTorchBackend

        return GraphedTorchBackend(model)
    return TorchBackend(model)


def create_backend(name: str, artifact: str | Path, device: str = "cpu", dtype: torch.dtype | None = None,
                   enforce_eager: bool = False, provider: str | None = None) -> Backend:
    """The backend ``name`` running the exported artifact directory ``artifact``; ``provider`` (onnxruntime only)
    is the execution provider, ``cpu``, ``cuda``, ... with options (``m3export.plugins.onnxruntime.providers``)."""
    if provider is not None and name != "onnxruntime":
        raise ValueError(f"an execution provider ({provider!r}) is for the onnxruntime backend, not {name!r}")
    if name == "torch":
        from m3export.export.artifact import load_artifact, load_torch_model

        # Start-up checks structure and sizes; hashing every weight byte is `m3export verify`'s job.
        model = load_torch_model(load_artifact(artifact, verify_checksums=False), device, dtype)
        if str(device).startswith("cuda"):
            from m3export.plugins.kernels import use_on

            use_on(device)
        return make_torch_backend(model, enforce_eager)
    if name == "onnxruntime":
        from .onnxruntime_backend import OnnxRuntimeBackend

        return OnnxRuntimeBackend.from_artifact(artifact, device=device, provider=provider)
    if name == "tensorrt":
        from .tensorrt_backend import open_artifact

        return open_artifact(artifact, device=device)
    raise ValueError(f"unknown backend {name!r}: expected one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Backend", "create_backend", "make_torch_backend"]
