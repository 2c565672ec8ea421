"""Dense SwiGLU-OAI MLP (layers 0-2 and the shared expert) and the sigmoid-routed MoE block."""

from __future__ import annotations

import torch
from torch import nn

from ..config import M3Config
from ..ops.moe import swiglu_oai
from .linear import Linear


class DenseMLP(nn.Module):
    """gate_up_proj holds the gate rows then the up rows (the checkpoint's gate_proj / up_proj, stacked)."""

    def __init__(self, cfg: M3Config, intermediate: int, mxfp8: bool):
        super().__init__()
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * intermediate, mxfp8)
        self.down_proj = Linear(intermediate, cfg.hidden_size, mxfp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu_oai(self.gate_up_proj(x), self.alpha, self.limit))


class Router(nn.Module):
    """fp32 router weight and correction bias, as the checkpoint stores them whatever the model dtype."""

    def __init__(self, cfg: M3Config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_local_experts, cfg.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(cfg.num_local_experts, dtype=torch.float32), requires_grad=False
        )


class Experts(nn.Module):
    """All routed experts stacked: w13 [E, 2I, H] (w1 = gate rows, then w3 = up rows), w2 [E, H, I]."""

    def __init__(self, cfg: M3Config, mxfp8: bool):
        super().__init__()
        e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        self.mxfp8 = mxfp8
        if mxfp8:
            f8, u8 = torch.float8_e4m3fn, torch.uint8
            self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=f8), requires_grad=False)
            self.w13_scale_inv = nn.Parameter(torch.empty(e, 2 * i, h // 32, dtype=u8), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(e, h, i, dtype=f8), requires_grad=False)
            self.w2_scale_inv = nn.Parameter(torch.empty(e, h, i // 32, dtype=u8), requires_grad=False)
        else:
            self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))
            self.w2 = nn.Parameter(torch.empty(e, h, i))


class MoE(nn.Module):
    def __init__(self, cfg: M3Config, mxfp8: bool):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = Experts(cfg, mxfp8)
        self.shared_experts = DenseMLP(cfg, cfg.shared_intermediate_size, mxfp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, ex, sh = self.cfg, self.experts, self.shared_experts
        attrs = (c.num_experts_per_tok, c.routed_scaling_factor, c.swiglu_alpha, c.swiglu_limit)
        if ex.mxfp8:
            return torch.ops.m3.moe_mxfp8(
                x, self.gate.weight, self.gate.e_score_correction_bias, ex.w13, ex.w13_scale_inv, ex.w2,
                ex.w2_scale_inv, sh.gate_up_proj.weight, sh.gate_up_proj.weight_scale_inv, sh.down_proj.weight,
                sh.down_proj.weight_scale_inv, *attrs,
            )
        return torch.ops.m3.moe(
            x, self.gate.weight, self.gate.e_score_correction_bias, ex.w13, ex.w2, sh.gate_up_proj.weight,
            sh.down_proj.weight, *attrs,
        )
