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

Tensor cores (``tensor_cores=True``: 16-bit x and an fp32 router, which the GPU kernels' prefill path,
``plugins/kernels/moe_routing.py``'s ``_router_logits_tc``, multiplies as three exact bf16 parts of the weight on
tensor cores): step 1's dot is then within ``tc_logit_bound`` of the exact one instead, about gamma_(2D+3)(2u) A_e
(the adder truncates: that module's docstring derives it), 4x the IEEE term; the rest is unchanged. An IEEE
implementation of the same inputs is within it too, so the rule for those dtypes covers both.

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


def tc_logit_bound(x: torch.Tensor, parts: torch.Tensor, x_parts: int = 1) -> torch.Tensor:
    """[T, E] bound on |logit - exact| of the tensor-core router logits (``moe_routing._router_logits_tc``) from
    the router input x [T, D] and the weight's three bf16 parts [3, E, D] (float64 of what the kernel multiplies):
    gamma_(2D+3)(2u) A_big + gamma_(2n+3)(2u) A_small + 2^-133 sum_h |x_h|, A_big the |products| of x's top part
    and w_hi (one accumulator of D products), A_small those of the rest (n = (3 x_parts - 1) D products in the
    other accumulator); ``x_parts`` 2 for fp16 x (split into a top 8 and a low 3 significant bits, both parts
    passed in x's place as [2, T, D] then), 1 otherwise. The last term is what the split drops of weights below
    bf16's grid (``moe_routing.SPLIT_FLOOR``)."""
    d = parts.shape[-1]
    xs = x.reshape(x_parts, -1, d).abs()
    ws = parts.abs()
    big = xs[0] @ ws[0].t()
    small = sum(xs[i] @ ws[j].t() for i in range(x_parts) for j in range(3)) - big
    n_small = (3 * x_parts - 1) * d
    return (gamma(2 * d + 3, 2 * U32) * big + gamma(2 * n_small + 3, 2 * U32) * small
            + 2.0 ** -133 * xs.sum(0).sum(-1, keepdim=True))


def fp32_score_bounds(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      tensor_cores: bool = False) -> torch.Tensor:
    """beta [T, E] of the module docstring: how far an fp32 biased score may be from the float64 one computed from
    the same router input x [T, D], weight [E, D] and bias [E] (pass them in float64). ``tensor_cores``: the
    inputs were 16-bit x and an fp32 weight, which GPU kernels may multiply on tensor cores (the module docstring's
    last paragraph): the dot's term is then ``tc_logit_bound``'s at its widest. The parts are truncations of one
    sign: |w_hi| <= |w|, |w_mid| + |w_lo| = |w| - |w_hi| < 2^-7 |w| (the bits below the top 8), and likewise
    |x_hi| <= |x|, |x_lo| < 2^-7 |x| for fp16 x (bf16 x is x_hi alone); so A_big <= A_e and A_small <=
    2^-7 A_e + 2^-7 A_e, with fp16 x's n = 5 D."""
    d = x.shape[-1]
    abs_sum = x.abs() @ weight.abs().t()  # A_e
    if tensor_cores:
        # The split's drop (< 2^-133 per weight off bf16's grid) and what its rounding of w_lo adds to A_small there
        # (< 2^-134 per weight, times a gamma < 1): 2^-132 per unit of |x|.
        floor = 2.0 ** -132 * x.abs().sum(-1, keepdim=True)
        dot = (gamma(2 * d + 3, 2 * U32) + 2.0 ** -6 * gamma(10 * d + 3, 2 * U32)) * abs_sum + floor
    else:
        dot = gamma(d, U32) * abs_sum
    return (dot + gamma(d, U64) * abs_sum) / 4 + SIGMOID_ERROR + U32 * (1 + bias.abs()) + F64_SLACK


def swap_pairs(scores: torch.Tensor, beta: torch.Tensor, top_k: int):
    """Every (kept a, dropped c) pair of the float64 top-k of biased ``scores`` [T, E] (stable: lower id first among
    equals) -> (kept [T, k], rest [T, E - k] expert ids, gap [T, k, E - k] = S_a - S_c >= 0, bound [T, k, E - k] =
    beta_a + beta_c). An fp32 routing may keep c instead of a only where 0 < gap <= bound."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    kept, rest = order[:, :top_k], order[:, top_k:]
    gap = scores.gather(1, kept)[:, :, None] - scores.gather(1, rest)[:, None, :]
    bound = beta.gather(1, kept)[:, :, None] + beta.gather(1, rest)[:, None, :]
    return kept, rest, gap, bound
