"""``m3::lightning_indexer``: per-token, per-index-head block selection over the paged index-key cache.

The reference here is the definition of truth for every other implementation (ONNX function, Triton kernel,
TensorRT plugin); ``docs/ops.md`` states the same semantics in words.
"""

from __future__ import annotations

import torch

from .kv_fp8 import read_pool
from .paged import accumulation_dtype, gather_rows, sequences


def select_blocks(block_scores: torch.Tensor, positions: torch.Tensor, block_size: int, topk: int,
                  local_blocks: int, init_blocks: int) -> torch.Tensor:
    """block_scores [T, H, NB] (future keys already -inf) -> [T, H, topk] int32 block ids, -1 padded.

    Order: forced blocks (the ``local_blocks`` blocks ending at the query's own, and the first ``init_blocks``)
    first, then descending score; ties go to the lower block id. Blocks after the query's own are never chosen.
    """
    t, h, nb = block_scores.shape
    ids = torch.arange(nb, device=block_scores.device)
    own = (positions // block_size).view(t, 1, 1)
    visible = ids.view(1, 1, nb) <= own
    forced = visible & ((ids.view(1, 1, nb) > own - local_blocks) | (ids.view(1, 1, nb) < init_blocks))
    scores = block_scores.masked_fill(~visible, float("-inf")).masked_fill(forced, float("inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    k = min(topk, nb)
    idx = order.indices[..., :k].to(torch.int32)
    idx = idx.masked_fill(order.values[..., :k] == float("-inf"), -1)
    if k < topk:
        idx = torch.cat([idx, idx.new_full((t, h, topk - k), -1)], dim=-1)
    return idx


def lightning_indexer_reference(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    topk_blocks: int,
    local_blocks: int,
    init_blocks: int,
    index_k_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """index_q [T, H, D], index_k_cache [pages, page, D] -> selected block ids [T, H, topk_blocks] int32.

    An FP8 key pool comes with its fp32 scale pool ``index_k_scale`` [pages, page]: keys read as
    ``float(q) * scale`` (``ops/kv_fp8.py``)."""
    t, h, _ = index_q.shape
    index_k_cache = read_pool("index_k_cache", index_k_cache, index_k_scale)
    out = torch.full((t, h, topk_blocks), -1, dtype=torch.int32, device=index_q.device)
    acc = accumulation_dtype(index_q, index_k_cache)
    for b, s, e, n in sequences(query_start_loc, seq_lens):
        if e == s:
            continue
        keys = gather_rows(index_k_cache, index_k_scale, block_tables[b], n, acc)  # [n, D]
        pos = positions[s:e]
        scores = torch.einsum("thd,nd->thn", index_q[s:e].to(acc), keys)
        future = torch.arange(n, device=keys.device).view(1, 1, n) > pos.view(-1, 1, 1)
        scores = scores.masked_fill(future, float("-inf"))
        nb = -(-n // block_size)
        pad = nb * block_size - n
        if pad:
            scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
        block_scores = scores.view(e - s, h, nb, block_size).amax(-1)
        out[s:e] = select_blocks(block_scores, pos, block_size, topk_blocks, local_blocks, init_blocks)
    return out


lightning_indexer = torch.library.custom_op("m3::lightning_indexer", lightning_indexer_reference, mutates_args=())


@lightning_indexer.register_fake
def _(index_q, index_k_cache, block_tables, query_start_loc, seq_lens, positions, block_size, topk_blocks,
      local_blocks, init_blocks, index_k_scale=None):
    return index_q.new_empty((index_q.shape[0], index_q.shape[1], topk_blocks), dtype=torch.int32)
