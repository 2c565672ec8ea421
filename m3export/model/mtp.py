"""Multi-token prediction module: one sparse-attention MoE decoder layer that drafts the next-next token.

z = eh_proj([enorm(embed(x_{t+1})), hnorm(h_t)]); out = layer(z); logits = lm_head(final_layernorm(out)).
The embedding and lm_head are the main model's; ``out`` feeds the next chained draft step as ``h``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import M3Config
from . import fusion
from .attention import ChooseBlocks
from .batch import Batch
from .layer import DecoderLayer
from .linear import Linear
from .norm import RMSNorm, add_norm


class MTPModule(nn.Module):
    def __init__(self, cfg: M3Config, mxfp8: bool):
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # eh_proj stays floating point: checkpoints ship it either way and an MXFP8 one dequantises exactly.
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.transformer_layer = DecoderLayer(cfg, sparse_attention=True, moe=True, mxfp8=mxfp8)
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos, sin, batch: Batch, cache, inplace: bool,
                choose_blocks: ChooseBlocks | None = None):
        """embeds [T, H] of the next tokens (zeroed at position 0), hidden [T, H] -> (out, normed, cache, sel)."""
        fused = fusion.use_fused_kernels(embeds, inplace)
        (e, _), (hn, _) = add_norm(self.enorm, embeds, None, fused), add_norm(self.hnorm, hidden, None, fused)
        z = self.eh_proj(torch.cat([e, hn], dim=-1))
        h, pending, cache, sel = self.transformer_layer(z, cos, sin, batch, cache, inplace, choose_blocks)
        normed, out = add_norm(self.final_layernorm, h, pending, fused)
        return out, normed, cache, sel
