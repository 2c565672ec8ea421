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
    """Backends that run the exported graphs use the pools those graphs declare (their dtype is recorded in
    manifest.json with every graph signature): asking for another cache dtype is one clear error. ``artifact`` may
    be a TensorRT engine directory, whose engines run the graphs of the artifact its ``build.json`` names."""
    if kv_cache_dtype in (None, "auto"):
        return
    from m3export.build.engine import built_from, is_engine_dir, read_build
    from m3export.dtypes import BY_NAME
    from m3export.errors import BackendUnavailable
    from m3export.export.artifact import load_artifact
    from m3export.ops.kv_fp8 import FP8, resolve_cache_dtype

    source, where = artifact, str(artifact)
    if is_engine_dir(artifact):  # TensorRT engines run the graphs (pools included) of the artifact they came from
        source = built_from(read_build(artifact), artifact)
        where = f"{artifact} (TensorRT engines built from {source})"
    manifest = load_artifact(source, verify_checksums=False).manifest
    pools = {t.dtype for g in manifest.graphs.values() for t in g.inputs
             if t.name.split(".")[0] in ("k_cache", "v_cache", "index_k_cache")}
    exported = BY_NAME[pools.pop() if len(pools) == 1 else manifest.dtype].torch
    wanted = resolve_cache_dtype(kv_cache_dtype, exported)
    if wanted == FP8:
        raise BackendUnavailable(
            f"--kv-cache-dtype fp8: the {backend} backend runs {artifact}'s exported graphs, whose caches are "
            f"{exported}; ONNX has no Gather / ScatterND on float8 in any opset, so no artifact carries FP8 pools "
            "yet: use --backend torch for an FP8 cache")
    if wanted != exported:
        raise BackendUnavailable(f"--kv-cache-dtype {kv_cache_dtype}: {where} was exported with {exported} "
                                 f"caches and the {backend} backend runs those graphs as exported")


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
        model = load_torch_model(load_artifact(artifact, verify_checksums=False), device, dtype)
        if str(device).startswith("cuda"):
            from m3export.plugins.kernels import use_on

            use_on(device)
        return make_torch_backend(model, enforce_eager, kv_cache_dtype)
    if name == "onnxruntime":
        from .onnxruntime_backend import OnnxRuntimeBackend

        return OnnxRuntimeBackend.from_artifact(artifact, device=device, provider=provider)
    if name == "tensorrt":
        from .tensorrt_backend import open_artifact

        return open_artifact(artifact, device=device)
    raise ValueError(f"unknown backend {name!r}: expected one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Backend", "create_backend", "make_torch_backend"]
