"""``m3::paged_attention`` on the GPU: causal GQA over the paged K/V pools (the dense layers).

Semantics: ``m3export.ops.attention.paged_attention_reference`` (``docs/ops.md`` §3). One program per
(query tile, KV head, context split): a query tile is up to ``TOKENS`` consecutive new tokens of one sequence, and
its rows are those tokens times the ``Hq / Hkv`` query heads of the KV head, so one key/value tile read from the
paged pool serves every query head that uses it (decode: the 16 heads of a group fill the tile; prefill: several
tokens do). Scores and the online softmax are fp32 (base 2); P is rounded to the value dtype for the tensor-core
product (fp32 stays fp32). The context splits, a number chosen from shapes, are merged by ``_splitk``.

Why not a library kernel: neither FlashAttention nor FlashInfer is on the H200 image (nothing can be fetched
there, and both would have to be carried as CUDA-13 builds matching its torch), torch's SDPA has no paged-KV
form, and one Triton source keeps the dense and sparse layers on the same tiling and the same numerics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._batch import (cdiv, dot_precision, interpreted, launch_settings, log2_ceil, next_pow2, sequence_of,
                     splits_for, tokens_per_tile)
from ._fp8 import by_bits, check_widen
from ._splitk import LOG2E, Partials, attend_tile, finish_rows
from ._tile_plan import tile_lists

OP = "m3::paged_attention"

DEFAULTS = {
    # One part per pool format: "attention" for 16-bit and fp32 pools, "attention_fp8" for E4M3 ones. block_n: key
    # tile; max_splits: most pieces a (query tile, KV head)'s context is cut into (about ``waves`` programs per
    # multiprocessor, no more splits than key tiles); fp8_widen: ``_fp8.WIDENS`` (bf16 queries; others convert).
    # Until 2026-12-02 both ran the first kernel's block_n 64, max_splits 32, waves 2, converting: at batch 1 that is
    # 4 KV heads x 32 splits, 128 programs of 4 warps for 132 multiprocessors, so a long context streamed from one
    # program per SM.
    # H200 2026-12-02 04:38 UTC (`mini`, pages of 16, `bench/decode_profile.py --settings`, dense attention us a step
    # at batch 1 / 4k, 1 / 128k, 8 / 32k; bench/results/decode_profile_h200_s20_dense_{bf16,fp8}.json):
    #   bf16 pools: 11.3 / 139.8 / 164.8 before; block_n 64, max_splits 256, waves 4: 8.9 / 69.6 / 132.1 (97 % of
    #   copy bandwidth at 8 / 32k); block_n 128, max_splits 128: 9.3 / 69.1 / 187.1;
    #   FP8 pools: 14.2 / 197.0 / 223.7 before; bits alone 12.9 / 173.6 / 205.0; with max_splits 128 9.3 / 103.6 /
    #   204.9; with block_n 128 and max_splits 128 9.7 / 70.9 / 133.7 (a 128-key FP8 tile is a 64-key bf16 tile's
    #   bytes); with max_splits 256, waves 4 9.2 / 104.5 / 203.0.
    "attention": dict(block_n=64, num_warps=4, num_stages=2, max_splits=256, waves=4),
    "attention_fp8": dict(block_n=128, num_warps=4, num_stages=2, max_splits=128, waves=2, fp8_widen="bits"),
}


def output_error_bound(dtype: torch.dtype, v_abs_max: float, fp8: bool = False) -> float:
    """Largest |kernel - reference| either attention kernel (dense or sparse, any launch settings) may show on
    16-bit inputs, from what it rounds; what the tests and benches check against.

    Every output row is a convex combination o = sum_j w_j v_j, w_j = p_j / sum_i p_i. The reference computes
    scores, softmax and P V in fp32 and rounds o once to ``dtype``. Let u be the dtype's unit roundoff (round to
    nearest: 2^-8 for bf16, 7 fraction bits; 2^-11 for fp16). The kernel differs by:

    1. P rounded to ``dtype`` for the tensor-core product: p_j (1 + d_j), |d_j| <= u (p_j <= 1 against the
       running max, far above the subnormals), while the normaliser l sums the unrounded fp32 p_j. So the
       numerator moves by sum_j w_j d_j v_j: at most u max|V|. FP8 pools: bf16 rounds p_j * scale_j instead (the
       E4M3 values are exact in bf16), the same u; fp16 rounds the dequantised V to fp16 too: one more u max|V|.
    2. Its output rounding: u |o'| <= u (1 + u) max|V|.
    3. The reference's output rounding: u |o| <= u max|V|.
    4. fp32: D-term score dots summed in other orders, exp2 against exp, the online rescaling by
       exp2(m_old - m_new) once per key tile and the split-K merge perturb each weight by a relative eta on both
       sides of w_j = p_j / sum p, which moves a convex combination by <= 2 eta max|V|. eta <= ~D * 2^-24 * S,
       S = sum_i |q_i k_i| * scale * log2(e): S ~ 5 at D = 32 and ~ 10 at D = 128 on normal q and k (the
       tests' and benches' inputs), so eta < 2^-13 and 2 eta < 2^-12.

    Sum: (3 u + u^2 + 2^-12) max|V| (bf16: 3.06 * 2^-8 = 0.0120 max|V|; it was 4 * 2^-9 = 2 u before, which the
    worst case of 1-3 exceeds: an FP8 bf16 case did by 2 %). Still a bound that fails a wrong kernel: a dropped or
    extra key or a wrong scale moves outputs by a large fraction of max|V| (tests/test_kernels_attention.py:
    a softmax scale 5 % off exceeds it 1.6x, a causal mask one key short 24x).
    """
    u = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}.get(dtype)
    if u is None:
        raise ValueError(f"output_error_bound: {dtype} is not a 16-bit float (fp32 outputs are compared relatively)")
    rounded_p = u * (2 if fp8 and dtype == torch.float16 else 1)
    return (rounded_p + 2 * u + u * u + 2.0**-12) * v_abs_max


@triton.jit
def _paged_attention(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, pos_ptr, qsl_ptr, tile_seq_ptr, tile_start_ptr, tile_end_ptr,
    out_ptr, acc_ptr, m_ptr, l_ptr, num_seqs,
    sq_t, sq_h, sk_p, sk_r, sk_h, sv_p, sv_r, sv_h, sks_p, sks_r, svs_p, svs_r, sbt_b, so_t, so_h, qk_scale,
    FP8: tl.constexpr, HQ: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE: tl.constexpr, TOKENS: tl.constexpr, ROWS: tl.constexpr, LOG2_SEQS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS, PREC: tl.constexpr, INTERPRETED: tl.constexpr, FP8_BITS: tl.constexpr = False,
):
    tile = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    if TOKENS == 1:  # one program per token (decode-like batches): its sequence by binary search
        seq = sequence_of(qsl_ptr, tile, num_seqs, LOG2_SEQS)
        start = tile
        end = tile + 1
    else:
        seq = tl.load(tile_seq_ptr + tile)
        start = tl.load(tile_start_ptr + tile)
        end = tl.load(tile_end_ptr + tile)

    rows = tl.arange(0, ROWS)
    tok = start + rows // G_PAD
    hh = rows % G_PAD
    hq = g * G + hh
    row_ok = (tok < end) & (hh < G)
    pos = tl.load(pos_ptr + tok, mask=row_ok, other=-1).to(tl.int32)
    last = tl.max(pos, axis=0)

    n_tiles = (last + BLOCK_N) // BLOCK_N
    per = (n_tiles + SPLITS - 1) // SPLITS
    lo = split * per
    hi = tl.minimum(lo + per, n_tiles)

    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + tok[:, None].to(tl.int64) * sq_t + hq[:, None] * sq_h + d[None, :],
                mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_DV], tl.float32)
    for it in range(lo, hi):
        j = it * BLOCK_N + tl.arange(0, BLOCK_N)
        kmask = j <= last
        page = tl.load(bt_ptr + seq.to(tl.int64) * sbt_b + j // PAGE, mask=kmask, other=0).to(tl.int64)
        row = j % PAGE
        k = tl.load(k_ptr + page[:, None] * sk_p + row[:, None] * sk_r + g * sk_h + d[None, :],
                    mask=kmask[:, None] & (d[None, :] < D), other=0.0)
        v = tl.load(v_ptr + page[:, None] * sv_p + row[:, None] * sv_r + g * sv_h + dv[None, :],
                    mask=kmask[:, None] & (dv[None, :] < DV), other=0.0)
        m_i, l_i, acc = attend_tile(q, k, v, ks_ptr + page * sks_p + row * sks_r + g,
                                    vs_ptr + page * svs_p + row * svs_r + g, kmask, j[None, :] <= pos[:, None],
                                    qk_scale, m_i, l_i, acc, FP8, PREC, INTERPRETED, FP8_BITS)

    finish_rows(out_ptr, acc_ptr, m_ptr, l_ptr, acc, m_i, l_i, tok, hq, row_ok, split, so_t, so_h, dv, HQ, DV, SPLITS)


def forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """q [T, Hq, D], k/v_cache [pages, page, Hkv, D] -> [T, Hq, Dv]; key j visible to token t iff j <= pos[t].
    FP8 pools come with their fp32 scale pools [pages, page, Hkv]. ``config``: {"attention": {...},
    "attention_fp8": {...}}, entries overriding ``DEFAULTS`` (None for the op; the part of the pools' format runs)."""
    t, hq, d = q.shape
    _check(q, k_cache, v_cache, "paged_attention", k_scale, v_scale)
    fp8 = k_scale is not None
    cfg = launch_settings("paged_attention", DEFAULTS, config, "attention_fp8" if fp8 else "attention")
    if fp8:
        check_widen("paged_attention", cfg["fp8_widen"])
    if cfg["block_n"] < 16 or cfg["block_n"] & (cfg["block_n"] - 1) or cfg["max_splits"] < 1:
        raise ValueError(f"paged_attention: block_n {cfg['block_n']} must be a power of two >= 16 and max_splits "
                         f"{cfg['max_splits']} >= 1")
    hkv, dv, page = k_cache.shape[2], v_cache.shape[3], k_cache.shape[1]
    out = torch.empty((t, hq, dv), dtype=q.dtype, device=q.device)
    b = seq_lens.shape[0]
    if t == 0 or b == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    kc = k_cache if k_cache.stride(3) == 1 else k_cache.contiguous()
    vc = v_cache if v_cache.stride(3) == 1 else v_cache.contiguous()
    bt = block_tables.contiguous()
    pos = positions.contiguous()
    group = hq // hkv
    g_pad = next_pow2(group)
    qsl = query_start_loc.contiguous()
    tokens = tokens_per_tile(t, b, g_pad)
    if tokens == 1:
        seq = start = end = qsl  # unused: the kernel finds each token's sequence itself
        slots = t
    else:
        seq, start, end, slots = tile_lists(qsl, t, tokens)  # one launch (_tile_plan)
    most = min(cfg["max_splits"], cdiv(bt.shape[1] * page, cfg["block_n"]))
    splits = splits_for(q.device, slots * hkv, most, cfg["waves"])
    parts = Partials(t, hq, dv, splits, q.device) if splits > 1 else None
    scratch = (parts.acc, parts.m, parts.l) if parts else (out, out, out)
    ks, vs = scale_pools(k_scale, v_scale, kc)
    _paged_attention[(slots, hkv, splits)](
        q, kc, vc, ks, vs, bt, pos, qsl, seq, start, end, out, *scratch, b,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1),
        vc.stride(2), ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1), bt.stride(0), out.stride(0),
        out.stride(1), scale * LOG2E, FP8=k_scale is not None,
        HQ=hq, G=group, G_PAD=g_pad, D=d, BLOCK_D=next_pow2(max(d, 16)), DV=dv, BLOCK_DV=next_pow2(max(dv, 16)),
        PAGE=page, TOKENS=tokens, ROWS=max(16, tokens * g_pad), LOG2_SEQS=log2_ceil(b), BLOCK_N=cfg["block_n"],
        SPLITS=splits, PREC=dot_precision(q.dtype), INTERPRETED=interpreted(q),
        FP8_BITS=fp8 and by_bits(cfg["fp8_widen"], fp8, q.dtype),  # (16-bit pools: no fp8_widen setting)
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return parts.merge_into(out) if parts else out


def scale_pools(k_scale, v_scale, k_cache):
    """The scale pools as the kernels index them ([pages, page, Hkv], head stride 1), or placeholders."""
    if k_scale is None:
        return k_cache, k_cache  # never read (FP8 off)
    return k_scale.contiguous(), v_scale.contiguous()


def _check(q, k_cache, v_cache, name, k_scale=None, v_scale=None):
    from m3export.ops.kv_fp8 import FP8, check_pair

    t, hq, d = q.shape
    check_pair("k_cache", k_cache, k_scale)
    check_pair("v_cache", v_cache, v_scale)
    if k_cache.dim() != 4 or k_cache.shape[3] != d:
        raise ValueError(f"{name}: k_cache {tuple(k_cache.shape)} must be [pages, page, Hkv, {d}]")
    if v_cache.dim() != 4 or v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"{name}: v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)} "
                         "in [pages, page, Hkv]")
    if hq % k_cache.shape[2]:
        raise ValueError(f"{name}: {hq} query heads are not a multiple of {k_cache.shape[2]} KV heads")
    if k_cache.dtype == v_cache.dtype == FP8 and q.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"{name}: q, k_cache, v_cache dtypes differ ({q.dtype}, {k_cache.dtype}, {v_cache.dtype})")
