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


def add_norm(norm: RMSNorm, h: torch.Tensor, branch: torch.Tensor | None, fused: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream h [T, H] plus a branch's output (None: nothing to add) -> (norm(h + branch),
    h + branch). ``fused`` (``fusion.use_fused_kernels``): one launch of ``plugins/kernels/rms_norm.py``, which
    rounds as these ops do; it has no backward, so where autograd records (training) the plain ops run."""
    if fused and not (torch.is_grad_enabled() and (norm.weight.requires_grad or h.requires_grad
                                                   or (branch is not None and branch.requires_grad))):
        from m3export.plugins.kernels import rms_norm

        if branch is None:
            return rms_norm.add_rms_norm(h, None, norm.weight, norm.eps)
        return rms_norm.add_rms_norm(branch, h, norm.weight, norm.eps)
    h = h if branch is None else h + branch
    return norm(h), h
