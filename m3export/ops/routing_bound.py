"""How close two expert scores must be before an fp32 implementation of M3's routing may order them otherwise than
float64 does: the one bound that ``m3export verify`` (``export/routing_ties.py``) and the op conformance suite
(``ops/conformance.py``'s near-tie rule for ``MoE`` / ``MoEMXFP8``) both apply.

What an fp32 routing computes between its router input and the score it compares (``ops.moe.route``, the ONNX
``MoE`` bodies, ``plugins/kernels/moe_routing.py``): x [T, D] the router input, in the activation dtype (bf16, fp16
or fp32: exact in fp32), W [E, D] and b [E] the fp32 router weight and correction bias, u = 2^-24 fp32's unit
roundoff (half of ``torch.finfo(torch.float32).eps``), A_e = sum_i |x_i W_ei|.

1. ``l_e = x . W_e``: D products (each rounded once, or fused into the following add by an FMA) and D - 1 adds, in
   any order and blocking (cuBLAS's GEMM, a tiled kernel's lanes and then its reduction, ORT's MatMul). No TF32:
   torch's fp32 matmuls default to IEEE, every ONNX Runtime session this project opens sets ``use_tf32=0``, the
   Triton router-logits kernel multiplies and sums elementwise. Higham, "Accuracy and Stability of Numerical
   Algorithms", 2nd ed., eq. (3.5): |fl(l_e) - l_e| <= gamma_D A_e, gamma_D = D u / (1 - D u).
2. ``s_e = sigmoid(l_e)``: sigmoid' <= 1/4, so the dot's error moves the score by at most gamma_D A_e / 4; the fp32
   sigmoid itself adds at most ``SIGMOID_ERROR`` (absolute: a score lies in [0, 1]).
3. ``s_e + b_e``: one fp32 rounding, at most u |s_e + b_e| <= u (1 + |b_e|).
4. The comparisons (top-k, "largest, lowest id among equals") are exact.

The float64 recomputation that judges it does the same with u64 = 2^-53: gamma_D(u64) A_e / 4, plus its own sigmoid,
add and comparison roundings (``F64_SLACK``). So the biased fp32 score is within

    beta_e = (gamma_D(u) + gamma_D(u64)) A_e / 4 + SIGMOID_ERROR + u (1 + |b_e|) + F64_SLACK

of the float64 one, and an fp32 routing can keep expert c where float64 keeps a only if S_a - S_c <= beta_a + beta_c
(each score moved toward the other by its own bound; nothing more is added). Two experts whose float64 scores are
exactly equal (identical router rows and bias) are equal in fp32 too and go to the lower id: never a near tie.

Why this one and not ``D * eps32 * A_e`` (the conformance suite's rule before): eps32 = 2u, so that counted each
rounding twice, and a slack factor 2 on top of the two per-score bounds counted the pair twice more: 4x wider on the
dot, which excused (skipped) rows a wrong routing could hide in. It also divided the sigmoid's own error by 4 and
had no bias-add rounding; those small terms are the ones that matter where A_e is tiny.
"""

from __future__ import annotations

import torch

U32 = 2.0 ** -24  # fp32's unit roundoff u
U64 = 2.0 ** -53
SIGMOID_ERROR = 2.0 ** -21
"""Absolute error of an fp32 ``Sigmoid``: 8 units of 2^-24 (ONNX Runtime's CPU kernel, a polynomial approximation,
was measured at 2.8 over a dense sweep of [-30, 30], ``tests/test_verify_routing_ties.py``; ``1 / (1 + expf(-z))``
with a 2-ulp ``expf``, as GPU kernels compute it, stays within 4; a correctly rounded one within 0.5). Next to the
dot's gamma_D A_e / 4 it is small: it only keeps the bound honest where A_e is tiny."""
F64_SLACK = 2.0 ** -48  # the float64 recomputation's own sigmoid, add and comparison roundings, generously


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative bound of an n-term dot product's roundings, any order."""
    return n * u / (1 - n * u)


def fp32_score_bounds(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """beta [T, E] of the module docstring: how far an fp32 biased score may be from the float64 one computed from
    the same router input x [T, D], weight [E, D] and bias [E] (pass them in float64)."""
    d = x.shape[-1]
    abs_sum = x.abs() @ weight.abs().t()  # A_e
    return (gamma(d, U32) + gamma(d, U64)) * abs_sum / 4 + SIGMOID_ERROR + U32 * (1 + bias.abs()) + F64_SLACK


def swap_pairs(scores: torch.Tensor, beta: torch.Tensor, top_k: int):
    """Every (kept a, dropped c) pair of the float64 top-k of biased ``scores`` [T, E] (stable: lower id first among
    equals) -> (kept [T, k], rest [T, E - k] expert ids, gap [T, k, E - k] = S_a - S_c >= 0, bound [T, k, E - k] =
    beta_a + beta_c). An fp32 routing may keep c instead of a only where 0 < gap <= bound."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    kept, rest = order[:, :top_k], order[:, top_k:]
    gap = scores.gather(1, kept)[:, :, None] - scores.gather(1, rest)[:, None, :]
    bound = beta.gather(1, kept)[:, :, None] + beta.gather(1, rest)[:, None, :]
    return kept, rest, gap, bound
