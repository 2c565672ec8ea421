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

from m3export.ops import moe as ref, routing_bound  # noqa: E402
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
def test_prefill_sized_fp32_tokens_keep_the_reference_matmul():
    # The tensor-core path is for 16-bit x and an fp32 router; anything else at prefill sizes is the reference's.
    x, w = _case(moe_routing.LOGITS_KERNEL_MAX_T + 1, 6, 64, torch.float32, torch.float32)
    assert torch.equal(moe_routing._logits(x, w), x.float() @ w.float().t())
    xb, wb = _case(moe_routing.LOGITS_KERNEL_MAX_T + 1, 6, 64, torch.bfloat16, torch.bfloat16)
    assert torch.equal(moe_routing._logits(xb, wb), xb.float() @ wb.float().t())


def _truncated_bf16(v: torch.Tensor) -> torch.Tensor:
    """The top 8 significant bits of fp32 values (the low 16 bits of the pattern cleared), in float64."""
    return (v.float().contiguous().view(torch.int32) & -65536).view(torch.float32).double()


def _tc_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``routing_bound.tc_logit_bound`` of what ``_router_logits_tc`` multiplies: the weight's three parts and, for
    fp16 x, x's two (top 8 / low 3 significant bits, as the kernel splits it)."""
    parts = moe_routing.split_router_weight(w).double()
    if x.dtype == torch.float16:
        hi = _truncated_bf16(x)
        return routing_bound.tc_logit_bound(torch.stack([hi, x.double() - hi]), parts, x_parts=2)
    return routing_bound.tc_logit_bound(x.double(), parts)


def test_split_router_weight_is_exact():
    """w_hi + w_mid + w_lo == w bit for bit (float64 sums of three bf16 values: exact) for ordinary, tiny, huge and
    subnormal weights on bf16's grid; off it (fp32 subnormals with bits below 2^-133) less than 2^-133 lost;
    inf / NaN in w_hi alone."""
    g = torch.Generator().manual_seed(0)
    big = torch.finfo(torch.float32).max
    grid = torch.arange(1, 300, dtype=torch.float64) * 2.0 ** -133  # multiples of 2^-133 up to past 2^-126
    w = torch.cat([
        torch.randn(4000, generator=g) * 0.05,
        torch.randn(500, generator=g) * 2.0 ** -100,  # tiny, normal: |w| >= 2^-110 mostly (asserted below)
        torch.tensor([big, -big, big * (1 - 2.0 ** -20), 2.0 ** 127 * 1.99999, 1.0, -1.0, 0.0, -0.0,
                      1 + 2.0 ** -23, 2.0 ** -110 * (1 + 2.0 ** -23), 2.0 ** -126, -(2.0 ** -126) * 1.5]),
        grid.float(), -grid.float(),  # fp32 subnormals (and the first normals) on bf16's grid
        torch.rand(1000, generator=g) * 2.0 ** -30 - 2.0 ** -31,  # random bits, all 24
    ]).reshape(-1, 1)
    w = w[(w.abs() >= 2.0 ** -110) | (w == 0) | ((w.double() / 2.0 ** -133).frac() == 0)].reshape(1, -1)
    parts = moe_routing.split_router_weight(w)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, *w.shape)
    assert torch.equal(parts.double().sum(0), w.double())
    assert torch.equal(parts[0].double().abs() + parts[1].double().abs() + parts[2].double().abs(), w.double().abs())
    # Off bf16's grid: fp32 subnormals below 2^-133's multiples keep what bf16 can hold.
    off = (torch.arange(1, 2000, 7, dtype=torch.int32)).view(torch.float32).reshape(1, -1)  # 7 x 2^-149, ...
    lost = (moe_routing.split_router_weight(off).double().sum(0) - off.double()).abs()
    assert (lost < moe_routing.SPLIT_FLOOR).all() and (lost > 0).any()
    special = torch.tensor([[float("inf"), -float("inf"), float("nan"), 0.5]])
    sp = moe_routing.split_router_weight(special).float()
    assert sp[0, 0, 0] == float("inf") and sp[0, 0, 1] == -float("inf") and sp[0, 0, 2].isnan()
    assert (sp[1:, 0, :3] == 0).all() and sp[:, 0, 3].tolist() == [0.5, 0.0, 0.0]


@cpu_only
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_prefill_logits_within_the_tensor_core_bound(x_dtype):
    # 130 tokens (a second, partial 128-row tile), 20 experts (a 32-wide tile, 12 masked), H = 200 (a partial K
    # step). Weights with all 24 bits in use (randn), so all three parts carry bits.
    x, w = _case(130, 20, 200, x_dtype, torch.float32, seed=7, tie_rows=((1, 17),))
    got = moe_routing._logits(x, w)
    exact = x.double() @ w.double().t()
    assert got.dtype == torch.float32 and got.shape == (130, 20)
    assert ((got.double() - exact).abs() <= _tc_bound(x, w)).all()
    assert torch.equal(got[:, 1], got[:, 17])  # identical rows, the same operations: an exact tie
    assert ((got.double() - exact).abs() > 0).any()  # not vacuous: some sums rounded


@cpu_only
def test_prefill_split_is_cached_per_weight_and_version():
    x, w = _case(70, 8, 64, torch.bfloat16, torch.float32, seed=2)
    first = moe_routing._split_cached(w)
    assert moe_routing._split_cached(w) is first
    with torch.no_grad():
        w.mul_(2)  # an in-place update (a new version): a new split, and the logits follow it
    assert moe_routing._split_cached(w) is not first
    exact = x.double() @ w.double().t()
    assert ((moe_routing._logits(x, w).double() - exact).abs() <= _tc_bound(x, w)).all()


@cpu_only
def test_prefill_nonfinite_router_weights_as_the_reference():
    x, w = _case(70, 8, 64, torch.bfloat16, torch.float32, seed=4)
    w[2, 5] = float("inf")
    w[3, 9] = float("nan")
    x[0, 5] = 0.0  # 0 x inf: NaN in both
    got, want = moe_routing._logits(x, w), x.float() @ w.float().t()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[want.isinf()], want[want.isinf()])


@cpu_only
def test_prefill_tokens_route_as_the_reference():
    # 96 tokens over 32 experts, top-4, experts 3 and 20 identical (a tie on every token: the lower id first, as
    # the reference's stable sort). Tokens where another pair of scores is within the tensor-core rule (a near tie,
    # which either order may resolve) are left out; every other choice must equal the reference's.
    x, w = _case(96, 32, 256, torch.bfloat16, torch.float32, seed=5, tie_rows=((3, 20),))
    bias = torch.randn(32, generator=torch.Generator().manual_seed(6)) * 0.05
    bias[20] = bias[3]
    x64, w64, b64 = x.double(), w.double(), bias.double()
    beta = routing_bound.fp32_score_bounds(x64, w64, b64, tensor_cores=True)
    _, _, gap, bound = routing_bound.swap_pairs(torch.sigmoid(x64 @ w64.t()) + b64, beta, 4)
    clear = ~((gap > 0) & (gap <= bound)).flatten(1).any(-1)
    assert clear.sum() >= 80
    ids, weights = moe_routing.route(x, w, bias, 4)
    want_ids, want_w = ref.route(x, w, bias, 4)
    assert torch.equal(ids.long()[clear], want_ids[clear])
    assert ((ids == 3).any(-1) | ~(ids == 20).any(-1)).all()  # 20 only ever chosen with (after) 3
    assert ((ids == 20).any(-1)).any()
    torch.testing.assert_close(weights[clear], want_w[clear], rtol=1e-6, atol=0)  # logits within the bound: ulps


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
def test_gpu_prefill_router_logits_at_mini_dims():
    """The tensor-core path at the benchmark's shape (16k tokens, H = 6144, 128 experts): within the bound that
    ``moe_routing``'s docstring derives for truncating adders of any block width, against float64 and (with the
    IEEE bound added) against cuBLAS's fp32 GEMM, the expression it replaces; identical rows tie exactly."""
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(16384, 6144, device="cuda", generator=g).bfloat16()
    w = torch.randn(128, 6144, device="cuda", generator=g) / 6144 ** 0.5
    w[70] = w[3]
    got = moe_routing._logits(x, w)
    exact = x.double() @ w.double().t()
    bound = _tc_bound(x, w)
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), (err / bound).max().item()
    cublas = x.float() @ w.t()
    assert ((got.double() - cublas.double()).abs() <= bound + _bound(x, w)).all()
    assert torch.equal(got[:, 3], got[:, 70])
