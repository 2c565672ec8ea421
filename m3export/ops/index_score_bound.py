"""How far an implementation's lightning-indexer score may be from the float64 one before two blocks may come out in
the other order: the one bound that the op conformance suite's near-tie rule (``ops/conformance.py``) and ``m3export
verify``'s selection comparison (``export/selection_ties.py``) both apply.

A score is a dot s = q . k of an index query and an index key of D elements (the contract, ``docs/ops.md`` §2: fp32
arithmetic on the operands as stored), and a block's score is the max of its visible keys' scores. Let A = sum_d
|q_d k_d| of the operands (exact in float64), u = 2^-24 fp32's unit roundoff, gamma_n(u) = n u / (1 - n u)
(Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., eq. (3.5) and §3.1).

1. fp32 operands, IEEE arithmetic (the CPU reference, ONNX Runtime's MatMul with TF32 off, Triton's interpreter,
   the Triton kernels' fp32 dots: ``input_precision="ieee"``, FMA in round-to-nearest): D products, each rounded
   once (or fused into the next add), and D - 1 additions in any order and blocking:
   |fl(s) - s| <= gamma_D(u) A. An FP8 pool's keys are its E4M3 bytes times an fp32 scale; that product (or the
   score times the row's scale) is one more rounding: gamma_{D+1}(u) A covers both.
2. 16-bit or FP8 operands on tensor cores (the GPU kernels' bf16 / fp16 dots; E4M3 keys widened exactly to 16
   bits): the products are exact (at most 2 x 11 significant bits), but the additions are not IEEE. NVIDIA's tensor
   cores add a block of b products to the fp32 accumulator in one multi-term adder that aligns every addend to the
   largest one's exponent and truncates what falls below the accumulator's last bit, then normalises by truncation
   (round toward zero: Fasi, Higham, Mikaitis, Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ CS 7:e330,
   2021, on V100 / T4 / A100; Khattak and Mikaitis, "Accurate models of NVIDIA tensor cores", arXiv:2512.07004, on
   H100). One truncated addend loses less than one unit in the last place of the largest addend, 2u times its
   magnitude, itself at most the block's sum of magnitudes S_j (the accumulator's |partial sum| plus the block's
   |products|); so block j errs by at most (b + 1) 2u S_j (b addends below the largest, then the result), and over
   the D / b blocks sum_j S_j <= (D / b + 1) A. In all: (D + b + D / b + 1) 2u A <= (2D + 2) 2u A for any block
   width 1 <= b <= D (b + D / b <= D + 1 there): gamma_{2D+3}(2u) A with the scale's rounding. Measured hardware
   keeps extra alignment bits and errs far less; the bound is for any block width, so no measurement of H200's
   adder enters it.
3. The float64 recomputation that judges it errs by at most gamma_D(2^-53) A (its own roundings).
4. Block max: max is 1-Lipschitz in the largest change, so a block's bound is its keys' largest (``conformance.
   block_scores64`` returns, per block, the largest A of its visible keys).

So an implementation's block score lies within beta = c A of the float64 one, c = ``dot_error_factor``, and it may
keep block b where float64 keeps a only if M_a - M_b <= beta_a + beta_b (each score moved toward the other by its own
bound; nothing more is added). Two blocks whose float64 scores are exactly equal are equal in any implementation
that computes them alike and go to the lower id: never a near tie.

Why this and not ``SCORE_SLACK * D * eps32 * (A_a + A_b)`` (the conformance rule before, SCORE_SLACK = 2, eps32 =
2u): that is 4 D u per unit of A, the tensor-core case's width (2) applied to every dtype, so fp32 operands, which
every implementation computes in IEEE arithmetic, were excused 4x further than their roundings can reach; rows a
wrong fp32 selection could hide in. Both rules are the same for 16-bit operands (up to the +3 terms).
``tests/test_index_score_bound.py`` builds an IEEE fp32 summation order that swaps two blocks whose float64 scores are
0.976 of the fp32 bound apart (a swap the rule must excuse: a bound 3 % narrower fails it), and swaps 1.3 and 3.9
bounds apart that the rule must catch (the old rule excused both).
"""

from __future__ import annotations

import torch

from .routing_bound import U32, U64, gamma


def dot_error_factor(d: int, ieee_fp32: bool) -> float:
    """c of the module docstring: an implementation's score of D-element operands is within c * sum |q_d k_d| of
    the float64 one. ``ieee_fp32``: fp32 queries and keys (IEEE arithmetic everywhere, case 1); otherwise 16-bit or
    FP8 operands, which GPU kernels multiply on tensor cores (case 2)."""
    ours = gamma(d + 1, U32) if ieee_fp32 else gamma(2 * d + 3, 2 * U32)
    return ours + gamma(d, U64)


def ieee_operands(query_dtype: torch.dtype, key_dtype: torch.dtype) -> bool:
    """Whether scores of these operand dtypes are IEEE fp32 dots in every implementation (case 1): fp32 queries and
    fp32 (not FP8) keys."""
    return query_dtype == torch.float32 and key_dtype == torch.float32
