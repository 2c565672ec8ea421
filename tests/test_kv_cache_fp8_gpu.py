"""The FP8 (E4M3) cache on a CUDA device at M3's per-layer dimensions (``mini``): the compiled kernels reading and
writing E4M3 pools against the references reading the same bytes, and the ``mini`` model with an FP8 cache
through the engine, kernels against references. Skipped without a GPU (CI); on the H200:
``python3 -m pytest -q -m gpu tests/test_kv_cache_fp8_gpu.py`` in a process of its own (the CPU test files switch
Triton to its interpreter). The CPU twin is ``tests/test_kv_cache_fp8.py``."""

from __future__ import annotations

import pytest
import torch

from tests.test_kernels_attention_gpu import (BS, D, HKV, HQ, INIT, LOCAL, MIXED, TOPK, _batch,
                                              mini_greedy_with_kernels_and_references)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page", [128, 64])
def test_fp8_kernels_at_mini_dims_match_fp8_references_without_host_sync(page, dtype):
    """Mixed batch (a 300-token prefill chunk, decodes up to 5k, a 4-token verify, an idle sequence). Same E4M3
    bytes and scales on both sides. Selections exact up to fp32 near-ties of the dequantised scores (the
    conformance rule). Attention: the bounds of the unquantised kernels with V as read (dequantised): bf16 folds
    V's scales into P (P rounded to bf16, 2^-9, as before; output rounded on each side): 4 * 2^-9 max|V|; fp16
    rounds the dequantised V to fp16 instead (one more 2^-11): 5 * 2^-11 max|V|."""
    from m3export.ops.attention import paged_attention_reference, sparse_paged_attention_reference
    from m3export.ops.conformance import Verdict, _compare_selection, upcast
    from m3export.ops.indexer import lightning_indexer_reference
    from m3export.ops.kv_fp8 import dequantize_rows, quantize_rows
    from m3export.plugins.kernels import lightning_indexer, paged_attention, sparse_paged_attention

    gen = torch.Generator().manual_seed(page)
    pages, args = _batch(*MIXED, page, gen)
    t = args[3].numel()
    dev = dict(device="cuda", dtype=dtype)
    iq, q = torch.randn(t, HKV, D, **dev), torch.randn(t, HQ, D, **dev)
    (ikc, iks) = quantize_rows(torch.randn(pages, page, D, **dev))
    (kc, ks), (vc, vs) = (quantize_rows(torch.randn(pages, page, HKV, D, **dev) * 3) for _ in range(2))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host sync inside a launcher raises
    try:
        sel = lightning_indexer.forward(iq, ikc, *args, BS, TOPK, LOCAL, INIT, iks)
        sparse = sparse_paged_attention.forward(q, kc, vc, *args, sel, BS, D**-0.5, ks, vs)
        dense = paged_attention.forward(q, kc, vc, *args, D**-0.5, ks, vs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    verdict = Verdict()
    inputs64 = upcast([iq, ikc, *args])
    inputs64[1] = dequantize_rows(ikc, iks, torch.float64)
    _compare_selection(sel, lightning_indexer_reference(iq, ikc, *args, BS, TOPK, LOCAL, INIT, iks), inputs64,
                       dict(block_size=BS, topk_blocks=TOPK, local_blocks=LOCAL, init_blocks=INIT), verdict)
    assert verdict.ok, verdict.failures
    v_max = dequantize_rows(vc, vs).abs().max().item()
    bound = paged_attention.output_error_bound(dtype, v_max, fp8=True)  # derived there from what the kernels round
    for got, ref in ((sparse, sparse_paged_attention_reference(q, kc, vc, *args, sel, BS, D**-0.5, ks, vs)),
                     (dense, paged_attention_reference(q, kc, vc, *args, D**-0.5, ks, vs))):
        assert torch.isfinite(got).all()
        assert (got.float() - ref.float()).abs().max().item() <= bound


def test_fp8_fused_cache_write_at_mini_dims():
    """The fused norm / RoPE / cache write into E4M3 pools (4 KV heads of 128, 64 rotary dims, bf16) against
    the model's steps and ``write_pool_fp8``. V is quantised from the same bf16 values on both sides: bytes and
    scales equal. K: the normed rows may differ by one bf16 unit where the fp32 mean square rounds differently
    (test_mini_dims_fused_norm_rope_cache_write: <= 2^-7 of the row's largest value), and such a row may round
    to a neighbouring E4M3 code: the dequantised rows agree within that movement plus both sides' E4M3 rounding
    (2^-4 relative, 2^-10 * scale in the subnormal range)."""
    from m3export.model.batch import write_pool_fp8
    from m3export.model.norm import RMSNorm
    from m3export.model.rope import Rotary, apply_rope
    from m3export.ops.kv_fp8 import FP8, dequantize_rows
    from m3export.plugins.kernels.qk_norm_rope_cache import norm_rope

    gen = torch.Generator(device="cuda").manual_seed(3)
    t, page, pages = 257, 64, 8
    norm = RMSNorm(D, 1e-6).cuda()
    norm.weight.data = torch.randn(D, device="cuda", generator=gen) * 0.3
    pos = torch.randint(0, 4096, (t,), device="cuda", generator=gen)
    cos, sin = Rotary(64, 5e6).cuda()(pos, torch.bfloat16)  # inv_freq is a buffer: on the positions' device
    x = (torch.randn(t, HKV, D, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    v = (torch.randn(t, HKV, D, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    slots = torch.randperm(pages * page, device="cuda", generator=gen)[:t]

    def empty():
        return (torch.zeros(pages, page, HKV, D, dtype=FP8, device="cuda"),
                torch.zeros(pages, page, HKV, device="cuda"))

    (pk, sk), (pv, sv) = empty(), empty()
    norm_rope(x, norm.weight.data, 1e-6, cos, sin, pk, slots, v, pv, pool_scale=sk, v_pool_scale=sv)
    y = apply_rope(norm(x), cos, sin)
    want_k, want_v = write_pool_fp8(*empty(), slots, y, True), write_pool_fp8(*empty(), slots, v, True)
    assert torch.equal(pv.view(torch.uint8), want_v[0].view(torch.uint8)) and torch.equal(sv, want_v[1])
    at = (slots // page, slots % page)
    got, want = dequantize_rows(pk, sk)[at], dequantize_rows(*want_k)[at]
    yf = y.float()
    row_max = yf.abs().amax(-1, keepdim=True)
    moved = 2.0**-7
    bound = 2 * moved * row_max + 2 * (2.0**-4 * (yf.abs() + moved * row_max) + 2.0**-10 * row_max / 448)
    assert ((got - want).abs() <= bound).all()


def test_mini_model_fp8_cache_greedy_tokens_equal_with_kernels_and_references():
    """The whole ``mini`` model (8 experts, random weights, fp32) with an FP8 cache through the engine: 32 greedy
    tokens after a 2300-token prompt (the indexer selects), kernels (fused quantising cache write, E4M3-reading
    indexer and attention) vs the reference path (``write_pool_fp8`` and the references). fp32, as the
    unquantised twin in test_kernels_attention_gpu.py: both sides hold the same bytes up to a rare neighbouring
    code where the fused norm's summation order moves a row, and compute in fp32 otherwise."""
    from m3export.ops.kv_fp8 import FP8

    kernels, refs = mini_greedy_with_kernels_and_references(32, FP8)
    same = sum(a == b for a, b in zip(kernels, refs, strict=True))
    assert kernels == refs, f"{same} of 32 greedy tokens agree"


@pytest.mark.parametrize("k", [0, 2], ids=["no-spec", "mtp-k2"])
def test_graphs_replay_the_eager_tokens_on_fp8_caches(k):
    """Decode (and with k = 2 verify and MTP chain) steps replayed from CUDA graphs on FP8 pools give the eager
    tokens (fp32 tiny model: the same kernels, the same bytes)."""
    from m3export.ops.kv_fp8 import FP8
    from m3export.plugins.kernels import register
    from m3export.runtime import Engine, SamplingParams
    from m3export.runtime.backends.cuda_graph import GraphedTorchBackend
    from tests.runtime_fixtures import prompts, tiny_model

    register()
    m = tiny_model().float().cuda()
    ps = prompts(3, seed=4)
    kw = dict(page_size=4, num_pages=64, num_speculative_tokens=k)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    eager = Engine(GraphedTorchBackend(m, FP8, use_graphs=False), **kw).generate(ps, params)
    be = GraphedTorchBackend(m, FP8, use_graphs=True)
    graphed = Engine(be, **kw).generate(ps, params)
    assert be.replays > 0 and be._caches[-1][0].dtype == FP8
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
