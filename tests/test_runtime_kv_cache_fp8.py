"""The engine with an FP8 (E4M3) cache (``--kv-cache-dtype fp8``): what it computes, what it holds, who refuses it.

Oracle: the cache-free model (``model(ids)``, full recompute) whose cache writes round every row through E4M3
and back (``quantize_rows`` then ``dequantize_rows``), i.e. the model reading exactly the values an FP8 cache
holds. Each row's bytes depend on that row alone, so paging, chunked prefill, batching, preemption and prefix
sharing must reproduce that oracle's greedy tokens exactly (float64 model: argmax decisions are not at the
mercy of fp32 rounding). How far E4M3 moves an attention output is bounded in ``test_attention_error_bound``.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

import m3export.model.attention as model_attention
from m3export.errors import BackendUnavailable
from m3export.ops.attention import paged_attention_reference
from m3export.ops.kv_fp8 import E4M3_HALF_ULP, E4M3_SUBNORMAL_ABS, FP8, dequantize_rows, quantize_rows
from m3export.runtime import Engine, SamplingParams
from m3export.runtime.backends import check_exported_cache_dtype, make_torch_backend
from m3export.runtime.backends.torch_backend import TorchBackend

from .runtime_fixtures import model, prompts  # noqa: F401  (fixtures)

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _write_through_e4m3(pool, slots, values, inplace, _write=model_attention.write_pool):
    q, scale = quantize_rows(values)
    return _write(pool, slots, dequantize_rows(q, scale, pool.dtype), inplace)


@pytest.fixture(scope="module")
def e4m3_reference(model):
    """Greedy continuation by full recompute of the model whose cache rows went through E4M3."""

    @functools.cache
    def run(prompt: tuple, n: int) -> list[int]:
        ids = list(prompt)
        with pytest.MonkeyPatch.context() as mp, torch.no_grad():
            mp.setattr(model_attention, "write_pool", _write_through_e4m3)
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        return ids[len(prompt):]

    return run


def fp8_engine(model, **kw) -> Engine:
    kw.setdefault("page_size", 4)
    kw.setdefault("num_pages", 128)
    return Engine(TorchBackend(model, FP8), **kw)


def test_pools_are_e4m3_with_fp32_scales(model):
    eng = fp8_engine(model, num_pages=8)
    dense, sparse = eng.backend._caches[0], eng.backend._caches[-1]
    assert [p.dtype for p in sparse] == [FP8] * 3 + [torch.float32] * 3
    assert [tuple(p.shape) for p in sparse[3:]] == [tuple(p.shape[:-1]) for p in sparse[:3]]
    assert len(dense) in (4, 6) and all(len(c) == 6 for c in eng.backend._mtp_caches)


def test_fp8_engine_equals_recompute_through_e4m3_under_preemption_and_chunking(model, e4m3_reference):
    """Chunked prefill (5 tokens a step) and a pool too small for the batch (preemption, recompute)."""
    ps = prompts(5, seed=31, lo=10, hi=30)
    eng = fp8_engine(model, num_pages=12, max_num_batched_tokens=5)
    outs = eng.generate(ps, GREEDY)
    assert eng.stats.preemptions > 0
    for p, o in zip(ps, outs, strict=True):
        assert o.token_ids == e4m3_reference(tuple(p), 10)
    assert eng.blocks.num_free == eng.blocks.num_pages


def test_fp8_prefix_pages_are_shared_and_outputs_identical(model, e4m3_reference):
    base = prompts(1, seed=41, lo=14, hi=15)[0]  # 3 full pages of 4 to share
    a, b = base + [7, 8, 9], base + [200, 201]
    eng = fp8_engine(model)
    eng.add_request("a", a, GREEDY)
    eng.step()
    eng.add_request("b", b, GREEDY)
    finals = {}
    while eng.has_unfinished():
        for o in eng.step():
            finals[o.request_id] = o.token_ids
    assert eng.stats.prefill_tokens == len(a) + len(b) - 12  # b reused a's quantised pages and their scales
    assert finals["a"] == e4m3_reference(tuple(a), 10) and finals["b"] == e4m3_reference(tuple(b), 10)


def test_first_step_logits_are_the_e4m3_models_and_differ_from_the_full_cache(model):
    """The fp8 engine's first-step logits equal the E4M3-rounded model's (float64: to 1e-12 of their scale,
    the same values summed alike) and are not the float64 cache's (the option really quantises)."""
    ids = prompts(1, seed=3, lo=30, hi=31)[0]
    logits = {}

    class Capture(TorchBackend):
        def forward(self, input_ids, batch, logits_indices, media=None):
            out = super().forward(input_ids, batch, logits_indices, media)
            logits.setdefault(self.dtype, out[0])
            return out

    for dtype in (FP8, torch.float64):
        Engine(Capture(model, dtype), page_size=4, num_pages=16).generate([ids], SamplingParams(max_tokens=1))
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(model_attention, "write_pool", _write_through_e4m3)
        want = model(torch.tensor([ids]))[0, -1].float()
    scale = want.abs().max().item()
    assert (logits[FP8][-1] - want).abs().max().item() <= 1e-12 * scale + 1e-6  # float32 logits from the engine
    assert (logits[FP8][-1] - logits[torch.float64][-1]).abs().max().item() > 1e-4 * scale


def test_attention_error_bound():
    """E4M3 per-row rounding moves an attention output by at most (2^-4 + e^{2 Delta} - 1) max|V|, where

    * values: each element moves by <= 2^-4 |v| + 2^-10 s (half an E4M3 unit; the subnormal spacing for small
      elements, s = the row's scale), and a convex combination of rows moves by at most the largest such move,
      <= 2^-4 max|V| (+ 2^-10 max s, which is 2^-10 max|V| / 448: negligible, included);
    * keys: each score moves by <= Delta = scale * max_j sum_d |q_d| (2^-4 |k_jd| + 2^-10 s_j); a softmax whose
      logits move by <= Delta changes each weight by a factor within e^{+-2 Delta}, so the combination moves by
      <= (e^{2 Delta} - 1) max|V|.

    Checked here on heavy-tailed K/V (rows spanning decades, some zero) against the unquantised reference."""
    gen = torch.Generator().manual_seed(0)
    n, hkv, hq, d = 37, 2, 4, 32
    q = torch.randn(1, hq, d, generator=gen, dtype=torch.float64)
    spread = torch.logspace(-3, 1, n, dtype=torch.float64)[:, None, None]  # rows spanning four decades
    k = torch.randn(n, hkv, d, generator=gen, dtype=torch.float64) * spread
    v = torch.randn(n, hkv, d, generator=gen, dtype=torch.float64) ** 3
    k[5], v[7] = 0.0, 0.0
    (kq, ks), (vq, vs) = quantize_rows(k), quantize_rows(v)
    page = dict(block_tables=torch.zeros(1, 1, dtype=torch.int32),
                query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                seq_lens=torch.tensor([n], dtype=torch.int32), positions=torch.tensor([n - 1]))
    scale = d**-0.5
    exact = paged_attention_reference(q, k[None], v[None], *page.values(), scale)
    fp8 = paged_attention_reference(q, kq[None], vq[None], *page.values(), scale, ks[None], vs[None])
    group = hq // hkv
    for h in range(hq):
        g = h // group
        k_move = E4M3_HALF_ULP * k[:, g].abs() + E4M3_SUBNORMAL_ABS * ks[:, g, None]
        delta = scale * (q[0, h].abs() * k_move).sum(-1).max()
        vmax = v[:, g].abs().max().item()
        bound = (E4M3_HALF_ULP + E4M3_SUBNORMAL_ABS / 448 + math.expm1(2 * delta.item())) * vmax
        err = (fp8[0, h] - exact[0, h]).abs().max().item()
        assert 0 < err <= bound, (h, err, bound)


def test_page_bytes_count_the_scales_and_fit_about_twice_the_tokens(model):
    """fp8: one byte per element plus 4 bytes per row of D; against 2-byte bf16 that is 2D / (D + 4) as many
    pages per byte (1.94x at M3's D = 128; 1.78x at the tiny preset's 32)."""
    m = model.float()
    try:
        bf16, fp8 = TorchBackend(m, torch.bfloat16).page_bytes(4), TorchBackend(m, FP8).page_bytes(4)
        elems = bf16 // 2
        assert fp8 == elems + 4 * elems // 32
        budget = 40 * bf16
        eng = Engine(TorchBackend(m, FP8), page_size=4, kv_cache_bytes=budget)
        assert eng.blocks.num_pages == budget // fp8 == int(40 * 2 * 32 / 36)
    finally:
        model.double()


def test_kv_cache_dtype_names_reach_the_backend(model):
    assert make_torch_backend(model, kv_cache_dtype="fp8").dtype == FP8
    assert make_torch_backend(model, kv_cache_dtype="auto").dtype == torch.float64
    assert make_torch_backend(model, kv_cache_dtype="bf16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="--kv-cache-dtype 'fp4'"):
        make_torch_backend(model, kv_cache_dtype="fp4")


def test_exported_graphs_refuse_another_cache_dtype(tiny_artifact):
    """onnxruntime / tensorrt run the graphs as exported (float32 pools here): fp8 and bf16 are one clear error
    each, auto and the exported dtype pass; the torch backend takes any. (FP8 artifacts:
    ``tests/test_export_kv_fp8.py``.)"""
    check_exported_cache_dtype("onnxruntime", tiny_artifact, "auto")
    with pytest.raises(BackendUnavailable, match=rf"fp8: {tiny_artifact} was exported with float32 caches, not fp8"
                                                 r".*--kv-cache-dtype fp8, or --backend torch"):
        check_exported_cache_dtype("onnxruntime", tiny_artifact, "fp8")
    with pytest.raises(BackendUnavailable, match="exported with float32 caches, not bfloat16"):
        check_exported_cache_dtype("tensorrt", tiny_artifact, "bf16")
    eng = Engine.from_artifact(tiny_artifact, backend="torch", kv_cache_dtype="fp8", num_pages=16, page_size=4)
    assert eng.backend.dtype == FP8 and len(eng.generate([[1, 2, 3]], GREEDY)[0].token_ids) == 10
    with pytest.raises(BackendUnavailable, match="fp8"):
        Engine.from_artifact(tiny_artifact, backend="onnxruntime", kv_cache_dtype="fp8")


def test_triton_repo_engine_args_check_the_cache_dtype():
    from m3export.serve.repo import RepositoryError, parse_engine_args

    assert parse_engine_args(["kv_cache_dtype=fp8"]) == {"kv_cache_dtype": "fp8"}
    with pytest.raises(RepositoryError, match="kv_cache_dtype='int8'"):
        parse_engine_args(["kv_cache_dtype=int8"])


def test_speculative_decoding_on_fp8_caches_keeps_the_greedy_tokens(model, e4m3_reference):
    """MTP drafts (the modules' own FP8 pools) verified against the target: greedy output unchanged."""
    ps = prompts(3, seed=7, lo=5, hi=25)
    eng = fp8_engine(model, num_speculative_tokens=2)
    assert all(c[0].dtype == FP8 for c in eng.backend._mtp_caches)
    for p, o in zip(ps, eng.generate(ps, GREEDY), strict=True):
        assert o.token_ids == e4m3_reference(tuple(p), 10)


def test_command_line_server_and_offline_api_take_the_option(capsys):
    from m3export import LLM
    from m3export.cli import build_parser, main

    assert main(["generate", "tiny", "--prompt-ids", "1,2,3", "--temperature", "0", "--max-tokens", "4",
                 "--kv-cache-dtype", "fp8"]) == 0
    assert build_parser().parse_args(["serve", "tiny", "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    args = build_parser().parse_args(["triton-repo", "tiny", "--out", "r", "--kv-cache-dtype", "fp8"])
    assert args.kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "tiny", "--prompt", "x", "--kv-cache-dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    assert LLM("tiny", kv_cache_dtype="fp8", max_model_len=64).engine.backend.dtype == FP8


def test_padded_graph_shapes_on_fp8_caches_keep_the_tokens(model, e4m3_reference):
    """The CUDA-graph backend's bucket shapes (padded decode and verify steps, MTP chain steps), run eagerly
    here, on FP8 pools: padding rows write their quantised rows and scales where no request reads."""
    from m3export.runtime.backends.cuda_graph import GraphedTorchBackend

    be = GraphedTorchBackend(model, FP8, use_graphs=False, pad_eagerly=True, buckets=(1, 2, 4))
    eng = Engine(be, page_size=4, num_pages=64, max_num_seqs=3, num_speculative_tokens=2)
    ps = prompts(3, seed=5)
    for p, o in zip(ps, eng.generate(ps, GREEDY), strict=True):
        assert o.token_ids == e4m3_reference(tuple(p), 10)
    assert be.padded_mtp_steps > 0
