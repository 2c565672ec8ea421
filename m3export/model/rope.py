"""Partial NeoX RoPE: dims [0, rotary_dim) of each head rotate (pairs i, i + rotary_dim/2), the rest pass.

cos/sin are computed from the positions on the fly (one tiny outer product) instead of a [max_pos, dim] table,
so the exported graph carries no million-row constant and any position up to the config's limit works.
"""

from __future__ import annotations

import torch
from torch import nn


class Rotary(nn.Module):
    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim, self.theta = rotary_dim, theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        return 1.0 / (self.theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))

    def reset_parameters(self) -> None:
        """Recompute the (non-persistent) frequencies after a model is materialised from ``meta``."""
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rotary_dim/2] (fp32 angles, rounded to the activation dtype)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, R/2]."""
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)
