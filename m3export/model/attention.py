"""M3 attention: per-head QK norm, partial RoPE, paged cache write, then dense or indexer-sparse attention."""

from __future__ import annotations

import torch
from torch import nn

from ..config import M3Config
from .batch import Batch, write_pool
from .linear import Linear
from .norm import RMSNorm
from .rope import apply_rope


def _use_fused(x: torch.Tensor, inplace: bool) -> bool:
    """Eager CUDA runs with the Triton kernels active (``m3export.plugins.kernels``, registered by ``load_model``
    on CUDA) norm, rotate and write the cache in one kernel; export and CPU keep the separate steps."""
    if not (inplace and x.is_cuda):
        return False
    try:
        from m3export.plugins.kernels import active
    except ImportError:
        return False
    return active()


class Indexer(nn.Module):
    """Lightning indexer: 4 index query heads against one shared index-key head; chooses blocks per KV head."""

    def __init__(self, cfg: M3Config, mxfp8: bool):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.index_q_proj = Linear(cfg.hidden_size, cfg.index_n_heads * cfg.index_head_dim, mxfp8)
        self.index_k_proj = Linear(cfg.hidden_size, cfg.index_head_dim, mxfp8)
        self.index_q_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps)
        self.index_k_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps)

    def keys_and_queries(self, x, cos, sin):
        t = x.shape[0]
        iq = apply_rope(self.index_q_norm(self.index_q_proj(x).view(t, self.n_heads, self.head_dim)), cos, sin)
        ik = apply_rope(self.index_k_norm(self.index_k_proj(x).view(t, 1, self.head_dim)), cos, sin)
        return iq, ik[:, 0]

    def queries_writing_keys(self, x, cos, sin, ik_cache, slots):
        """Fused (CUDA kernels): index queries returned, index keys normed, rotated and written into the pool."""
        from m3export.plugins.kernels.qk_norm_rope_cache import norm_rope

        t = x.shape[0]
        n_q, n_k = self.index_q_norm, self.index_k_norm
        iq = norm_rope(self.index_q_proj(x).view(t, self.n_heads, self.head_dim), n_q.weight, n_q.eps, cos, sin)
        norm_rope(self.index_k_proj(x).view(t, self.head_dim), n_k.weight, n_k.eps, cos, sin, ik_cache, slots)
        return iq

    def select(self, iq: torch.Tensor, ik_cache: torch.Tensor, batch: Batch) -> torch.Tensor:
        c = self.cfg
        return torch.ops.m3.lightning_indexer(
            iq, ik_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.positions,
            c.index_block_size, c.index_topk_blocks, c.index_local_blocks, c.index_init_blocks,
        )


class Attention(nn.Module):
    def __init__(self, cfg: M3Config, sparse: bool, mxfp8: bool):
        super().__init__()
        self.cfg = cfg
        self.sparse = sparse
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(h, self.n_heads * d, mxfp8)
        self.k_proj = Linear(h, self.n_kv * d, mxfp8)
        self.v_proj = Linear(h, self.n_kv * d, mxfp8)
        self.o_proj = Linear(self.n_heads * d, h, mxfp8)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        # Indexer weights sit directly under self_attn in the original layout (index_q_proj, ...).
        self.indexer = Indexer(cfg, mxfp8) if sparse else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch,
                cache: tuple[torch.Tensor, ...], inplace: bool):
        """x [T, H] -> (out [T, H], updated cache tuple, selected blocks [T, Hkv, K] or None)."""
        t = x.shape[0]
        fused = _use_fused(x, inplace)
        if fused:  # one launch each for q and k + v: norm, rotation and cache write fused
            from m3export.plugins.kernels.qk_norm_rope_cache import norm_rope

            q = norm_rope(self.q_proj(x).view(t, self.n_heads, self.head_dim), self.q_norm.weight,
                          self.q_norm.eps, cos, sin)
            norm_rope(self.k_proj(x).view(t, self.n_kv, self.head_dim), self.k_norm.weight, self.k_norm.eps, cos,
                      sin, cache[0], batch.slot_mapping, self.v_proj(x).view(t, self.n_kv, self.head_dim), cache[1])
            k_cache, v_cache = cache[0], cache[1]
        else:
            q = apply_rope(self.q_norm(self.q_proj(x).view(t, self.n_heads, self.head_dim)), cos, sin)
            k = apply_rope(self.k_norm(self.k_proj(x).view(t, self.n_kv, self.head_dim)), cos, sin)
            v = self.v_proj(x).view(t, self.n_kv, self.head_dim)
            k_cache = write_pool(cache[0], batch.slot_mapping, k, inplace)
            v_cache = write_pool(cache[1], batch.slot_mapping, v, inplace)
        args = (q, k_cache, v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.positions)
        if self.indexer is None:
            o = torch.ops.m3.paged_attention(*args, self.scale)
            return self.o_proj(o.reshape(t, -1)), (k_cache, v_cache), None
        if fused:
            iq = self.indexer.queries_writing_keys(x, cos, sin, cache[2], batch.slot_mapping)
            ik_cache = cache[2]
        else:
            iq, ik = self.indexer.keys_and_queries(x, cos, sin)
            ik_cache = write_pool(cache[2], batch.slot_mapping, ik, inplace)
        sel = self.indexer.select(iq, ik_cache, batch)
        o = torch.ops.m3.sparse_paged_attention(*args, sel, self.cfg.index_block_size, self.scale)
        return self.o_proj(o.reshape(t, -1)), (k_cache, v_cache, ik_cache), sel
