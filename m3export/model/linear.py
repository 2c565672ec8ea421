"""A bias-free linear layer whose weight is either floating point or MXFP8 (E4M3 + UE8M0 per 32 along K)."""

from __future__ import annotations

import torch
from torch import nn


class Linear(nn.Module):
    """Parameter names follow the checkpoint (``weight``, ``weight_scale_inv``) so loading is a rename."""

    def __init__(self, in_features: int, out_features: int, mxfp8: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.mxfp8 = in_features, out_features, mxfp8
        if mxfp8:
            self.weight = nn.Parameter(
                torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn), requires_grad=False
            )
            self.weight_scale_inv = nn.Parameter(
                torch.empty(out_features, in_features // 32, dtype=torch.uint8), requires_grad=False
            )
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mxfp8:
            return torch.ops.m3.mxfp8_linear(x, self.weight, self.weight_scale_inv)
        return nn.functional.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}{', mxfp8' if self.mxfp8 else ''}"
