"""When a call of the model runs its fused CUDA kernels instead of the plain ops that define it.

One condition for all of them (the QK norm + RoPE + cache write of ``attention``, the residual add + RMSNorm of
``norm.add_norm``, the projections of one input in one launch, ``linear.FusedLinears``): eager or graph-captured
CUDA steps of the runtime (``inplace``) while the Triton kernels of ``m3export.plugins.kernels`` serve the ops
(registered by ``use_on`` where a model is put on CUDA, and not inside ``references()``). Export, the CPU and the
references keep the plain ops, so exported graphs do not depend on it.

Callers look it up through this module (``fusion.use_fused_kernels(...)``) at call time, so a test can force the
fused path on the CPU by patching this one name.
"""

from __future__ import annotations

import torch


def kernels_serve(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run the ops for activations ``x``: CUDA, registered by ``use_on``, not inside
    ``references()``. Code that calls a kernel's launcher directly outside a runtime step (the expert-parallel MoE
    of ``parallel/layers.py``) asks this; the fused paths ask ``use_fused_kernels``."""
    if not x.is_cuda:
        return False
    try:
        from m3export.plugins.kernels import active
    except ImportError:  # an install without the plugins: the references serve CUDA too
        return False
    return active()


def use_fused_kernels(x: torch.Tensor, inplace: bool) -> bool:
    """Whether this call (activations ``x``; ``inplace``: a runtime step that may update its pools in place) runs
    the fused kernels."""
    return bool(inplace) and kernels_serve(x)


def serve_on(model, device) -> bool:
    """Where a model is put on ``device`` (``m3export.load_model``, the torch backend): on CUDA the Triton kernels
    become the ops' implementation (``use_on``) and, where they serve, each layer's input projections are fused
    into one launch (``M3ForCausalLM.fuse_projections``; idempotent). Returns whether the kernels serve."""
    if torch.device(device).type != "cuda":
        return False
    from m3export.plugins.kernels import use_on

    serving = use_on(device)
    if serving:
        model.fuse_projections()
    return serving
