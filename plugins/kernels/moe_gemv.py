"""The MoE decode path without tensor cores: one program per (assignment, column tile), weights dotted on CUDA cores.

Not a kernel module (it is not in ``KERNEL_MODULES``): ``moe.run_moe`` launches it when its config says
``GEMV``, by default at one token and at up to 8 with bf16 weights (``moe.default_config``: measured faster there
on the H200; ``bench/moe.py`` sweeps its tiles). At decode nearly every expert a batch
reaches gets one token (batch 8 over 128 experts: ~30 experts for 32 assignments), so a 16-row tensor-core tile
carries one useful row, and feeding ``tl.dot`` costs layout shuffles through shared memory for every weight tile.
Here each program streams one expert's ``[BLOCK_N, H]`` slab for one token and reduces it in registers: no
permutation (the routing's ``[T, top_k]`` ids address the weights directly), no padding, no shared memory.

Semantics are ``moe.py``'s: weights (E4M3 x UE8M0 scale, exactly, per element) are rounded to the activation
dtype as the reference casts them, products and sums are fp32, the gate-up output is rounded to the activation
dtype before SwiGLU-OAI, each expert's output before the routing weight.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .gemv import reduce_rows as _reduce, row_dot as _row_dot, x_tile as _x3
from .mxfp8_linear import cast


@triton.jit
def _gate_up_gemv(
    x_ptr, w_ptr, s_ptr, act_ptr, ids_ptr,
    sx_t, sw_e, sw_n, sw_k, ss_e, ss_n, ss_k, sa_p, alpha, limit,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, ROUTED: tl.constexpr, MXFP8: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (a, n-tile): routed, ``a`` is the assignment token * top_k + slot (expert ``ids[a]``); shared, ``a``
    is the token (expert 0 of a stack of one). act[a] = SwiGLU-OAI(x[token] @ w13[e]^T) for the tile's columns."""
    a = tl.program_id(0)
    pid_n = tl.program_id(1)
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
    acc_g = tl.zeros((BLOCK_N, BLOCK_K // 32, 32), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K // 32, 32), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        x = _x3(x_ptr + tok.to(tl.int64) * sx_t, k0, H, BLOCK_K)
        acc_g = _row_dot(x, acc_g, w_g, s_g, k0, sw_k, ss_k, n_ok, H, BLOCK_K, MXFP8, dt)
        acc_u = _row_dot(x, acc_u, w_g + I * sw_n, s_g + I * ss_n, k0, sw_k, ss_k, n_ok, H, BLOCK_K, MXFP8, dt)
    acc_g = _reduce(acc_g)
    acc_u = _reduce(acc_u)
    gate = tl.minimum(cast(acc_g, dt).to(tl.float32), limit)
    up = tl.minimum(tl.maximum(cast(acc_u, dt).to(tl.float32), -limit), limit)
    act = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    tl.store(act_ptr + a.to(tl.int64) * sa_p + n, cast(act, dt), mask=n_ok)


@triton.jit
def _down_gemv(
    act_ptr, w_ptr, s_ptr, y_ptr, ids_ptr, route_w_ptr,
    sa_p, sw_e, sw_n, sw_k, ss_e, ss_n, ss_k, sy_t, sy_s,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, ROUTED: tl.constexpr, MXFP8: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """y[token, slot] = T(act[a] @ w2[e]^T) * routing weight (routed), y[token, top_k] = act @ w2^T (shared)."""
    a = tl.program_id(0)
    pid_n = tl.program_id(1)
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
    acc = tl.zeros((BLOCK_N, BLOCK_K // 32, 32), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        x = _x3(act_ptr + a.to(tl.int64) * sa_p, k0, I, BLOCK_K)
        acc = _row_dot(x, acc, w_rows, s_rows, k0, sw_k, ss_k, n_ok, I, BLOCK_K, MXFP8, dt)
    y = cast(_reduce(acc), dt).to(tl.float32)
    if ROUTED:
        y = y * tl.load(route_w_ptr + a)
    tl.store(y_ptr + tok.to(tl.int64) * sy_t + slot * sy_s + n, cast(y, dt), mask=n_ok)


def launch(x, act, act_s, y, ids, route_w, routed13, routed2, shared13, shared2, h, i, i_s, top_k, alpha, limit,
           cfg: dict) -> None:
    """The four GEMV launches of one MoE call (``moe.run_moe`` allocates the buffers and combines)."""
    t = x.shape[0]
    bn, bk = cfg.get("BLOCK_N", 32), cfg.get("BLOCK_K", 128)
    launch_kw = dict(num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3))
    for w, rows, out, width, routed in ((routed13, t * top_k, act, i, True), (shared13, t, act_s, i_s, False)):
        _gate_up_gemv[(rows, triton.cdiv(width, bn))](
            x, w.w, w.s, out, ids, x.stride(0), *w.strides(), out.stride(0), alpha, limit,
            H=h, I=width, TOP_K=top_k, ROUTED=routed, MXFP8=w.mxfp8, BLOCK_N=bn, BLOCK_K=bk, **launch_kw,
        )
    for w, rows, a, width, routed in ((routed2, t * top_k, act, i, True), (shared2, t, act_s, i_s, False)):
        _down_gemv[(rows, triton.cdiv(h, bn))](
            a, w.w, w.s, y, ids, route_w, a.stride(0), *w.strides(), y.stride(0), y.stride(1),
            H=h, I=width, TOP_K=top_k, ROUTED=routed, MXFP8=w.mxfp8, BLOCK_N=bn, BLOCK_K=bk, **launch_kw,
        )
