"""Gemma RMSNorm: the checkpoint stores each weight as an offset from one (zeros = identity)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Normalises in fp32 and rounds back to the input dtype once, after the (1 + w) scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)
