"""m3export: MiniMax M3 out of PyTorch and into production runtimes."""

import os as _os

# ``runtime/`` and ``plugins/`` sit beside this package in the source tree and are installed as
# ``m3export.runtime`` / ``m3export.plugins`` (pyproject's package-dir). When the tree itself is on ``sys.path``
# (``PYTHONPATH=.``, or pytest / python started in the repository root, where ``./m3export`` shadows an editable
# install) they are found by letting this package also search the tree's root for its subpackages.
_tree = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if (not _os.path.isdir(_os.path.join(__path__[0], "runtime"))
        and _os.path.isfile(_os.path.join(_tree, "pyproject.toml"))
        and _os.path.isfile(_os.path.join(_tree, "runtime", "__init__.py"))
        and _os.path.isfile(_os.path.join(_tree, "plugins", "__init__.py"))):
    __path__.append(_tree)

from .config import M3Config, preset
from .errors import ArtifactError, BackendUnavailable, CheckpointError, M3Error

__version__ = "0.1.0"


def load_model(path_or_preset, device="cpu", dtype=None, **kwargs):
    """A checkpoint directory or a preset name (random weights) -> ``M3ForCausalLM`` in eval mode.

    On a CUDA device the ``m3`` ops then run the Triton kernels of ``m3export.plugins.kernels`` (registered once
    per process; the references stay the CPU implementation and the definition of truth), and each attention
    layer's input projections share one weight buffer (``M3ForCausalLM.fuse_projections``).

    ``dtype`` None loads float32 on every device; on a GPU pass ``torch.bfloat16``, what ``Engine.from_checkpoint``
    and the CLI load there by default (``runtime.engine.checkpoint_dtype`` says why)."""
    from .checkpoint.loader import load_model as _load
    from .model import fusion

    model = _load(path_or_preset, device=device, dtype=dtype, **kwargs)
    fusion.serve_on(model, device)
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
