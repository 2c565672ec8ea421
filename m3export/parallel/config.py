"""How a model is split across ranks: vLLM's two knobs, and the check that the model's sizes allow it.

``tensor_parallel_size`` ranks form one model replica (data parallelism is out of scope, so the world size equals
it). Attention, the dense MLPs, the shared expert and ``lm_head`` are tensor parallel over those ranks. Routed
experts are tensor parallel too (each expert's intermediate dimension split) unless ``expert_parallel``, in
which case the same ranks own whole experts, a contiguous range each: vLLM's ``--expert-parallel``, where the
expert-parallel size *is* the tensor-parallel size and attention stays tensor parallel. "EP=2" on its own is
therefore ``ParallelConfig(2, expert_parallel=True)``; there is no attention-replicated expert parallelism here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..config import ConfigError, M3Config

MX_BLOCK = 32  # MXFP8: one scale per 32 values along K, so a K split must fall on a block boundary


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    expert_parallel: bool = False

    def __post_init__(self):
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if not isinstance(self.expert_parallel, bool):
            raise ConfigError(f"expert_parallel must be true or false, got {self.expert_parallel!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    def validate(self, cfg: M3Config, mxfp8: bool | None = None) -> ParallelConfig:
        """``self`` when ``cfg``'s sizes split evenly over the ranks; else one ``ConfigError`` naming the field and
        the numbers. ``mxfp8`` (default: the config declares quantization) also needs every split of a K
        dimension to fall on a 32-value scale block."""
        tp = self.tensor_parallel_size
        if tp == 1:
            return self
        mxfp8 = cfg.quantization is not None if mxfp8 is None else mxfp8
        split = [("num_attention_heads", cfg.num_attention_heads, "query heads"),
                 ("vocab_size", cfg.vocab_size, "lm_head rows (vocab parallel)"),
                 ("dense_intermediate_size", cfg.dense_intermediate_size, "dense MLP columns"),
                 ("shared_intermediate_size", cfg.shared_intermediate_size, "shared expert columns")]
        if self.expert_parallel:
            split.append(("num_local_experts", cfg.num_local_experts, "routed experts (expert parallel)"))
        else:
            split.append(("intermediate_size", cfg.intermediate_size, "routed experts' columns"))
        for name, value, what in split:
            if value % tp:
                raise ConfigError(f"tensor_parallel_size {tp} does not divide {name} ({value}): the {what} are "
                                  f"split evenly across the ranks")
        kv = cfg.num_key_value_heads
        if kv % tp and tp % kv:
            raise ConfigError(f"tensor_parallel_size {tp} neither divides nor is a multiple of num_key_value_heads "
                              f"({kv}): each rank holds an equal share of the KV heads, or one KV head replicated "
                              f"on tensor_parallel_size / num_key_value_heads ranks")
        if mxfp8:
            widths = [("num_attention_heads * head_dim / tensor_parallel_size (o_proj input per rank)",
                       cfg.num_attention_heads * cfg.head_dim // tp),
                      ("dense_intermediate_size / tensor_parallel_size", cfg.dense_intermediate_size // tp),
                      ("shared_intermediate_size / tensor_parallel_size", cfg.shared_intermediate_size // tp)]
            if not self.expert_parallel:
                widths.append(("intermediate_size / tensor_parallel_size", cfg.intermediate_size // tp))
            for name, value in widths:
                if value % MX_BLOCK:
                    raise ConfigError(f"MXFP8 with tensor_parallel_size {tp}: {name} = {value} is not a multiple "
                                      f"of {MX_BLOCK} (a rank's slice must hold whole scale blocks)")
        return self

    def local_config(self, cfg: M3Config) -> M3Config:
        """The config one rank's modules are built from: its share of the heads and intermediate sizes.

        ``num_local_experts`` stays global (the router scores every expert on every rank); the expert stack of an
        expert-parallel rank is sized by ``experts_per_rank``. ``vocab_size`` stays global: ``lm_head`` gathers
        the full logits, and the runtime reads the vocabulary from here. The cache shapes a backend allocates
        (``M3ForCausalLM.cache_shapes``) follow from the local ``num_key_value_heads``.
        """
        self.validate(cfg)
        tp = self.tensor_parallel_size
        if tp == 1:
            return cfg
        changes = dict(num_attention_heads=cfg.num_attention_heads // tp,
                       num_key_value_heads=self.kv_heads_per_rank(cfg),
                       dense_intermediate_size=cfg.dense_intermediate_size // tp,
                       shared_intermediate_size=cfg.shared_intermediate_size // tp)
        if cfg.has_sparse_layers:  # index head r selects for KV head r (the config checks the counts are equal)
            changes["index_n_heads"] = self.kv_heads_per_rank(cfg)
        if not self.expert_parallel:
            changes["intermediate_size"] = cfg.intermediate_size // tp
        return dataclasses.replace(cfg, **changes).validate()

    def kv_heads_per_rank(self, cfg: M3Config) -> int:
        """KV heads a rank holds: its share, or 1 when there are more ranks than KV heads (as vLLM, each KV head
        is then replicated on ``tensor_parallel_size / num_key_value_heads`` ranks: the release's 4 KV heads at
        TP8 give pairs of ranks one KV head each, with 8 distinct query heads per rank)."""
        return max(1, cfg.num_key_value_heads // self.tensor_parallel_size)

    def experts_per_rank(self, cfg: M3Config) -> int:
        return cfg.num_local_experts // self.tensor_parallel_size if self.expert_parallel else cfg.num_local_experts
