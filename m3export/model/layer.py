"""Pre-norm decoder layer: h += Attn(Norm(h)); h += FFN(Norm(h))."""

from __future__ import annotations

import torch
from torch import nn

from ..config import M3Config
from .attention import Attention, ChooseBlocks
from .batch import Batch
from .mlp import MoE, DenseMLP
from .norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, cfg: M3Config, sparse_attention: bool, moe: bool, mxfp8: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, sparse_attention, mxfp8)
        self.mlp = MoE(cfg, mxfp8) if moe else DenseMLP(cfg, cfg.dense_intermediate_size, mxfp8)

    def forward(self, h: torch.Tensor, cos, sin, batch: Batch, cache, inplace: bool,
                choose_blocks: ChooseBlocks | None = None):
        a, cache, sel = self.self_attn(self.input_layernorm(h), cos, sin, batch, cache, inplace, choose_blocks)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h)), cache, sel
