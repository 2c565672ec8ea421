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

Round 5 (config keys; ``bench/moe.py``'s DECODE_ROUND5, ``moe.GEMV_DECODE`` takes the H200's winner):
``SHARED_GRID`` 1 runs the shared expert's tokens as more rows of the routed launches' grid (``_row_source``), so
gate-up and down are one launch each; ``BLOCK_N_DOWN`` gives the down launch its own N tile; ``PDL`` 1 / 2 makes
gate-up and down programmatic dependent launches (``_down_gemv``'s docstring); ``GSUM`` 1 sums each K step per
32-column group (``gemv._group_dot``: fewer instructions and registers, another fp32 summation order); ``ACT_F32``
1 hands the activations to the down launch as fp32 (``launch``). Three more round-5 keys measured slower on the
H200 in every pairing and were removed (``docs/performance.md``): the combine in the down launch by ticket, TMA
weight tiles, and a split-K of the down launch alone.

Semantics are ``moe.py``'s: weights (E4M3 x UE8M0 scale, exactly, per element) are rounded to the activation
dtype as the reference casts them, products and sums are fp32, the gate-up output is rounded to the activation
dtype before SwiGLU-OAI, each expert's output before the routing weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .gemv import (acc_zeros as _acc_zeros, gsum_kw, pipeline_kw, reduce_rows as _reduce, row_dot as _row_dot,
                   stream_dot as _stream, x_tile as _x3)
from .mxfp8_linear import _INTERPRETED, cast


@triton.jit
def _row_source(a, n_routed, ids_ptr, w_ptr, s_ptr, sh_w_off, sh_s_off, sw_e, ss_e, TOP_K: tl.constexpr,
                ROUTED: tl.constexpr, SHARED: tl.constexpr):
    """(weights, scales, token, slot) of grid row ``a``: rows below ``n_routed`` are assignments (token * top_k +
    slot, expert ``ids[a]`` of the stack at ``w_ptr``), the rows from ``n_routed`` on are tokens of the shared
    expert (slot top_k), whose weights and scales lie ``sh_w_off`` / ``sh_s_off`` elements from ``w_ptr`` /
    ``s_ptr``: ROUTED and SHARED, the ``SHARED_GRID`` launch. ROUTED alone: every row an assignment; neither:
    every row a token of the shared expert, whose weights are then at ``w_ptr`` (the launches' positional
    arguments are those of the kernels before round 5, which the TensorRT plugin wrappers call). Selects, not
    branches: the compiler keeps the offsets' divisibility through a select (through an if it does not, and the
    weight loads lose their 16-byte vectors and cp.async), and a hint that both offsets are whole multiples of
    16 bytes, which ``launch`` checks (the select of a loaded expert id's offset loses the divisibility the
    compiler knows of each: without the hint the sm_90 K step was 523 instructions with byte loads, 213 with it)."""
    if ROUTED and SHARED:
        routed = a < n_routed
        e = tl.load(ids_ptr + a, mask=routed, other=0).to(tl.int64)
        # 16 bytes' worth of elements: launch() checks that both offsets are multiples of it
        w16: tl.constexpr = 128 // w_ptr.dtype.element_ty.primitive_bitwidth
        s16: tl.constexpr = 128 // s_ptr.dtype.element_ty.primitive_bitwidth
        w_base = w_ptr + tl.multiple_of(tl.where(routed, e * sw_e, sh_w_off), w16)
        s_base = s_ptr + tl.multiple_of(tl.where(routed, e * ss_e, sh_s_off), s16)
        tok = tl.where(routed, a // TOP_K, a - n_routed)
        slot = tl.where(routed, a % TOP_K, TOP_K)
    elif ROUTED:
        e = tl.load(ids_ptr + a).to(tl.int64)
        w_base = w_ptr + e * sw_e
        s_base = s_ptr + e * ss_e
        tok = a // TOP_K
        slot = a % TOP_K
    else:  # a launch of the shared expert alone (its weights at w_ptr)
        w_base = w_ptr
        s_base = s_ptr
        tok = a
        slot = a * 0 + TOP_K
    return w_base, s_base, tok, slot


@triton.jit
def _wait_for_previous_launch(PDL: tl.constexpr):
    """PDL >= 1 (the launch made with ``launch_pdl``): wait until the previous launch has finished and its writes
    are visible (``griddepcontrol.wait``); a no-op otherwise (and under the interpreter, which runs launches in
    order)."""
    if PDL and not _INTERPRETED:
        gdc_wait()


@triton.jit
def _prefetch_l2(w_rows, k_lo, KS: tl.constexpr, K: tl.constexpr, ELEM_BYTES: tl.constexpr):
    """Ask L2 for the 128-byte lines of the tile rows' columns k_lo .. k_lo + KS (``prefetch.global.L2``: no
    registers, no wait). A down program launched during the gate-up launch's last wave (PDL) issues these before it
    waits for the gate-up to finish, so its first weight tiles are in L2, not HBM, when it may start."""
    LINES: tl.constexpr = triton.next_power_of_2((KS * ELEM_BYTES + 127) // 128)
    j = tl.minimum(tl.arange(0, LINES), (KS * ELEM_BYTES + 127) // 128 - 1)
    col = tl.minimum(k_lo + j * (128 // ELEM_BYTES), K - 1)
    addr = (w_rows[:, None] + col[None, :]).to(tl.int64)
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [addr],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gate_up_gemv(
    x_ptr, w_ptr, s_ptr, act_ptr, ids_ptr, part_ptr, cnt_ptr,
    sx_t, sw_e, sw_n, sw_k, ss_e, ss_n, ss_k, sa_p, alpha, limit,
    H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr, ROUTED: tl.constexpr, MXFP8: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PREFETCH: tl.constexpr,
    PIPELINE: tl.constexpr = None, SHARED: tl.constexpr = 0, PDL: tl.constexpr = 0, GSUM: tl.constexpr = 0,
    sh_w_off=0, sh_s_off=0, n_routed=0,
):
    """Program (a, n-tile, split): row ``a`` of the grid is an assignment or a token of the shared expert
    (``_row_source``). act[a] = SwiGLU-OAI(x[token] @ w13[e]^T) for the tile's columns. With SPLIT_K > 1,
    ``part_ptr`` is fp32 [SPLIT_K, rows, 2, I] and ``cnt_ptr`` int32 [rows, n-tiles]. PDL >= 1: launched as a
    programmatic dependent of the routing; waits for it, then lets the down launch start (its programs take the
    SM slots this launch's last wave leaves free, and wait there for this launch to finish)."""
    a = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    _wait_for_previous_launch(PDL)
    if PDL and not _INTERPRETED:
        gdc_launch_dependents()
    w_base, s_base, tok, slot = _row_source(a, n_routed, ids_ptr, w_ptr, s_ptr, sh_w_off, sh_s_off, sw_e, ss_e,
                                            TOP_K, ROUTED, SHARED)
    dt = x_ptr.dtype.element_ty
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    w_g = w_base + n.to(tl.int64) * sw_n
    s_g = s_base + n.to(tl.int64) * ss_n
    KS: tl.constexpr = ((H + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K  # K per split
    x_row = x_ptr + tok.to(tl.int64) * sx_t
    if PREFETCH == 0:  # gate and up in one loop, one K step in flight
        acc_g = _acc_zeros(BLOCK_N, BLOCK_K, GSUM)
        acc_u = _acc_zeros(BLOCK_N, BLOCK_K, GSUM)
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
    PIPELINE: tl.constexpr = None, SHARED: tl.constexpr = 0, PDL: tl.constexpr = 0, GSUM: tl.constexpr = 0,
    sh_w_off=0, sh_s_off=0, n_routed=0,
):
    """y[token, slot] = T(act[a] @ w2[e]^T) * routing weight (an assignment row), y[token, top_k] = act[a] @ w2^T
    (a shared row; ``_row_source``). With SPLIT_K > 1, ``part_ptr`` is fp32 [SPLIT_K, rows, H] and ``cnt_ptr``
    int32 [rows, n-tiles]. PDL >= 1 (launched as a programmatic dependent of the gate-up launch): waits for it
    before reading the activations; PDL 2 first
    asks L2 for the program's weight rows (``_prefetch_l2``), so the programs that start during the gate-up's last
    wave fetch weights instead of idling. The expert ids it reads before waiting come from the routing, which the
    gate-up launch waited for before it let this one start."""
    a = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    w_base, s_base, tok, slot = _row_source(a, n_routed, ids_ptr, w_ptr, s_ptr, sh_w_off, sh_s_off, sw_e, ss_e,
                                            TOP_K, ROUTED, SHARED)
    dt = y_ptr.dtype.element_ty  # the activations' dtype (act may be fp32 holding its values: ACT_F32)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    w_rows = w_base + n.to(tl.int64) * sw_n
    s_rows = s_base + n.to(tl.int64) * ss_n
    KS: tl.constexpr = ((I + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    if PDL == 2 and not _INTERPRETED:
        _prefetch_l2(tl.where(n_ok, w_rows, w_base), pid_k * KS, KS, I, w_ptr.dtype.element_ty.primitive_bitwidth
                     // 8)
    _wait_for_previous_launch(PDL)
    if PREFETCH == 0:
        acc = _acc_zeros(BLOCK_N, BLOCK_K, GSUM)
        for kk in tl.range(0, KS, BLOCK_K, num_stages=PIPELINE):
            k0 = pid_k * KS + kk
            x = _x3(act_ptr + a.to(tl.int64) * sa_p, k0, I, BLOCK_K)
            acc = _row_dot(x, acc, w_rows, s_rows, k0, sw_k, ss_k, n_ok, I, BLOCK_K, MXFP8, dt)
        acc = _reduce(acc)
    else:
        acc = _stream(act_ptr + a.to(tl.int64) * sa_p, w_rows, s_rows, sw_k, ss_k, n_ok, pid_k * KS, KS, I, BLOCK_N,
                      BLOCK_K, MXFP8, dt, PREFETCH)
    if ROUTED and SHARED:  # a shared row's "routing weight" is 1: y * 1.0 is y, bit for bit
        route_w = tl.load(route_w_ptr + a, mask=a < n_routed, other=1.0)
    elif ROUTED:
        route_w = tl.load(route_w_ptr + a)
    else:
        route_w = 1.0
    y_row = y_ptr + tok.to(tl.int64) * sy_t + n
    if SPLIT_K == 1:
        _weighted_store(acc, y_row + slot * sy_s, n_ok, route_w, ROUTED, dt)
    else:
        rows = tl.num_programs(0)
        part = part_ptr + a.to(tl.int64) * H + n
        tl.store(part + pid_k.to(tl.int64) * rows * H, acc, mask=n_ok)
        if _arrive_last(cnt_ptr + a * tl.num_programs(1) + pid_n, SPLIT_K):
            _weighted_store(_sum_splits(part, rows * H, n_ok, SPLIT_K), y_row + slot * sy_s, n_ok, route_w, ROUTED,
                            dt)


@triton.jit
def _weighted_store(acc, out_ptrs, n_ok, route_w, ROUTED: tl.constexpr, dt: tl.constexpr):
    """The expert's output rounded to the activation dtype (as the reference rounds it), times the routing weight."""
    y = cast(acc, dt).to(tl.float32)
    if ROUTED:
        y = y * route_w
    tl.store(out_ptrs, cast(y, dt), mask=n_ok)


def _offset(shared: torch.Tensor, routed: torch.Tensor) -> int | None:
    """Elements from ``routed``'s first element to ``shared``'s (the SHARED_GRID kernels address the shared expert
    from the routed stack's pointer, ``_row_source``); None unless that distance and the stack's expert stride are
    whole multiples of 16 bytes, as the kernels assume."""
    step = routed.element_size()
    if (shared.dtype != routed.dtype or (shared.data_ptr() - routed.data_ptr()) % 16
            or routed.stride(0) * step % 16):
        return None
    return (shared.data_ptr() - routed.data_ptr()) // step


# The keys a GEMV config may hold (``launch`` refuses others rather than ignoring them).
CONFIG_KEYS = {"GEMV", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "SPLIT_K", "PREFETCH", "PIPELINE",
               "SHARED_GRID", "BLOCK_N_DOWN", "PDL", "GSUM", "ACT_F32"}


def launch(x, ids, route_w, routed13, routed2, shared13, shared2, top_k, alpha, limit, cfg: dict) -> torch.Tensor:
    """The GEMV launches of one MoE call: gate-up and down, each as one launch over the assignments and the shared
    expert's tokens (``SHARED_GRID`` 1, where the shared expert has the routed experts' I and row strides) or as a
    routed and a shared launch. Returns the expert outputs ``y [T, top_k + 1, H]`` for ``moe._combine``."""
    unknown = set(cfg) - CONFIG_KEYS
    if unknown:
        raise ValueError(f"moe: the GEMV decode path takes the config keys {sorted(CONFIG_KEYS)}, got "
                         f"{sorted(unknown)}")
    t, h = x.shape
    n = t * top_k
    i, i_s = routed13.w.shape[1] // 2, shared13.w.shape[1] // 2
    bn, bk, split = cfg.get("BLOCK_N", 32), cfg.get("BLOCK_K", 128), int(cfg.get("SPLIT_K", 1))
    bn_down = cfg.get("BLOCK_N_DOWN") or bn  # the down launch's own N tile (its K loop is half the gate-up's)
    prefetch = int(cfg.get("PREFETCH", 0))
    if split < 1 or prefetch not in (0, 1, 2):
        raise ValueError(f"moe: SPLIT_K must be >= 1 and PREFETCH 0, 1 or 2, got {split} and {prefetch}")
    pdl = int(cfg.get("PDL", 0))
    if pdl not in (0, 1, 2):
        raise ValueError(f"moe: PDL must be 0, 1 or 2, got {pdl}")
    launch_kw = dict(num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
                     **pipeline_kw(cfg, "moe"), **gsum_kw(cfg, "moe"))
    if pdl:  # programmatic dependent launches (Hopper); the interpreter runs launches in order without them
        launch_kw.update(PDL=pdl, **({} if triton.knobs.runtime.interpret else {"launch_pdl": True}))
    same_layout = all(r.w.stride()[1:] == s.w.stride()[1:] and r.s.stride()[1:] == s.s.stride()[1:]
                      for r, s in ((routed13, shared13), (routed2, shared2)))
    dev, dt = x.device, x.dtype
    # ACT_F32 1: the SwiGLU activations stored as fp32 (the same values, rounded to the activation dtype first), so
    # the down launch loads them without a conversion per weight element (a thread of the down GEMV converts each
    # activation it multiplies: about one instruction per weight byte of a 4- or 8-row tile on sm_90).
    act_dt = torch.float32 if cfg.get("ACT_F32") else dt
    offsets_13 = (_offset(shared13.w, routed13.w), _offset(shared13.s, routed13.s))
    offsets_2 = (_offset(shared2.w, routed2.w), _offset(shared2.s, routed2.s))
    if cfg.get("SHARED_GRID") and i == i_s and same_layout and None not in offsets_13 + offsets_2:
        act = torch.empty((n + t, i), dtype=act_dt, device=dev)
        # (weights, the shared expert's offsets from them, grid rows, activations, I, ROUTED, SHARED)
        gate_up = [(routed13, offsets_13, n + t, act, i, True, True)]
        down = [(routed2, offsets_2, n + t, act, i, True, True)]
    else:
        act, act_s = torch.empty((n, i), dtype=act_dt, device=dev), torch.empty((t, i_s), dtype=act_dt, device=dev)
        gate_up = [(routed13, (0, 0), n, act, i, True, False), (shared13, (0, 0), t, act_s, i_s, False, False)]
        down = [(routed2, (0, 0), n, act, i, True, False), (shared2, (0, 0), t, act_s, i_s, False, False)]
    y = torch.empty((t, top_k + 1, h), dtype=dt, device=dev)
    # Split-K scratch: fp32 partials, and one zeroed arrival counter per (row, N tile) of each launch.
    tiles = [g[2] * triton.cdiv(g[4], bn) for g in gate_up] + [d[2] * triton.cdiv(h, bn_down) for d in down]
    part = cnt = act  # never read without split-K
    if split > 1:
        part = torch.empty(split * (n + t) * max(2 * max(i, i_s), h), dtype=torch.float32, device=dev)
        cnt = torch.zeros(sum(tiles), dtype=torch.int32, device=dev)
    offsets = [sum(tiles[:j]) for j in range(len(tiles))]
    for j, (w, (w_off, s_off), rows, a, width, routed, shared) in enumerate(gate_up):
        _gate_up_gemv[(rows, triton.cdiv(width, bn), split)](
            x, w.w, w.s, a, ids, part, cnt[offsets[j]:] if split > 1 else cnt, x.stride(0), *w.strides(),
            a.stride(0), alpha, limit,
            H=h, I=width, TOP_K=top_k, ROUTED=routed, MXFP8=w.mxfp8, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
            PREFETCH=prefetch, SHARED=shared, sh_w_off=w_off, sh_s_off=s_off, n_routed=n,
            **launch_kw,
        )
    for j, (w, (w_off, s_off), rows, a, width, routed, shared) in enumerate(down, start=len(gate_up)):
        _down_gemv[(rows, triton.cdiv(h, bn_down), split)](
            a, w.w, w.s, y, ids, route_w, part, cnt[offsets[j]:] if split > 1 else cnt, a.stride(0),
            *w.strides(), y.stride(0), y.stride(1),
            H=h, I=width, TOP_K=top_k, ROUTED=routed, MXFP8=w.mxfp8, BLOCK_N=bn_down, BLOCK_K=bk, SPLIT_K=split,
            PREFETCH=prefetch, SHARED=shared, sh_w_off=w_off, sh_s_off=s_off, n_routed=n, **launch_kw,
        )
    return y
