"""Triton kernels for the ``m3`` ops: the GPU implementations of the contract in ``docs/ops.md``.

One module per op (kernel + launcher, nothing else). Each module defines

* ``OP``: the torch op it implements, e.g. ``"m3::lightning_indexer"``;
* ``forward(...)``: the launcher, with exactly the reference's signature (``m3export.ops.<module>.<op>_reference``).

``KERNEL_MODULES`` lists them; :func:`kernels` imports the ones present and :func:`register` makes them the CUDA
implementations of the torch ops (``torch.library.register_kernel(op, "cuda", forward)``), so the model, the torch
backend and the TensorRT plugins run the same kernels while the references stay the definition of truth. The
conformance suite (``m3export.ops.conformance``) runs every launcher here against the references, on the GPU and,
at tiny sizes, on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings
from typing import Callable

# Modules of this package that hold one op's kernel each (added as they land).
KERNEL_MODULES: tuple[str, ...] = (
    "lightning_indexer", "paged_attention", "sparse_paged_attention", "moe", "moe_mxfp8", "mxfp8_linear",
)

_registered = False


class KernelsUnavailable(RuntimeError):
    """Triton (the ``[gpu]`` extra) is not installed, so no kernel can be built or interpreted."""


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernels() -> dict[str, Callable]:
    """Op name -> launcher for every kernel module present. Raises KernelsUnavailable without Triton."""
    if not triton_available():
        raise KernelsUnavailable("the m3 Triton kernels need triton: pip install 'm3export[gpu]'")
    out: dict[str, Callable] = {}
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        if module.OP in out:
            raise RuntimeError(f"two kernel modules implement {module.OP}")
        out[module.OP] = module.forward
    return out


def register() -> list[str]:
    """Register every kernel as the CUDA implementation of its op (idempotent). Returns the op names.

    Inside :func:`references` the registered implementations call the ops' references instead, so one process
    can run the same model both ways (the GPU checks compare them)."""
    global _registered
    import torch

    import m3export.ops  # noqa: F401  (defines the ops before kernels attach to them)

    found = kernels()
    if not _registered:
        for op, fn in found.items():
            torch.library.register_kernel(op, "cuda", _switchable(fn, _reference_of(op)))
        _registered = True
    return sorted(found)


def use_on(device) -> bool:
    """Called where a model is put on ``device`` (``m3export.load_model``, the torch backend): on CUDA the kernels
    become the ops' implementation. Without Triton the references keep running, with one warning. Returns
    whether kernels serve ``device``."""
    import torch

    if torch.device(device).type != "cuda":
        return False
    if not triton_available():
        global _warned
        if not _warned:
            warnings.warn("triton is not installed: the m3 ops run their PyTorch references on CUDA (slow); "
                          "pip install 'm3export[gpu]'", stacklevel=2)
            _warned = True
        return False
    register()
    return True


def active() -> bool:
    """Whether CUDA ops run the kernels now (registered, and not inside :func:`references`). The model asks this
    before using the fused QK-norm + RoPE + cache-write kernel, which is not an op."""
    return _registered and not _use_references


@contextlib.contextmanager
def references():
    """Within this block the CUDA ops run their references even where kernels are registered."""
    global _use_references
    before, _use_references = _use_references, True
    try:
        yield
    finally:
        _use_references = before


_use_references = False
_warned = False


def _reference_of(op: str) -> Callable:
    """``m3::foo`` -> ``m3export.ops.<module>.foo_reference`` (the definition of truth)."""
    from m3export import ops

    name = op.split("::", 1)[1] + "_reference"
    for module in (ops.indexer, ops.attention, ops.moe, ops.mxfp8):
        if hasattr(module, name):
            return getattr(module, name)
    raise RuntimeError(f"{op}: no reference function {name} in m3export.ops")


def _switchable(kernel: Callable, reference: Callable) -> Callable:
    @functools.wraps(kernel)
    def impl(*args, **kwargs):
        return (reference if _use_references else kernel)(*args, **kwargs)

    return impl
