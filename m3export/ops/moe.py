"""``m3::moe`` / ``m3::moe_mxfp8``: the whole M3 MoE block as one op, and ``m3::mxfp8_linear``.

Routing is data dependent (which experts a token reaches), which torch.export and ONNX tracing cannot express
without dropping experts; one opaque op with static inputs keeps every expert in the graph.
"""

from __future__ import annotations

import torch

from . import mxfp8
from .paged import accumulation_dtype


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """Uninterleaved SwiGLU-OAI with clamp: gate = first half, up = second half, +1 on up."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))


def route(x: torch.Tensor, router_weight: torch.Tensor, bias: torch.Tensor, top_k: int):
    """fp32 sigmoid scores (float64 for float64 inputs); the correction bias only picks experts; weights
    renormalised over the chosen."""
    acc = accumulation_dtype(x, router_weight, bias)
    scores = torch.sigmoid(x.to(acc) @ router_weight.to(acc).t())
    order = torch.sort(scores + bias.to(acc), dim=-1, descending=True, stable=True)
    idx = order.indices[:, :top_k]
    w = scores.gather(1, idx)
    return idx, w / w.sum(dim=-1, keepdim=True)


def _moe(x, router_weight, bias, expert, shared, top_k, routed_scaling_factor, alpha, limit, owned=None):
    """``expert(e)`` / ``shared()`` return (w13 [2I, H], w2 [H, I]) in the activation dtype. ``owned`` (a range of
    expert ids; all when None) limits the routed sum to those experts: an expert-parallel rank's partial sum, the
    routing itself still over every expert (``m3export.parallel``)."""
    idx, w = route(x, router_weight, bias, top_k)
    out = torch.zeros_like(x)
    for e in torch.unique(idx).tolist():
        if owned is not None and e not in owned:
            continue
        rows, slot = torch.nonzero(idx == e, as_tuple=True)
        w13, w2 = expert(e)
        y = swiglu_oai(x[rows] @ w13.t(), alpha, limit) @ w2.t()
        out.index_add_(0, rows, (y * w[rows, slot, None]).to(x.dtype))
    s13, s2 = shared()
    return out * routed_scaling_factor + swiglu_oai(x @ s13.t(), alpha, limit) @ s2.t()


def moe_reference(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared_w13: torch.Tensor,
    shared_w2: torch.Tensor,
    top_k: int,
    routed_scaling_factor: float,
    swiglu_alpha: float,
    swiglu_limit: float,
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; shared_w13 [2Is, H]; shared_w2 [H, Is]."""
    dt = x.dtype
    return _moe(x, router_weight, e_score_correction_bias, lambda e: (w13[e].to(dt), w2[e].to(dt)),
                lambda: (shared_w13.to(dt), shared_w2.to(dt)), top_k, routed_scaling_factor, swiglu_alpha,
                swiglu_limit)


moe = torch.library.custom_op("m3::moe", moe_reference, mutates_args=())


@moe.register_fake
def _(x, router_weight, e_score_correction_bias, w13, w2, shared_w13, shared_w2, top_k, routed_scaling_factor,
      swiglu_alpha, swiglu_limit):
    return torch.empty_like(x)


def moe_mxfp8_reference(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    shared_w13: torch.Tensor,
    shared_w13_scale: torch.Tensor,
    shared_w2: torch.Tensor,
    shared_w2_scale: torch.Tensor,
    top_k: int,
    routed_scaling_factor: float,
    swiglu_alpha: float,
    swiglu_limit: float,
) -> torch.Tensor:
    """As ``m3::moe`` with E4M3 weights and UE8M0 scales [.., N, K/32]; only the experts in use are dequantised."""
    dt = x.dtype
    return _moe(
        x, router_weight, e_score_correction_bias,
        lambda e: (mxfp8.dequantize(w13[e], w13_scale[e], dt), mxfp8.dequantize(w2[e], w2_scale[e], dt)),
        lambda: (mxfp8.dequantize(shared_w13, shared_w13_scale, dt), mxfp8.dequantize(shared_w2, shared_w2_scale, dt)),
        top_k, routed_scaling_factor, swiglu_alpha, swiglu_limit,
    )


moe_mxfp8 = torch.library.custom_op("m3::moe_mxfp8", moe_mxfp8_reference, mutates_args=())


@moe_mxfp8.register_fake
def _(x, router_weight, e_score_correction_bias, w13, w13_scale, w2, w2_scale, shared_w13, shared_w13_scale,
      shared_w2, shared_w2_scale, top_k, routed_scaling_factor, swiglu_alpha, swiglu_limit):
    return torch.empty_like(x)


def mxfp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ dequant(weight [N, K], scale [N, K/32]).T in x's dtype (weight-only, as Hopper runs it)."""
    return x @ mxfp8.dequantize(weight, weight_scale, x.dtype).t()


mxfp8_linear = torch.library.custom_op("m3::mxfp8_linear", mxfp8_linear_reference, mutates_args=())


@mxfp8_linear.register_fake
def _(x, weight, weight_scale):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
