"""``m3::moe_mxfp8`` on the GPU: the ``m3::moe`` kernels (``moe.py``) reading E4M3 weights with UE8M0 scales.

Semantics: ``m3export.ops.moe.moe_mxfp8_reference`` (``docs/ops.md`` §6). Weight-only: each weight tile is
dequantised exactly on chip to the activation dtype right before its dot; activations are never quantised and no
weight is ever dequantised as a whole (the release's experts are 444 GB in MXFP8).
"""

from __future__ import annotations

import torch

from .moe import run_moe

OP = "m3::moe_mxfp8"


def forward(x: torch.Tensor, router_weight: torch.Tensor, e_score_correction_bias: torch.Tensor, w13: torch.Tensor,
            w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, shared_w13: torch.Tensor,
            shared_w13_scale: torch.Tensor, shared_w2: torch.Tensor, shared_w2_scale: torch.Tensor, top_k: int,
            routed_scaling_factor: float, swiglu_alpha: float, swiglu_limit: float) -> torch.Tensor:
    return run_moe(x, router_weight, e_score_correction_bias, w13, w2, shared_w13, shared_w2, top_k,
                   routed_scaling_factor, swiglu_alpha, swiglu_limit,
                   scales=(w13_scale, w2_scale, shared_w13_scale, shared_w2_scale))
