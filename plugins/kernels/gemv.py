"""CUDA-core GEMV for decode-sized batches: weight rows streamed once, dotted in registers, no tensor cores.

At one to a few rows a 16-row tensor-core tile carries one useful row and feeding ``tl.dot`` costs a layout
shuffle through shared memory for every weight tile; a GEMV is bound by the weight stream alone. The primitives
here serve the MoE decode path (``moe_gemv.py``) and ``m3::mxfp8_linear`` at decode (``linear_gemv`` below, chosen
by ``mxfp8_linear.gemv_config`` only where the H200 measured it faster). Semantics are the references': weights
(E4M3 x UE8M0, exactly) in the activation dtype, fp32 products and sums, the output rounded once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .mxfp8_linear import _e4m3_value, _scale_value, cast


@triton.jit
def row_dot(x3, acc3, w_rows, s_rows, k0, sw_k, ss_k, n_ok, K: tl.constexpr, BLOCK_K: tl.constexpr,
             MXFP8: tl.constexpr, DT: tl.constexpr):
    """acc3 [BN, BLOCK_K / 32, 32] += W[rows, k0 : k0 + BLOCK_K] * x (x3: fp32 [1, BLOCK_K / 32, 32]).

    The products are accumulated element-wise and reduced once after the K loop (``reduce_rows``): a cross-lane
    reduction per K step would cost more than the weight stream itself. The tile is loaded as [rows, groups of 32,
    32] so each group's UE8M0 scale broadcasts over its 32 columns without a reshape.
    MXFP8 with bf16 activations: E4M3 x 2^e has 4 significant bits, so rounding it to bf16 (what the reference
    does) changes nothing for any magnitude >= 2^-126; the rounding is skipped there. fp16 keeps it (its
    exponent range is narrower)."""
    G: tl.constexpr = BLOCK_K // 32
    g = tl.arange(0, G)
    j = tl.arange(0, 32)
    k3 = k0 + g[None, :, None] * 32 + j[None, None, :]
    mask = n_ok[:, None, None] & (k3 < K)
    w = tl.load(w_rows[:, None, None] + k3 * sw_k, mask=mask, other=0.0)
    if MXFP8:
        gg = k0 // 32 + g
        s = tl.load(s_rows[:, None] + gg[None, :] * ss_k, mask=n_ok[:, None] & (gg[None, :] < K // 32), other=127)
    else:
        s = g  # not read
    return _dot_tile(acc3, w, s, x3, MXFP8, DT)


@triton.jit
def acc_zeros(BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GSUM: tl.constexpr):
    """The K loop's accumulator: element-wise fp32 [BN, BLOCK_K / 32, 32] (GSUM 0, ``row_dot``'s docstring says
    why), or one fp32 sum per row and 32-column group [BN, BLOCK_K / 32] (GSUM 1, ``_group_dot``)."""
    if GSUM:
        acc = tl.zeros((BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K // 32, 32), dtype=tl.float32)
    return acc


@triton.jit
def _group_dot(acc2, w, s, x3, MXFP8: tl.constexpr, DT: tl.constexpr):
    """GSUM 1: each K step's products summed per 32-column group first (the group's 32 columns lie in one or two
    threads of the load's layout: in-thread adds and at most one shuffle), then, with MXFP8 weights, scaled once
    per group: sum_j (e4m3_j x_j) * 2^(s - 127) instead of sum_j (e4m3_j 2^(s - 127)) x_j. Why: the element-wise
    form spends a multiply per weight on the scale and one fp32 register per weight of a K step on the
    accumulator; this spends a multiply per group and BN x BLOCK_K / 32 registers, so the loop issues about a
    quarter fewer instructions per weight byte (the sm_90 SASS of GEMV_DECODE's K step: 211 instructions for 32
    weights per thread, 112 of them the conversion, scale, product and sum) and wider K steps fit the registers.
    The products are exact in fp32 (E4M3's 4 significant bits times a 16-bit activation's 8 or 11) and a power of
    two scales a sum exactly (outside fp32's subnormal and overflow range, where the element-wise form's products
    are not exact either), so only the order of the fp32 sums changes: the same bound as any summation order.
    fp16 activations keep the reference's rounding of each weight to fp16 first (its range is narrow), unscaled
    sums per group."""
    if MXFP8:
        if DT == tl.float16:
            w3 = cast(_e4m3_value(w) * _scale_value(s)[:, :, None], DT).to(tl.float32)
            acc2 = acc2 + tl.sum(w3 * x3, axis=2)
        else:
            acc2 = acc2 + tl.sum(_e4m3_value(w) * x3, axis=2) * _scale_value(s)
    else:
        acc2 = acc2 + tl.sum(w.to(tl.float32) * x3, axis=2)
    return acc2


@triton.jit
def _load_tile(x_row, w_rows, s_rows, k0, k_end, sw_k, ss_k, n_ok, BLOCK_K: tl.constexpr, MXFP8: tl.constexpr):
    """The raw bytes of one K step (columns k0 .. k0 + BLOCK_K below ``k_end``): weights [BN, G, 32] in their
    stored dtype, UE8M0 scales [BN, G] (MXFP8; else a placeholder), activations [1, G, 32] unconverted. Nothing
    is converted here, so a tile loaded ahead holds one register per 4 E4M3 values while it is in flight."""
    G: tl.constexpr = BLOCK_K // 32
    g = tl.arange(0, G)
    k3 = k0 + g[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    w = tl.load(w_rows[:, None, None] + k3 * sw_k, mask=n_ok[:, None, None] & (k3 < k_end), other=0.0)
    x = tl.load(x_row + k3, mask=k3 < k_end, other=0.0)
    gg = k0 // 32 + g
    if MXFP8:
        s = tl.load(s_rows[:, None] + gg[None, :] * ss_k, mask=n_ok[:, None] & (gg[None, :] * 32 < k_end),
                    other=127)
    else:
        s = gg
    return w, s, x


@triton.jit
def _dot_tile(acc3, w, s, x, MXFP8: tl.constexpr, DT: tl.constexpr):
    """``row_dot``'s arithmetic on a loaded tile (``_load_tile``, ``row_dot`` itself): the
    element-wise accumulator, or the group sums of ``_group_dot`` (a 2-D accumulator, ``acc_zeros`` GSUM 1)."""
    if len(acc3.shape) == 2:  # group sums (``acc_zeros`` GSUM 1)
        acc3 = _group_dot(acc3, w, s, x.to(tl.float32), MXFP8, DT)
    else:
        if MXFP8:
            w3 = _e4m3_value(w) * _scale_value(s)[:, :, None]
            if DT != tl.bfloat16:
                w3 = cast(w3, DT).to(tl.float32)
        else:
            w3 = w.to(tl.float32)
        acc3 = acc3 + w3 * x.to(tl.float32)
    return acc3


@triton.jit
def stream_dot(x_row, w_rows, s_rows, sw_k, ss_k, n_ok, k_lo, KS: tl.constexpr, K: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MXFP8: tl.constexpr, DT: tl.constexpr,
               PREFETCH: tl.constexpr):
    """W[rows, k_lo : k_lo + KS] @ x[k_lo : k_lo + KS] (fp32 [BN]) with PREFETCH (1 or 2) K steps loaded ahead.

    Why: the element-wise accumulator of ``row_dot`` costs one fp32 register per weight element of a K step, so a
    program has one step's loads in flight, and at the registers a gate-up program needs (168 at BN 8 / BK 256 /
    2 warps for sm_90, ``scripts/compile_moe_kernels_sm90.py``) 6 programs = 12 warps fit on an SM, about 24 KB
    of weights in flight: short of what HBM latency needs at 4.3 TB/s. Streaming gate and up one after the other
    halves the accumulators, and raw bytes held for the next steps are cheaper than accumulators (96 registers at
    BN 8 / BK 128 / PREFETCH 2: 10 programs per SM, ~30 KB in flight). Sums are ``row_dot``'s, exactly (same
    products, same element-wise order, one reduction at the end)."""
    k_end = tl.minimum(k_lo + KS, K)
    acc = tl.zeros((BLOCK_N, BLOCK_K // 32, 32), dtype=tl.float32)
    w_a, s_a, x_a = _load_tile(x_row, w_rows, s_rows, k_lo, k_end, sw_k, ss_k, n_ok, BLOCK_K, MXFP8)
    if PREFETCH == 1:
        for kk in range(0, KS, BLOCK_K):
            w_b, s_b, x_b = _load_tile(x_row, w_rows, s_rows, k_lo + kk + BLOCK_K, k_end, sw_k, ss_k, n_ok,
                                       BLOCK_K, MXFP8)
            acc = _dot_tile(acc, w_a, s_a, x_a, MXFP8, DT)
            w_a, s_a, x_a = w_b, s_b, x_b
    else:
        w_b, s_b, x_b = _load_tile(x_row, w_rows, s_rows, k_lo + BLOCK_K, k_end, sw_k, ss_k, n_ok, BLOCK_K, MXFP8)
        for kk in range(0, KS, BLOCK_K):
            w_c, s_c, x_c = _load_tile(x_row, w_rows, s_rows, k_lo + kk + 2 * BLOCK_K, k_end, sw_k, ss_k, n_ok,
                                       BLOCK_K, MXFP8)
            acc = _dot_tile(acc, w_a, s_a, x_a, MXFP8, DT)
            w_a, s_a, x_a = w_b, s_b, x_b
            w_b, s_b, x_b = w_c, s_c, x_c
    return reduce_rows(acc)


@triton.jit
def reduce_rows(acc3):
    """The K loop's accumulator (``acc_zeros``) summed to one fp32 value per row."""
    if len(acc3.shape) == 2:
        out = tl.sum(acc3, axis=1)
    else:
        out = tl.sum(tl.sum(acc3, axis=2), axis=1)
    return out


@triton.jit
def x_tile(x_row, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Activations k0 .. k0 + BLOCK_K of one row as fp32 [1, BLOCK_K / 32, 32]."""
    G: tl.constexpr = BLOCK_K // 32
    k3 = k0 + tl.arange(0, G)[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    return tl.load(x_row + k3, mask=k3 < K, other=0.0).to(tl.float32)


@triton.jit
def _linear_gemv(x_ptr, w_ptr, s_ptr, y_ptr, sx_m, sw_n, sw_k, ss_n, ss_k, sy_m, N,
                 K: tl.constexpr, MXFP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PREFETCH: tl.constexpr, PIPELINE: tl.constexpr = None, GSUM: tl.constexpr = 0):
    """Program (n-tile, row): y[row, tile] = x[row] @ W[tile]^T. ``PIPELINE``: cp.async stages of the K loop
    (``moe_gemv``'s docstring says why the loop must name them); ``GSUM``: per-group sums (``acc_zeros``)."""
    pid_n = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    dt = x_ptr.dtype.element_ty
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_rows = w_ptr + n.to(tl.int64) * sw_n
    s_rows = s_ptr + n.to(tl.int64) * ss_n
    if PREFETCH == 0:
        acc = acc_zeros(BLOCK_N, BLOCK_K, GSUM)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=PIPELINE):
            x = x_tile(x_ptr + row * sx_m, k0, K, BLOCK_K)
            acc = row_dot(x, acc, w_rows, s_rows, k0, sw_k, ss_k, n_ok, K, BLOCK_K, MXFP8, dt)
        out = reduce_rows(acc)
    else:
        KS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K * BLOCK_K
        out = stream_dot(x_ptr + row * sx_m, w_rows, s_rows, sw_k, ss_k, n_ok, 0, KS, K, BLOCK_N, BLOCK_K, MXFP8,
                         dt, PREFETCH)
    tl.store(y_ptr + row * sy_m + n, cast(out, y_ptr.dtype.element_ty), mask=n_ok)


def pipeline_kw(cfg: dict, who: str) -> dict:
    """The ``PIPELINE`` constexpr of a GEMV config (absent when unset: the kernels' default, a plain K loop)."""
    stages = cfg.get("PIPELINE")
    if stages is None:
        return {}
    if int(stages) < 1 or cfg.get("PREFETCH", 0):
        raise ValueError(f"{who}: PIPELINE must be >= 1 and goes with PREFETCH 0, got {stages} and "
                         f"{cfg.get('PREFETCH', 0)}")
    return {"PIPELINE": int(stages)}


def gsum_kw(cfg: dict, who: str) -> dict:
    """The ``GSUM`` constexpr of a GEMV config (absent when unset): per-group sums in the K loop (``acc_zeros``);
    the register-streamed PREFETCH loop keeps the element-wise accumulator."""
    if not cfg.get("GSUM"):
        return {}
    if cfg.get("PREFETCH", 0):
        raise ValueError(f"{who}: GSUM goes with PREFETCH 0, got PREFETCH {cfg['PREFETCH']}")
    return {"GSUM": 1}


# The keys a GEMV config of the linear may hold (``linear_gemv`` refuses others rather than ignoring them).
LINEAR_CONFIG_KEYS = {"GEMV", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "PREFETCH", "PIPELINE", "GSUM"}


def linear_gemv(x2, weight, weight_scale, y, cfg: dict) -> None:
    """y [M, N] = x2 [M, K] @ dequant(weight)^T, one program per (row, N tile)."""
    m, k = x2.shape
    n = weight.shape[0]
    unknown = set(cfg) - LINEAR_CONFIG_KEYS
    if unknown:
        raise ValueError(f"mxfp8_linear: the GEMV path takes the config keys {sorted(LINEAR_CONFIG_KEYS)}, got "
                         f"{sorted(unknown)}")
    bn = cfg.get("BLOCK_N", 32)
    _linear_gemv[(triton.cdiv(n, bn), m)](
        x2, weight, weight_scale, y, x2.stride(0), weight.stride(0), weight.stride(1),
        weight_scale.stride(0), weight_scale.stride(1), y.stride(0), n,
        K=k, MXFP8=True, BLOCK_N=bn, BLOCK_K=cfg.get("BLOCK_K", 128), PREFETCH=cfg.get("PREFETCH", 0),
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3), **pipeline_kw(cfg, "mxfp8_linear"),
        **gsum_kw(cfg, "mxfp8_linear"),
    )
