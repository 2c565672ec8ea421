"""Pre-norm decoder layer: h += Attn(Norm(h)); h += FFN(Norm(h)).

The last add is left to the next norm (the next layer's input norm, or the final norm), so that on CUDA each
residual add runs in the same launch as the norm that follows it (``norm.add_norm``); the plain path runs the same
ops in the same order."""

from __future__ import annotations

import torch
from torch import nn

from ..config import M3Config
from . import fusion
from .attention import Attention, ChooseBlocks
from .batch import Batch
from .mlp import MoE, DenseMLP
from .norm import RMSNorm, add_norm


class DecoderLayer(nn.Module):
    def __init__(self, cfg: M3Config, sparse_attention: bool, moe: bool, mxfp8: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, sparse_attention, mxfp8)
        self.mlp = MoE(cfg, mxfp8) if moe else DenseMLP(cfg, cfg.dense_intermediate_size, mxfp8)

    def forward(self, h: torch.Tensor, cos, sin, batch: Batch, cache, inplace: bool,
                choose_blocks: ChooseBlocks | None = None, pending: torch.Tensor | None = None):
        """h [T, H]: the residual stream, still without ``pending`` (the previous layer's MLP output, or None) ->
        (h, mlp output, cache, selection): this layer's result is h + mlp output, the add left to the next norm."""
        fused = fusion.use_fused_kernels(h, inplace)
        x, h = add_norm(self.input_layernorm, h, pending, fused)
        a, cache, sel = self.self_attn(x, cos, sin, batch, cache, inplace, choose_blocks)
        x, h = add_norm(self.post_attention_layernorm, h, a, fused)
        return h, self.mlp(x), cache, sel
