"""M3 attention: per-head QK norm, partial RoPE, paged cache write, then dense or indexer-sparse attention."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..config import M3Config
from . import fusion
from .batch import Batch, write_pool, write_pool_fp8
from .linear import FusedLinears, Linear
from .norm import RMSNorm
from .rope import apply_rope


ChooseBlocks = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""Optional per-layer hook of a sparse layer: (its own selection [T, H, K], the index queries [T, H, D] it was
computed from, the index-key pool after this step's write, that pool's scale pool or None) -> the selection the
sparse attention reads. ``m3export verify`` uses it to feed a near-tie swap of another runtime back into the
reference (teacher forcing); None, the default everywhere, keeps the layer's own selection."""


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

    def queries_writing_keys(self, iq_rows, ik_rows, cos, sin, ik_cache, slots, ik_scale=None):
        """Fused (CUDA kernels), from the projections' rows iq_rows [T, Hi * Di] and ik_rows [T, Di] (column views
        of the layer's fused projection are fine): index queries returned, index keys normed, rotated and written
        into the pool (quantised, with their scales into ``ik_scale``, for an FP8 pool)."""
        from m3export.plugins.kernels.qk_norm_rope_cache import norm_rope

        t = iq_rows.shape[0]
        n_q, n_k = self.index_q_norm, self.index_k_norm
        iq = norm_rope(iq_rows.view(t, self.n_heads, self.head_dim), n_q.weight, n_q.eps, cos, sin)
        norm_rope(ik_rows.view(t, self.head_dim), n_k.weight, n_k.eps, cos, sin, ik_cache, slots,
                  pool_scale=ik_scale)
        return iq

    def select(self, iq: torch.Tensor, ik_cache: torch.Tensor, batch: Batch, ik_scale=None) -> torch.Tensor:
        c = self.cfg
        scale = () if ik_scale is None else (ik_scale,)
        return torch.ops.m3.lightning_indexer(
            iq, ik_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.positions,
            c.index_block_size, c.index_topk_blocks, c.index_local_blocks, c.index_init_blocks, *scale,
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
        self.fused_projections: FusedLinears | None = None  # see fuse_projections

    def input_projections(self) -> list[Linear]:
        """The projections that read the normed input: q, k, v (+ index q, index k on sparse layers)."""
        ix = self.indexer
        return [self.q_proj, self.k_proj, self.v_proj] + ([] if ix is None else [ix.index_q_proj, ix.index_k_proj])

    def fuse_projections(self) -> None:
        """Concatenate ``input_projections``' weights into one buffer (their parameters become views into it,
        ``FusedLinears``), so the fused path computes them in one launch. Called where a model is put on CUDA with
        the kernels active (the torch backend), once its weights are on the device; the plain path, the state dict
        and export are unchanged. Idempotent."""
        if self.fused_projections is None or not self.fused_projections.intact():
            self.fused_projections = FusedLinears(self.input_projections())

    def _projected_rows(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``input_projections``' outputs [T, N_i]: column views of one product where the layer is fused (and
        autograd does not need the members' own parameters), else one product each."""
        fp = self.fused_projections
        if fp is not None and fp.intact() and not (torch.is_grad_enabled() and self.q_proj.weight.requires_grad):
            return fp(x)
        return [proj(x) for proj in self.input_projections()]

    def check_cache(self, cache: tuple[torch.Tensor, ...], where: str = "attention layer") -> None:
        """The layer's pool tuple has the layout ``forward`` reads (see there). Checked where pools are made or
        handed over (``M3ForCausalLM.check_caches``), not in ``forward``: a step runs every layer, and the layout
        of a backend's pools does not change between its steps."""
        n = 2 if self.indexer is None else 3
        if len(cache) not in (n, 2 * n) or (len(cache) == 2 * n) != (cache[0].dtype == torch.float8_e4m3fn):
            raise ValueError(f"{where} cache: expected {n} pools, or {n} float8_e4m3fn pools and their "
                             f"{n} scale pools; got {len(cache)} of {cache[0].dtype}")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: Batch,
                cache: tuple[torch.Tensor, ...], inplace: bool, choose_blocks: ChooseBlocks | None = None):
        """x [T, H] -> (out [T, H], updated cache tuple, selected blocks [T, Hkv, K] or None).

        ``choose_blocks`` (sparse layers, see ``ChooseBlocks``) replaces the selection the attention reads; the
        returned selection is the one it read.

        ``cache`` is (k, v) on dense layers and (k, v, index_k) on sparse ones; with FP8 (E4M3) pools their fp32
        scale pools follow in the same order: (k, v, k_scale, v_scale) / (k, v, index_k, k_scale, v_scale,
        index_k_scale) (``m3export.ops.kv_fp8``)."""
        t = x.shape[0]
        n = 2 if self.indexer is None else 3
        pools, scales = list(cache[:n]), list(cache[n:]) or [None] * n
        fused = fusion.use_fused_kernels(x, inplace)
        if fused:  # the projections in one launch (if fused), then one each for q and k + v: norm, rope, write
            from m3export.plugins.kernels.qk_norm_rope_cache import norm_rope

            q_rows, k_rows, v_rows, *index_rows = self._projected_rows(x)
            q = norm_rope(q_rows.view(t, self.n_heads, self.head_dim), self.q_norm.weight, self.q_norm.eps, cos,
                          sin)
            norm_rope(k_rows.view(t, self.n_kv, self.head_dim), self.k_norm.weight, self.k_norm.eps, cos, sin,
                      pools[0], batch.slot_mapping, v_rows.view(t, self.n_kv, self.head_dim), pools[1],
                      pool_scale=scales[0], v_pool_scale=scales[1])
        else:
            q = apply_rope(self.q_norm(self.q_proj(x).view(t, self.n_heads, self.head_dim)), cos, sin)
            k = apply_rope(self.k_norm(self.k_proj(x).view(t, self.n_kv, self.head_dim)), cos, sin)
            v = self.v_proj(x).view(t, self.n_kv, self.head_dim)
            for i, rows in ((0, k), (1, v)):
                pools[i], scales[i] = _write(pools[i], scales[i], batch.slot_mapping, rows, inplace)
        fp8 = scales[0] is not None
        kv_scales = (scales[0], scales[1]) if fp8 else ()
        args = (q, pools[0], pools[1], batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.positions)
        if self.indexer is None:
            o = torch.ops.m3.paged_attention(*args, self.scale, *kv_scales)
            return self.o_proj(o.reshape(t, -1)), tuple(pools + (scales if fp8 else [])), None
        if fused:
            iq = self.indexer.queries_writing_keys(*index_rows, cos, sin, pools[2], batch.slot_mapping, scales[2])
        else:
            iq, ik = self.indexer.keys_and_queries(x, cos, sin)
            pools[2], scales[2] = _write(pools[2], scales[2], batch.slot_mapping, ik, inplace)
        sel = self.indexer.select(iq, pools[2], batch, scales[2])
        if choose_blocks is not None:
            sel = choose_blocks(sel, iq, pools[2], scales[2])
        o = torch.ops.m3.sparse_paged_attention(*args, sel, self.cfg.index_block_size, self.scale, *kv_scales)
        return self.o_proj(o.reshape(t, -1)), tuple(pools + (scales if fp8 else [])), sel


def _write(pool, scale_pool, slots, values, inplace):
    """One cache write: plain, or quantised with its scales when the pool is FP8."""
    if scale_pool is None:
        return write_pool(pool, slots, values, inplace), None
    return write_pool_fp8(pool, scale_pool, slots, values, inplace)
