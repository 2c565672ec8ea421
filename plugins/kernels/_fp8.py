"""The FP8 (E4M3) cache row format inside kernels: quantise a row on the write path, with its fp32 scale.

Not a kernel module (it is not in ``KERNEL_MODULES``): the fused cache write (``qk_norm_rope_cache``) uses it and
the attention / indexer kernels read what it writes (``float(q) * scale``). The format is
``m3export.ops.kv_fp8`` (the reference): ``scale = amax / 448`` and ``q = e4m3(x / scale)`` rounded to nearest,
ties to even, per row; both divisions correctly rounded (``div_rn``), as PyTorch's.

The E4M3 byte is built by integer arithmetic on the fp32 bits and stored through a ``uint8`` view of the pool,
not by a float -> float8 cast: Triton's CPU interpreter does not round that cast (31.4 became 16), so the
interpreter-checked code and the GPU code are one and the same here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0


@triton.jit
def _div(a, b, INTERPRETED: tl.constexpr):
    """a / b correctly rounded (Triton's ``/`` is an approximate division on NVIDIA GPUs)."""
    if INTERPRETED:
        return a / b
    else:
        return tl.math.div_rn(a, b)


@triton.jit
def row_scale(x, keep, INTERPRETED: tl.constexpr):
    """x [R, D] fp32 (``keep`` marks the real elements) -> per-row scale [R] = amax / 448 (0 for a zero row)."""
    amax = tl.max(tl.where(keep, tl.abs(x), 0.0), axis=1)
    return _div(amax, 448.0, INTERPRETED)


@triton.jit
def encode_e4m3(x, scale, INTERPRETED: tl.constexpr):
    """x [R, D] fp32, scale [R] -> E4M3 bytes [R, D] uint8 of clamp(x / scale, +-448), RNE; 0 where scale is 0."""
    ok = scale[:, None] > 0
    y = _div(x, tl.where(ok, scale[:, None], 1.0), INTERPRETED)
    y = tl.where(ok, tl.minimum(tl.maximum(y, -448.0), 448.0), 0.0)
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) << 7
    a = tl.abs(y)
    abits = a.to(tl.uint32, bitcast=True)
    # normal range (a >= 2^-6): keep 3 mantissa bits, round to nearest even at bit 20; a carry moves the exponent
    r = abits + 0x7FFFF + ((abits >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # subnormal range (a < 2^-6): multiples of 2^-9; a * 512 < 8 rounds to an integer by adding 1.5 * 2^23
    # (one correctly rounded fp32 addition); 8 is the first normal code, 0x08, so the two ranges meet
    k = (a * 512.0 + 12582912.0) - 12582912.0
    sub = k.to(tl.uint32)
    code = tl.where(a >= 0.015625, normal, sub) | sign
    return code.to(tl.uint8)


@triton.jit
def widen(x, DTYPE: tl.constexpr):
    """E4M3 values as ``DTYPE`` (the query's) for the tensor-core dot: exact, every E4M3 value is a bf16, fp16
    and fp32 value (Hopper converts pairs, e4m3x2 -> f16x2); the row scales are applied to the dot's result (keys)
    or to P (values), never rounded in."""
    return x.to(DTYPE)


@triton.jit
def store_quantized(row_ptrs, scale_ptrs, x, keep, scale_keep, INTERPRETED: tl.constexpr):
    """Quantise rows x [R, D] fp32 (``keep`` marks the real elements) into the E4M3 bytes at ``row_ptrs`` (a uint8
    view of the pool) and their scales at ``scale_ptrs`` [R] (where ``scale_keep``)."""
    scale = row_scale(x, keep, INTERPRETED)
    tl.store(row_ptrs, encode_e4m3(x, scale, INTERPRETED), mask=keep)
    tl.store(scale_ptrs, scale, mask=scale_keep)


# How the attention kernels widen E4M3 K / V for bf16 queries (their settings ``fp8_widen``): "convert" (sm_90's
# e4m3x2 -> f16x2 and f16 -> bf16 conversions, ``widen``) or "bits" (``widen_by_bits``); the same values either way.
WIDENS = ("convert", "bits")


def check_widen(kernel: str, value: str) -> None:
    """Refuse an ``fp8_widen`` setting that is not one of ``WIDENS``, naming the kernel."""
    if value not in WIDENS:
        raise ValueError(f"{kernel}: fp8_widen {value!r} is not one of {WIDENS}")


def by_bits(setting: str, fp8_pool: bool, query_dtype) -> bool:
    """Whether a launch widens its E4M3 pool by bit placement (``widen_by_bits``): the setting ("bits" of the
    attention kernels' ``fp8_widen`` or the indexer scan's ``fp8_dot``) asks for it, the pool is FP8 and the
    queries are bf16 (the placement makes bf16; other queries widen by conversion to their own dtype)."""
    return fp8_pool and setting == "bits" and query_dtype == torch.bfloat16


# E4M3 -> bf16 without a conversion instruction, four bytes at a time (sm_90; ``widen_by_bits``): each byte
# sign-extended to 16 bits (PRMT's sign-replicate mode), shifted left by 4 and masked, which puts its sign at bit 15,
# its 4 exponent bits at the bottom of bf16's 8 and its 3 mantissa bits at the top of bf16's 7: the bf16 value is the
# E4M3 value x 2^-120, subnormals included (both formats' subnormals have the same 2^-6 / 2^-126 place); one exact
# bf16 multiply by 2^120 (0x7B80) restores it. E4M3's NaN codes (0x7F, 0xFF) would come out as +-480: the cache
# writers never store them (values are clamped to +-448).
_E4M3_TO_BF16_ASM = tl.constexpr("""{
.reg .b32 lo, hi, k;
mov.b32 k, 0x7B807B80;
prmt.b32 lo, $2, 0, 0x9180;
prmt.b32 hi, $2, 0, 0xB3A2;
shl.b32 lo, lo, 4;
shl.b32 hi, hi, 4;
and.b32 lo, lo, 0x87F087F0;
and.b32 hi, hi, 0x87F087F0;
mul.rn.bf16x2 $0, lo, k;
mul.rn.bf16x2 $1, hi, k;
}""")


@triton.jit
def widen_by_bits(x, INTERPRETED: tl.constexpr):
    """E4M3 values as bf16 for the tensor-core dot, exact as ``widen``'s, by integer bit placement and one bf16
    multiply per two values (``_E4M3_TO_BF16_ASM``) instead of sm_90's e4m3x2 -> f16x2 and f16 -> bf16 conversions,
    which issue at a quarter of the integer rate. The interpreter runs ``widen`` (it has no PTX); the GPU test
    ``tests/test_fp8_widen_gpu.py`` checks every byte against PyTorch's conversion."""
    if INTERPRETED:
        return widen(x, tl.bfloat16)
    else:
        return tl.inline_asm_elementwise(_E4M3_TO_BF16_ASM, "=r,=r,r", [x.to(tl.uint8, bitcast=True)],
                                         dtype=tl.bfloat16, is_pure=True, pack=4)

