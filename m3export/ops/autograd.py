"""Gradients for the differentiable ``m3`` ops, so training runs through the very modules that inference runs.

The ops are opaque to autograd (``torch.library.custom_op``). Their pure-PyTorch references are differentiable,
so the backward of each op recomputes its reference under autograd from the saved inputs and back-propagates
through it (activation recomputation, as in gradient checkpointing): the gradient is by construction that of
the definition of truth, whatever kernel ran the forward. ``m3::lightning_indexer`` returns block ids and has no
gradient; the MXFP8 ops hold frozen E4M3 weights and are inference only.
"""

from __future__ import annotations

import torch

from .attention import paged_attention_reference, sparse_paged_attention_reference
from .moe import moe_reference


def _register(op: str, reference, n_inputs: int) -> None:
    def setup_context(ctx, inputs, output):
        ctx.tensor_at = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
        ctx.others = {i: a for i, a in enumerate(inputs) if not isinstance(a, torch.Tensor)}
        ctx.save_for_backward(*(inputs[i] for i in ctx.tensor_at))

    def backward(ctx, grad):
        args: list = [None] * n_inputs
        for i, v in ctx.others.items():
            args[i] = v
        wanted = []
        for i, t in zip(ctx.tensor_at, ctx.saved_tensors):
            need = ctx.needs_input_grad[i] and t.is_floating_point()
            args[i] = t.detach().requires_grad_(need)
            if need:
                wanted.append(i)
        grads: list = [None] * n_inputs
        if wanted:
            with torch.enable_grad():
                out = reference(*args)
            for i, g in zip(wanted, torch.autograd.grad(out, [args[i] for i in wanted], grad, allow_unused=True)):
                grads[i] = g
        return tuple(grads)

    torch.library.register_autograd(op, backward, setup_context=setup_context)


_register("m3::paged_attention", paged_attention_reference, 10)
_register("m3::sparse_paged_attention", sparse_paged_attention_reference, 12)
_register("m3::moe", moe_reference, 11)
