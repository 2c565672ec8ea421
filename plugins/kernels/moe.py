"""``m3::moe`` on the GPU: device routing, grouped gate-up GEMM with SwiGLU-OAI fused, grouped down GEMM with the
routing weight fused, one combine with the shared expert. The MXFP8 op (``moe_mxfp8.py``) runs the same kernels.

Semantics: ``m3export.ops.moe.moe_reference`` (``docs/ops.md`` §5-6). Launches, none of which waits for the device:

1. routing (``moe_routing.route``) and the permutation (``moe_routing.group_by_expert``): assignments sorted by
   expert into row blocks of ``BLOCK_M``, one expert per block, sized from shapes alone;
2. ``_gate_up``: one program per (row block, ``BLOCK_N`` columns of I): the gate and the up tiles of the block's
   expert against the gathered token rows, SwiGLU-OAI (gate clamp, up clamp, alpha, +1) in the epilogue, the
   activation [rows, I] written once; the shared expert is the same kernel with the identity permutation;
3. ``_down``: one program per (row block, ``BLOCK_N`` columns of H): activation @ w2^T, rounded to the activation
   dtype as the reference rounds each expert's output, times the assignment's routing weight, stored in the
   assignment's slot of ``y [T, top_k + 1, H]`` (the last slot is the shared expert's);
4. ``_combine``: ``y_out = scaling * sum(routed slots) + shared slot`` in fp32, rounded once.

Weights are read tile by tile in their stored dtype (bf16, or E4M3 + UE8M0 dequantised on chip, never as a whole).
At decode a row block holds 16 rows (the smallest tensor-core tile) and the grid is spread over narrow N tiles, so
each selected expert's bytes are streamed once by many programs; in prefill blocks of 64-128 rows feed wgmma.
At one token the launcher takes the CUDA-core GEMV path of ``moe_gemv.py`` instead (``default_config``: the tiles
measured fastest on the H200 per batch bucket and weight format).
Differences from the reference are rounding only: the reference sums the routed experts in the activation dtype,
in expert order; this sums them in fp32 (more accurate by a few roundings in bf16, the same to ~1e-6 in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton import cdiv
from . import moe_gemv
from ._tma import descriptor_memory as _descriptor_memory  # noqa: F401  (the tests read it here)
from ._tma import ensure_descriptor_allocator as _ensure_descriptor_allocator
from .moe_routing import ExpertBlocks, group_by_expert, route
from .mxfp8_linear import (_INTERPRETED, _e4m3_value, _scale_value, cast, check_mx_mode, check_mxfp8,
                           mx_mode2_available, tile_dot, use_f32_dot, weight_dot)

OP = "m3::moe"


@triton.jit
def _tile_ids(GROUP_M: tl.constexpr, N_TILES: tl.constexpr):
    """(row block, N tile) of this program.

    GROUP_M 0: the 2-D grid as launched, row blocks varying fastest, so the programs in flight at one time share
    one N tile and span every row block: each N tile re-reads all the activation rows (100-200 MB at 4k tokens,
    more than the 50 MB L2), which then come from HBM again for every N tile (read from the code; no counters
    measured it). GROUP_M g >= 1: a 1-D grid walked in
    groups of g row blocks, the N tiles outer and the group's row blocks inner (Triton's grouped ordering): the
    group's activation rows stay in L2 while every N tile passes over them, and an expert's weight tile is read by
    its row blocks (neighbours in the permutation) one after the other."""
    if GROUP_M == 0:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    else:
        pid = tl.program_id(0)
        num_m = tl.num_programs(0) // N_TILES
        per_group = GROUP_M * N_TILES
        first_m = (pid // per_group) * GROUP_M
        size = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size
        pid_n = (pid % per_group) // size
    return pid_m, pid_n


def _e4m3_pair_asm(out: int, codes: str, nans: str) -> str:
    """PTX for one output register of ``_E4M3_BF16_ASM``: the pair of codes that prmt selector ``codes`` places,
    whose NaN flags selector ``nans`` spreads."""
    return (f"prmt.b32 a, $2, 0, {codes}; prmt.b32 n, f, 0, {nans}; shr.u32 t, a, 4; and.b32 a, a, 0x80008000;"
            f" and.b32 t, t, 0x07F007F0; and.b32 n, n, 0x7F807F80; or.b32 a, a, t; or.b32 ${out}, a, n;\n")


# ``_e4m3_tile_bf16``'s bits for four E4M3 codes b0..b3 in one register ($2, b0 lowest), two bf16 per output
# register ($0 = (b0, b1), $1 = (b2, b3), element 0 in the low half). prmt places b0 and b1 in the high bytes of
# the two halves (b << 8 per half); per half the sign stays at bit 15 and exponent and mantissa move to bits 4-10
# (>> 4). NaN codes (magnitude 0x7F): magnitude + 1 carries into bit 7 of the code's byte in f, prmt's
# sign-replicating selectors (nibbles 8-B) spread that bit over the code's half, and 0x7F80 of it is or-ed in (an
# all-ones exponent over the code's non-zero mantissa).
_E4M3_BF16_ASM = tl.constexpr("{ .reg .b32 f, a, t, n; and.b32 f, $2, 0x7F7F7F7F; add.u32 f, f, 0x01010101;\n"
                              + _e4m3_pair_asm(0, "0x1404", "0x9988") + _e4m3_pair_asm(1, "0x3424", "0xBBAA") + "}")
# The same bits for codes that are not NaN (0x7F / 0xFF), without the NaN flag: per output register the placing
# prmt, the shift and the two masks. Only for weights checked free of NaN codes (``moe_prefill_ws.FAST_CONVERT``).
_E4M3_BF16_NO_NAN_ASM = tl.constexpr(
    "{ .reg .b32 a, t;\n" + "".join(f"prmt.b32 a, $2, 0, {sel}; shr.u32 t, a, 4; and.b32 a, a, 0x80008000;"
                                     f" and.b32 t, t, 0x07F007F0; or.b32 ${out}, a, t;\n"
                                     for out, sel in ((0, "0x1404"), (1, "0x3424"))) + "}")


@triton.jit
def _e4m3_tile_bf16(w, s):
    """The integer E4M3 conversion ("MX_MODE 3"): an E4M3 tile [BN, BK] times its UE8M0 scales [BN, BK / 32] as
    bf16, by integer operations on the bits instead of the conversion instructions ``tl.dot_scaled`` lowers to on
    sm_90 (per element an E4M3 -> f16 ``cvt`` for two, an f16 -> bf16 ``cvt``, then a bf16 multiply; the
    conversions run at a quarter of the integer rate). The warp-specialised prefill (``moe_prefill_ws``) runs its
    PTX (``_E4M3_BF16_ASM``) in a converter partition; the Triton tiles here no longer take it (``_check_tma``
    says why), and the tests check this form, PTX included, against every code and scale. Exact, every code
    included:

    * E4M3 (bias 7) and bf16 (bias 127) differ in exponent bias by 120 and E4M3's 3 mantissa bits fit bf16's 7, so
      sign << 15 | (exponent and mantissa) << 4 is the bf16 of the value times 2^-120, normal or subnormal (an
      E4M3 subnormal lands on a bf16 subnormal of the same significand) and zero;
    * times 2^120 (exact: the result is the E4M3 value itself), then times the scale 2^(s - 127) built in the bf16
      exponent field (byte 0 is the subnormal 2^-127, byte 255 +inf as ``docs/ops.md`` §8 says), one rounding
      exactly as the reference's fp32 product rounded to bf16;
    * the NaN codes 0x7F / 0xFF get an all-ones exponent (their mantissa bits are already non-zero)."""
    BN: tl.constexpr = w.shape[0]
    BK: tl.constexpr = w.shape[1]
    if _INTERPRETED:  # no PTX here: the value it computes, in fp32 (Triton 3.6's interpreter multiplies bf16
        # wrongly and flushes bf16 subnormals); an E4M3 value times 2^(s - 127) is exact in fp32 (the smallest,
        # 2^-9 x 2^-127, is above fp32's least subnormal), so ``cast``'s one rounding is the GPU's.
        out = cast(tl.reshape(tl.reshape(_e4m3_value(w), (BN, BK // 32, 32)) * _scale_value(s)[:, :, None],
                              (BN, BK)), tl.bfloat16)
    else:  # four codes per 32-bit register, two bf16 per output register; packed bf16 multiplies
        u8 = w.to(tl.uint8, bitcast=True)
        v = tl.inline_asm_elementwise(_E4M3_BF16_ASM, "=r,=r,r", [u8], dtype=tl.bfloat16, is_pure=True, pack=4)
        v = v * tl.full((1, 1), 0x7B80, tl.uint16).to(tl.bfloat16, bitcast=True)  # 2^120 (exponent field 247)
        b = s.to(tl.uint16)
        f = tl.where(b == 0, 0x0040, b << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        out = tl.reshape(tl.reshape(v, (BN, BK // 32, 32)) * f[:, :, None], (BN, BK))
    return out


@triton.jit
def _gate_up(
    x_ptr, w_ptr, s_ptr, act_ptr, rows_ptr, block_expert_ptr, num_rows,
    sx_t, sw_e, sw_n, sw_k, ss_e, ss_n, ss_k, sa_p, alpha, limit,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, ROUTED: tl.constexpr, MXFP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr,
    MX_MODE: tl.constexpr, GU_FUSED: tl.constexpr = 0, GROUP_M: tl.constexpr = 0, TMA: tl.constexpr = 0,
    X_TMA: tl.constexpr = 0,
):
    """GU_FUSED 1: the gate and up tiles as one [2 x BLOCK_N, BLOCK_K] weight tile, rows interleaved (gate n, up n,
    ...), so each K step is one dot of twice the width instead of two (one wgmma of N = 2 x BLOCK_N, the activation
    tile read once), split back into gate and up in the epilogue. The same products and sums per output.
    GROUP_M: the order programs visit the tiles (``_tile_ids``; a 1-D grid when >= 1). TMA 1: the weight tiles
    come through a tensor descriptor made on the device (Hopper's bulk tensor copy; rows past I and columns past H
    read as zeros), the expert stack viewed as [E, 2, I, H] (gate, up); with GU_FUSED the gate and up tiles are one
    [1, 2, BLOCK_N, BLOCK_K] copy, stacked (gate rows, then up rows) instead of interleaved. Scales and the
    gathered activation rows are ordinary loads (a row gather by TMA is a Blackwell feature).
    X_TMA 1 (with TMA): the activation tile by TMA too, from rows in block order: for the routed experts ``x_ptr``
    is then a gathered copy (``_launch_gate_up``: row p holds the token of assignment p, padding rows a copy of a
    real one, not stored), for the shared expert x itself (rows past the tokens read as zeros)."""
    pid_m, pid_n = _tile_ids(GROUP_M, tl.cdiv(I, BLOCK_N))
    p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if ROUTED:
        e = tl.load(block_expert_ptr + pid_m)
        if e < 0:
            return
        a = tl.load(rows_ptr + p)
        ok = a < num_rows
        tok = a // TOP_K
    else:
        e = pid_m * 0  # the shared expert: a stack of one
        ok = p < num_rows
        tok = p
    dt = x_ptr.dtype.element_ty
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    if TMA:
        G: tl.constexpr = 2 if GU_FUSED else 1
        # Only expert e is read, so the leading extent e + 1 bounds it without the stack's size.
        desc = tl.make_tensor_descriptor(w_ptr, shape=[e + 1, 2, I, H], strides=[sw_e, I * sw_n, sw_n, 1],
                                         block_shape=[1, G, BLOCK_N, BLOCK_K])
        j = tl.arange(0, G * BLOCK_N)
        r = pid_n * BLOCK_N + j % BLOCK_N  # tile row j: gate row r (j < BLOCK_N) or up row I + r
        r_ok = r < I
        s_r = s_ptr + e.to(tl.int64) * ss_e + (r + (j // BLOCK_N) * I).to(tl.int64) * ss_n
        acc = tl.zeros((BLOCK_M, G * BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if X_TMA:  # x's rows: every row block's (routed: the grid's row blocks) or the tokens (shared)
            grid_m = tl.num_programs(0) // tl.cdiv(I, BLOCK_N) if GROUP_M else tl.num_programs(0)
            x_desc = tl.make_tensor_descriptor(x_ptr, shape=[grid_m * BLOCK_M if ROUTED else num_rows, H],
                                               strides=[sx_t, 1], block_shape=[BLOCK_M, BLOCK_K])
        for k0 in range(0, H, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            if X_TMA:
                x = x_desc.load([pid_m * BLOCK_M, k0])
            else:
                x = tl.load(x_ptr + tok[:, None].to(tl.int64) * sx_t + k[None, :],
                            mask=ok[:, None] & (k[None, :] < H), other=0.0)
            w = tl.reshape(desc.load([e, 0, pid_n * BLOCK_N, k0]), (G * BLOCK_N, BLOCK_K))
            acc = tile_dot(x, acc, w, s_r, k0, ss_k, r_ok, H, MXFP8, MX_MODE, F32, PREC)
            if not GU_FUSED:  # the up tile: a second copy and dot
                wu = tl.reshape(desc.load([e, 1, pid_n * BLOCK_N, k0]), (BLOCK_N, BLOCK_K))
                acc_u = tile_dot(x, acc_u, wu, s_r + I * ss_n, k0, ss_k, r_ok, H, MXFP8, MX_MODE, F32, PREC)
        if GU_FUSED:
            acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
        else:
            acc_g = acc
    elif GU_FUSED:
        j = tl.arange(0, 2 * BLOCK_N)
        r = pid_n * BLOCK_N + j // 2  # row j: gate row r (j even) or up row I + r (j odd)
        r_ok = r < I
        r = r + (j % 2) * I
        w_r = w_ptr + e.to(tl.int64) * sw_e + r.to(tl.int64) * sw_n
        s_r = s_ptr + e.to(tl.int64) * ss_e + r.to(tl.int64) * ss_n
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + tok[:, None].to(tl.int64) * sx_t + k[None, :], mask=ok[:, None] & (k[None, :] < H),
                        other=0.0)
            acc = weight_dot(x, acc, w_r, s_r, k0, sw_k, ss_k, r_ok, H, BLOCK_K, MXFP8, MX_MODE, F32, PREC)
        acc_g, acc_u = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    else:
        w_g = w_ptr + e.to(tl.int64) * sw_e + n.to(tl.int64) * sw_n  # gate rows; the up rows are I further
        s_g = s_ptr + e.to(tl.int64) * ss_e + n.to(tl.int64) * ss_n
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + tok[:, None].to(tl.int64) * sx_t + k[None, :], mask=ok[:, None] & (k[None, :] < H),
                        other=0.0)
            acc_g = weight_dot(x, acc_g, w_g, s_g, k0, sw_k, ss_k, n_ok, H, BLOCK_K, MXFP8, MX_MODE, F32, PREC)
            acc_u = weight_dot(x, acc_u, w_g + I * sw_n, s_g + I * ss_n, k0, sw_k, ss_k, n_ok, H, BLOCK_K, MXFP8,
                               MX_MODE, F32, PREC)
    # SwiGLU-OAI on the GEMM output rounded to the activation dtype, as the reference computes it.
    gate = tl.minimum(cast(acc_g, dt).to(tl.float32), limit)
    up = tl.minimum(tl.maximum(cast(acc_u, dt).to(tl.float32), -limit), limit)
    act = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    tl.store(act_ptr + p[:, None].to(tl.int64) * sa_p + n[None, :], cast(act, dt), mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _down(
    act_ptr, w_ptr, s_ptr, y_ptr, rows_ptr, block_expert_ptr, route_w_ptr, num_rows,
    sa_p, sw_e, sw_n, sw_k, ss_e, ss_n, ss_k, sy_t, sy_s,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, ROUTED: tl.constexpr, MXFP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr,
    MX_MODE: tl.constexpr, GROUP_M: tl.constexpr = 0, TMA: tl.constexpr = 0,
):
    """GROUP_M and TMA as in ``_gate_up``: tile order, weight tiles through a device-made tensor descriptor over
    the stack viewed as [E, H, I]."""
    pid_m, pid_n = _tile_ids(GROUP_M, tl.cdiv(H, BLOCK_N))
    p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if ROUTED:
        e = tl.load(block_expert_ptr + pid_m)
        if e < 0:
            return
        a = tl.load(rows_ptr + p)
        ok = a < num_rows
        tok = a // TOP_K
        slot = a % TOP_K
    else:
        e = pid_m * 0  # the shared expert: a stack of one
        ok = p < num_rows
        tok = p
        slot = tl.full((BLOCK_M,), TOP_K, tl.int32)
    dt = act_ptr.dtype.element_ty
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    w_rows = w_ptr + e.to(tl.int64) * sw_e + n.to(tl.int64) * sw_n
    s_rows = s_ptr + e.to(tl.int64) * ss_e + n.to(tl.int64) * ss_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        desc = tl.make_tensor_descriptor(w_ptr, shape=[e + 1, H, I], strides=[sw_e, sw_n, 1],
                                         block_shape=[1, BLOCK_N, BLOCK_K])
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(act_ptr + p[:, None].to(tl.int64) * sa_p + k[None, :], mask=ok[:, None] & (k[None, :] < I),
                    other=0.0)
        if TMA:
            w = tl.reshape(desc.load([e, pid_n * BLOCK_N, k0]), (BLOCK_N, BLOCK_K))
            acc = tile_dot(x, acc, w, s_rows, k0, ss_k, n_ok, I, MXFP8, MX_MODE, F32, PREC)
        else:
            acc = weight_dot(x, acc, w_rows, s_rows, k0, sw_k, ss_k, n_ok, I, BLOCK_K, MXFP8, MX_MODE, F32, PREC)
    y = cast(acc, dt).to(tl.float32)
    if ROUTED:
        y = y * tl.load(route_w_ptr + a, mask=ok, other=0.0)[:, None]
    tl.store(y_ptr + tok[:, None].to(tl.int64) * sy_t + slot[:, None] * sy_s + n[None, :], cast(y, dt),
             mask=ok[:, None] & n_ok[None, :])


@triton.jit
def _combine(y_ptr, out_ptr, T, sy_t, sy_s, so_t, scaling, H: tl.constexpr, TOP_K: tl.constexpr,
             BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    row = y_ptr + t.to(tl.int64) * sy_t + h
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(row + k * sy_s, mask=h_ok, other=0.0).to(tl.float32)
    shared = tl.load(row + TOP_K * sy_s, mask=h_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * so_t + h, cast(acc * scaling + shared, out_ptr.dtype.element_ty), mask=h_ok)


def block_m_for(num_assignments: int, num_experts: int) -> int:
    """Rows per block from the mean assignments per expert: 16 (the smallest tensor-core tile) at decode, 64 or
    128 in prefill. Larger blocks amortise each weight tile's load and dequantisation over more rows; smaller
    ones waste fewer padding rows (each expert in use pads up to BLOCK_M - 1). The launcher's default overrides
    the prefill blocks with the measured winners (``default_config``: MXFP8 64 / 256 rows, bf16 128 with 128-wide
    N tiles); the 16-row decode bucket and the bucket bounds are this table's."""
    mean = num_assignments / max(1, num_experts)
    if mean <= 16:
        return 16
    if mean <= 48:
        return 64
    return 128


def gemm_config(block_m: int, mx_mode2: bool = True) -> dict:
    """Tile sizes, launch parameters and MXFP8 path for both grouped GEMMs at a row tile (see block_m_for).

    No variant spills registers on sm_90 (``scripts/compile_moe_kernels_sm90.py`` prints the resources). Measured
    on the H200 with MXFP8 weights (``bench/moe.py``, docs/performance.md): at decode, narrow N tiles with one
    scale per 32 columns broadcast (``MX_MODE`` 1) ran 2.3-3.9x faster than the per-element scale gather and
    1.5-2.2x faster than ``tl.dot_scaled``; in prefill ``tl.dot_scaled`` (``MX_MODE`` 2) with 128-row blocks ran
    2-2.8x faster than the others. ``mx_mode2`` False (fp32 activations, the interpreter) falls back to mode 1.
    """
    if block_m <= 16:
        return dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4, MX_MODE=1)
    mode = 2 if mx_mode2 else 1
    if block_m <= 64:
        return dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3, MX_MODE=mode)
    return dict(BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3, MX_MODE=mode)


# The CUDA-core GEMV decode tiles (moe_gemv.py) that ran fastest on the H200 at one token (bench/moe.py round-3
# sweep, 2026-12-01 00:35 UTC, commit bd355ce, bench/results/moe_h200_round3.json; 128 experts, graph replays), each
# with the default's error against the fp32 oracle. Both name their K loop's stages (PIPELINE 4: Triton keeps three
# K steps of weights in flight through shared memory with cp.async). MXFP8: 4-row tiles at 2 warps (141.1 -> 123.3
# us, 49 -> 56 % of copy bandwidth); bf16: 8-row tiles at 4 warps (207 -> 175 us, 76 %). The tiles they replaced
# (MXFP8: BN 8 at 4 warps without PIPELINE; bf16: BN 4 with PREFETCH 2) are bench/moe.py's "gemv_4warps" and
# "gemv_bn4_prefetch2" variants, re-measured by every sweep.
# MXFP8 from round 5 (H200, 2026-12-01 06:30 UTC, commit ced295b, bench/results/moe_h200_decode_round5.json):
# bench/moe.py's "gemv_bn4_bk512_pipe3_sg_comb_gsum", 4-row tiles over 512-wide K steps in 3 pipelined stages, the
# shared expert as more rows of the routed launches' grid (SHARED_GRID), the combine in the down launch (COMBINE) and
# per-32-column group sums (GSUM): one token 119.9 -> 103.9 us (56 -> 67 % of copy bandwidth), within the
# reference's bound (only the fp32 summation order changes). It replaced "gemv_bn4_pipe4" (PIPELINE_SWEEP). Re-swept
# at 07:45 UTC (commit 2d00e02, moe_h200_decode_round5b.json, after the shared-grid load fix 4e00b6c): the same tile
# without COMBINE (the combine as its own launch, bit-identical) 101.7 us = 68 % against 110.5 with it: COMBINE off
# (and removed since, with the GEMV's TMA and SPLIT_K_DOWN keys, all slower in every pairing measured).
GEMV_DECODE = dict(GEMV=1, BLOCK_N=4, BLOCK_K=512, num_warps=2, num_stages=3, PIPELINE=3, SHARED_GRID=1, GSUM=1)
GEMV_DECODE_BF16 = dict(GEMV=1, BLOCK_N=8, BLOCK_K=256, num_warps=4, num_stages=4, PIPELINE=4)


# The prefill tiles that won bench/moe.py's round-4 sweep on the H200 (2026-12-01 03:40 UTC, commit a2ec016, mini
# dims, 128 experts, bf16 activations, bench/results/moe_h200_prefill_round4.json; each within the default's error
# against the fp32 oracle at 4k and equal to its output at 16k). Every one reads the weight tiles by TMA and walks
# the row blocks in groups of 8 (GROUP_M). MXFP8 at 4k tokens (128 assignments per expert): 64-row blocks, gate and
# up as one dot, 13.74 -> 10.53 ms (169 -> 221 TFLOP/s; _gate_up 8.25 -> 6.28 ms, _down 4.98 -> 3.51 ms). MXFP8 at
# 16k (512 per expert): 256-row blocks at 8 warps, 44.95 -> 33.27 ms (207 -> 280 TFLOP/s; _gate_up 27.5 -> 15.9
# ms, _down 16.3 -> 15.0 ms). bf16 at 4k and 16k: 128 x 128 tiles, 9.16 -> 6.43 ms (254 -> 362 TFLOP/s) and 29.95
# -> 19.97 ms (311 -> 466). The tiles they replaced are bench/moe.py's PREVIOUS_DEFAULTS "prefill_bm64_gu",
# "prefill_bm128_bn128" (MXFP8) and "prefill_bm128" (bf16), re-measured by every sweep.
PREFILL_MXFP8 = dict(BLOCK_M=64, GU_FUSED=1, GROUP_M=8, TMA=1)
# Round 5 (H200, 2026-12-01 05:55 UTC, bench/results/moe_h200_prefill_round5.json; again in round 6 at 06:36 UTC,
# moe_h200_prefill_round6_16k.json): 128-wide N tiles for the down GEMM (BLOCK_N_DOWN) halve its time at 16k (15.2
# -> 7.9 ms): 32.2 -> 25.5-26.6 ms (289 -> 350-365 TFLOP/s), output bit-equal to the tile without it (same K order).
# No round-6 key (SCALES_AHEAD, MX_MODE 4, ACT_TMA, X_TMA) beat it (the first three, slower in every pairing, are
# removed since); MX_MODE 3 with BLOCK_N_DOWN 128 FAILED its GPU test at mini dims: a register race in its
# pipelined loop (``_check_tma``), refused since.
PREFILL_MXFP8_LARGE = dict(BLOCK_M=256, GU_FUSED=1, BLOCK_N=64, num_warps=8, GROUP_M=8, TMA=1, BLOCK_N_DOWN=128)
PREFILL_BF16 = dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, TMA=1)
# MXFP8 weights and bf16 activations take the warp-specialised GEMMs (``moe_prefill_ws.WS_TILE``) above this many
# assignments per expert. H200 2026-12-02 13:11 UTC (``bench/moe_prefill_ab.py``, 128 experts, top-4, interleaved
# rounds, every output the same bits; bench/results/moe_prefill_ab_s23_crossover.json), ms against PREFILL_MXFP8:
# 1024 tokens (32 per expert) 6.50 / 4.60, 2048 (64) 6.76 / 6.25, 4096 (128) 7.72 / 10.54, 6144 (192) 9.46 / 14.88,
# 8192 (256) 12.74 / 19.46. Until then the split was 256 (not measured), which gave a prefill chunk of 8192 tokens
# the 64-row Triton tile at 239 TFLOP/s.
WS_LEAST_MEAN = 64


def default_config(t: int, num_assignments: int, num_experts: int, mxfp8: bool,
                   dtype: torch.dtype = torch.bfloat16, weights: "list[_Weights] | None" = None) -> dict:
    """The launcher's choice when the caller gives no ``config``, per batch bucket, weight format and activation
    dtype: the winners of the H200 sweeps (round 2, 2026-11-30 22:12 UTC, commit b0036a9; one token: round 3,
    2026-12-01 00:35 UTC, commit bd355ce; prefill: round 4, 2026-12-01 03:40 UTC, commit a2ec016; 128 experts, H
    6144, I 3072, top-4, bf16 activations), each checked against the fp32 oracle in that run.

    * One token: the CUDA-core GEMV (no permutation) with its K loop pipelined through shared memory,
      ``GEMV_DECODE`` with MXFP8 weights, ``GEMV_DECODE_BF16`` with bf16 weights.
    * 2 tokens up to the 16-row-block bucket (mean <= 16 assignments per expert, ``block_m_for``): the grouped
      tensor-core tiles of ``gemm_config(16)`` (BN 32, BK 128, 4 warps, 4 stages, MX_MODE 1), with MXFP8 weights as
      ``GU_FUSED`` (gate and up as one dot of twice the width, ``_gate_up``): it won at 8 and 64 tokens. bf16
      weights take the plain tiles there (they won at 8 tokens over the GEMV; GU_FUSED not measured with bf16).
      Batches 2-7 are not measured: they take the bucket of 8.
    * MXFP8 in prefill with bf16 activations, above ``WS_LEAST_MEAN`` assignments per expert: the
      warp-specialised Gluon GEMMs of ``moe_prefill_ws`` (``WS_TILE``: 256-row tiles, the E4M3 conversion on its
      own warps; H200 2026-12-01 11:10 UTC, 16k tokens: 22.76 against 25.38 ms for ``PREFILL_MXFP8_LARGE``; 2026-12-02
      at 4k / 8k tokens 7.72 / 12.74 against 10.54 / 19.46 ms for ``PREFILL_MXFP8``; outputs bit-equal), where they
      can run: ``weights`` given (the launcher's four stacks) and ``moe_prefill_ws.why_not`` without a reason (no
      CUDA device, weights TMA cannot read); without ``weights`` the choice by shapes. Otherwise ``PREFILL_MXFP8``
      (64-row blocks, TMA) up to 256 assignments per expert (measured at 4k tokens = 128 per expert) and
      ``PREFILL_MXFP8_LARGE`` (256-row blocks, TMA) above (measured at 16k = 512 per expert). bf16 weights:
      ``PREFILL_BF16`` (128 x 128 tiles, TMA) from ``block_m_for``'s 128-row bucket (mean > 48; measured at 128
      and 512 per expert); between 16 and 48 per expert (not measured) its 64-row blocks.
    * fp32 activations (tests, precision runs; none measured) keep the prefill tiles from before round 4: the
      round-4 tiles were sized for 16-bit activation tiles, and in fp32 the 256-row block's activation stages
      alone would fill the 227 KB of shared memory.
    Returned as an override dict, so the shared expert gets exactly the tiles the sweep ran it with. Every tile
    here computes the same function (rounding points unchanged, sums in fp32 in another order). Where the weights
    cannot be read by TMA (``tma_unusable``) the launcher runs the same tile without it. The settings these
    replaced are named variants of ``bench/moe.py``'s sweep (``PREVIOUS_DEFAULTS``), re-measured each run."""
    if t == 1:
        return dict(GEMV_DECODE if mxfp8 else GEMV_DECODE_BF16)
    mean = num_assignments / max(1, num_experts)
    bm = block_m_for(num_assignments, num_experts)
    wide = dtype.itemsize <= 2
    if not mxfp8:
        return dict(PREFILL_BF16) if bm == 128 and wide else {}
    if bm <= 16:
        return {"GU_FUSED": 1}
    if dtype == torch.bfloat16 and mean > WS_LEAST_MEAN:  # the warp-specialised Gluon GEMMs where they can run
        from .moe_prefill_ws import WS_TILE, why_not

        if weights is None or why_not(weights, dtype, WS_TILE) is None:
            return dict(WS_TILE)
    if mean <= 256:
        return dict(PREFILL_MXFP8) if wide else {"BLOCK_M": 64, "GU_FUSED": 1}
    return dict(PREFILL_MXFP8_LARGE) if wide else {"BLOCK_M": 128, "BLOCK_N": 128}


def _grid(grid_m: int, grid_n: int, cfg: dict) -> tuple:
    """The launch grid: 2-D (row blocks, N tiles), or 1-D when ``GROUP_M`` orders the tiles (``_tile_ids``)."""
    return (grid_m * grid_n,) if cfg.get("GROUP_M") else (grid_m, grid_n)


def tma_unusable(weights: "list[_Weights]") -> str | None:
    """Why the TMA path cannot read these weight stacks, or None. A tensor descriptor (Hopper's bulk tensor copy)
    needs a 16-byte aligned base, unit stride along K and every other stride a multiple of 16 bytes: the model's
    parameters ([E, 2I, H] / [E, H, I] stacks and the shared expert's [2I, H] / [H, I], MXFP8 or bf16, the MTP
    layer's too) meet that whenever the row length in bytes is a multiple of 16 (H and I at every preset); a
    tensor-parallel slice of I that is not, or a view with an odd offset, does not."""
    for w in weights:
        size = w.w.element_size()
        if w.w.stride(-1) != 1 or w.w.data_ptr() % 16 or any(st * size % 16 for st in w.w.stride()[:-1]):
            return (f"TMA needs contiguous weight rows with 16-byte aligned base and strides, got shape "
                    f"{tuple(w.w.shape)} strides {w.w.stride()} ({w.w.dtype})")
    return None


def _check_tma(cfg: dict, weights: "list[_Weights]", fallback: bool) -> dict:
    """``cfg`` as the launch will run it. TMA reads each expert stack through a device-made tensor descriptor: the
    MX_MODE 1 / 2 scale paths (``mxfp8_linear.tile_dot``), weights ``tma_unusable`` accepts, and on the GPU a
    global-memory allocator for the descriptors. Weights TMA cannot read: with ``fallback`` (the launcher's own
    default, inside a model step) the same tile without TMA; without it (a config the caller chose) a ValueError.
    ``X_TMA`` exists on the TMA path only.

    MX_MODE 3 (the integer E4M3 conversion feeding the transposed product, the converted weights the wgmma's
    register operand) is refused: its tiles gave wrong outputs on the H200, not in every run (kernel error inf /
    42.1 at mini dims, docs/performance.md), and in the sm_90 SASS of their pipelined K loop (Triton 3.6) the next
    K step's conversion writes registers that a wgmma still pending from the step before reads as its A operand
    (``scripts/compile_moe_kernels_sm90.py``'s ``pending_a_writes``; at 256-row blocks 1 in the 64-wide down tile,
    4 in the 128-wide one, 12 in the fused gate-up; none in any MX_MODE 2 tile). It lost to the defaults where it
    ran (31.05 against 25.48 ms at 16k, 10.70 against 10.53 at 4k)."""
    mx = weights[0].mxfp8
    if mx and cfg["MX_MODE"] not in (0, 1, 2):
        raise ValueError(f"moe: MX_MODE must be 0, 1 or 2 with MXFP8 weights, got {cfg['MX_MODE']}"
                         + (" (3, the integer conversion, raced in its pipelined loop on the H200)"
                            if cfg["MX_MODE"] == 3 else ""))
    if not cfg.get("TMA"):
        if cfg.get("X_TMA"):
            raise ValueError("moe: X_TMA needs TMA 1")
        return cfg
    if mx and cfg["MX_MODE"] == 0:
        raise ValueError("moe: TMA takes MX_MODE 1 or 2 with MXFP8 weights, got 0")
    why = tma_unusable(weights)
    if why is not None:
        if not fallback:
            raise ValueError(f"moe: {why}")
        return {**{k: v for k, v in cfg.items() if k != "X_TMA"}, "TMA": 0}
    if not triton.knobs.runtime.interpret:
        _ensure_descriptor_allocator()
    return cfg


def _launch_gate_up(x, w: "_Weights", act, blocks: ExpertBlocks | None, num_rows, alpha, limit, h, i, top_k, bm,
                    cfg, f32, prec):
    """Routed experts (``blocks`` given) or the shared expert (identity rows, expert 0 of a stack of one).
    ``X_TMA``: the routed rows are gathered into block order first (one copy of [blocks' rows, H]: 0.8 GB and
    ~0.3 ms at 16k tokens x top-4, what the TMA tile must repay), the shared expert reads x itself (a copy only
    where x's rows are not 16-byte aligned, which TMA needs)."""
    routed = blocks is not None
    grid_m = blocks.num_blocks if routed else cdiv(num_rows, bm)
    rows, block_expert = (blocks.rows, blocks.block_expert) if routed else (act, act)  # unused when not routed
    if cfg.get("X_TMA"):
        if routed:  # padding rows (index num_rows) copy the last assignment's token: computed, never stored
            x = x.index_select(0, blocks.rows.clamp(max=num_rows - 1) // top_k)
        elif x.data_ptr() % 16 or x.stride(0) * x.element_size() % 16:
            x = x.clone(memory_format=torch.contiguous_format)
    _gate_up[_grid(grid_m, cdiv(i, cfg["BLOCK_N"]), cfg)](
        x, w.w, w.s, act, rows, block_expert, num_rows, x.stride(0), *w.strides(), act.stride(0), alpha, limit,
        H=h, I=i, TOP_K=top_k, ROUTED=routed, MXFP8=w.mxfp8, BLOCK_M=bm, F32=f32, PREC=prec,
        **{k: v for k, v in cfg.items() if k != "BLOCK_N_DOWN"},  # the down key
    )


def _launch_down(act, w: "_Weights", y, blocks: ExpertBlocks | None, route_w, num_rows, h, i, top_k, bm, cfg, f32,
                 prec):
    """``BLOCK_N_DOWN`` (optional): the down GEMM's own N tile. Every N tile re-reads the block's activation rows
    ([BLOCK_M, I]), so a narrow one multiplies that traffic (BN 64 over H 6144: 96 passes); the gate-up GEMM keeps
    ``BLOCK_N``."""
    routed = blocks is not None
    grid_m = blocks.num_blocks if routed else cdiv(num_rows, bm)
    rows, block_expert = (blocks.rows, blocks.block_expert) if routed else (act, act)
    bn = cfg.get("BLOCK_N_DOWN") or cfg["BLOCK_N"]
    _down[_grid(grid_m, cdiv(h, bn), cfg)](
        act, w.w, w.s, y, rows, block_expert, route_w if routed else act, num_rows, act.stride(0), *w.strides(),
        y.stride(0), y.stride(1), H=h, I=i, TOP_K=top_k, ROUTED=routed, MXFP8=w.mxfp8, BLOCK_M=bm, F32=f32,
        PREC=prec, BLOCK_N=bn,
        **{k: v for k, v in cfg.items() if k not in ("GU_FUSED", "BLOCK_N", "BLOCK_N_DOWN", "X_TMA")},  # gate-up keys
    )


class _Weights:
    """One expert stack (or the shared expert as a stack of one): values, scales, strides, MXFP8 or not."""

    def __init__(self, w: torch.Tensor, scale: torch.Tensor | None):
        self.w = w if w.dim() == 3 else w.unsqueeze(0)
        self.mxfp8 = scale is not None
        # Without MXFP8 the scale pointer is never read; the values stand in for it.
        self.s = (scale if scale.dim() == 3 else scale.unsqueeze(0)) if scale is not None else self.w

    def strides(self):
        return (*self.w.stride(), *self.s.stride())


def forward(x: torch.Tensor, router_weight: torch.Tensor, e_score_correction_bias: torch.Tensor, w13: torch.Tensor,
            w2: torch.Tensor, shared_w13: torch.Tensor, shared_w2: torch.Tensor, top_k: int,
            routed_scaling_factor: float, swiglu_alpha: float, swiglu_limit: float) -> torch.Tensor:
    return run_moe(x, router_weight, e_score_correction_bias, w13, w2, shared_w13, shared_w2, top_k,
                   routed_scaling_factor, swiglu_alpha, swiglu_limit)


def run_moe(x, router_weight, bias, w13, w2, shared_w13, shared_w2, top_k, routed_scaling_factor, swiglu_alpha,
            swiglu_limit, scales=(None, None, None, None), config: dict | None = None,
            owned: tuple[int, int] | None = None) -> torch.Tensor:
    """Both ops' launcher. ``scales`` = (w13, w2, shared_w13, shared_w2) UE8M0 scales for MXFP8, else Nones.
    ``config`` overrides the tile choice (benchmarks): keys BLOCK_M plus those of gemm_config (and GU_FUSED, GROUP_M,
    TMA, see ``_gate_up``; BLOCK_N_DOWN, see ``_launch_down``), or ``GEMV`` with
    BLOCK_N / BLOCK_K / num_warps / num_stages for the CUDA-core decode path (``moe_gemv.py``); None takes
    ``default_config`` (the measured winners per batch bucket and weight format).

    ``owned`` = (first, count): expert parallelism (``m3export.parallel``). The router scores every expert;
    ``w13`` / ``w2`` hold only experts first .. first + count - 1, and only the assignments to them are computed
    (the others go to a block range whose programs return at once, their output slots stay zero), so the result
    is this rank's partial sum; no host synchronisation, so it can be captured in a CUDA graph."""
    if x.dim() != 2:
        raise ValueError(f"moe: x must be [T, H], got shape {tuple(x.shape)}")
    t, h = x.shape
    e, two_i = w13.shape[0], w13.shape[1]
    i = two_i // 2
    i_s = shared_w13.shape[0] // 2
    e_routed = e if owned is None else router_weight.shape[0]
    if owned is not None and not (owned[1] == e and 0 <= owned[0] and owned[0] + e <= e_routed):
        raise ValueError(f"moe: owned experts {owned} do not match w13's {e} experts of the router's {e_routed}")
    for name, got, want in (("router_weight", router_weight.shape, (e_routed, h)), ("w13", w13.shape, (e, 2 * i, h)),
                            ("w2", w2.shape, (e, h, i)), ("shared_w13", shared_w13.shape, (2 * i_s, h)),
                            ("shared_w2", shared_w2.shape, (h, i_s))):
        if tuple(got) != tuple(want):
            raise ValueError(f"moe: {name} has shape {tuple(got)}, expected {want} (x is {tuple(x.shape)})")
    for name, w, scale in zip(("w13", "w2", "shared_w13", "shared_w2"), (w13, w2, shared_w13, shared_w2), scales):
        if scale is not None:
            check_mxfp8(f"moe_mxfp8 {name}", w, scale)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty_like(x)
    if t == 0:
        return out
    ids, route_w = route(x, router_weight, bias, top_k)
    n = t * top_k
    routed13, routed2 = _Weights(w13, scales[0]), _Weights(w2, scales[1])
    shared13, shared2 = _Weights(shared_w13, scales[2]), _Weights(shared_w2, scales[3])
    weights = [routed13, routed2, shared13, shared2]
    defaulted = config is None
    if config is None:
        config = default_config(t, n, e, scales[0] is not None, x.dtype, weights)
        if owned is not None and config.get("GEMV"):  # the GEMV path computes every expert: grouped tiles instead
            config = {}
    if owned is not None:
        if (config or {}).get("GEMV"):
            raise ValueError("moe: the GEMV decode path does not take owned experts (expert parallelism)")
        local = ids.long() - owned[0]
        ids = torch.where((local >= 0) & (local < e), local, e).to(ids.dtype)  # not ours: expert e, skipped
    if (config or {}).get("GEMV"):  # the CUDA-core decode path (moe_gemv.py): no permutation, no padding
        y = moe_gemv.launch(x, ids, route_w, *weights, top_k, float(swiglu_alpha), float(swiglu_limit), config)
        return _combine_launch(y, out, routed_scaling_factor, h, top_k)
    bm = (config or {}).get("BLOCK_M") or block_m_for(n, e)
    if owned is None:
        blocks: ExpertBlocks = group_by_expert(ids, e, bm)
    else:
        blocks = group_by_expert(ids, e + 1, bm, skip=e)
    mode2 = mx_mode2_available(x.dtype)
    if scales[0] is None:  # bf16 weights: the MXFP8 path is irrelevant; one compiled variant per tile
        config = {**(config or {}), "MX_MODE": 0}
    cfg = gemm_config(bm, mode2) | {k: v for k, v in (config or {}).items() if k != "BLOCK_M"}
    shared_bm = 16 if t <= 16 else 64 if t <= 48 else 128
    shared_cfg = gemm_config(shared_bm, mode2) | {k: v for k, v in (config or {}).items() if k != "BLOCK_M"}
    f32, prec = use_f32_dot(x.dtype), "tf32"
    check_mx_mode(cfg["MX_MODE"], x.dtype)
    if scales[0] is not None and cfg["MX_MODE"] >= 3 and x.dtype == torch.float16:
        raise ValueError(f"moe: MX_MODE {cfg['MX_MODE']} makes bf16 weight tiles; it takes bf16 or fp32 activations, "
                         "not fp16")
    dev, dt = x.device, x.dtype

    ws = cfg.get("WS")  # the warp-specialised Gluon GEMMs (moe_prefill_ws.py)
    if ws:
        from . import moe_prefill_ws

        if not defaulted:  # default_config asked moe_prefill_ws.why_not already
            moe_prefill_ws.check(weights, dt, cfg)
    else:
        cfg, shared_cfg = (_check_tma(c, weights, fallback=defaulted) for c in (cfg, shared_cfg))
    act = torch.empty((blocks.rows.shape[0], i), dtype=dt, device=dev)
    act_s = torch.empty((t, i_s), dtype=dt, device=dev)
    y = (torch.empty if owned is None else torch.zeros)((t, top_k + 1, h), dtype=dt, device=dev)
    alpha, limit = float(swiglu_alpha), float(swiglu_limit)

    if ws:
        moe_prefill_ws.launch(x, weights, act, act_s, y, blocks, route_w, n, alpha, limit, top_k, cfg)
        return _combine_launch(y, out, routed_scaling_factor, h, top_k)
    _launch_gate_up(x, routed13, act, blocks, n, alpha, limit, h, i, top_k, bm, cfg, f32, prec)
    _launch_gate_up(x, shared13, act_s, None, t, alpha, limit, h, i_s, top_k, shared_bm, shared_cfg, f32, prec)
    _launch_down(act, routed2, y, blocks, route_w, n, h, i, top_k, bm, cfg, f32, prec)
    _launch_down(act_s, shared2, y, None, None, t, h, i_s, top_k, shared_bm, shared_cfg, f32, prec)
    return _combine_launch(y, out, routed_scaling_factor, h, top_k)


def _combine_launch(y, out, routed_scaling_factor, h, top_k):
    block_h = 1024
    t = out.shape[0]
    _combine[(t, cdiv(h, block_h))](y, out, t, y.stride(0), y.stride(1), out.stride(0), float(routed_scaling_factor),
                                    H=h, TOP_K=top_k, BLOCK_H=block_h, num_warps=4)
    return out
