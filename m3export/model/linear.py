"""A bias-free linear layer whose weight is either floating point or MXFP8 (E4M3 + UE8M0 per 32 along K), and
``FusedLinears``: several of them that read one input, run as one product over one weight buffer."""

from __future__ import annotations

import itertools

import torch
from torch import nn


class Linear(nn.Module):
    """Parameter names follow the checkpoint (``weight``, ``weight_scale_inv``) so loading is a rename."""

    def __init__(self, in_features: int, out_features: int, mxfp8: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.mxfp8 = in_features, out_features, mxfp8
        if mxfp8:
            self.weight = nn.Parameter(
                torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn), requires_grad=False
            )
            self.weight_scale_inv = nn.Parameter(
                torch.empty(out_features, in_features // 32, dtype=torch.uint8), requires_grad=False
            )
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mxfp8:
            return torch.ops.m3.mxfp8_linear(x, self.weight, self.weight_scale_inv)
        return nn.functional.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}{', mxfp8' if self.mxfp8 else ''}"


class FusedLinears:
    """Linears that read one input, run as one product: ``linears``' weights concatenated along N in one buffer
    (MXFP8: the UE8M0 scales in a second one, concatenated the same way), each member's ``weight`` /
    ``weight_scale_inv`` made a view into it.

    Why: at decode a projection is a GEMV bound by its weight stream, and the small ones (k, v, index keys: a few
    hundred KB each at ``mini`` width) are mostly launch latency and ramp; one launch over the concatenation streams
    the same bytes once. Memory does not grow: the buffer replaces the members' own storage (freed here), and since
    the members' parameters are views, the state dict, export, ``load_state_dict`` and every plain path read and
    write the same bytes. Each output column is the same dot product of the same row with the same input, so the
    fused output's columns equal the members' outputs wherever the product's tiling does not depend on N (the
    ``m3::mxfp8_linear`` kernels and references; a BLAS ``F.linear`` may pick another blocking for another N).

    Not an ``nn.Module`` and not a registered buffer: the state dict stays the members'. Anything that gives a
    member new storage (``.to(...)``, assigning a parameter) ends the fusion; ``intact`` tells, and callers then run
    the members one by one.
    """

    def __init__(self, linears: list[Linear]):
        first = linears[0]
        for lin in linears:
            if type(lin).forward is not Linear.forward:
                raise TypeError(f"FusedLinears: {type(lin).__name__} has its own forward; only plain Linears fuse")
            if (lin.in_features, lin.mxfp8) != (first.in_features, first.mxfp8):
                raise ValueError("FusedLinears: members must share the input width and the weight format")
            if (lin.weight.dtype, lin.weight.device) != (first.weight.dtype, first.weight.device):
                raise ValueError("FusedLinears: members must share the weight dtype and device")
        self.linears = list(linears)
        self.mxfp8 = first.mxfp8
        ends = list(itertools.accumulate(lin.out_features for lin in linears))
        self.bounds = list(zip([0] + ends[:-1], ends))  # each member's rows of the buffer / columns of the output
        names = ("weight", "weight_scale_inv") if self.mxfp8 else ("weight",)
        self.buffers = [self._concatenate(name) for name in names]
        self._views = [(lin, name, getattr(lin, name).data_ptr()) for lin in self.linears for name in names]

    def _concatenate(self, name: str) -> torch.Tensor:
        """One buffer for parameter ``name`` of every member; each member's parameter becomes its rows' view."""
        params = [getattr(lin, name) for lin in self.linears]
        buf = torch.empty((self.bounds[-1][1], *params[0].shape[1:]), dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            for p, (a, b) in zip(params, self.bounds):
                buf[a:b].copy_(p)
                p.data = buf[a:b]  # the same Parameter object (hooks, references to it), the buffer's storage
        return buf

    def intact(self) -> bool:
        """Whether every member's parameters are still the views made here."""
        return all(getattr(lin, name).data_ptr() == ptr for lin, name, ptr in self._views)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [..., K] -> each member's output, as column views of one [..., sum N] product (not contiguous when
        there is more than one row: the row stride is sum N)."""
        if self.mxfp8:
            y = torch.ops.m3.mxfp8_linear(x, *self.buffers)
        else:
            y = nn.functional.linear(x, self.buffers[0])
        return [y[..., a:b] for a, b in self.bounds]
