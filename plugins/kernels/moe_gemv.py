"""The MoE decode path without tensor cores: one program per (assignment, column tile), weights dotted on CUDA cores.

Not a kernel module (it is not in ``KERNEL_MODULES``): ``moe.run_moe`` launches it when its config says
``GEMV``, by default at one token (``moe.default_config``: measured faster there on the H200; ``bench/moe.py``
sweeps its tiles, at up to 8 tokens). At decode nearly every expert a batch
reaches gets one token (batch 8 over 128 experts: ~30 experts for 32 assignments), so a 16-row tensor-core tile
carries one useful row, and feeding ``tl.dot`` costs layout shuffles through shared memory for every weight tile.
Here each program streams one expert's ``[BLOCK_N, H]`` slab for one token and reduces it in registers: no
permutation (the routing's ``[T, top_k]`` ids address the weights directly), no padding, no shared memory (but
for the cp.async buffers of ``PIPELINE``).

``SPLIT_K`` > 1 (a config key; 1 by default) splits each program's K loop over ``SPLIT_K`` programs, so that
batch 1's few experts are streamed by more CTAs: each stores its fp32 partial sums, and the last program of the
tile to arrive (a per-tile arrival counter, zeroed per call) adds the partials in split order, then applies the
epilogue. Deterministic (the order of the adds does not depend on which program arrives last), no extra launch.

``PREFETCH`` 1 or 2 (config key; 0 by default) streams gate and up one after the other with that many K steps
raw bytes loaded ahead (``gemv.stream_dot``): more bytes in flight per SM for the same registers.

``PIPELINE`` S (config key, PREFETCH 0 only; 4 in both one-token defaults, ``moe.GEMV_DECODE*``) gives the K loop ``tl.range(num_stages=S)``. Triton
pipelines the loads of a loop without a dot only when the loop itself names its stages (the launch's
``num_stages`` does not): the weight, scale and activation tiles of the next S - 1 K steps are then copied into
shared memory with cp.async while this step is summed, so the bytes in flight no longer cost registers (sm_90
compile at mini dims, gate-up BN 8 / BK 256 / 4 warps: 72 registers either way, 13.8 KB of shared memory at S 4,
about 3x the bytes in flight per SM). The same loads and sums in the same order: results are bit-identical.

Semantics are ``moe.py``'s: weights (E4M3 x UE8M0 scale, exactly, per element) are rounded to the activation
dtype as the reference casts them, products and sums are fp32, the gate-up output is rounded to the activation
dtype before SwiGLU-OAI, each expert's output before the routing weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv import pipeline_kw, reduce_rows as _reduce, row_dot as _row_dot, stream_dot as _stream, x_tile as _x3
from .mxfp8_linear import cast


@triton.jit
def _gate_up_gemv(
    x_ptr, w_ptr, s_ptr, act_ptr, ids_ptr, part_ptr, cnt_ptr,
    sx_t, sw_e, sw_n, sw_k, ss_e, ss_n, ss_k, sa_p, alpha, limit,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, ROUTED: tl.constexpr, MXFP8: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PREFETCH: tl.constexpr,
    PIPELINE: tl.constexpr = None,
):
    """Program (a, n-tile, split): routed, ``a`` is the assignment token * top_k + slot (expert ``ids[a]``); shared,
    ``a`` is the token (expert 0 of a stack of one). act[a] = SwiGLU-OAI(x[token] @ w13[e]^T) for the tile's
    columns. With SPLIT_K > 1, ``part_ptr`` is fp32 [SPLIT_K, rows, 2, I] and ``cnt_ptr`` int32 [rows, n-tiles]."""
    a = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if ROUTED:
        e = tl.load(ids_ptr + a).to(tl.int64)
        tok = a // TOP_K
    else:
        e = (a * 0).to(tl.int64)
        tok = a
    dt = x_ptr.dtype.element_ty
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    w_g = w_ptr + e * sw_e + n.to(tl.int64) * sw_n
    s_g = s_ptr + e * ss_e + n.to(tl.int64) * ss_n
    KS: tl.constexpr = ((H + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K  # K per split
    x_row = x_ptr + tok.to(tl.int64) * sx_t
    if PREFETCH == 0:  # gate and up in one loop, one K step in flight
        acc_g = tl.zeros((BLOCK_N, BLOCK_K // 32, 32), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K // 32, 32), dtype=tl.float32)
        for kk in tl.range(0, KS, BLOCK_K, num_stages=PIPELINE):
            k0 = pid_k * KS + kk  # past H in the last split: masked loads, zeros added
            x = _x3(x_row, k0, H, BLOCK_K)
            acc_g = _row_dot(x, acc_g, w_g, s_g, k0, sw_k, ss_k, n_ok, H, BLOCK_K, MXFP8, dt)
            acc_u = _row_dot(x, acc_u, w_g + I * sw_n, s_g + I * ss_n, k0, sw_k, ss_k, n_ok, H, BLOCK_K, MXFP8, dt)
        acc_g = _reduce(acc_g)
        acc_u = _reduce(acc_u)
    else:  # gate, then up, each streamed with PREFETCH K steps in flight (gemv.stream_dot)
        acc_g = _stream(x_row, w_g, s_g, sw_k, ss_k, n_ok, pid_k * KS, KS, H, BLOCK_N, BLOCK_K, MXFP8, dt, PREFETCH)
        acc_u = _stream(x_row, w_g + I * sw_n, s_g + I * ss_n, sw_k, ss_k, n_ok, pid_k * KS, KS, H, BLOCK_N,
                        BLOCK_K, MXFP8, dt, PREFETCH)
    out = act_ptr + a.to(tl.int64) * sa_p + n
    if SPLIT_K == 1:
        _swiglu_store(acc_g, acc_u, out, n_ok, alpha, limit, dt)
    else:
        rows = tl.num_programs(0)
        part = part_ptr + a.to(tl.int64) * (2 * I) + n
        tl.store(part + pid_k.to(tl.int64) * rows * (2 * I), acc_g, mask=n_ok)
        tl.store(part + pid_k.to(tl.int64) * rows * (2 * I) + I, acc_u, mask=n_ok)
        if _arrive_last(cnt_ptr + a * tl.num_programs(1) + pid_n, SPLIT_K):
            _swiglu_store(_sum_splits(part, rows * (2 * I), n_ok, SPLIT_K),
                          _sum_splits(part + I, rows * (2 * I), n_ok, SPLIT_K), out, n_ok, alpha, limit, dt)


@triton.jit
def _swiglu_store(acc_g, acc_u, out_ptrs, n_ok, alpha, limit, dt: tl.constexpr):
    """SwiGLU-OAI of the fp32 gate / up sums rounded to the activation dtype, as the reference computes it."""
    gate = tl.minimum(cast(acc_g, dt).to(tl.float32), limit)
    up = tl.minimum(tl.maximum(cast(acc_u, dt).to(tl.float32), -limit), limit)
    act = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    tl.store(out_ptrs, cast(act, dt), mask=n_ok)


@triton.jit
def _arrive_last(cnt_ptr, SPLIT_K: tl.constexpr):
    """Called after this program stored its partial sums: True in the last of the tile's SPLIT_K programs to
    arrive. The barrier orders every thread's stores before the counter's release; the acquire makes the other
    programs' partials visible to the last one."""
    tl.debug_barrier()
    return tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1


@triton.jit
def _sum_splits(part_ptrs, split_stride, n_ok, SPLIT_K: tl.constexpr):
    """The partials of splits 0 .. SPLIT_K - 1 added in that order (read past L1: written by other programs)."""
    acc = tl.load(part_ptrs, mask=n_ok, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptrs + s * split_stride, mask=n_ok, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def _down_gemv(
    act_ptr, w_ptr, s_ptr, y_ptr, ids_ptr, route_w_ptr, part_ptr, cnt_ptr,
    sa_p, sw_e, sw_n, sw_k, ss_e, ss_n, ss_k, sy_t, sy_s,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, ROUTED: tl.constexpr, MXFP8: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PREFETCH: tl.constexpr,
    PIPELINE: tl.constexpr = None,
):
    """y[token, slot] = T(act[a] @ w2[e]^T) * routing weight (routed), y[token, top_k] = act @ w2^T (shared).
    With SPLIT_K > 1, ``part_ptr`` is fp32 [SPLIT_K, rows, H] and ``cnt_ptr`` int32 [rows, n-tiles]."""
    a = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if ROUTED:
        e = tl.load(ids_ptr + a).to(tl.int64)
        tok = a // TOP_K
        slot = a % TOP_K
    else:
        e = (a * 0).to(tl.int64)
        tok = a
        slot = TOP_K
    dt = act_ptr.dtype.element_ty
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    w_rows = w_ptr + e * sw_e + n.to(tl.int64) * sw_n
    s_rows = s_ptr + e * ss_e + n.to(tl.int64) * ss_n
    KS: tl.constexpr = ((I + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    if PREFETCH == 0:
        acc = tl.zeros((BLOCK_N, BLOCK_K // 32, 32), dtype=tl.float32)
        for kk in tl.range(0, KS, BLOCK_K, num_stages=PIPELINE):
            k0 = pid_k * KS + kk
            x = _x3(act_ptr + a.to(tl.int64) * sa_p, k0, I, BLOCK_K)
            acc = _row_dot(x, acc, w_rows, s_rows, k0, sw_k, ss_k, n_ok, I, BLOCK_K, MXFP8, dt)
        acc = _reduce(acc)
    else:
        acc = _stream(act_ptr + a.to(tl.int64) * sa_p, w_rows, s_rows, sw_k, ss_k, n_ok, pid_k * KS, KS, I, BLOCK_N,
                      BLOCK_K, MXFP8, dt, PREFETCH)
    out = y_ptr + tok.to(tl.int64) * sy_t + slot * sy_s + n
    if SPLIT_K == 1:
        _weighted_store(acc, out, n_ok, route_w_ptr + a, ROUTED, dt)
    else:
        rows = tl.num_programs(0)
        part = part_ptr + a.to(tl.int64) * H + n
        tl.store(part + pid_k.to(tl.int64) * rows * H, acc, mask=n_ok)
        if _arrive_last(cnt_ptr + a * tl.num_programs(1) + pid_n, SPLIT_K):
            _weighted_store(_sum_splits(part, rows * H, n_ok, SPLIT_K), out, n_ok, route_w_ptr + a, ROUTED, dt)


@triton.jit
def _weighted_store(acc, out_ptrs, n_ok, route_w_ptr, ROUTED: tl.constexpr, dt: tl.constexpr):
    """The expert's output rounded to the activation dtype (as the reference rounds it), times the routing weight."""
    y = cast(acc, dt).to(tl.float32)
    if ROUTED:
        y = y * tl.load(route_w_ptr)
    tl.store(out_ptrs, cast(y, dt), mask=n_ok)


def launch(x, act, act_s, y, ids, route_w, routed13, routed2, shared13, shared2, h, i, i_s, top_k, alpha, limit,
           cfg: dict) -> None:
    """The four GEMV launches of one MoE call (``moe.run_moe`` allocates the buffers and combines)."""
    t = x.shape[0]
    bn, bk, split = cfg.get("BLOCK_N", 32), cfg.get("BLOCK_K", 128), int(cfg.get("SPLIT_K", 1))
    prefetch = int(cfg.get("PREFETCH", 0))
    if split < 1 or prefetch not in (0, 1, 2):
        raise ValueError(f"moe: SPLIT_K must be >= 1 and PREFETCH 0, 1 or 2, got {split} and {prefetch}")
    launch_kw = dict(num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
                     **pipeline_kw(cfg, "moe"))
    gate_up = ((routed13, t * top_k, act, i, True), (shared13, t, act_s, i_s, False))
    down = ((routed2, t * top_k, act, i, True), (shared2, t, act_s, i_s, False))
    # Split-K scratch: fp32 partials, and one zeroed arrival counter per (row, N tile) of each of the four launches.
    tiles = [rows * triton.cdiv(width, bn) for _, rows, _, width, _ in gate_up] + [rows * triton.cdiv(h, bn)
                                                                                 for _, rows, _, _, _ in down]
    part = cnt = act  # never read when split == 1
    if split > 1:
        part = torch.empty(split * t * (top_k + 1) * max(2 * max(i, i_s), h), dtype=torch.float32, device=x.device)
        cnt = torch.zeros(sum(tiles), dtype=torch.int32, device=x.device)
    offsets = [sum(tiles[:j]) for j in range(4)]
    for j, (w, rows, out, width, routed) in enumerate(gate_up):
        _gate_up_gemv[(rows, triton.cdiv(width, bn), split)](
            x, w.w, w.s, out, ids, part, cnt[offsets[j]:] if split > 1 else cnt, x.stride(0), *w.strides(),
            out.stride(0), alpha, limit,
            H=h, I=width, TOP_K=top_k, ROUTED=routed, MXFP8=w.mxfp8, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, PREFETCH=prefetch,
            **launch_kw,
        )
    for j, (w, rows, a, width, routed) in enumerate(down, start=2):
        _down_gemv[(rows, triton.cdiv(h, bn), split)](
            a, w.w, w.s, y, ids, route_w, part, cnt[offsets[j]:] if split > 1 else cnt, a.stride(0), *w.strides(),
            y.stride(0), y.stride(1),
            H=h, I=width, TOP_K=top_k, ROUTED=routed, MXFP8=w.mxfp8, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, PREFETCH=prefetch,
            **launch_kw,
        )
