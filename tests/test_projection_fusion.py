"""Projection fusion (``m3export.model.linear.FusedLinears``, ``Attention.fuse_projections``): a layer's q, k, v
(+ index q, index k) projections as one product over one buffer, the members' parameters views into it.

Without a GPU the Triton launcher runs under the interpreter (``TRITON_INTERPRET=1``, CPU tensors) and the model's
fused path is forced on (``fusion.use_fused_kernels``, as on CUDA with the kernels active);
``tests/test_projection_fusion_gpu.py`` runs the compiled kernels at ``mini`` dims.

Exactness. Each output column of a fused product is the dot of the same weight row with the same input row, so
it equals the member's column wherever the product's K loop does not depend on N: the ``m3::mxfp8_linear``
kernels (their tiles are chosen from the row count alone; a column's sum is the same loop whichever N tile holds
it), which is asserted bit for bit. A BLAS ``F.linear`` / the CPU reference may in principle block K differently
for another N; the model test therefore bounds its logits as the fused-norm model test does (summation-order
differences of a few products carried through the tiny model: 1e-4) and asks for the same greedy tokens.
"""

from __future__ import annotations

import os

import pytest
import torch

_INTERPRET = not torch.cuda.is_available()
if _INTERPRET:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from m3export.model.linear import FusedLinears, Linear  # noqa: E402
from m3export.ops import mxfp8  # noqa: E402
from m3export.plugins.kernels import mxfp8_linear as linear_kernel  # noqa: E402

cpu_only = pytest.mark.skipif(not _INTERPRET, reason="CPU tensors run the kernels only under TRITON_INTERPRET=1")
SIZES = (40, 17, 24, 8, 33)  # output widths that are not multiples of any N tile: members straddle tiles


def _linears(mxfp8_weights: bool, k: int = 96, dtype=torch.float32, seed: int = 0) -> list[Linear]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in SIZES:
        lin = Linear(k, n, mxfp8_weights)
        w = torch.randn(n, k, generator=g)
        if mxfp8_weights:
            q, s = mxfp8.quantize(w)
            lin.weight.data.copy_(q)
            lin.weight_scale_inv.data.copy_(s)
        else:
            lin.weight.data = w.to(dtype)
        lin.requires_grad_(False)
        out.append(lin)
    return out


def _params(linears):
    return [p for lin in linears for p in lin.parameters()]


@cpu_only
@pytest.mark.parametrize("rows", [1, 5], ids=["gemv", "tiles"])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_mxfp8_kernel_columns_equal_the_members(dt, rows):
    """One launch over the concatenated E4M3 weights + UE8M0 scales = each member's own launch, bit for bit: the
    one-row GEMV tile (``gemv_config``) and the tensor-core tiles (``tile_config``), members not aligned to tiles."""
    linears = _linears(True)
    x = torch.randn(rows, 96).to(dt)
    separate = [linear_kernel.run_linear(x, lin.weight, lin.weight_scale_inv) for lin in linears]
    fused = FusedLinears(linears)
    y = linear_kernel.run_linear(x, *fused.buffers)
    for want, (a, b) in zip(separate, fused.bounds, strict=True):
        assert torch.equal(y[:, a:b], want)


@pytest.mark.parametrize("mxfp8_weights", [True, False], ids=["mxfp8", "fp32"])
def test_members_become_views_of_one_buffer(mxfp8_weights):
    """After fusing, every member parameter is the same Parameter object, holds the same values, and lies inside
    the one buffer (no second copy: the bytes of distinct storages are those of the parameters before)."""
    linears = _linears(mxfp8_weights)
    before = [(p, p.detach().clone()) for p in _params(linears)]
    bytes_before = sum(p.numel() * p.element_size() for p in _params(linears))
    fused = FusedLinears(linears)
    assert [p for p, _ in before] == _params(linears)  # the same objects: modules, hooks and state dicts see them
    for p, value in before:
        assert torch.equal(p, value)
    storages = {}
    for lin in linears:
        for p, buf in zip([lin.weight, lin.weight_scale_inv] if mxfp8_weights else [lin.weight], fused.buffers):
            start, end = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
            assert start <= p.data_ptr() and p.data_ptr() + p.numel() * p.element_size() <= end
            assert p.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    for p in _params(linears):
        storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    assert sum(storages.values()) == bytes_before
    assert fused.intact()
    linears[1].weight.data = linears[1].weight.data.clone()  # new storage for one member: the fusion is over
    assert not fused.intact()


@pytest.mark.parametrize("mxfp8_weights", [True, False], ids=["mxfp8", "fp32"])
@pytest.mark.parametrize("rows", [1, 3])
def test_fused_call_equals_the_members(mxfp8_weights, rows):
    """``FusedLinears(x)`` (the op / ``F.linear`` over the buffer, then column views) against each member's own
    call, at one row (contiguous views) and three (views with row stride sum N): same shapes, values within the
    summation-order bound of the CPU products (fp32: K = 96 products, relative 2 K 2^-24 of sum |x w|)."""
    linears = _linears(mxfp8_weights)
    x = torch.randn(rows, 96)
    separate = [lin(x) for lin in linears]
    bound = 2 * 96 * 2.0**-24 * max((x.abs() @ lin.weight.float().abs().t()).max().item() for lin in linears)
    if mxfp8_weights:  # weights dequantised: bound on the dequantised magnitudes
        bound = 2 * 96 * 2.0**-24 * max(
            (x.abs() @ mxfp8.dequantize(lin.weight, lin.weight_scale_inv, torch.float32).abs().t()).max().item()
            for lin in linears)
    parts = FusedLinears(linears)(x)
    for want, got in zip(separate, parts, strict=True):
        assert got.shape == want.shape
        assert got.stride() == (sum(SIZES), 1) or rows == 1
        torch.testing.assert_close(got, want, rtol=0, atol=bound)


def test_fusion_refuses_mixed_members():
    a, b = Linear(32, 8), Linear(64, 8)
    with pytest.raises(ValueError, match="input width"):
        FusedLinears([a, b])
    with pytest.raises(ValueError, match="weight format"):
        FusedLinears([Linear(32, 8), Linear(32, 8, mxfp8=True)])


@pytest.mark.parametrize("mxfp8_weights,with_engine", [(False, True), (True, False)], ids=["fp32", "mxfp8"])
def test_model_with_fused_projections(monkeypatch, mxfp8_weights, with_engine):
    """The tiny model (dense and sparse layers, an MTP module) with the fused path forced on: the runtime step's
    logits (5 rows each of 2 sequences: strided column views; one row: contiguous ones) and, in fp32, the engine's
    greedy tokens with MTP speculation are those of the same model without fused projections; the state dict is
    unchanged (keys and values) and only the fused path reads the buffer (the plain path stays the same ops)."""
    import m3export
    import m3export.model.fusion as fusion
    from m3export.model.batch import Batch
    from m3export.runtime import Engine, SamplingParams
    from m3export.runtime.backends.torch_backend import TorchBackend

    model = m3export.load_model("tiny", mxfp8=mxfp8_weights)
    prompts = [list(range(1, 7)), [40]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ids = torch.tensor([list(range(3, 8)), list(range(20, 25))])

    def run():
        eng = Engine(TorchBackend(model), None, page_size=4, num_pages=32, max_model_len=64,
                     num_speculative_tokens=1)
        tokens = [o.token_ids for o in eng.generate(prompts, params)] if with_engine else None
        logits = [model.step(i.reshape(-1), Batch.contiguous(*i.shape, 4, "cpu"),
                             model.allocate_caches(6, 4, torch.float32, "cpu")).logits for i in (ids, ids[:1, :1])]
        return tokens, logits

    plain_forward = model(ids)  # the plain path (the CPU: no fused kernels)
    use_fused_kernels = fusion.use_fused_kernels
    monkeypatch.setattr(fusion, "use_fused_kernels", lambda x, inplace: inplace)
    plain_tokens, plain_logits = run()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.fuse_projections()
    attn = [layer.self_attn for layer in model.model.layers] + [m.transformer_layer.self_attn for m in model.mtp]
    assert all(a.fused_projections is not None and a.fused_projections.intact() for a in attn)
    assert len(attn[0].fused_projections.bounds) == 3 and len(attn[1].fused_projections.bounds) == 5
    calls = []
    real = FusedLinears.__call__
    monkeypatch.setattr(FusedLinears, "__call__", lambda self, x: calls.append(x.shape[0]) or real(self, x))
    tokens, logits = run()
    assert tokens == plain_tokens
    torch.testing.assert_close(logits, plain_logits, rtol=1e-4, atol=1e-4)  # see the module docstring
    assert 1 in calls and max(calls) > 1  # decode rows (contiguous views) and prefill rows (strided views)
    after = model.state_dict()
    assert list(after) == list(state) and all(torch.equal(after[k], v) for k, v in state.items())
    calls.clear()
    monkeypatch.setattr(fusion, "use_fused_kernels", use_fused_kernels)
    assert torch.equal(model(ids), plain_forward) and not calls  # the plain path: the members' own products
