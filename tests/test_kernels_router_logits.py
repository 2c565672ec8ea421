"""The fused router logits of ``plugins/kernels/moe_routing.py`` (``_router_logits``: the 16-bit x and the fp32 or
bf16 router weight read as they are, one launch instead of a cast and cuBLAS's fp32 GEMV) against the exact
logits in float64 of the same inputs, within the bound the module derives for any fp32 summation of the H
products: gamma_(H+1) * sum_h |x_h w_h| (u = 2^-24). cuBLAS's / the CPU's fp32 matmul (the reference's
expression) meets the same bound, and experts with identical router rows get identical logits. The CPU tests
run the kernel under the Triton interpreter; the ``gpu`` test runs it compiled at the ``mini`` preset's
H = 6144 and E = 128."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (the [gpu] extra)")
import triton  # noqa: E402

from m3export.ops import moe as ref  # noqa: E402
from m3export.plugins.kernels import moe_routing  # noqa: E402

INTERPRETED = bool(triton.knobs.runtime.interpret)
cpu_only = pytest.mark.skipif(not INTERPRETED, reason="TRITON_INTERPRET=0 in this process: CPU tensors cannot run")
U = 2.0 ** -24  # fp32 unit roundoff


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """gamma_(H+1) * sum_h |x_h w_h| per (token, expert): any fp32 sum of the H products (each exact or rounded
    once, or fused into its add), in any order, is this close to the exact sum (Higham, Accuracy and Stability,
    Lemma 3.1 / eq. 3.5, with one more rounding for the product)."""
    n = x.shape[1] + 1
    gamma = n * U / (1 - n * U)
    return gamma * (x.double().abs() @ w.double().abs().t())


def _case(t, e, h, x_dtype, w_dtype, seed=0, tie_rows=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(x_dtype)
    w = (torch.randn(e, h, generator=g) * 0.05).to(w_dtype)
    for a, b in tie_rows:
        w[b] = w[a]
    return x, w


@cpu_only
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["fp32-router", "bf16-router"])
@pytest.mark.parametrize("t,e,h", [(1, 7, 600), (5, 13, 2100)])  # H past one 2048 step, odd E and H
def test_router_logits_within_the_fp32_summation_bound(t, e, h, w_dtype):
    x, w = _case(t, e, h, torch.bfloat16, w_dtype, seed=t + e, tie_rows=((1, 4),))
    got = moe_routing._logits(x, w)
    exact = x.double() @ w.double().t()
    bound = _bound(x, w)
    assert got.dtype == torch.float32 and got.shape == (t, e)
    assert ((got.double() - exact).abs() <= bound).all()
    assert ((x.float() @ w.float().t()).double() - exact).abs().le(bound).all()  # the reference's own expression
    assert torch.equal(got[:, 1], got[:, 4])  # identical rows, the same summation order: an exact tie


@cpu_only
def test_prefill_sized_logits_are_the_reference_matmul():
    x, w = _case(moe_routing.LOGITS_KERNEL_MAX_T + 1, 6, 64, torch.bfloat16, torch.float32)
    assert torch.equal(moe_routing._logits(x, w), x.float() @ w.float().t())


@cpu_only
def test_bf16_tokens_route_as_the_reference():
    x, w = _case(4, 64, 256, torch.bfloat16, torch.float32, seed=3)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(4)) * 0.05
    ids, weights = moe_routing.route(x, w, bias, 4)
    want_ids, want_w = ref.route(x, w, bias, 4)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=0)  # sigmoid of logits within the bound: ulps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
@pytest.mark.parametrize("t", [1, 8, 64])
def test_gpu_router_logits_at_mini_dims(t):
    x, w = _case(t, 128, 6144, torch.bfloat16, torch.float32, seed=t, tie_rows=((3, 70),))
    x, w = x.cuda(), w.cuda()
    got = moe_routing._logits(x, w)
    exact = x.double() @ w.double().t()
    assert ((got.double() - exact).abs() <= _bound(x, w)).all()
    assert torch.equal(got[:, 3], got[:, 70])
    bias = (torch.randn(128, generator=torch.Generator().manual_seed(5)) * 0.05).cuda()
    ids, _ = moe_routing.route(x, w, bias, 4)
    want_ids, _ = ref.route(x, w, bias, 4)  # cuBLAS's fp32 GEMV: another order, within the same bound
    assert torch.equal(ids.long(), want_ids)
