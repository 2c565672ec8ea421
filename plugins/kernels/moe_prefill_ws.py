"""The MXFP8 MoE prefill GEMMs as warp-specialised Gluon kernels (sm_90): a launch path of ``moe.py``, not an op.

Why: with MXFP8 weights the Triton tiles of ``moe._gate_up`` / ``moe._down`` convert each E4M3 weight tile to bf16
on the same warps that issue the wgmma, so the tensor cores wait for the conversion every K step (the layer ran
365 TFLOP/s at 16k tokens on the H200 against ~550 for the same kernels on bf16 weights, ``docs/performance.md``),
and Triton 3.6 does not warp-specialise that loop on sm_90. Here each program splits its warps in three partitions
that meet through shared-memory rings guarded by mbarriers:

* the loader (1 warp) issues the bulk tensor copies (TMA): the activation tile [BLOCK_M, BLOCK_K] (bf16) and the
  E4M3 weight tile [rows, BLOCK_K] of each K step into a ring of ``STAGES`` slots;
* the converter (one warpgroup) reads a weight tile and its UE8M0 scales and writes the bf16 tile into a second
  ring of ``CONV_STAGES`` slots (``_e4m3_bf16``: the integer conversion of ``moe._e4m3_tile_bf16``, MX_MODE 3,
  times the power-of-two scale, one rounding: exact as the reference; with ``FAST_CONVERT``, for weights checked
  free of NaN codes and large scales, without the NaN flag and with one multiply: the same bits);
* the default partition (``num_warps`` warps) issues ``warpgroup_mma`` on the two shared-memory tiles, keeps the
  accumulator in registers and runs the epilogue of the Triton kernel it replaces: SwiGLU-OAI for gate-up
  (``moe._gate_up``), the routing weight and the slot store for down (``moe._down``); their roundings are the same.

Gate and up weight rows of one tile come as two copies stacked in one slot (gate rows, then up rows), so one wgmma
of N = 2 x BLOCK_N covers both; the epilogue splits the accumulator back. The activation tile of the routed
gate-up GEMM needs its token rows in block order (a Hopper TMA cannot gather rows): the launcher gathers them once
(``x.index_select``, as ``moe``'s ``X_TMA``); the down GEMM's activations are already in block order.

``HALF_TAIL`` (a config key, on in ``WS_TILE``): a routed row block whose rows from BLOCK_M / 2 on are padding
(each expert's last block, at most half full; ~25 % of the routed rows are padding at 512 assignments per expert
in 256-row blocks) runs as a BLOCK_M / 2-row wgmma on the first half of its activation slot, the loader copying
those rows only (a second descriptor with the half box); the converter's work is the same.

Tried on the H200 on 2026-12-01 against this default (22.47 ms at 16k tokens, ``docs/performance.md``), every output
the same bits, and removed as slower: the shared expert's tiles as more tiles of the routed launches (22.59 ms); the
routed rows gathered only where an assignment is (22.65); 128-row blocks with 256-wide tiles, the two MMA
warpgroups side by side along N (28.04-28.40: fewer bytes loaded per K step, each weight tile converted for 128
rows instead of 256).

Selected by the config key ``WS`` (``moe.run_moe``; ``bench/moe.py``'s ``prefill_ws_*`` variants): ``WS_TILE`` is
the launcher's default above ``moe.WS_LEAST_MEAN`` (64) assignments per expert with bf16 activations
(``moe.default_config``), which takes the Triton tile of the size instead where ``why_not`` gives a reason
(``moe.PREFILL_MXFP8`` up to 256 per expert, ``moe.PREFILL_MXFP8_LARGE`` above). MXFP8 weights that TMA can read
(``moe.tma_unusable``) and bf16 activations only; Gluon kernels do not run under the Triton interpreter, so the CPU
tests compile them for sm_90 (``tests/test_moe_prefill_ws.py``) and the GPU tests compare them with the reference.

A WS config's ``MX_MODE`` 3 is a label of the conversion's semantics, not a Triton path: the integer E4M3 conversion
times the exact power-of-two scale (UE8M0 byte 0 is 2^-127, as the reference), so ``moe.check_mx_mode`` accepts it
whatever scale bytes were loaded (``MX_MODE`` 2, ``tl.dot_scaled``, reads byte 0 as 0) and ``moe.run_moe`` refuses
it with fp16 activations (bf16 tiles). The Triton tiles of ``MX_MODE`` 3 stay refused (``moe._check_tma``): a WS
config reaches them only with ``WS`` 0 given by the caller, which raises, and the launcher's own fallback is
``moe.PREFILL_MXFP8_LARGE`` chosen whole by ``moe.default_config`` (``MX_MODE`` from ``moe.gemm_config``: 1 or 2).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# The tile the H200 runs (the 16k winner's shape, ``moe.PREFILL_MXFP8_LARGE``: 256-row blocks, 128 weight rows per
# wgmma, 64-wide K steps): rings of 4 loaded and 2 converted slots, 8 MMA warps (two warpgroups of 128 rows).
# Shared memory: 4 x (32 KB activations + 8 KB E4M3) + 2 x 16 KB bf16 = 192 KB of the H200's 227.
# MX_MODE 3 labels the conversion's semantics (the module docstring): not the refused Triton MX_MODE 3 tiles.
# HALF_TAIL since the H200 call of 2026-12-01 13:46 UTC (snapshot 16f43db, 16k tokens: 22.15 against 23.15 ms,
# output bit-equal; routed gate-up 10.57 -> 9.97 ms, routed down 5.39 -> 5.27).
# A QUARTER_TAIL key (a block whose rows from 64 on are padding as a 64-row wgmma, the two MMA warpgroups side by
# side along N) was tried on the H200 on 2026-12-02 (bench/moe_prefill_ab.py, interleaved rounds, the same bits):
# 22.94 against 22.90 ms at 16k, 13.13 against 13.07 at 8k; removed. Such a block still loads and converts whole
# weight tiles, which is what its time follows, not its rows.
# FAST_CONVERT since the H200 call of 2026-12-02 ~18:45 UTC (bench/moe_prefill_ab.py, eight interleaved rounds of six
# calls, the same bits): 16k tokens 20.34 against 22.61 ms (457 against 411 TFLOP/s), 8k 11.65 against 13.29.
WS_TILE = dict(BLOCK_M=256, BLOCK_N=64, BLOCK_N_DOWN=128, BLOCK_K=64, GROUP_M=8, num_warps=8, STAGES=4,
               CONV_STAGES=2, MX_MODE=3, WS=1, HALF_TAIL=1, FAST_CONVERT=1)
CONVERTER_WARPS = 4
LOADER_WARPS = gl.constexpr(1)
# Registers per thread asked for the worker partitions (setmaxnreg); the MMA warps get what is left of the 64K
# registers of the SM (8 MMA warps: 192 each while the partitions run, no spills at the tile above).
CONVERTER_REGS = gl.constexpr(96)
LOADER_REGS = gl.constexpr(24)


def maxnreg(num_warps: int) -> int:
    """The launch's register cap per thread: the SM's 64K registers over every warp of one program (the MMA warps
    and two worker warpgroups, the loader's warp counting as one), a multiple of 8. Triton splits it between the
    partitions with setmaxnreg; one program per SM either way (shared memory)."""
    return 65536 // (32 * (num_warps + 8)) // 8 * 8

# ``moe._E4M3_BF16_ASM``'s bits: four E4M3 codes in one register ($2) to two registers of two bf16 each, the value
# times 2^-120 (sign << 15 | exponent and mantissa << 4), NaN codes 0x7F / 0xFF with an all-ones exponent.
from .moe import _E4M3_BF16_ASM, _E4M3_BF16_NO_NAN_ASM  # noqa: E402  (one owner of the PTX)

_ASM = gl.constexpr(_E4M3_BF16_ASM.value)
_ASM_NO_NAN = gl.constexpr(_E4M3_BF16_NO_NAN_ASM.value)
# FAST_CONVERT (a config key): weights whose codes hold no NaN and whose scale bytes are at most 134 (checked once per
# weight by the launcher, ``fast_convert_ok``) take the conversion without the NaN flag and one multiply by the
# folded factor 2^(s - 7) = 2^120 x 2^(s - 127), a bf16 normal for s <= 134: the same bits (the product is the
# same exact value, rounded once), fewer instructions in the converter warpgroup.
FAST_SCALE_MOST = 134


@gluon.jit
def _tile(tile, num_m, GROUP_M: gl.constexpr, N_TILES: gl.constexpr):
    """(row block, N tile) of tile number ``tile``, the tiles walked in groups of GROUP_M row blocks (as
    ``moe._tile_ids`` with GROUP_M >= 1: the group's activation rows stay in L2 while every N tile passes over them,
    and an expert's weight tile is read by its row blocks one after the other)."""
    per_group = GROUP_M * N_TILES
    first_m = (tile // per_group) * GROUP_M
    size = gl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % size, (tile % per_group) // size


@gluon.jit
def _expert(block_expert_ptr, pid_m, ROUTED: gl.constexpr):
    """The expert of row block ``pid_m`` (-1: a block past the last in use, skipped); the shared expert: 0."""
    if ROUTED:
        e = gl.load(block_expert_ptr + pid_m)
    else:
        e = pid_m * 0
    return e


@gluon.jit
def _half(rows_ptr, pid_m, num_rows, BM: gl.constexpr):
    """Whether routed row block ``pid_m`` runs as its first BM / 2 rows only (``HALF_TAIL``): its row BM / 2 is
    padding. An expert's rows fill its blocks from the front and padding (row id ``num_rows``) only ends its last
    block, so that one load tells that every row from BM / 2 on is padding (computed, never stored). The same value
    in the loader and the MMA partition (the same load), so both take the same branch; the converter converts the
    whole weight tile either way. Callers ask only under ``HALF_TAIL and ROUTED`` (a compile-time branch: a jit
    function's result is a run-time value), so that without the key the kernel is the one without the branches."""
    return gl.load(rows_ptr + pid_m * BM + BM // 2) >= num_rows


@gluon.jit
def _loader(a_desc, a_half_desc, w_desc, a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, block_expert_ptr,
            rows_ptr, num_rows, num_m, first_tile, tile_step, W_E: gl.constexpr, N_OUT: gl.constexpr,
            N_TILES: gl.constexpr, GROUP_M: gl.constexpr, ROUTED: gl.constexpr, HALF_TAIL: gl.constexpr,
            K_STEPS: gl.constexpr, G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
            STAGES: gl.constexpr):
    """One warp: per K step of each of the program's tiles, wait for the slot to be free, then TMA the G weight
    chunks (gate-up: the gate rows, then the up rows N_OUT further) and the activation tile into it (a half-tail
    block, ``_half``: its first BM / 2 rows into the slot's first half, by ``a_half_desc``). The weights first: the
    converter needs them before the MMA needs the activations."""
    it = 0  # K steps issued over the program's tiles: the ring position
    for tile in range(first_tile, num_m * N_TILES, tile_step):
        pid_m, pid_n = _tile(tile, num_m, GROUP_M, N_TILES)
        e = _expert(block_expert_ptr, pid_m, ROUTED)
        if e >= 0:
            half = pid_m < 0  # read only with HALF_TAIL (then _half's)
            if HALF_TAIL and ROUTED:
                half = _half(rows_ptr, pid_m, num_rows, BM)
            _load_tile(a_desc, a_half_desc, w_desc, a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, it,
                       pid_m * BM, e * W_E + pid_n * BN, half, HALF_TAIL and ROUTED, N_OUT, K_STEPS, G, BM, BN, BK,
                       STAGES)
            it += K_STEPS


@gluon.jit
def _load_tile(a_desc, a_half_desc, w_desc, a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, it, a_row, w_row,
               half, HALF: gl.constexpr, N_OUT: gl.constexpr, K_STEPS: gl.constexpr, G: gl.constexpr,
               BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """One tile's K steps: activation rows from ``a_row``, weight rows from ``w_row`` (gate-up: and N_OUT below)."""
    for k in range(0, K_STEPS, 1):
        s = (it + k) % STAGES
        free = (((it + k) // STAGES) & 1) ^ 1  # a fresh barrier counts as having completed phase -1
        mbarrier.wait(w_empty.index(s), free)
        mbarrier.expect(w_ready.index(s), G * BN * BK)
        for g in gl.static_range(G):
            tma.async_copy_global_to_shared(w_desc, [w_row + g * N_OUT, k * BK], w_ready.index(s),
                                            w_bufs.index(s).slice(g * BN, BN))
        mbarrier.wait(a_empty.index(s), free)
        if HALF:
            if half:
                _load_a(a_half_desc, a_bufs.index(s).slice(0, BM // 2), a_ready.index(s), a_row, k * BK)
            else:
                _load_a(a_desc, a_bufs.index(s), a_ready.index(s), a_row, k * BK)
        else:
            _load_a(a_desc, a_bufs.index(s), a_ready.index(s), a_row, k * BK)


@gluon.jit
def _load_a(desc, slot, ready, row, col):
    """The activation tile at (row, col) into ``slot`` (desc's box), ``ready`` expecting its bytes."""
    mbarrier.expect(ready, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, col], ready, slot)


@gluon.jit
def _scale_factor(scales, FAST: gl.constexpr):
    """UE8M0 scale bytes as the bf16 power of two 2^(s - 127), built in the exponent field: byte 0 is the subnormal
    2^-127, byte 255 +inf (``docs/ops.md`` §8), as ``moe._e4m3_tile_bf16``. FAST: 2^(s - 7), the scale times the
    conversion's 2^120 (exponent field s + 120: bytes up to ``FAST_SCALE_MOST`` only)."""
    b = scales.to(gl.uint16)
    if FAST:
        return ((b + 120) << 7).to(gl.uint16).to(gl.bfloat16, bitcast=True)
    return gl.where(b == 0, 0x0040, b << 7).to(gl.uint16).to(gl.bfloat16, bitcast=True)


@gluon.jit
def _e4m3_bf16(codes, factor, FAST: gl.constexpr):
    """E4M3 codes (uint8, four consecutive per thread) times their scale factors (bf16, broadcast) as bf16, exactly
    the bits of ``moe._e4m3_tile_bf16`` (MX_MODE 3): the integer conversion gives the code's value times 2^-120
    (normal, subnormal, zero; NaN codes stay NaN); times 2^120 (exact) and times the scale: one rounding, as the
    reference's fp32 product rounded to bf16. FAST (``FAST_CONVERT``): no NaN flag, and one multiply by the folded
    factor of ``_scale_factor``: the same exact product, rounded once."""
    if FAST:
        v = gl.inline_asm_elementwise(_ASM_NO_NAN, "=r,=r,r", [codes], dtype=gl.bfloat16, is_pure=True, pack=4)
        return v * factor
    v = gl.inline_asm_elementwise(_ASM, "=r,=r,r", [codes], dtype=gl.bfloat16, is_pure=True, pack=4)
    v = v * gl.full(v.shape, 0x7B80, gl.uint16, v.type.layout).to(gl.bfloat16, bitcast=True)  # 2^120
    return v * factor


@gluon.jit
def _converter(w_bufs, c_bufs, w_ready, w_empty, c_ready, c_empty, s_ptr, ss_e, ss_n, block_expert_ptr, num_m,
               first_tile, tile_step, N_OUT: gl.constexpr, K: gl.constexpr, N_TILES: gl.constexpr,
               GROUP_M: gl.constexpr, ROUTED: gl.constexpr, K_STEPS: gl.constexpr, G: gl.constexpr, BN: gl.constexpr,
               BK: gl.constexpr, STAGES: gl.constexpr, CONV_STAGES: gl.constexpr, WARPS: gl.constexpr,
               FAST: gl.constexpr):
    """One warpgroup: per K step, the E4M3 tile of the load ring and its scales (plain loads, issued before the
    wait on the tile) to the bf16 tile of the converted ring (``_convert_tile``)."""
    it = 0
    for tile in range(first_tile, num_m * N_TILES, tile_step):
        pid_m, pid_n = _tile(tile, num_m, GROUP_M, N_TILES)
        e = _expert(block_expert_ptr, pid_m, ROUTED)
        if e >= 0:
            _convert_tile(w_bufs, c_bufs, w_ready, w_empty, c_ready, c_empty, s_ptr + e.to(gl.int64) * ss_e, ss_n,
                          pid_n, it, N_OUT, K, K_STEPS, G, BN, BK, STAGES, CONV_STAGES, WARPS, FAST)
            it += K_STEPS


@gluon.jit
def _convert_tile(w_bufs, c_bufs, w_ready, w_empty, c_ready, c_empty, s_base, ss_n, pid_n, it, N_OUT: gl.constexpr,
                  K: gl.constexpr, K_STEPS: gl.constexpr, G: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                  STAGES: gl.constexpr, CONV_STAGES: gl.constexpr, WARPS: gl.constexpr, FAST: gl.constexpr):
    """One tile's K steps of conversion, the expert's scales [W_E, K / 32] at ``s_base``. Each thread holds runs of
    32 codes along K (one scale group): the tile is seen as [rows, BK / 32, 32] and each thread loads its group's
    scale byte once."""
    NW: gl.constexpr = G * BN
    GROUPS: gl.constexpr = BK // 32
    flat: gl.constexpr = gl.BlockedLayout([1, 32], [32 // GROUPS, GROUPS], [WARPS, 1], [1, 0])
    grouped: gl.constexpr = gl.BlockedLayout([1, 1, 32], [32 // GROUPS, GROUPS, 1], [WARPS, 1, 1], [2, 1, 0])
    s_layout: gl.constexpr = gl.SliceLayout(2, grouped)
    j = gl.arange(0, NW, layout=gl.SliceLayout(1, s_layout))
    grp = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, s_layout))
    n = pid_n * BN + j % BN  # the output column (gate-up: gate / up row) of tile row j
    row = (n + (j // BN) * N_OUT).to(gl.int64) * ss_n
    row_ok = n < N_OUT
    for k in range(0, K_STEPS, 1):
        s = (it + k) % STAGES
        c = (it + k) % CONV_STAGES
        kg = k * GROUPS + grp
        sc = gl.load(s_base + row[:, None] + kg[None, :], mask=row_ok[:, None] & (kg < K // 32)[None, :], other=0)
        factor = gl.expand_dims(_scale_factor(sc, FAST), 2)
        mbarrier.wait(w_ready.index(s), ((it + k) // STAGES) & 1)
        codes = w_bufs.index(s).load(flat)
        fence_async_shared()  # the read is ordered before the loader's next copy into this slot
        mbarrier.arrive(w_empty.index(s), count=1)
        codes = gl.convert_layout(gl.reshape(codes, [NW, GROUPS, 32]), grouped, assert_trivial=True)
        vals = gl.reshape(_e4m3_bf16(codes, factor, FAST), [NW, BK])
        mbarrier.wait(c_empty.index(c), (((it + k) // CONV_STAGES) & 1) ^ 1)
        c_bufs.index(c).store(vals)
        fence_async_shared()  # the generic-proxy store is visible to the wgmma (async proxy) reading it
        mbarrier.arrive(c_ready.index(c), count=1)


@gluon.jit
def _block(a_bufs, c_bufs, a_ready, a_empty, c_ready, c_empty, it, out_ptr, rows_ptr, route_w_ptr, num_rows, alpha,
           limit, so_r, so_s, p_first, n_first, N_OUT: gl.constexpr, TOP_K: gl.constexpr, ROUTED: gl.constexpr,
           GATE_UP: gl.constexpr, K_STEPS: gl.constexpr, ROWS: gl.constexpr, BN: gl.constexpr, NW: gl.constexpr,
           STAGES: gl.constexpr, CONV_STAGES: gl.constexpr, WARPS: gl.constexpr):
    """One tile's products (``_k_loop``) and epilogue on its first ROWS rows from block-order row ``p_first``."""
    acc = _k_loop(a_bufs, c_bufs, a_ready, a_empty, c_ready, c_empty, it, K_STEPS, ROWS, NW, STAGES, CONV_STAGES,
                  WARPS)
    _epilogue(acc, out_ptr, rows_ptr, route_w_ptr, num_rows, alpha, limit, so_r, so_s, p_first, n_first, N_OUT,
              TOP_K, ROUTED, GATE_UP, ROWS, BN)


@gluon.jit
def _k_loop(a_bufs, c_bufs, a_ready, a_empty, c_ready, c_empty, it, K_STEPS: gl.constexpr, ROWS: gl.constexpr,
            NW: gl.constexpr, STAGES: gl.constexpr, CONV_STAGES: gl.constexpr, WARPS: gl.constexpr):
    """acc [ROWS, NW] = the first ROWS rows of each step's activation slot @ converted^T over the K steps, one wgmma
    in flight (a step's slots go back to the loader and the converter once the next step's wgmma is issued and the
    previous one has retired; the last step's after the final wait). Each output element sums the same K steps in
    the same order whatever ROWS is, so a half-tail block's rows are the full block's bits."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                          instr_shape=[16, NW, 16])
    acc = gl.zeros([ROWS, NW], gl.float32, acc_layout)
    for k in range(0, K_STEPS, 1):
        s = (it + k) % STAGES
        c = (it + k) % CONV_STAGES
        mbarrier.wait(a_ready.index(s), ((it + k) // STAGES) & 1)
        mbarrier.wait(c_ready.index(c), ((it + k) // CONV_STAGES) & 1)
        a = a_bufs.index(s)
        if ROWS < a_bufs.shape[1]:
            a = a.slice(0, ROWS)
        acc = warpgroup_mma(a, c_bufs.index(c).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        if k > 0:
            mbarrier.arrive(a_empty.index((it + k - 1) % STAGES), count=1)
            mbarrier.arrive(c_empty.index((it + k - 1) % CONV_STAGES), count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(a_empty.index((it + K_STEPS - 1) % STAGES), count=1)
    mbarrier.arrive(c_empty.index((it + K_STEPS - 1) % CONV_STAGES), count=1)
    return acc


@gluon.jit
def _mma(a_bufs, c_bufs, a_ready, a_empty, c_ready, c_empty, block_expert_ptr, num_m, first_tile, tile_step, out_ptr,
         rows_ptr, route_w_ptr, num_rows, alpha, limit, so_r, so_s, N_OUT: gl.constexpr, N_TILES: gl.constexpr,
         GROUP_M: gl.constexpr, TOP_K: gl.constexpr, ROUTED: gl.constexpr, GATE_UP: gl.constexpr,
         HALF_TAIL: gl.constexpr, K_STEPS: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, NW: gl.constexpr,
         STAGES: gl.constexpr, CONV_STAGES: gl.constexpr, WARPS: gl.constexpr):
    """The default partition, per tile: acc [BM, NW] += activations [BM, BK] @ converted^T [BK, NW] over the K
    steps (``_k_loop``; a half-tail block, ``_half``: [BM / 2, NW] on the slot's first half), then the epilogue,
    which overlaps the workers' first steps of the next tile."""
    it = 0
    for tile in range(first_tile, num_m * N_TILES, tile_step):
        pid_m, pid_n = _tile(tile, num_m, GROUP_M, N_TILES)
        e = _expert(block_expert_ptr, pid_m, ROUTED)
        if e >= 0:
            if HALF_TAIL and ROUTED:
                if _half(rows_ptr, pid_m, num_rows, BM):
                    _block(a_bufs, c_bufs, a_ready, a_empty, c_ready, c_empty, it, out_ptr, rows_ptr, route_w_ptr,
                           num_rows, alpha, limit, so_r, so_s, pid_m * BM, pid_n * BN, N_OUT, TOP_K, ROUTED, GATE_UP,
                           K_STEPS, BM // 2, BN, NW, STAGES, CONV_STAGES, WARPS)
                else:
                    _block(a_bufs, c_bufs, a_ready, a_empty, c_ready, c_empty, it, out_ptr, rows_ptr, route_w_ptr,
                           num_rows, alpha, limit, so_r, so_s, pid_m * BM, pid_n * BN, N_OUT, TOP_K, ROUTED, GATE_UP,
                           K_STEPS, BM, BN, NW, STAGES, CONV_STAGES, WARPS)
            else:
                _block(a_bufs, c_bufs, a_ready, a_empty, c_ready, c_empty, it, out_ptr, rows_ptr, route_w_ptr,
                       num_rows, alpha, limit, so_r, so_s, pid_m * BM, pid_n * BN, N_OUT, TOP_K, ROUTED, GATE_UP,
                       K_STEPS, BM, BN, NW, STAGES, CONV_STAGES, WARPS)
            it += K_STEPS


def _kernel_name(spec) -> str:
    """The compiled kernel's name, so that profiles tell the launches apart (one source function)."""
    c = spec.constants
    return f"moe_ws_{'gate_up' if c['GATE_UP'] else 'down'}{'' if c['ROUTED'] else '_shared'}"


@gluon.jit(repr=_kernel_name)
def _gemm_ws(
    a_desc, a_half_desc, w_desc, s_ptr, out_ptr, rows_ptr, block_expert_ptr, route_w_ptr, num_rows, num_m, alpha,
    limit, ss_e, ss_n, so_r, so_s,
    N_OUT: gl.constexpr, K: gl.constexpr, W_E: gl.constexpr, TOP_K: gl.constexpr, ROUTED: gl.constexpr,
    GATE_UP: gl.constexpr, HALF_TAIL: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
    CONV_STAGES: gl.constexpr, CONV_WARPS: gl.constexpr, FAST_CONVERT: gl.constexpr, num_warps: gl.constexpr,
):
    """Tiles of (row block: one expert's rows, or BLOCK_M tokens for the shared expert) x BLOCK_N output columns,
    ``num_m`` row blocks; program p takes tiles p, p + grid, p + 2 grid, ... (one tile each when the grid covers
    them all, persistent with a smaller grid). GATE_UP: out = act [rows, I] (SwiGLU-OAI of the gate and up tiles),
    W_E = 2I rows per expert, the up chunk N_OUT rows below the gate chunk. Down: out = y [T, TOP_K + 1, H] (so_r
    / so_s its token / slot strides), W_E = H. The weights are seen as one [E * W_E, K] matrix (``w_desc``), their
    scales as [E, W_E, K / 32]."""
    # The MMA partition hands a step's slots back one step late (after the next wgmma is issued), so a ring of one
    # slot would wait on itself.
    gl.static_assert(STAGES >= 2 and CONV_STAGES >= 2, "WS rings need at least 2 slots each")
    # A half-tail block's accumulator [BLOCK_M / 2, NW] still spans every MMA warp (16 rows each).
    gl.static_assert(not HALF_TAIL or BLOCK_M // 2 >= 16 * num_warps, "HALF_TAIL needs BLOCK_M >= 32 x num_warps")
    G: gl.constexpr = 2 if GATE_UP else 1
    NW: gl.constexpr = G * BLOCK_N
    K_STEPS: gl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    N_TILES: gl.constexpr = (N_OUT + BLOCK_N - 1) // BLOCK_N
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.uint8)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NW, BLOCK_K], gl.bfloat16)
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES, NW, BLOCK_K], w_layout)
    c_bufs = gl.allocate_shared_memory(gl.bfloat16, [CONV_STAGES, NW, BLOCK_K], c_layout)
    a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    c_ready = gl.allocate_shared_memory(gl.int64, [CONV_STAGES, 1], mbarrier.MBarrierLayout())
    c_empty = gl.allocate_shared_memory(gl.int64, [CONV_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(a_empty.index(i), count=1)
        mbarrier.init(w_ready.index(i), count=1)
        mbarrier.init(w_empty.index(i), count=1)
    for i in gl.static_range(CONV_STAGES):
        mbarrier.init(c_ready.index(i), count=1)
        mbarrier.init(c_empty.index(i), count=1)
    fence_async_shared()  # the initialised barriers are visible to the async proxy (TMA) before first use

    first_tile = gl.program_id(0)
    tile_step = gl.num_programs(0)
    gl.warp_specialize([
        (_mma, (a_bufs, c_bufs, a_ready, a_empty, c_ready, c_empty, block_expert_ptr, num_m, first_tile, tile_step,
                out_ptr, rows_ptr, route_w_ptr, num_rows, alpha, limit, so_r, so_s, N_OUT, N_TILES, GROUP_M, TOP_K,
                ROUTED, GATE_UP, HALF_TAIL, K_STEPS, BLOCK_M, BLOCK_N, NW, STAGES, CONV_STAGES, num_warps)),
        (_loader, (a_desc, a_half_desc, w_desc, a_bufs, w_bufs, a_ready, a_empty, w_ready, w_empty, block_expert_ptr,
                   rows_ptr, num_rows, num_m, first_tile, tile_step, W_E, N_OUT, N_TILES, GROUP_M, ROUTED, HALF_TAIL,
                   K_STEPS, G, BLOCK_M, BLOCK_N, BLOCK_K, STAGES)),
        (_converter, (w_bufs, c_bufs, w_ready, w_empty, c_ready, c_empty, s_ptr, ss_e, ss_n, block_expert_ptr, num_m,
                      first_tile, tile_step, N_OUT, K, N_TILES, GROUP_M, ROUTED, K_STEPS, G, BLOCK_N, BLOCK_K,
                      STAGES, CONV_STAGES, CONV_WARPS, FAST_CONVERT)),
    ], [LOADER_WARPS, CONV_WARPS], [LOADER_REGS, CONVERTER_REGS])


@gluon.jit
def _epilogue(acc, out_ptr, rows_ptr, route_w_ptr, num_rows, alpha, limit, so_r, so_s, p_first, n_first,
              N_OUT: gl.constexpr, TOP_K: gl.constexpr, ROUTED: gl.constexpr, GATE_UP: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """``moe._gate_up``'s and ``moe._down``'s epilogues on the accumulator: the GEMM output rounded to bf16 as the
    reference rounds it; gate-up: SwiGLU-OAI (gate clamp, up clamp, alpha, + 1), the activation row p of the
    block order stored; down: times the assignment's routing weight, stored in its token's slot (the shared
    expert's slot TOP_K). The accumulator holds BLOCK_M rows of the block order from ``p_first`` on."""
    if GATE_UP:
        g, u = gl.split(gl.permute(gl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
        layout: gl.constexpr = g.type.layout
        gate = gl.minimum(g.to(gl.bfloat16).to(gl.float32), limit)
        up = gl.minimum(gl.maximum(u.to(gl.bfloat16).to(gl.float32), -limit), limit)
        val = (up + 1.0) * (gate / (1.0 + gl.exp(-alpha * gate)))
    else:
        layout: gl.constexpr = acc.type.layout
        val = acc.to(gl.bfloat16).to(gl.float32)
    p = p_first + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    n = n_first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    if ROUTED:
        a = gl.load(rows_ptr + p)
        ok = a < num_rows
    else:
        a = p
        ok = p < num_rows
    if GATE_UP:  # act rows in block order (the shared expert: token order)
        dst = out_ptr + p.to(gl.int64)[:, None] * so_r + n[None, :]
    else:
        if ROUTED:
            tok = a // TOP_K
            slot = a % TOP_K
            val = val * gl.load(route_w_ptr + a, mask=ok, other=0.0)[:, None]
        else:
            tok = a
            slot = a * 0 + TOP_K
        dst = out_ptr + tok.to(gl.int64)[:, None] * so_r + (slot * so_s)[:, None] + n[None, :]
    gl.store(dst, val.to(gl.bfloat16), mask=ok[:, None] & (n < N_OUT)[None, :])


def _descriptor(t: torch.Tensor, block: list) -> TensorDescriptor:
    """A host-made TMA descriptor over the 2-D ``t`` with its default swizzled shared-memory layout."""
    dtype = {torch.bfloat16: gl.bfloat16, torch.uint8: gl.uint8}[t.dtype]
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def _stacked_rows(w: torch.Tensor) -> torch.Tensor:
    """An expert stack [E, rows, K] of E4M3 codes as one [E * rows, K] uint8 matrix (no copy)."""
    return w.view(torch.uint8).reshape(w.shape[0] * w.shape[1], w.shape[2])


def why_not(weights: list, dtype: torch.dtype, cfg: dict) -> str | None:
    """Why these weights / activations / tile cannot take the warp-specialised path (naming the tensor), or None:
    the one owner of that answer, asked by ``moe.default_config`` (which takes ``moe.PREFILL_MXFP8_LARGE`` instead)
    and, through ``check``, by ``moe.run_moe`` for a config the caller chose. It takes a CUDA device (Gluon kernels
    do not run under the Triton interpreter), bf16 activations (the converted weights are bf16 tiles), MXFP8 weight
    stacks whose rows TMA can read (``moe.tma_unusable``) laid out as one matrix (expert stride = rows x row
    stride, so an expert's tile never needs a second descriptor) with scales contiguous along K, and tiles of one
    TMA box and one wgmma N of at most 128."""
    from .moe import tma_unusable

    if triton.knobs.runtime.interpret:
        return ("moe: WS (warp-specialised Gluon kernels) needs a CUDA device: Gluon kernels do not run under the "
                "Triton interpreter (TRITON_INTERPRET=1)")
    if dtype != torch.bfloat16:
        return f"moe: WS (warp-specialised MXFP8 prefill) takes bf16 activations, got {dtype}"
    for name, w in zip(("w13", "w2", "shared_w13", "shared_w2"), weights):
        if not w.mxfp8:
            return f"moe: WS takes MXFP8 weights (E4M3 + UE8M0 scales), {name} has none"
        why = tma_unusable([w])
        if why is not None:
            return f"moe: WS {name}: {why}"
        if w.w.stride(0) != w.w.shape[1] * w.w.stride(1) or w.s.stride(-1) != 1:
            return (f"moe: WS {name} must be one contiguous stack of rows with scales contiguous along K, got "
                    f"strides {w.w.stride()} / scale strides {w.s.stride()}")
    # One TMA box; one wgmma's N: 2 x BLOCK_N in gate-up, BLOCK_N_DOWN in down, at most 128 (a wider wgmma needs more
    # than the launch's 128 registers per thread: ptxas refuses it).
    for key, most in (("BLOCK_M", 256), ("BLOCK_N", 64), ("BLOCK_N_DOWN", 128), ("BLOCK_K", 64)):
        if cfg.get(key, 64) > most or cfg.get(key, 64) % 64:
            return (f"moe: WS {key} must be a multiple of 64 up to {most} (one TMA box, one wgmma N of at most 128), "
                    f"got {cfg[key]}")
    return None


def check(weights: list, dtype: torch.dtype, cfg: dict) -> None:
    """``why_not``'s reason as a ValueError: a WS config the caller chose that cannot run."""
    why = why_not(weights, dtype, cfg)
    if why is not None:
        raise ValueError(why)


def _programs(tiles: int, device: torch.device, persistent: bool) -> int:
    """The grid: one program per tile, or with ``persistent`` one per SM (one program fits an SM: 192 KB of shared
    memory, 16 warps), each walking its share of the tiles."""
    if not persistent:
        return tiles
    return max(1, min(tiles, torch.cuda.get_device_properties(device).multi_processor_count))


_FAST_OK: dict = {}
# Bytes of weights one step of ``fast_convert_ok``'s scan compares at a time (its temporary mask's size).
_FAST_SCAN_BYTES = 1 << 26


def _stack_key(t: torch.Tensor) -> tuple:
    """What identifies a weight tensor's bytes across launches (each launch wraps the same parameters anew): its
    storage (``fast_convert_ok`` keeps a weak reference to it, so a freed storage's address is never taken for
    another while the entry lives), where in it, and its version (an in-place write changes it)."""
    return t.untyped_storage()._cdata, t.storage_offset(), t.numel(), t._version


def fast_convert_ok(w) -> bool:
    """Whether MXFP8 weight stack ``w`` may take ``FAST_CONVERT``: no NaN code (magnitude 0x7F) among its E4M3 bytes
    and no scale byte above ``FAST_SCALE_MOST``. Scanned on the device once per stack, 64 MB at a time (a layer of
    the release's experts is 7 GB), with one host read at the end, at the stack's first prefill; the answer is kept
    for the stack's storage and version, so a launch never changes what it computes. While a CUDA graph is being
    captured (no host read allowed) an unscanned stack takes the NaN-exact conversion."""
    from torch.multiprocessing.reductions import StorageWeakRef

    key = _stack_key(w.w) + _stack_key(w.s)
    entry = _FAST_OK.get(key)
    if entry is not None and not any(ref.expired() for ref in entry[0]):
        return entry[1]
    if w.w.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    codes = w.w.view(torch.uint8)  # [E, rows, K]: whole experts per scan step, never a copy of the stack
    step = max(1, _FAST_SCAN_BYTES // max(1, codes[0].numel()))
    bad = w.s.view(torch.uint8).max() > FAST_SCALE_MOST
    for e in range(0, codes.shape[0], step):
        bad = bad | ((codes[e:e + step] & 0x7F) == 0x7F).any()
    for k in [k for k, (refs, _) in _FAST_OK.items() if any(ref.expired() for ref in refs)]:
        del _FAST_OK[k]  # stacks freed since: their entries go
    _FAST_OK[key] = ((StorageWeakRef(w.w.untyped_storage()), StorageWeakRef(w.s.untyped_storage())), not bool(bad))
    return _FAST_OK[key][1]


def _launch(a, w, out, rows, block_expert, route_w, num_rows, alpha, limit, so_r, so_s, num_m, n_out, k, top_k,
            routed, gate_up, bn, cfg):
    bm, bk = cfg["BLOCK_M"], cfg["BLOCK_K"]
    half_tail = bool(cfg.get("HALF_TAIL")) and routed
    a_desc = _descriptor(a, [bm, bk])
    # HALF_TAIL's copy of a block's first bm / 2 rows lands in the first half of a slot laid out for a_desc's box:
    # the same swizzle (the row count does not enter it); without the key the kernel never reads it.
    a_half = _descriptor(a, [bm // 2, bk]) if half_tail else a_desc
    if a_half.layout != a_desc.layout:
        raise ValueError(f"moe: WS HALF_TAIL: a {bm // 2}-row box is laid out as {a_half.layout}, the slot as "
                         f"{a_desc.layout}")
    grid = _programs(num_m * triton.cdiv(n_out, bn), a.device, bool(cfg.get("PERSISTENT")))
    _gemm_ws[(grid,)](
        a_desc, a_half, _descriptor(_stacked_rows(w.w), [bn, bk]), w.s, out, rows, block_expert, route_w, num_rows,
        num_m, alpha, limit, w.s.stride(0), w.s.stride(1), so_r, so_s,
        N_OUT=n_out, K=k, W_E=w.w.shape[1], TOP_K=top_k, ROUTED=routed, GATE_UP=gate_up, HALF_TAIL=half_tail,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.get("GROUP_M", 8), STAGES=cfg.get("STAGES", 4),
        CONV_STAGES=cfg.get("CONV_STAGES", 2), CONV_WARPS=CONVERTER_WARPS,
        FAST_CONVERT=bool(cfg.get("FAST_CONVERT")) and fast_convert_ok(w), num_warps=cfg["num_warps"],
        maxnreg=maxnreg(cfg["num_warps"]),
    )


def launch(x, weights, act, act_s, y, blocks, route_w, num_assignments, alpha, limit, top_k, cfg) -> None:
    """The four GEMMs of one MoE layer (routed gate-up, shared gate-up, routed down, shared down) into ``act``,
    ``act_s`` and ``y`` as ``moe.run_moe``'s Triton launches fill them; the row blocks are ``blocks``' (the shared
    expert takes blocks of as many tokens). ``check`` first."""
    routed13, routed2, shared13, shared2 = weights
    t, h = x.shape
    i, i_s = act.shape[1], act_s.shape[1]
    bm = blocks.block_m
    if bm > 256 or bm % 64:
        raise ValueError(f"moe: WS row blocks must be a multiple of 64 up to 256 (one TMA box), got {bm}")
    cfg = {**cfg, "BLOCK_M": bm}
    bn, bn_down = cfg["BLOCK_N"], cfg.get("BLOCK_N_DOWN") or cfg["BLOCK_N"]
    rows, block_expert = blocks.rows, blocks.block_expert
    # The routed rows in block order (padding rows copy the last assignment's token: computed, never stored).
    x_blocks = x.index_select(0, rows.clamp(max=num_assignments - 1) // top_k)
    if x.stride(1) != 1 or x.data_ptr() % 16 or x.stride(0) * x.element_size() % 16:  # TMA's alignment (shared)
        x = x.clone(memory_format=torch.contiguous_format)
    route_w = route_w.contiguous()
    m_s = triton.cdiv(t, bm)
    _launch(x_blocks, routed13, act, rows, block_expert, route_w, num_assignments, alpha, limit, act.stride(0), 0,
            blocks.num_blocks, i, h, top_k, True, True, bn, cfg)
    _launch(x, shared13, act_s, act_s, act_s, route_w, t, alpha, limit, act_s.stride(0), 0, m_s, i_s, h, top_k,
            False, True, bn, cfg)
    _launch(act, routed2, y, rows, block_expert, route_w, num_assignments, alpha, limit, y.stride(0), y.stride(1),
            blocks.num_blocks, h, i, top_k, True, False, bn_down, cfg)
    _launch(act_s, shared2, y, act_s, act_s, route_w, t, alpha, limit, y.stride(0), y.stride(1), m_s, h, i_s,
            top_k, False, False, bn_down, cfg)
