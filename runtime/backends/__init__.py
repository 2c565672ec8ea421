"""Backends behind one interface (``Backend``): torch, onnxruntime and tensorrt, chosen by name."""

from __future__ import annotations

from pathlib import Path

import torch

from m3export.sources import BACKENDS

from .base import Backend


def create_backend(name: str, artifact: str | Path, device: str = "cpu", dtype: torch.dtype | None = None
                   ) -> Backend:
    """The backend ``name`` running the exported artifact directory ``artifact``."""
    if name == "torch":
        from m3export.export.artifact import load_artifact, load_torch_model
        from .torch_backend import TorchBackend

        # Start-up checks structure and sizes; hashing every weight byte is `m3export verify`'s job.
        return TorchBackend(load_torch_model(load_artifact(artifact, verify_checksums=False), device, dtype))
    if name == "onnxruntime":
        from .onnxruntime_backend import OnnxRuntimeBackend

        return OnnxRuntimeBackend.from_artifact(artifact, device=device)
    if name == "tensorrt":
        from .tensorrt_backend import open_artifact

        return open_artifact(artifact, device=device)
    raise ValueError(f"unknown backend {name!r}: expected one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Backend", "create_backend"]
