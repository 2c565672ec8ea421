"""Backends behind one interface (``Backend``): torch, onnxruntime and tensorrt, chosen by name."""

from __future__ import annotations

from pathlib import Path

import torch

from m3export.sources import BACKENDS

from .base import Backend


def make_torch_backend(model: torch.nn.Module, enforce_eager: bool = False, kv_cache_dtype: str | None = None
                       ) -> Backend:
    """The torch backend for ``model``. On a CUDA device decode steps are replayed from CUDA graphs (hundreds of
    small launches per step otherwise set its time at small batch) unless ``enforce_eager`` (vLLM's flag).
    ``kv_cache_dtype``: ``auto`` (None: the model dtype), ``bf16`` or ``fp8`` (E4M3 pools with per-row fp32
    scales, ``m3export.ops.kv_fp8``)."""
    from m3export.ops.kv_fp8 import resolve_cache_dtype

    from .torch_backend import TorchBackend

    cache_dtype = resolve_cache_dtype(kv_cache_dtype, model.lm_head.weight.dtype)
    if not enforce_eager and next(model.parameters()).device.type == "cuda":
        from .cuda_graph import GraphedTorchBackend

        return GraphedTorchBackend(model, cache_dtype)
    return TorchBackend(model, cache_dtype)


def check_exported_cache_dtype(backend: str, artifact: str | Path, kv_cache_dtype: str | None) -> None:
    """Backends that run the exported graphs use the pools those graphs declare (manifest.json's
    ``kv_cache_dtype``: the model dtype, or ``float8_e4m3fn`` for an ``export --kv-cache-dtype fp8`` artifact,
    whose pools are uint8 E4M3 codes with fp32 scale pools): ``auto`` takes whatever the artifact has, asking for
    another cache dtype is one clear error. ``artifact`` may be a TensorRT engine directory, whose engines run the
    graphs of the artifact its ``build.json`` names."""
    if kv_cache_dtype in (None, "auto"):
        return
    from m3export.build.engine import built_from, is_engine_dir, read_build
    from m3export.dtypes import BY_NAME
    from m3export.errors import BackendUnavailable
    from m3export.export.artifact import load_artifact
    from m3export.ops.kv_fp8 import cache_dtype_name, resolve_cache_dtype

    source, where = artifact, str(artifact)
    if is_engine_dir(artifact):  # TensorRT engines run the graphs (pools included) of the artifact they came from
        source = built_from(read_build(artifact), artifact)
        where = f"{artifact} (TensorRT engines built from {source})"
    manifest = load_artifact(source, verify_checksums=False).manifest
    exported = BY_NAME[manifest.cache_dtype].torch
    wanted = resolve_cache_dtype(kv_cache_dtype, BY_NAME[manifest.dtype].torch)
    if wanted != exported:
        raise BackendUnavailable(
            f"--kv-cache-dtype {kv_cache_dtype}: {where} was exported with {cache_dtype_name(exported)} caches, not "
            f"{cache_dtype_name(wanted)}, and the {backend} backend runs those graphs as exported (export again with "
            f"--kv-cache-dtype {kv_cache_dtype}, or --backend torch, which takes any)")


def _artifact_cache_dtype(manifest, kv_cache_dtype: str | None) -> str | None:
    """The torch backend's ``--kv-cache-dtype`` on an exported artifact: ``auto`` is the artifact's own cache
    dtype (``fp8`` for an FP8 artifact, so every backend runs it alike), anything else as asked."""
    from m3export.export.manifest import KV_FP8

    if kv_cache_dtype in (None, "auto") and manifest.cache_dtype == KV_FP8:
        return "fp8"
    return kv_cache_dtype


def create_backend(name: str, artifact: str | Path, device: str = "cpu", dtype: torch.dtype | None = None,
                   enforce_eager: bool = False, provider: str | None = None, kv_cache_dtype: str | None = None
                   ) -> Backend:
    """The backend ``name`` running the exported artifact directory ``artifact``; ``provider`` (onnxruntime only)
    is the execution provider, ``cpu``, ``cuda``, ... with options (``m3export.plugins.onnxruntime.providers``);
    ``kv_cache_dtype`` (``auto``/``bf16``/``fp8``): the cache pools' dtype, free on the torch backend, the
    exported one elsewhere (``check_exported_cache_dtype``)."""
    if name != "torch":
        check_exported_cache_dtype(name, artifact, kv_cache_dtype)
    if provider is not None and name != "onnxruntime":
        raise ValueError(f"an execution provider ({provider!r}) is for the onnxruntime backend, not {name!r}")
    if name == "torch":
        from m3export.export.artifact import load_artifact, load_torch_model

        # Start-up checks structure and sizes; hashing every weight byte is `m3export verify`'s job.
        art = load_artifact(artifact, verify_checksums=False)
        model = load_torch_model(art, device, dtype)
        # On CUDA the backend makes the kernels the ops' implementation (TorchBackend: fusion.serve_on).
        return make_torch_backend(model, enforce_eager, _artifact_cache_dtype(art.manifest, kv_cache_dtype))
    if name == "onnxruntime":
        from .onnxruntime_backend import OnnxRuntimeBackend

        return OnnxRuntimeBackend.from_artifact(artifact, device=device, provider=provider)
    if name == "tensorrt":
        from .tensorrt_backend import open_artifact

        return open_artifact(artifact, device=device)
    raise ValueError(f"unknown backend {name!r}: expected one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Backend", "create_backend", "make_torch_backend"]
