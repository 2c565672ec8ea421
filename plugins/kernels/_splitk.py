"""Split-K attention: the online-softmax step both attention kernels share, and the merge of per-split partials.

Not a kernel module (it is not in ``KERNEL_MODULES``). A split writes its unnormalised fp32 accumulator with its
running max ``m`` (base 2, already multiplied by ``scale * log2(e)``) and sum ``l``; the merge rescales every
split to the common max and divides once, in fp32, then rounds to the output dtype. A split that saw no key
(``m = -inf``, ``l = 0``) weighs nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._batch import mma
from ._fp8 import widen, widen_by_bits

LOG2E = 1.4426950408889634


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, PREC: tl.constexpr, INTERPRETED: tl.constexpr):
    """One key tile: s [M, N] fp32 scores in base 2 (-inf where not allowed), v [N, Dv] -> (m_i, l_i, acc).

    Rows that have seen nothing keep m = -inf; the exponent's reference point is then 0 so that no -inf - -inf
    (NaN) appears."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - ref[:, None])
    alpha = tl.exp2(m_i - ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, PREC, INTERPRETED)
    return m_new, l_i, acc


@triton.jit
def online_softmax_step_scaled(s, v, vs, m_i, l_i, acc, PREC: tl.constexpr, INTERPRETED: tl.constexpr):
    """``online_softmax_step`` for FP8 values: v [N, Dv] holds the E4M3 values (widened), vs [N] their row
    scales, folded into P's columns before the product (P V = (P diag(vs)) V8), so V is never rounded."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - ref[:, None])
    alpha = tl.exp2(m_i - ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + mma((p * vs[None, :]).to(v.dtype), v, PREC, INTERPRETED)
    return m_new, l_i, acc


@triton.jit
def attend_tile(q, k, v, ks_ptrs, vs_ptrs, kmask, allowed, qk_scale, m_i, l_i, acc, FP8: tl.constexpr,
                PREC: tl.constexpr, INTERPRETED: tl.constexpr, FP8_BITS: tl.constexpr = False):
    """One key tile of either attention kernel: q [M, D] against k [N, D] and v [N, Dv] as loaded from the pools,
    ``allowed`` [M, N], ``qk_scale`` already times log2(e) -> (m_i, l_i, acc).

    FP8 pools (E4M3 bytes; ``ks_ptrs`` / ``vs_ptrs`` [N] address the rows' scales, read where ``kmask``): the dot
    runs on the exact E4M3 values widened to q's dtype and each key's scale multiplies its score column; V's
    scales are folded into P's columns (``online_softmax_step_scaled``), except in fp16, where P * scale could fall
    below fp16's normal range and V is dequantised to fp16 (one more rounding, 2^-11) instead. ``FP8_BITS`` (bf16
    queries only): K and V widened by bit placement (``_fp8.widen_by_bits``), the same values without sm_90's slow
    conversions."""
    if FP8:
        ks = tl.load(ks_ptrs, mask=kmask, other=0.0)
        vs = tl.load(vs_ptrs, mask=kmask, other=0.0)
        k16 = widen_by_bits(k, INTERPRETED) if FP8_BITS else widen(k, q.dtype)
        s = mma(q, tl.trans(k16), PREC, INTERPRETED) * (ks * qk_scale)[None, :]
    else:
        s = mma(q, tl.trans(k), PREC, INTERPRETED) * qk_scale
    s = tl.where(allowed, s, float("-inf"))
    if FP8:
        if q.dtype == tl.float16:
            v16 = (v.to(tl.float32) * vs[:, None]).to(tl.float16)
            m_i, l_i, acc = online_softmax_step(s, v16, m_i, l_i, acc, PREC, INTERPRETED)
        else:
            v16 = widen_by_bits(v, INTERPRETED) if FP8_BITS else widen(v, q.dtype)
            m_i, l_i, acc = online_softmax_step_scaled(s, v16, vs, m_i, l_i, acc, PREC, INTERPRETED)
    else:
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, PREC, INTERPRETED)
    return m_i, l_i, acc


@triton.jit
def attend_tile_lean(q, k, v, need_mask, allowed, qk_scale, m_i, l_i, acc, PREC: tl.constexpr,
                     INTERPRETED: tl.constexpr, ALWAYS_RESCALE: tl.constexpr = False):
    """``attend_tile`` (16-bit or fp32 pools, not FP8) with less vector work per score, the same semantics: the
    mask applied only when ``need_mask`` (the caller knows when every row may see every key of the tile), the
    scale folded into the exponent's FMA (the running max is kept scaled, as the partials and the merge expect:
    max(s) * c is the max of s * c exactly, c > 0), and the accumulator rescaled only when some row's max grew (else
    every alpha is exp2(0) = 1 exactly, so skipping it changes no bit). Only fp32 rounding of the exponent's argument
    differs from ``attend_tile`` (one FMA instead of a product and a difference). ``ALWAYS_RESCALE``: the
    accumulator rescaled at every tile instead (64 products a thread at 128 x 128 over 8 warps): the any-row test
    is a reduction across the program's warps, i.e. a CTA barrier per tile (sm_90 SASS of the 8-warp union tile: 9
    barriers a key tile), which also keeps the two warpgroups in step; the same bits (alpha = 1 where no max grew)."""
    s = mma(q, tl.trans(k), PREC, INTERPRETED)
    if need_mask:
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(tl.fma(s, qk_scale, -ref[:, None]))
    alpha = tl.exp2(m_i - ref)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if ALWAYS_RESCALE:
        acc = acc * alpha[:, None]
    elif tl.max((m_new != m_i).to(tl.int32), axis=0) > 0:
        acc = acc * alpha[:, None]
    acc += mma(p.to(v.dtype), v, PREC, INTERPRETED)
    return m_new, l_i, acc


@triton.jit
def finish_rows(out_ptr, acc_ptr, m_ptr, l_ptr, acc, m_i, l_i, tok, hq, row_ok, split, so_t, so_h, dv,
                HQ: tl.constexpr, DV: tl.constexpr, SPLITS):
    """The rows' output (one split), or their partial (m, l, acc) for ``_merge`` (the end of every split-K
    attention program: dense and sparse)."""
    if SPLITS == 1:
        o = acc / tl.where(row_ok, l_i, 1.0)[:, None]  # padding rows: no 0/0; a real empty row stays NaN
        tl.store(out_ptr + tok[:, None].to(tl.int64) * so_t + hq[:, None] * so_h + dv[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))
    else:
        r = (tok.to(tl.int64) * HQ + hq) * SPLITS + split
        tl.store(m_ptr + r, m_i, mask=row_ok)
        tl.store(l_ptr + r, l_i, mask=row_ok)
        tl.store(acc_ptr + r[:, None] * DV + dv[None, :], acc, mask=row_ok[:, None] & (dv[None, :] < DV))


@triton.jit
def finish_rows_fused(out_ptr, acc_ptr, m_ptr, l_ptr, tick_ptr, acc, m_i, l_i, tok, hq, row_ok, split, so_t, so_h,
                      dv, HQ: tl.constexpr, DV: tl.constexpr, SPLITS: tl.constexpr):
    """``finish_rows`` with the merge in the same launch: every split stores its partial, then takes a ticket on its
    rows' counter (``tick_ptr``: one int32 per (query tile, KV head), from ``_batch.ticket_counters``); the split that draws the
    last ticket merges all ``SPLITS`` partials of the rows, in split order (so the bits do not depend on which split
    came last), writes the output and puts the counter back to 0 for the next launch.

    Ordering: a CTA barrier after the partial stores, then the ticket as an ``acq_rel`` atomic at GPU scope (its
    release publishes the stores the barrier ordered before it; the last split's acquire makes every other split's
    published stores visible), then a barrier so that all of the last program's threads read after the acquire;
    the partials are read with ``.cg`` (L2, never a stale L1 line)."""
    if SPLITS == 1:
        finish_rows(out_ptr, acc_ptr, m_ptr, l_ptr, acc, m_i, l_i, tok, hq, row_ok, split, so_t, so_h, dv, HQ, DV,
                    SPLITS)
    else:
        r = (tok.to(tl.int64) * HQ + hq) * SPLITS
        tl.store(m_ptr + r + split, m_i, mask=row_ok)
        tl.store(l_ptr + r + split, l_i, mask=row_ok)
        keep = row_ok[:, None] & (dv[None, :] < DV)
        tl.store(acc_ptr + (r + split)[:, None] * DV + dv[None, :], acc, mask=keep)
        tl.debug_barrier()
        ticket = tl.atomic_add(tick_ptr, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        if ticket == SPLITS - 1:
            mx = tl.full(m_i.shape, float("-inf"), tl.float32)
            for s in tl.static_range(SPLITS):
                mx = tl.maximum(mx, tl.load(m_ptr + r + s, mask=row_ok, other=float("-inf"), cache_modifier=".cg"))
            ref = tl.where(mx == float("-inf"), 0.0, mx)
            o = tl.zeros(acc.shape, tl.float32)
            den = tl.zeros(l_i.shape, tl.float32)
            for s in tl.static_range(SPLITS):
                w = tl.exp2(tl.load(m_ptr + r + s, mask=row_ok, other=float("-inf"), cache_modifier=".cg") - ref)
                den += w * tl.load(l_ptr + r + s, mask=row_ok, other=0.0, cache_modifier=".cg")
                o += w[:, None] * tl.load(acc_ptr + (r + s)[:, None] * DV + dv[None, :], mask=keep, other=0.0,
                                          cache_modifier=".cg")
            o = o / tl.where(row_ok, den, 1.0)[:, None]  # padding rows: no 0/0; a real empty row stays NaN
            tl.store(out_ptr + tok[:, None].to(tl.int64) * so_t + hq[:, None] * so_h + dv[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=keep)
            tl.atomic_xchg(tick_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge(acc_ptr, m_ptr, l_ptr, out_ptr, so_t, so_h, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
           SPLITS, SPLITS_PAD: tl.constexpr):
    row = tl.program_id(0)  # (token, query head) flattened: partials are [T * Hq, SPLITS, (DV)]
    hq = tl.num_programs(1)
    hd = tl.program_id(1)
    r = row * hq + hd
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_DV)
    m = tl.load(m_ptr + r * SPLITS + s, mask=s < SPLITS, other=float("-inf"))
    l_s = tl.load(l_ptr + r * SPLITS + s, mask=s < SPLITS, other=0.0)
    mx = tl.max(m, axis=0)
    ref = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(m - ref)
    acc = tl.load(acc_ptr + (r * SPLITS + s)[:, None].to(tl.int64) * DV + d[None, :],
                  mask=(s[:, None] < SPLITS) & (d[None, :] < DV), other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
    tl.store(out_ptr + row.to(tl.int64) * so_t + hd * so_h + d, o.to(out_ptr.dtype.element_ty), mask=d < DV)


class Partials:
    """Per-split scratch for [T, Hq] query rows: accumulators [T*Hq, splits, Dv] and m, l [T*Hq, splits]."""

    def __init__(self, t: int, hq: int, dv: int, splits: int, device: torch.device):
        self.splits, self.dv = splits, dv
        self.acc = torch.empty((t * hq, splits, dv), dtype=torch.float32, device=device)
        self.m = torch.empty((t * hq, splits), dtype=torch.float32, device=device)
        self.l = torch.empty((t * hq, splits), dtype=torch.float32, device=device)

    def merge_into(self, out: torch.Tensor) -> torch.Tensor:
        t, hq, dv = out.shape
        if t:
            _merge[(t, hq)](self.acc, self.m, self.l, out, out.stride(0), out.stride(1), DV=dv,
                            BLOCK_DV=triton.next_power_of_2(dv), SPLITS=self.splits,
                            SPLITS_PAD=triton.next_power_of_2(max(self.splits, 2)), num_warps=4)
        return out
