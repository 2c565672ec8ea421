"""m3export: MiniMax M3 out of PyTorch and into production runtimes."""

from .config import M3Config, preset
from .errors import ArtifactError, BackendUnavailable, CheckpointError, M3Error

__version__ = "0.1.0"


def load_model(path_or_preset, device="cpu", dtype=None, **kwargs):
    """A checkpoint directory or a preset name (random weights) -> ``M3ForCausalLM`` in eval mode.

    On a CUDA device the ``m3`` ops then run the Triton kernels of ``m3export.plugins.kernels`` (registered once
    per process; the references stay the CPU implementation and the definition of truth)."""
    from .checkpoint.loader import load_model as _load

    model = _load(path_or_preset, device=device, dtype=dtype, **kwargs)
    if str(device).startswith("cuda"):
        from m3export.plugins.kernels import use_on

        use_on(device)
    return model


def __getattr__(name):
    """``LLM`` and ``SamplingParams`` (vLLM's offline API) load the runtime, and so torch, only when used."""
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "SamplingParams":
        from .runtime.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'm3export' has no attribute {name!r}")


__all__ = [
    "ArtifactError", "BackendUnavailable", "CheckpointError", "LLM", "M3Config", "M3Error", "SamplingParams",
    "load_model", "preset", "__version__",
]
