"""The fused residual add + RMSNorm kernel (``plugins/kernels/rms_norm.py``) against the model's plain ops
(``residual + x`` and ``RMSNorm.forward``) and a float64 oracle, and the model with it against the plain path.

Without a GPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors), set here before
anything imports the kernel modules; ``tests/test_kernels_rms_norm_gpu.py`` runs it compiled at ``mini`` dims.

Bounds. The residual sum is one fp32 add of two values of the activation dtype rounded to that dtype, as
PyTorch's ``h + a`` does: bit-exact. The norm repeats every rounding of ``RMSNorm.forward`` except the order in
which the fp32 squares are summed. For N positive terms the sum in any order is within (N - 1) u of the exact sum
(u = 2^-24, first order: every partial sum is at most the total); rsqrt halves that relative error, so the two
fp32 results differ by at most (N + 4) u relative (the + 4: the rsqrt and the products, each a few u at most
apart). Below one unit of the 16-bit dtype (bf16 2^-8, fp16 2^-11 relative) for N <= 6144, two values that close
round to the same or to adjacent 16-bit numbers: one unit in the last place of the output. Near that, almost every
element is bit-equal (the sums rarely differ, and a difference rarely crosses a rounding boundary): >= 99 %.
"""

from __future__ import annotations

import os

import pytest
import torch

_INTERPRET = not torch.cuda.is_available()
if _INTERPRET:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from m3export.model.norm import RMSNorm  # noqa: E402
from m3export.plugins.kernels.rms_norm import add_rms_norm  # noqa: E402

DEVICE = "cpu" if _INTERPRET else "cuda"
U = 2.0**-24
PRECISION = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}  # significand bits


def ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` numbers at |v| (float64), at least the spacing of its smallest normal numbers."""
    _, e = torch.frexp(v.double().abs())  # |v| = m 2^e, m in [0.5, 1)
    low = {torch.bfloat16: -133, torch.float16: -24, torch.float32: -149}[dtype]
    return torch.exp2((e - PRECISION[dtype]).clamp(min=low).double())


def assert_within_norm_bound(got: torch.Tensor, want: torch.Tensor, n: int) -> None:
    """``got`` (kernel) against ``want`` (the plain ops) under the module docstring's bound for rows of ``n``."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.double(), want.double()
    if got.dtype == torch.float32:
        assert ((g - w).abs() <= (n + 4) * U * w.abs()).all()
        return
    assert ((g - w).abs() <= ulp(torch.maximum(g.abs(), w.abs()), got.dtype)).all()
    assert (got == want).float().mean().item() >= 0.99


def oracle(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the (already rounded) residual h in float64: the exact value both roundings approximate."""
    hd = h.double()
    return hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight.double())


def _case(rows, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(n, 1e-6)
    norm.weight.data = (torch.randn(n, generator=gen) * 0.3).to(dtype)  # the model's weights are in its dtype
    x = (torch.randn(rows, n, generator=gen) * 2).to(dtype)
    residual = (torch.randn(rows, n, generator=gen) * 5).to(dtype)
    return norm, x, residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n", [(1, 6144), (5, 6144), (3, 37), (7, 100), (2, 1)])
def test_add_rms_norm_matches_the_plain_ops(dtype, rows, n):
    """The release's hidden width (one block, decode's one row and a few), odd widths that are not a power of
    two, a width of one; the residual sum bit-exact, the norm within the bound (module docstring)."""
    norm, x, residual = _case(rows, n, dtype, seed=rows * 1000 + n)
    normed, h = add_rms_norm(x.to(DEVICE), residual.to(DEVICE), norm.weight.data.to(DEVICE), norm.eps)
    want_h = residual + x
    assert torch.equal(h.cpu(), want_h)
    assert_within_norm_bound(normed.cpu(), norm(want_h), n)
    # the float64 oracle: one rounding to the dtype (half a unit) after fp32 work within (n + 4) u
    exact = oracle(want_h, norm.weight.data, norm.eps)
    err = (normed.cpu().double() - exact).abs()
    assert (err <= 0.5 * ulp(exact, dtype) + (n + 8) * U * exact.abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_residual_norms_x_and_returns_it(dtype):
    norm, x, _ = _case(4, 96, dtype, seed=3)
    xd = x.to(DEVICE)
    normed, h = add_rms_norm(xd, None, norm.weight.data.to(DEVICE), norm.eps)
    assert h is xd
    assert_within_norm_bound(normed.cpu(), norm(x), 96)


def test_strided_rows_leading_dims_and_no_rows():
    """Rows of a wider buffer (row stride > N), a [2, 3, N] input, a non-contiguous residual, zero rows."""
    norm, x, residual = _case(6, 48, torch.bfloat16, seed=11)
    w = norm.weight.data.to(DEVICE)
    wide = torch.zeros(6, 80, dtype=torch.bfloat16)
    wide[:, 16:64] = x
    xs = wide.to(DEVICE)[:, 16:64]
    rs = residual.t().contiguous().t().to(DEVICE)  # column-major storage: last dimension not contiguous
    normed, h = add_rms_norm(xs, rs, w, norm.eps)
    assert torch.equal(h.cpu(), residual + x)
    assert_within_norm_bound(normed.cpu(), norm(residual + x), 48)
    normed3, h3 = add_rms_norm(x.view(2, 3, 48).to(DEVICE), residual.view(2, 3, 48).to(DEVICE), w, norm.eps)
    assert normed3.shape == h3.shape == (2, 3, 48)
    assert torch.equal(normed3.cpu().view(6, 48), normed.cpu()) and torch.equal(h3.cpu().view(6, 48), h.cpu())
    empty = torch.zeros(0, 48, dtype=torch.bfloat16, device=DEVICE)
    normed0, h0 = add_rms_norm(empty, empty, w, norm.eps)
    assert normed0.shape == h0.shape == (0, 48)


def test_mismatched_inputs_are_refused():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, torch.zeros(2, 9, device=DEVICE), torch.zeros(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(x, torch.zeros(2, 8, dtype=torch.bfloat16, device=DEVICE), torch.zeros(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, None, torch.zeros(9, device=DEVICE), 1e-6)


def test_model_with_fused_norms_generates_the_same_tokens(monkeypatch):
    """The tiny model through the engine, MTP speculation on, with the fused norms (forced on here, as on CUDA
    with the kernels active: every decoder layer's two norms with their residual adds, the final norm, the MTP
    modules' four) against the plain ops: the same greedy tokens, fp32 (norms within ~1e-6 relative, far inside
    any greedy margin of the tiny model's random weights), and the cache-free forward's logits close (1e-4: the
    ~1e-6 differences of a few norms carried through the tiny model's layers)."""
    import m3export
    import m3export.model.fusion as fusion
    from m3export.plugins.kernels import rms_norm
    from m3export.runtime import Engine, SamplingParams
    from m3export.runtime.backends.torch_backend import TorchBackend

    model = m3export.load_model("tiny")
    prompts = [list(range(1, 6)), [40]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run():
        eng = Engine(TorchBackend(model), None, page_size=4, num_pages=32, max_model_len=64,
                     num_speculative_tokens=1)
        return [o.token_ids for o in eng.generate(prompts, params)]

    ids = torch.tensor([list(range(3, 12))])
    plain, plain_logits = run(), model(ids)
    calls = []
    real = rms_norm.add_rms_norm
    monkeypatch.setattr(rms_norm, "add_rms_norm", lambda *a: calls.append(a[1] is not None) or real(*a))
    monkeypatch.setattr(fusion, "use_fused_kernels", lambda x, inplace: inplace)
    assert run() == plain
    torch.testing.assert_close(model(ids), plain_logits, rtol=1e-4, atol=1e-4)
    assert any(calls) and not all(calls)  # norms with a residual add (layers, final) and without (MTP's enorm)
