"""Fused residual add + Gemma RMSNorm (``1 + w``): ``h = residual + x`` and ``RMSNorm(h)`` in one launch.

Not an ``m3`` op (it is not in ``KERNEL_MODULES``): the model calls :func:`add_rms_norm` on CUDA with the kernels
active (``m3export/model/norm.py: add_norm``) in place of PyTorch's ``residual + x`` and ``RMSNorm.forward``
(about eleven launches: the add, the fp32 cast, pow, mean, + eps, rsqrt, two products, the weight's cast, 1 + w,
the cast back). It repeats their roundings:

* the sum in fp32, rounded once to the activation dtype (what ``h + a`` does in bf16 / fp16), and the norm reads
  that rounded sum;
* the mean square as PyTorch's ``mean`` finishes it on each device: on CUDA the fp32 sum times fp32 ``1 / N``
  (its reduction's mean), on the CPU (Triton's interpreter) the sum divided by N (``sum`` then ``div_``);
* ``rsqrt`` as PyTorch's (``tl.math.rsqrt``: CUDA's ``rsqrtf``; ``1 / sqrt`` in the interpreter, as on the CPU),
  then ``(x * rstd) * (1 + w)`` in that order, rounded to the activation dtype once;
* no fused multiply-add (``enable_fp_fusion=False``): ``mean + eps`` rounds twice, as two PyTorch ops do.

What is left: the fp32 summation order of the squares (a tree here, PyTorch's own reduction there), which can move
the mean square, hence ``rstd``, by a few units in the last place of fp32 (at most (N + 4) 2^-24 relative: the
bound ``tests/test_kernels_rms_norm.py`` derives and checks), and so an output by one unit in the last place of the
activation dtype where its exact value lies that close to a rounding boundary (rare: at width 6144 under the
interpreter, no bf16 output and about 2e-5 of fp16 ones). The residual sum is bit-exact.

One program per row: the whole row (hidden 6144 in the release) is one block, any number of rows.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from ._batch import interpreted, next_pow2
from .qk_norm_rope_cache import _round


@triton.jit
def _add_rms_norm(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, eps, inv_n, sx, sr, so, sh,
                  N: tl.constexpr, BLOCK: tl.constexpr, RESIDUAL: tl.constexpr, MEAN_BY_FACTOR: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    dtype = x_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * sx + cols, mask=ok, other=0.0).to(tl.float32)
    if RESIDUAL:
        h = _round(tl.load(res_ptr + row * sr + cols, mask=ok, other=0.0).to(tl.float32) + h, dtype)
        tl.store(h_ptr + row * sh + cols, h.to(dtype), mask=ok)
    squares = tl.sum(h * h, axis=0)
    if MEAN_BY_FACTOR:
        mean_square = squares * inv_n
    else:
        mean_square = squares / N
    rstd = tl.math.rsqrt(mean_square + eps)
    scale = 1.0 + tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * so + cols, _round(h * rstd * scale, dtype).to(dtype), mask=ok)


@functools.cache
def _inverse(n: int) -> float:
    """fp32 ``1 / n``, correctly rounded in fp32 (the factor of PyTorch's CUDA mean), as a Python float."""
    return float(np.float32(1.0) / np.float32(n))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N] (and ``residual`` shaped and typed like it, or None), weight [N] -> (normed, new_residual):
    new_residual = residual + x (x itself, not a copy, without a residual), normed = RMSNorm(new_residual) with
    the Gemma ``1 + weight`` scale, both in x's dtype. Rows may be strided; the last dimension must be
    contiguous (a copy is made otherwise)."""
    n = x.shape[-1]
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device):
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} does not match x "
                         f"{tuple(x.shape)} {x.dtype}")
    if weight.shape != (n,):
        raise ValueError(f"add_rms_norm: weight {tuple(weight.shape)} does not fit rows of {n}")
    xs = x.reshape(-1, n)
    xs = xs if xs.stride(1) == 1 else xs.contiguous()
    out = torch.empty(xs.shape, dtype=x.dtype, device=x.device)
    rs = h = None
    if residual is not None:
        rs = residual.reshape(-1, n)
        rs = rs if rs.stride(1) == 1 else rs.contiguous()
        h = torch.empty_like(out)
    if xs.shape[0] and n:
        block = next_pow2(n)
        _add_rms_norm[(xs.shape[0],)](
            xs, rs if rs is not None else xs, weight, out, h if h is not None else out, eps, _inverse(n),
            xs.stride(0), (rs if rs is not None else xs).stride(0), out.stride(0), out.stride(0),
            N=n, BLOCK=block, RESIDUAL=residual is not None, MEAN_BY_FACTOR=not interpreted(x),
            num_warps=max(1, min(16, block // 512)), enable_fp_fusion=False,
        )
    return out.view(x.shape), (x if h is None else h.view(x.shape))
