"""``m3::mxfp8_linear`` on the GPU: W8A16 GEMM / GEMV with MXFP8 weights dequantised tile by tile on chip.

Semantics: ``m3export.ops.moe.mxfp8_linear_reference`` (``docs/ops.md`` §7-8). sm_90 has no MXFP8 tensor-core
instruction, so each program loads a ``[BLOCK_N, BLOCK_K]`` tile of E4M3 bytes plus its UE8M0 scales, turns it into
activation-dtype values (exact: an E4M3 value times a power of two fits bf16 and fp32) and feeds the tensor cores
with activations that are never quantised. The whole weight is never dequantised in memory: weights stay at one
byte per element, which is what a decode step has to stream.

``weight_dot``, ``dot_acc`` and ``cast`` are shared with the MoE kernels (``moe.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton import cdiv

from m3export.ops import mxfp8

OP = "m3::mxfp8_linear"

# 2**-127: the one UE8M0 scale that is an fp32 subnormal, so it cannot be built by shifting the byte into the
# exponent field like the others (255 << 23 is +inf, which docs/ops.md §8 specifies for the byte 255).
_SCALE_ZERO_BYTE = tl.constexpr(5.877471754111438e-39)

# Triton 3.6's interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even); ``cast`` rounds explicitly there
# so that CPU tests see the same roundings as the device. Fixed when the module is imported, as jit functions are.
_INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def cast(x, DTYPE: tl.constexpr):
    """``x.to(DTYPE)`` with round-to-nearest-even also under the interpreter."""
    if _INTERPRETED:
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True).to(DTYPE)
    return x.to(DTYPE)


@triton.jit
def _e4m3_value(w):
    """E4M3 -> fp32. The device converts 0x7F / 0xFF to NaN; Triton 3.6's interpreter decodes them as +-480, so
    under the interpreter the NaN codes are restored explicitly (CPU tests then see what the GPU computes)."""
    v = w.to(tl.float32)
    if _INTERPRETED:
        v = tl.where((w.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F, float("nan"), v)
    return v


@triton.jit
def _scale_value(s):
    """UE8M0 bytes -> fp32 powers of two, built in the exponent field (exact, no exp2 approximation)."""
    s = s.to(tl.int32)
    return tl.where(s == 0, _SCALE_ZERO_BYTE, (s << 23).to(tl.float32, bitcast=True))


@triton.jit
def weight_dot(x, acc, w_rows, s_rows, k0, sw_k, ss_k, n_ok, K: tl.constexpr, BLOCK_K: tl.constexpr,
               MXFP8: tl.constexpr, MX_MODE: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr):
    """acc += x [BM, BLOCK_K] @ W[rows, k0 : k0 + BLOCK_K]^T, W in its stored dtype (``w_rows``: row pointers).

    MXFP8 tiles become activation-dtype values on chip, three ways (``MX_MODE``, all exact):
    0: each element's scale byte gathered (column k // 32) and multiplied in;
    1: one scale per 32 columns loaded as a [BN, BLOCK_K / 32] tile and broadcast over a reshaped tile;
    2: ``tl.dot_scaled`` (bf16 activations only; Triton lowers it to the same upcast on sm_90; not available
       under the interpreter).
    Modes 1 and 2 and bf16 weights are ``tile_dot`` on the loaded tile (the MoE kernels' TMA path shares it).
    """
    k = k0 + tl.arange(0, BLOCK_K)
    mask = n_ok[:, None] & (k[None, :] < K)
    w = tl.load(w_rows[:, None] + k[None, :] * sw_k, mask=mask, other=0.0)
    # One return at the end: Triton compiles the code after a return inside a constexpr branch too.
    if MXFP8 and MX_MODE == 0:
        s = tl.load(s_rows[:, None] + (k[None, :] // 32) * ss_k, mask=mask, other=127)
        acc = dot_acc(x, tl.trans(cast(_e4m3_value(w) * _scale_value(s), x.dtype)), acc, F32, PREC)
    else:
        acc = tile_dot(x, acc, w, s_rows, k0, ss_k, n_ok, K, MXFP8, MX_MODE, F32, PREC)
    return acc


@triton.jit
def tile_scales(s_rows, k0, ss_k, n_ok, K: tl.constexpr, BK: tl.constexpr):
    """The UE8M0 scales [BN, BK / 32] of a weight tile's rows (``s_rows``) at columns k0 .. k0 + BK."""
    g = k0 // 32 + tl.arange(0, BK // 32)
    return tl.load(s_rows[:, None] + g[None, :] * ss_k, mask=n_ok[:, None] & (g[None, :] < K // 32), other=127)


@triton.jit
def tile_dot(x, acc, w, s_rows, k0, ss_k, n_ok, K: tl.constexpr, MXFP8: tl.constexpr, MX_MODE: tl.constexpr,
             F32: tl.constexpr, PREC: tl.constexpr):
    """acc += x [BM, BK] @ w^T for a weight tile w [BN, BK] already loaded: bf16 / fp32 weights, or MXFP8 with
    MX_MODE 1 or 2 (``weight_dot``); ``s_rows`` [BN] address the rows' scales."""
    if not MXFP8:
        acc = dot_acc(x, tl.trans(cast(w, x.dtype)), acc, F32, PREC)
    else:
        BN: tl.constexpr = w.shape[0]
        BK: tl.constexpr = w.shape[1]
        s = tile_scales(s_rows, k0, ss_k, n_ok, K, BK)
        if MX_MODE == 2:
            acc = tl.dot_scaled(x, None, "bf16", tl.trans(w), s, "e4m3", acc)
        else:
            w3 = tl.reshape(_e4m3_value(w), (BN, BK // 32, 32)) * _scale_value(s)[:, :, None]
            acc = dot_acc(x, tl.trans(cast(tl.reshape(w3, (BN, BK)), x.dtype)), acc, F32, PREC)
    return acc


@triton.jit
def dot_acc(a, b, acc, F32: tl.constexpr, PREC: tl.constexpr):
    """acc += a @ b. ``F32`` multiplies in fp32: for fp32 activations, and under the interpreter, whose 16-bit
    dot is wrong in Triton 3.6 (a product of two bf16 values is exact in fp32, so nothing changes but speed)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _mxfp8_linear(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N,
    sx_m, sw_n, sw_k, ss_n, ss_k, sy_m,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr,
    PREC: tl.constexpr, MX_MODE: tl.constexpr,
):
    # K is a compile-time constant (a model dimension): loop bounds from runtime scalars do not run under the
    # Triton 3.6 interpreter with numpy 2, and a fixed trip count lets the compiler pipeline the loads anyway.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_rows = w_ptr + n.to(tl.int64) * sw_n
    s_rows = s_ptr + n.to(tl.int64) * ss_n
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * sx_m + k[None, :], mask=m_ok[:, None] & (k[None, :] < K),
                    other=0.0)
        acc = weight_dot(x, acc, w_rows, s_rows, k0, sw_k, ss_k, n_ok, K, BLOCK_K, True, MX_MODE, F32, PREC)
    tl.store(y_ptr + m[:, None].to(tl.int64) * sy_m + n[None, :], cast(acc, y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def check_mxfp8(name: str, weight: torch.Tensor, scale: torch.Tensor) -> None:
    """One clear error for a malformed MXFP8 pair (the kernels would read garbage instead)."""
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}: MXFP8 values must be float8_e4m3fn, got {weight.dtype}")
    if scale.dtype != torch.uint8:
        raise TypeError(f"{name}: MXFP8 scales must be uint8 (UE8M0), got {scale.dtype}")
    *lead, n, k = weight.shape
    if k % 32 or tuple(scale.shape) != (*lead, n, k // 32):
        raise ValueError(f"{name}: scale shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)} / 32")


def mx_mode2_available(dtype: torch.dtype) -> bool:
    """``tl.dot_scaled`` takes bf16 activations and has no interpreter implementation; and it reads UE8M0 byte 0
    as 0 (docs/ops.md §8: 2^-127), so not once weights with that byte are loaded (``mxfp8.zero_scales_seen``)."""
    return dtype == torch.bfloat16 and not triton.knobs.runtime.interpret and not mxfp8.zero_scales_seen()


def check_mx_mode(mode: int, dtype: torch.dtype) -> None:
    if mode == 2 and not mx_mode2_available(dtype):
        zeros = mxfp8.zero_scales_loaded()
        if zeros:
            where = next(iter(zeros))
            raise ValueError(f"MX_MODE 2 (tl.dot_scaled) reads UE8M0 byte 0 as 0, not 2^-127, and {where} (and "
                             f"{len(zeros) - 1} more) holds such scales: use MX_MODE 1 or 3")
        raise ValueError("MX_MODE 2 (tl.dot_scaled) needs bf16 activations and compiled kernels")


def use_f32_dot(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or bool(triton.knobs.runtime.interpret)


def tile_config(m: int, mx_mode2: bool = True) -> dict:
    """Tiles and MXFP8 path from the row count: GEMV tiles at decode (16 rows, the smallest tensor-core tile; many
    narrow N tiles so the weight stream is spread over every SM; per-32 scale broadcast), wgmma-sized tiles with
    ``tl.dot_scaled`` once there are rows to fill them: the choices the grouped MoE GEMMs measured best on the
    H200 (``moe.gemm_config``; this kernel is the same loop with one expert)."""
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4, MX_MODE=1)
    mode = 2 if mx_mode2 else 1
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3, MX_MODE=mode)
    return dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3, MX_MODE=mode)


def gemv_config(m: int) -> dict | None:
    """The CUDA-core GEMV tile (``gemv.py``) where the H200 measured it faster than ``tile_config``'s: one row.
    8-row tiles over 512-wide K steps at 2 warps, 3 named stages (PIPELINE: cp.async through shared memory), each
    K step summed per 32-column group and scaled once per group (GSUM, ``gemv._group_dot``: only the fp32 summation
    order changes). bench/moe.py's "gemv_bn8_bk512_w2_pipe3_gsum" (LINEAR_ROUND6), measured on the H200 (2026-12-01
    ~10:45 UTC, commit cf7c9e8, ``python3 bench/moe.py --only linear --formats mxfp8 --decode-variants ...``,
    bench/results/moe_h200_linear_gsum.json; graph replays, 4.24 TB/s copy): 8192 x 6144 28.1 -> 23.9 us (43 -> 51 %
    of copy bandwidth), 6144 x 8192 26.8 -> 22.0, the fused sparse-layer projections 9856 x 6144 31.7 -> 25.2 (46 ->
    58 %), the dense layers' 9216 x 6144 29.4 -> 24.4; same error against the fp32 reference; its GPU test
    (tests/test_linear_gemv_sweep.py: bf16 / fp16 / fp32 activations at the step's shapes) passed in the same call.
    The tile it replaced (BN 8 / BK 256 at 4 warps, PIPELINE 4: round 3's winner, 2026-12-01 00:35 UTC) is the
    sweep's "gemv_pipe4", the one before that "gemv_4warps". At 8 rows the tensor-core tiles won (the GEMV tiles
    took 3-4x longer), so only m == 1 takes it."""
    if m == 1:
        return dict(GEMV=1, BLOCK_N=8, BLOCK_K=512, num_warps=2, num_stages=3, PIPELINE=3, GSUM=1)
    return None


def forward(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    return run_linear(x, weight, weight_scale)


def run_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, config: dict | None = None
               ) -> torch.Tensor:
    """The launcher; ``config`` overrides the tiles (benchmarks): BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
    num_stages, MX_MODE over ``tile_config``'s tensor-core tiles, or ``GEMV`` (the CUDA-core path of ``gemv.py``)
    with BLOCK_N, BLOCK_K, num_warps, num_stages. None: ``gemv_config`` where it applies, else ``tile_config``."""
    check_mxfp8("mxfp8_linear weight", weight, weight_scale)
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"mxfp8_linear: x has {x.shape[-1]} features, weight expects {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*lead, n)
    if config is None:
        config = gemv_config(m) or {}
    cfg = config if config.get("GEMV") else tile_config(m, mx_mode2_available(x.dtype)) | config
    if cfg.get("GEMV"):  # the CUDA-core decode path (gemv.py); imported here: gemv.py builds on this module
        from .gemv import linear_gemv

        linear_gemv(x2, weight, weight_scale, y, cfg)
        return y.reshape(*lead, n)
    check_mx_mode(cfg["MX_MODE"], x.dtype)
    _mxfp8_linear[(cdiv(n, cfg["BLOCK_N"]), cdiv(m, cfg["BLOCK_M"]))](
        x2, weight, weight_scale, y, m, n,
        x2.stride(0), weight.stride(0), weight.stride(1), weight_scale.stride(0), weight_scale.stride(1), y.stride(0),
        K=k, F32=use_f32_dot(x.dtype), PREC="tf32", **cfg,
    )
    return y.reshape(*lead, n)
