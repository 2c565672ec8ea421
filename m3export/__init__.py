"""m3export: MiniMax M3 out of PyTorch and into production runtimes."""

from .config import M3Config, preset
from .errors import ArtifactError, BackendUnavailable, CheckpointError, M3Error

__version__ = "0.1.0"


def load_model(path_or_preset, device="cpu", dtype=None, **kwargs):
    """A checkpoint directory or a preset name (random weights) -> ``M3ForCausalLM`` in eval mode."""
    from .checkpoint.loader import load_model as _load

    return _load(path_or_preset, device=device, dtype=dtype, **kwargs)


__all__ = [
    "ArtifactError", "BackendUnavailable", "CheckpointError", "M3Config", "M3Error", "load_model", "preset",
    "__version__",
]
