"""``m3::paged_attention`` and ``m3::sparse_paged_attention``: causal GQA over paged K/V pools.

Both share one reference: the sparse op only narrows each query's visible keys to the blocks the lightning
indexer chose for its KV group. Softmax in fp32 (float64 for float64 inputs); the output keeps the query dtype.
"""

from __future__ import annotations

import torch

from .kv_fp8 import read_pool
from .paged import accumulation_dtype, gather_rows, sequences


def _attend(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, positions, scale, block_idx,
            block_size, k_scale=None, v_scale=None):
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    k_cache = read_pool("k_cache", k_cache, k_scale)
    v_cache = read_pool("v_cache", v_cache, v_scale)
    out = torch.zeros((t, hq, v_cache.shape[-1]), dtype=q.dtype, device=q.device)
    acc = accumulation_dtype(q, k_cache, v_cache)
    for b, s, e, n in sequences(query_start_loc, seq_lens):
        if e == s:
            continue
        k = gather_rows(k_cache, k_scale, block_tables[b], n, acc)  # [n, Hkv, D]
        v = gather_rows(v_cache, v_scale, block_tables[b], n, acc)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,nhd->thn", q[s:e].to(acc), k) * scale
        key_pos = torch.arange(n, device=q.device)
        allowed = key_pos.view(1, 1, n) <= positions[s:e].view(-1, 1, 1)
        if block_idx is not None:
            nb = -(-n // block_size)
            sel = block_idx[s:e].long()  # [t, Hkv, K]
            keep = torch.zeros((e - s, hkv, nb + 1), dtype=torch.bool, device=q.device)
            keep.scatter_(-1, torch.where(sel < 0, nb, sel.clamp(max=nb)), True)
            keep = keep[..., :nb].repeat_interleave(block_size, dim=-1)[..., :n]
            allowed = allowed & keep.repeat_interleave(group, dim=1)
        scores = scores.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        out[s:e] = torch.einsum("thn,nhd->thd", p, v).to(q.dtype)
    return out


def paged_attention_reference(
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
) -> torch.Tensor:
    """q [T, Hq, D], k/v_cache [pages, page, Hkv, D] -> [T, Hq, D]; key j visible to token t iff j <= pos[t].

    FP8 pools (float8_e4m3fn) come with their fp32 scale pools ``k_scale`` / ``v_scale`` [pages, page, Hkv]:
    every key and value is read as ``float(q) * scale`` (``ops/kv_fp8.py``)."""
    return _attend(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, positions, scale, None, 1,
                   k_scale, v_scale)


paged_attention = torch.library.custom_op("m3::paged_attention", paged_attention_reference, mutates_args=())


@paged_attention.register_fake
def _(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, positions, scale, k_scale=None,
      v_scale=None):
    return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))


def sparse_paged_attention_reference(
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """As paged_attention, but token t / head h sees only blocks ``block_idx[t, h // (Hq/Hkv)]`` (-1 = none)."""
    return _attend(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, positions, scale, block_idx,
                   block_size, k_scale, v_scale)


sparse_paged_attention = torch.library.custom_op("m3::sparse_paged_attention", sparse_paged_attention_reference, mutates_args=())


@sparse_paged_attention.register_fake
def _(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, positions, block_idx, block_size, scale,
      k_scale=None, v_scale=None):
    return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))
