"""The modules a rank runs in place of the single-GPU ones: same parameter names, local shapes, one collective.

Each is a subclass of the module it replaces, built from the rank's local config (``ParallelConfig.local_config``),
so parameter names, the checkpoint mapping and the ops' calls are unchanged; only the output is combined:

- ``RowParallelLinear`` (``o_proj``): the rank's heads' share of K, then all-reduce (sum).
- ``TensorParallelMLP`` (dense MLP): gate/up column parallel, down row parallel, then all-reduce.
- ``TensorParallelMoE``: routed experts' and shared expert's intermediate dims split; ``m3::moe`` on the rank's
  slices gives the rank's partial sum of ``routed * scaling + shared``; one all-reduce.
- ``ExpertParallelMoE``: the rank owns whole experts ``[first, first + n)``; the router (replicated, fp32) scores
  every expert on every rank, so each rank computes the same top-k and adds only its own experts' contributions;
  the shared expert is tensor parallel; one all-reduce of the partial sums combines them. ``m3::moe`` takes the
  whole expert stack, so this one calls the reference's loop restricted to its experts (CPU) or the MoE kernels'
  launcher with ``owned`` (CUDA); the op itself is unchanged.
- ``VocabParallelLMHead``: each rank scores its rows of the vocabulary, all-gather along the vocabulary.

Collectives use ``torch.distributed`` on ``group`` (None: the default group); NCCL on GPUs, gloo on CPU.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from ..config import M3Config
from ..model import fusion
from ..model.linear import Linear
from ..model.mlp import DenseMLP, Experts, MoE
from ..ops import mxfp8 as mx
from ..ops.moe import _moe


def all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``t`` over the group's ranks, in place (every rank gets the same bits: ring reduce + broadcast)."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def all_gather_last(t: torch.Tensor, group) -> torch.Tensor:
    """The ranks' ``t`` [..., n] concatenated in rank order along the last dimension -> [..., n * world]."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class SummedOverRanks:
    """Mixin: the module's output is this rank's partial sum; return the sum over the ranks of ``group``."""

    group = None  # the process group of the collectives; None: the default group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x), self.group)


class RowParallelLinear(SummedOverRanks, Linear):
    """``o_proj``: the input features of the rank's heads."""


class TensorParallelMLP(SummedOverRanks, DenseMLP):
    """Dense MLP with the rank's share of the intermediate columns."""


class TensorParallelMoE(SummedOverRanks, MoE):
    """MoE block with the rank's share of every routed expert's and the shared expert's intermediate columns."""


class ExpertParallelMoE(MoE):
    """Experts ``first .. first + num_experts - 1`` of the global stack; router and shared expert as in ``MoE``."""

    group = None  # as SummedOverRanks

    def __init__(self, cfg: M3Config, mxfp8: bool, first: int, num_experts: int):
        super().__init__(cfg, mxfp8)
        self.experts = Experts(dataclasses.replace(cfg, num_local_experts=num_experts), mxfp8)
        self.owned = range(first, first + num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, ex, sh, lo, dt = self.cfg, self.experts, self.shared_experts, self.owned.start, x.dtype
        if fusion.kernels_serve(x):  # the m3::moe kernels, told which experts are this rank's (no host sync)
            from m3export.plugins.kernels.moe import run_moe

            scales = ((ex.w13_scale_inv, ex.w2_scale_inv, sh.gate_up_proj.weight_scale_inv,
                       sh.down_proj.weight_scale_inv) if ex.mxfp8 else (None,) * 4)
            out = run_moe(x, self.gate.weight, self.gate.e_score_correction_bias, ex.w13, ex.w2,
                          sh.gate_up_proj.weight, sh.down_proj.weight, c.num_experts_per_tok, c.routed_scaling_factor,
                          c.swiglu_alpha, c.swiglu_limit, scales=scales, owned=(lo, len(self.owned)))
            return all_reduce(out, self.group)
        if ex.mxfp8:
            def expert(e):
                return (mx.dequantize(ex.w13[e - lo], ex.w13_scale_inv[e - lo], dt),
                        mx.dequantize(ex.w2[e - lo], ex.w2_scale_inv[e - lo], dt))

            def shared():
                return (mx.dequantize(sh.gate_up_proj.weight, sh.gate_up_proj.weight_scale_inv, dt),
                        mx.dequantize(sh.down_proj.weight, sh.down_proj.weight_scale_inv, dt))
        else:
            def expert(e):
                return ex.w13[e - lo].to(dt), ex.w2[e - lo].to(dt)

            def shared():
                return sh.gate_up_proj.weight.to(dt), sh.down_proj.weight.to(dt)
        out = _moe(x, self.gate.weight, self.gate.e_score_correction_bias, expert, shared, c.num_experts_per_tok,
                   c.routed_scaling_factor, c.swiglu_alpha, c.swiglu_limit, owned=self.owned)
        return all_reduce(out, self.group)


class VocabParallelLMHead(nn.Linear):
    """``lm_head`` with the rank's rows of the vocabulary; the logits of all ranks gathered."""

    group = None  # as SummedOverRanks

    def __init__(self, hidden: int, vocab_per_rank: int):
        super().__init__(hidden, vocab_per_rank, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather_last(super().forward(x), self.group)
