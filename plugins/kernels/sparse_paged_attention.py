"""``m3::sparse_paged_attention`` on the GPU: GQA over only the blocks the lightning indexer selected.

Semantics: ``m3export.ops.attention.sparse_paged_attention_reference`` (``docs/ops.md`` §4). One program per
(token, KV head, split of the selection): its rows are the ``Hq / Hkv`` query heads of the KV head (16 on M3, a
full tensor-core tile), and it walks its share of the token's selected blocks, reading each block's keys and
values from the paged pool once for all those heads; online softmax in fp32 (base 2). Decode splits the
selection so that a small batch still fills the device, and ``_splitk`` merges the splits; large (prefill)
batches use one split per program. Each token keeps its own selection (multi-token verify never unions them).
Selection entries that are -1, after the token's own block, or repeated earlier in the list are skipped, so the
allowed set is exactly the reference's (order and duplicates do not matter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._batch import dot_precision, interpreted, log2_ceil, mma, next_pow2, sequence_of, splits_for
from ._splitk import LOG2E, Partials, online_softmax_step
from .paged_attention import _check

OP = "m3::sparse_paged_attention"

_BLOCK_N = 64


@triton.jit
def _sparse_paged_attention(
    q_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, qsl_ptr, sel_ptr,
    out_ptr, acc_ptr, m_ptr, l_ptr, num_seqs,
    sq_t, sq_h, sk_p, sk_r, sk_h, sv_p, sv_r, sv_h, sbt_b, ss_t, ss_g, so_t, so_h, qk_scale,
    HQ: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE: tl.constexpr, BS: tl.constexpr, K: tl.constexpr,
    K_PAD: tl.constexpr, LOG2_SEQS: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PREC: tl.constexpr, INTERPRETED: tl.constexpr,
):
    t = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    seq = sequence_of(qsl_ptr, t, num_seqs, LOG2_SEQS)
    pos = tl.load(pos_ptr + t).to(tl.int32)
    own = pos // BS

    hh = tl.arange(0, ROWS)
    hq = g * G + hh
    row_ok = hh < G
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + t.to(tl.int64) * sq_t + hq[:, None] * sq_h + d[None, :],
                mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
    sel_base = sel_ptr + t.to(tl.int64) * ss_t + g * ss_g
    kk = tl.arange(0, K_PAD)
    sel_row = tl.load(sel_base + kk, mask=kk < K, other=-1)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_DV], tl.float32)
    PER: tl.constexpr = (K + SPLITS - 1) // SPLITS
    SUB: tl.constexpr = (BS + BLOCK_N - 1) // BLOCK_N
    bt_row = bt_ptr + seq.to(tl.int64) * sbt_b
    for i in range(split * PER, tl.minimum(split * PER + PER, K)):
        c = tl.load(sel_base + i)
        repeats = tl.sum(tl.where((kk < i) & (sel_row == c), 1, 0), axis=0)
        use = (c >= 0) & (c <= own) & (repeats == 0)
        for sub in range(0, tl.where(use, SUB, 0)):
            j = c * BS + sub * BLOCK_N + tl.arange(0, BLOCK_N)
            kmask = (j < c * BS + BS) & (j <= pos)
            page = tl.load(bt_row + j // PAGE, mask=kmask, other=0).to(tl.int64)
            row = j % PAGE
            k = tl.load(k_ptr + page[:, None] * sk_p + row[:, None] * sk_r + g * sk_h + d[None, :],
                        mask=kmask[:, None] & (d[None, :] < D), other=0.0)
            v = tl.load(v_ptr + page[:, None] * sv_p + row[:, None] * sv_r + g * sv_h + dv[None, :],
                        mask=kmask[:, None] & (dv[None, :] < DV), other=0.0)
            s = mma(q, tl.trans(k), PREC, INTERPRETED) * qk_scale
            s = tl.where(kmask[None, :], s, float("-inf"))
            m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, PREC, INTERPRETED)

    if SPLITS == 1:
        o = acc / tl.where(row_ok, l_i, 1.0)[:, None]  # padding rows: no 0/0; a real empty row stays NaN
        tl.store(out_ptr + t.to(tl.int64) * so_t + hq[:, None] * so_h + dv[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))
    else:
        r = (t.to(tl.int64) * HQ + hq) * SPLITS + split
        tl.store(m_ptr + r, m_i, mask=row_ok)
        tl.store(l_ptr + r, l_i, mask=row_ok)
        tl.store(acc_ptr + r[:, None] * DV + dv[None, :], acc, mask=row_ok[:, None] & (dv[None, :] < DV))


def forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    block_idx: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """As paged_attention, but token t / head h sees only blocks ``block_idx[t, h // (Hq/Hkv)]`` (-1 = none)."""
    t, hq, d = q.shape
    _check(q, k_cache, v_cache, "sparse_paged_attention")
    hkv, dv, page = k_cache.shape[2], v_cache.shape[3], k_cache.shape[1]
    if block_idx.dim() != 3 or block_idx.shape[:2] != (t, hkv):
        raise ValueError(f"sparse_paged_attention: block_idx {tuple(block_idx.shape)} must be [{t}, {hkv}, K]")
    if block_size < 1:
        raise ValueError(f"sparse_paged_attention: block_size {block_size} must be >= 1")
    out = torch.empty((t, hq, dv), dtype=q.dtype, device=q.device)
    b = seq_lens.shape[0]
    topk = block_idx.shape[2]
    if t == 0 or b == 0:
        return out
    if topk == 0:  # nothing allowed: a softmax over nothing, as the reference
        return out.fill_(float("nan"))
    q = q if q.stride(2) == 1 else q.contiguous()
    kc = k_cache if k_cache.stride(3) == 1 else k_cache.contiguous()
    vc = v_cache if v_cache.stride(3) == 1 else v_cache.contiguous()
    bt = block_tables.contiguous()
    pos = positions.contiguous()
    sel = block_idx.to(torch.int32).contiguous()
    qsl = query_start_loc.contiguous()
    group = hq // hkv
    splits = splits_for(q.device, t * hkv, topk)
    parts = Partials(t, hq, dv, splits, q.device) if splits > 1 else None
    scratch = (parts.acc, parts.m, parts.l) if parts else (out, out, out)
    block_n = min(_BLOCK_N, max(16, next_pow2(block_size)))
    _sparse_paged_attention[(t, hkv, splits)](
        q, kc, vc, bt, pos, qsl, sel, out, *scratch, b,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1),
        vc.stride(2), bt.stride(0), sel.stride(0), sel.stride(1), out.stride(0), out.stride(1), scale * LOG2E,
        HQ=hq, G=group, ROWS=max(16, next_pow2(group)), D=d, BLOCK_D=next_pow2(max(d, 16)), DV=dv,
        BLOCK_DV=next_pow2(max(dv, 16)), PAGE=page, BS=block_size, K=topk, K_PAD=next_pow2(max(topk, 2)),
        LOG2_SEQS=log2_ceil(b),
        BLOCK_N=block_n, SPLITS=splits, PREC=dot_precision(q.dtype), INTERPRETED=interpreted(q), num_warps=4,
        num_stages=2,
    )
    return parts.merge_into(out) if parts else out
