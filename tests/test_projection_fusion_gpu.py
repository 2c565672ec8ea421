"""Projection fusion (``linear.FusedLinears``, ``Attention.fuse_projections``) compiled on a CUDA device at ``mini``
dims. Skipped without a GPU (CI); on the H200: ``python3 -m pytest -q -m gpu tests/test_projection_fusion_gpu.py``.

The fused MXFP8 product must equal the members' bit for bit (each output column is the same K loop of the same
row whichever tile holds it; ``tests/test_projection_fusion.py`` says why), so a model with fused projections and
the same model without them compute the same bits at every step: same logits, same greedy tokens, in bf16 too,
where random weights' tokens flip on any rounding difference. The fused model against the reference ops is
``tests/test_kernels_attention_gpu.py::test_mini_model_greedy_tokens_equal_with_kernels_and_references`` (its
``TorchBackend`` fuses, which that test asserts)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _mini_attention(mxfp8_weights: bool, dtype: torch.dtype):
    """A sparse ``mini`` attention layer on the GPU (q 8192, k / v 512, index q 512, index k 128 rows of 6144)
    with random weights (MXFP8: quantised from normal values, as ``m3export synth`` does)."""
    from m3export.config import preset
    from m3export.model.attention import Attention
    from m3export.ops import mxfp8

    attn = Attention(preset("mini"), sparse=True, mxfp8=mxfp8_weights).to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for lin in attn.input_projections():
            w = torch.randn(lin.out_features, lin.in_features, device="cuda", generator=gen) / lin.in_features**0.5
            if mxfp8_weights:
                q, s = mxfp8.quantize(w)
                lin.weight.copy_(q)
                lin.weight_scale_inv.copy_(s)
            else:
                lin.weight.data = w.to(dtype)
    return attn.requires_grad_(False)


@pytest.mark.parametrize("rows", [1, 4, 64, 300])  # the one-row GEMV, then the tensor-core tiles
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_mxfp8_projections_equal_the_members_bit_for_bit(dtype, rows):
    from m3export.plugins.kernels import use_on

    assert use_on("cuda")
    attn = _mini_attention(True, dtype)
    x = torch.randn(rows, 6144, device="cuda").to(dtype)
    separate = [lin(x) for lin in attn.input_projections()]
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    attn.fuse_projections()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= allocated  # the members' storage is freed, the buffer replaces it
    fused = attn.fused_projections
    assert fused.bounds[-1][1] == 8192 + 512 + 512 + 512 + 128
    for want, got in zip(separate, attn._projected_rows(x), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("rows", [1, 64])
def test_fused_bf16_projections_within_the_rounding_of_the_members(monkeypatch, rows):
    """bf16 weights: one cuBLAS GEMM over the concatenation may block K differently from the members' (another N),
    so with fp32 accumulation (reduced-precision split-K reductions off here: with them the partial sums are
    rounded to bf16 at places cuBLAS chooses, and no small bound holds) the fp32 sums s1, s2 differ by at most
    d = 2 K 2^-24 sum |x w| (K = 6144); each is then rounded once to bf16, half a unit, at most 2^-8 |s| each:
    |got - want| <= 2^-8 (|s1| + |s2|) + d <= 2^-7 |want| (1 + 2^-8) + 2 d."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)
    attn = _mini_attention(False, torch.bfloat16)
    x = torch.randn(rows, 6144, device="cuda").to(torch.bfloat16)
    separate = [lin(x) for lin in attn.input_projections()]
    attn.fuse_projections()
    for lin, want, got in zip(attn.input_projections(), separate, attn._projected_rows(x), strict=True):
        d = 2 * 6144 * 2.0**-24 * (x.float().abs() @ lin.weight.float().abs().t())
        bound = 2.0**-7 * want.float().abs() * (1 + 2.0**-8) + 2 * d
        assert ((got.float() - want.float()).abs() <= bound).all()


def test_mini_mxfp8_model_same_bits_with_and_without_fusion(monkeypatch):
    """The bf16 MXFP8 ``mini`` model (8 experts, one MTP module, random weights) through the engine with CUDA
    graphs and MTP speculation: 16 greedy tokens after a 300-token prompt, fused projections against unfused ones
    (same kernels otherwise). Equal tokens, and the cache-free step's logits equal bit for bit at one row and
    at 2 x 300 rows (strided column views)."""
    from m3export.checkpoint.loader import random_model
    from m3export.config import preset
    from m3export.model.batch import Batch
    from m3export.model.linear import FusedLinears
    from m3export.plugins.kernels import use_on
    from m3export.runtime import Engine, SamplingParams
    from m3export.runtime.backends.cuda_graph import GraphedTorchBackend

    cfg = dataclasses.replace(preset("mini"), num_local_experts=8).validate()
    model = random_model(cfg, device="cuda", dtype=torch.bfloat16, mxfp8=True, num_mtp_modules=1)
    assert use_on("cuda")
    attn = [layer.self_attn for layer in model.model.layers] + [m.transformer_layer.self_attn for m in model.mtp]
    prompt = torch.randint(0, cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 300), device="cuda")
    calls = []
    real = FusedLinears.__call__

    def counted(self, x):
        calls.append(x.shape[0])
        return real(self, x)

    def run(fused: bool):
        backend = GraphedTorchBackend(model)
        assert all(a.fused_projections is not None for a in attn)  # the backend fused them
        if not fused:
            for a in attn:
                a.fused_projections = None
        eng = Engine(backend, None, page_size=128, num_pages=8, max_model_len=512, num_speculative_tokens=1)
        tokens = eng.generate([prompt], params)[0].token_ids
        with torch.inference_mode():
            logits = [model.step(i.reshape(-1), Batch.contiguous(*i.shape, 16, "cuda"),
                                 model.allocate_caches(2 * 19, 16, torch.bfloat16, "cuda")).logits
                      for i in (ids[:1, :1], ids)]
        return tokens, logits

    unfused_tokens, unfused_logits = run(False)
    monkeypatch.setattr(FusedLinears, "__call__", counted)
    tokens, logits = run(True)
    assert 1 in calls and max(calls) > 1
    assert tokens == unfused_tokens
    for got, want in zip(logits, unfused_logits, strict=True):
        assert torch.equal(got, want)
