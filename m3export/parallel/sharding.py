"""Which slice of every parameter a rank holds: the one table of the sharding (``docs/parallel.md`` explains it).

The ranks' slices of a parameter partition it, except the KV-head projections (``k_proj``, ``v_proj``,
``index_q_proj``) when there are more ranks than KV heads: each KV head is then held by tp / kv ranks.

``shard_of(name, cfg, parallel, rank)`` -> ``Shard``: replicated (``dim is None``), or the concatenation, along
``dim``, of the global index ranges ``ranges`` (in order). Two ranges where a parameter stacks two halves that are
split separately: ``gate_up_proj`` / ``w13`` hold the gate rows then the up rows, and a rank keeps its share of
each, so its local tensor is again "gate rows then up rows" and ``swiglu_oai``'s ``chunk(2)`` still pairs them.
An MXFP8 scale (``*_scale_inv``, one per 32 values along the last dimension) is split with its weight: the same
ranges, divided by 32 when the split dimension is the last. The loader, the per-rank export and the tests all
read this table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..config import M3Config
from .config import MX_BLOCK, ParallelConfig

SCALE = "_scale_inv"


@dataclass(frozen=True)
class Shard:
    """A rank's part of one parameter: ``dim is None`` = the whole (replicated), else the global index ranges
    ``ranges`` along ``dim``, concatenated in order."""

    dim: int | None = None
    ranges: tuple[tuple[int, int], ...] = ()

    @property
    def replicated(self) -> bool:
        return self.dim is None

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(shape)
        out = list(shape)
        out[self.dim] = sum(hi - lo for lo, hi in self.ranges)
        return tuple(out)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full parameter ``full`` (a view when one range, else a copy)."""
        if self.dim is None:
            return full
        parts = [full.narrow(self.dim, lo, hi - lo) for lo, hi in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)

    def scaled(self, ndim: int) -> Shard:
        """The split of the MXFP8 scale of a weight split as ``self`` (``ndim``: the weight's rank)."""
        if self.dim is None or self.dim != ndim - 1:
            return self
        return Shard(self.dim, tuple((lo // MX_BLOCK, hi // MX_BLOCK) for lo, hi in self.ranges))


def _block(rank: int, tp: int, total: int) -> tuple[int, int]:
    n = total // tp
    return rank * n, (rank + 1) * n


def _halves(rank: int, tp: int, inter: int) -> tuple[tuple[int, int], ...]:
    """Rows of a stacked [gate; up] weight with intermediate size ``inter`` that rank keeps."""
    lo, hi = _block(rank, tp, inter)
    return (lo, hi), (inter + lo, inter + hi)


def _kv_heads(rank: int, tp: int, kv: int) -> tuple[int, int]:
    """KV heads of ``rank``: an equal contiguous share, or, with more ranks than KV heads, the one KV head whose
    query heads the rank holds (replicated on ``tp / kv`` consecutive ranks)."""
    if tp <= kv:
        return _block(rank, tp, kv)
    head = rank // (tp // kv)
    return head, head + 1


# Parameter name (layer part) -> how it is split. Names are the model's (``model.named_parameters()``), which are
# the same on every rank; MTP modules' ``transformer_layer`` is a decoder layer like the others.
_LAYER = re.compile(r"(?:model\.layers\.\d+|mtp\.\d+\.transformer_layer)\.(.+)")


def shard_of(name: str, cfg: M3Config, parallel: ParallelConfig, rank: int) -> Shard:
    """The slice of the global parameter ``name`` (its weight-shaped form; a ``*_scale_inv`` follows its weight)
    that ``rank`` holds under ``parallel`` for the model configured by ``cfg`` (the global config)."""
    tp = parallel.tensor_parallel_size
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside tensor_parallel_size {tp}")
    if tp == 1:
        return Shard()
    base, is_scale = (name[: -len(SCALE)], True) if name.endswith(SCALE) else (name, False)
    shard, ndim = _weight_shard(base, cfg, parallel, rank)
    return shard.scaled(ndim) if is_scale else shard


def _weight_shard(name: str, cfg: M3Config, parallel: ParallelConfig, rank: int) -> tuple[Shard, int]:
    tp, d = parallel.tensor_parallel_size, cfg.head_dim
    if name == "lm_head.weight":  # vocab parallel: each rank scores its rows of the vocabulary, then all-gather
        return Shard(0, (_block(rank, tp, cfg.vocab_size),)), 2
    m = _LAYER.fullmatch(name)
    if m is None:  # embeddings, final norms, MTP enorm / hnorm / eh_proj, vision tower and projector
        return Shard(), 0
    rest = m[1]
    q_lo, q_hi = _block(rank, tp, cfg.num_attention_heads)
    kv_lo, kv_hi = _kv_heads(rank, tp, cfg.num_key_value_heads)
    if rest == "self_attn.q_proj.weight":  # column parallel by query head (rank's heads serve its KV heads)
        return Shard(0, ((q_lo * d, q_hi * d),)), 2
    if rest in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
        return Shard(0, ((kv_lo * d, kv_hi * d),)), 2
    if rest == "self_attn.o_proj.weight":  # row parallel: the rank's heads' part of K, then all-reduce
        return Shard(1, ((q_lo * d, q_hi * d),)), 2
    if rest == "self_attn.indexer.index_q_proj.weight":  # index head r selects for KV head r: follows it
        di = cfg.index_head_dim
        return Shard(0, ((kv_lo * di, kv_hi * di),)), 2
    # index_k_proj (the one shared index-key head), every norm and the router are replicated
    mm = re.fullmatch(r"mlp\.(shared_experts\.)?(gate_up_proj|down_proj)\.weight", rest)
    if mm:
        inter = cfg.shared_intermediate_size if mm[1] else cfg.dense_intermediate_size
        if mm[2] == "gate_up_proj":
            return Shard(0, _halves(rank, tp, inter)), 2
        return Shard(1, (_block(rank, tp, inter),)), 2
    if rest in ("mlp.experts.w13", "mlp.experts.w2"):
        if parallel.expert_parallel:  # the rank's contiguous range of whole experts
            return Shard(0, (_block(rank, tp, cfg.num_local_experts),)), 3
        if rest == "mlp.experts.w13":
            return Shard(1, _halves(rank, tp, cfg.intermediate_size)), 3
        return Shard(2, (_block(rank, tp, cfg.intermediate_size),)), 3
    return Shard(), 0
