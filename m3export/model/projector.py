"""The multi-modal projector: vision patches -> text embeddings, one token per spatial-merge group.

Each patch goes through a GELU MLP into the text width; then every ``spatial_merge_size**2`` consecutive patches
(a 2 x 2 neighbourhood, thanks to the block-major patch order) are concatenated along channels and fused into one
token by a second GELU MLP. The checkpoint stores the second MLP as ``patch_merge_mlp`` (original layout).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..config import VisionConfig


class MultiModalProjector(nn.Module):
    def __init__(self, cfg: VisionConfig, text_hidden_size: int):
        super().__init__()
        p, t = cfg.projector_hidden_size, text_hidden_size
        self.unit = cfg.merge_unit
        self.linear_1 = nn.Linear(cfg.hidden_size, p)
        self.linear_2 = nn.Linear(p, t)
        self.merge_linear_1 = nn.Linear(t * self.unit, p)
        self.merge_linear_2 = nn.Linear(p, t)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [N, vision hidden] (N a multiple of the merge unit) -> tokens [N / unit, text hidden]."""
        h = self.linear_2(F.gelu(self.linear_1(patches)))
        h = h.reshape(h.shape[0] // self.unit, -1)
        return self.merge_linear_2(F.gelu(self.merge_linear_1(h)))
