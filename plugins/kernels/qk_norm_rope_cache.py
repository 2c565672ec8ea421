"""Fused per-head Gemma RMSNorm (``1 + w``) + partial NeoX RoPE + paged cache write, for q, k (+ v) and index keys.

Not an ``m3`` op (it is not in ``KERNEL_MODULES``): the model calls :func:`norm_rope` on CUDA in place of
``RMSNorm`` -> ``apply_rope`` -> ``write_pool`` (``m3export/model/{norm,rope,batch}.py``, the definition of these
steps), one launch per tensor instead of ~15 small ones. It reproduces their rounding: the norm in fp32 rounded
to the activation dtype once after the ``(1 + w)`` scale, then each RoPE product and sum rounded to that dtype as
the PyTorch ops do. The only difference left is the fp32 summation order of the mean square, which can move an
output by one unit in the last place of the activation dtype.

One program per (token, group of heads). Each row is read twice (at its own and at its rotation partner's
columns) instead of shuffled in registers: both reads hit L1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._batch import cdiv, interpreted, next_pow2
from ._fp8 import store_quantized


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """Round fp32 to the activation dtype (to nearest, ties to even) and back, as a PyTorch op in that dtype
    would. bf16 by bit arithmetic: Triton's interpreter truncates on a plain fp32 -> bf16 cast, the GPU rounds;
    this gives both the same, correctly rounded, result."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float32:
        return x
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _norm_rope(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, slots_ptr, pool_ptr, v_ptr, vpool_ptr, scale_ptr, vscale_ptr, eps,
    sx_t, sx_h, so_t, so_h, sc_t, sp_p, sp_r, sp_h, sv_t, sv_h, svp_p, svp_r, svp_h, ss_p, ss_r, svs_p, svs_r,
    H: tl.constexpr, HB: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr,
    PAGE: tl.constexpr, WRITE_OUT: tl.constexpr, WRITE_POOL: tl.constexpr, WITH_V: tl.constexpr,
    FP8: tl.constexpr, INTERPRETED: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    d = tl.arange(0, BLOCK_D)
    ok = (h[:, None] < H) & (d[None, :] < D)
    dtype = x_ptr.dtype.element_ty
    row = x_ptr + t.to(tl.int64) * sx_t + h[:, None] * sx_h
    x = tl.load(row + d[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    scale = 1.0 + tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    y = _round(x * rstd[:, None] * scale[None, :], dtype)
    # partial NeoX rotation of columns [0, 2 * HALF): pairs (i, i + HALF)
    first = d < HALF
    rotated = d < 2 * HALF
    partner = tl.where(first, d + HALF, tl.where(rotated, d - HALF, d))
    xp = tl.load(row + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    wp = 1.0 + tl.load(w_ptr + partner, mask=d < D, other=0.0).to(tl.float32)
    yp = _round(xp * rstd[:, None] * wp[None, :], dtype)
    i = tl.where(first, d, d - HALF)
    c = tl.load(cos_ptr + t.to(tl.int64) * sc_t + i, mask=rotated, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + t.to(tl.int64) * sc_t + i, mask=rotated, other=0.0).to(tl.float32)
    a = _round(y * c[None, :], dtype)
    b = _round(yp * s[None, :], dtype)
    out = _round(tl.where(first[None, :], a - b, a + b), dtype)
    out = tl.where(rotated[None, :], out, y)
    if WRITE_OUT:
        tl.store(out_ptr + t.to(tl.int64) * so_t + h[:, None] * so_h + d[None, :], out.to(dtype), mask=ok)
    if WRITE_POOL:
        slot = tl.load(slots_ptr + t).to(tl.int64)
        page = slot // PAGE
        r = slot % PAGE
        if FP8:  # E4M3 bytes (the pools arrive as uint8 views) + one fp32 scale per (token, head)
            store_quantized(pool_ptr + page * sp_p + r * sp_r + h[:, None] * sp_h + d[None, :],
                            scale_ptr + page * ss_p + r * ss_r + h, out, ok, h < H, INTERPRETED)
        else:
            tl.store(pool_ptr + page * sp_p + r * sp_r + h[:, None] * sp_h + d[None, :],
                     out.to(pool_ptr.dtype.element_ty), mask=ok)
        if WITH_V:
            v = tl.load(v_ptr + t.to(tl.int64) * sv_t + h[:, None] * sv_h + d[None, :], mask=ok, other=0.0)
            if FP8:
                store_quantized(vpool_ptr + page * svp_p + r * svp_r + h[:, None] * svp_h + d[None, :],
                                vscale_ptr + page * svs_p + r * svs_r + h, v.to(tl.float32), ok, h < H, INTERPRETED)
            else:
                tl.store(vpool_ptr + page * svp_p + r * svp_r + h[:, None] * svp_h + d[None, :],
                         v.to(vpool_ptr.dtype.element_ty), mask=ok)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
              pool: torch.Tensor | None = None, slots: torch.Tensor | None = None, v: torch.Tensor | None = None,
              v_pool: torch.Tensor | None = None, pool_scale: torch.Tensor | None = None,
              v_pool_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [T, H, D] (or [T, D] for the single index-key head) -> RMSNorm(1 + weight) then RoPE on the first
    ``2 * cos.shape[-1]`` columns. With ``pool`` ([pages, page, H, D] or [pages, page, D]) the result is written
    at ``slots`` [T] (slot = page * page_size + row) and nothing is returned; ``v`` / ``v_pool`` are then written
    at the same slots unchanged. Without ``pool`` the result is returned. The pools are updated in place.
    FP8 (float8_e4m3fn) pools are written quantised per (token, head) row, each row's fp32 scale into
    ``pool_scale`` / ``v_pool_scale`` (the pool's shape without D), as ``m3export.ops.kv_fp8.quantize_rows``."""
    single = x.dim() == 2
    xs = x.unsqueeze(1) if single else x
    t, h, d = xs.shape
    half = cos.shape[-1]
    if 2 * half > d or cos.shape != sin.shape or cos.shape[0] != t:
        raise ValueError(f"norm_rope: cos/sin {tuple(cos.shape)} do not fit x {tuple(x.shape)}")
    if xs.stride(2) != 1 or cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError("norm_rope: x, cos and sin must be contiguous in their last dimension")
    out = None if pool is not None else torch.empty_like(xs)
    if t == 0:
        return None if pool is not None else out.view_as(x)
    hb = min(next_pow2(h), 16)
    dummy = xs
    if pool is not None:
        pv = pool.unsqueeze(2) if pool.dim() == 3 else pool
        if pv.shape[2:] != (h, d) or pv.stride(3) != 1:
            raise ValueError(f"norm_rope: pool {tuple(pool.shape)} does not hold rows of {tuple(xs.shape[1:])}")
        if slots is None or slots.shape != (t,):
            raise ValueError("norm_rope: a pool needs slots [T]")
    if v is not None:
        if v_pool is None or v.shape != xs.shape or v_pool.shape != pool.shape or v.stride(2) != 1:
            raise ValueError("norm_rope: v needs a v_pool shaped like the key pool and v shaped like x")
    from m3export.ops.kv_fp8 import check_pair

    fp8 = pool is not None and pool.dtype == torch.float8_e4m3fn
    if pool is not None:
        check_pair("pool", pool, pool_scale)
        if v_pool is not None:
            check_pair("v_pool", v_pool, v_pool_scale)
    pv = pv if pool is not None else dummy.unsqueeze(0)
    vv = v if v is not None else dummy
    vp = v_pool if v_pool is not None else pv
    if fp8:  # bytes written by the kernel's own E4M3 rounding (``_fp8``); scales [pages, page, H]
        pv, vp = pv.view(torch.uint8), vp.view(torch.uint8)
        sc = pool_scale.view(pv.shape[:3])
        vsc = v_pool_scale.view(pv.shape[:3]) if v_pool_scale is not None else sc
    else:
        sc = vsc = cos
    sc_strides = (sc.stride(0), sc.stride(1)) if fp8 else (0, 0)
    vsc_strides = (vsc.stride(0), vsc.stride(1)) if fp8 else (0, 0)
    _norm_rope[(t, cdiv(h, hb))](
        xs, weight, cos, sin, out if out is not None else dummy, slots if slots is not None else cos, pv, vv, vp,
        sc, vsc, eps, xs.stride(0), xs.stride(1), (out if out is not None else xs).stride(0),
        (out if out is not None else xs).stride(1), cos.stride(0), pv.stride(0), pv.stride(1), pv.stride(2),
        vv.stride(0), vv.stride(1), vp.stride(0), vp.stride(1), vp.stride(2), *sc_strides, *vsc_strides,
        H=h, HB=hb, D=d, BLOCK_D=next_pow2(max(d, 2)), HALF=half, PAGE=pv.shape[1], WRITE_OUT=out is not None,
        WRITE_POOL=pool is not None, WITH_V=v is not None, FP8=fp8, INTERPRETED=interpreted(x),
        num_warps=4 if not interpreted(x) else 1,
    )
    return None if pool is not None else out.view_as(x)
