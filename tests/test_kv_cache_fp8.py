"""The FP8 (E4M3) cache option: the row format, the kernels that write and read it, and the engine with it.

The format's truth is ``m3export.ops.kv_fp8`` (quantise per row, ``scale = amax / 448``) and the references that
read it (``m3export/ops/{attention,indexer}.py`` with scale pools). The kernels run under Triton's interpreter
here (tiny sizes), compiled on a GPU machine. Bounds against the unquantised cache are derived from E4M3's
rounding (module ``BOUNDS`` below), never tuned.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.test_kernels_attention import (CASES, DEVICE, Paged, _assert_attention_close,  # sets the interpreter
                                         _dev, spy_launches)

from m3export.ops.attention import paged_attention_reference, sparse_paged_attention_reference  # noqa: E402
from m3export.ops.indexer import lightning_indexer_reference  # noqa: E402
from m3export.ops.kv_fp8 import (E4M3_HALF_ULP, E4M3_SUBNORMAL_ABS, FP8, dequantize_rows,  # noqa: E402
                                 quantize_rows, resolve_cache_dtype)
from m3export.plugins.kernels import _batch, lightning_indexer, paged_attention, sparse_paged_attention  # noqa: E402
from m3export.plugins.kernels._fp8 import encode_e4m3, row_scale  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _encode(x_ptr, q_ptr, s_ptr, R: tl.constexpr, D: tl.constexpr, INTERPRETED: tl.constexpr):
    r = tl.arange(0, R)
    d = tl.arange(0, D)
    x = tl.load(x_ptr + r[:, None] * D + d[None, :])
    s = row_scale(x, d[None, :] < D, INTERPRETED)
    tl.store(s_ptr + r, s)
    tl.store(q_ptr + r[:, None] * D + d[None, :], encode_e4m3(x, s, INTERPRETED))


def quantized_pool(paged: Paged, *rest, values=None):
    """A Paged pool (NaN where no sequence owns a slot) as E4M3 bytes + per-row scales (NaN rows stay NaN)."""
    return quantize_rows(paged.pool(*rest, values=values))


# ------------------------------------------------------------------------------------------------ the format
def test_quantize_rows_rounds_to_nearest_even_and_keeps_zero_rows_finite():
    """Scale = amax / 448 exactly; ties go to the even code (1.0625 -> 1, 1.1875 -> 1.25; subnormal midpoints
    2^-10 -> 0 and 3 * 2^-10 -> 2^-8); a zero row has scale 0 and reads back as zeros, not 0/0."""
    row = torch.tensor([[448.0, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, -1.0625, 0.0, -448.0],
                        [0.0] * 8])
    q, scale = quantize_rows(row)
    assert scale.tolist() == [1.0, 0.0]
    assert q[0].float().tolist() == [448.0, 1.0, 1.25, 0.0, 2.0**-8, -1.0, 0.0, -448.0]
    back = dequantize_rows(q, scale)
    assert torch.isfinite(back).all() and back[1].eq(0).all()


def test_quantize_rows_error_is_within_e4m3_rounding():
    """Per element: normal values within half a unit (2^-4 relative), subnormal ones within 2^-10 * scale."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 4, 64)[:, None]
    q, scale = quantize_rows(x)
    err = (dequantize_rows(q, scale, torch.float64) - x.double()).abs()
    bound = torch.maximum(E4M3_HALF_ULP * x.double().abs(), E4M3_SUBNORMAL_ABS * scale.double()[:, None])
    assert (err <= bound * (1 + 1e-6)).all()


def test_kernel_encoding_equals_the_reference_bit_for_bit():
    """The Triton write path's E4M3 bytes (integer rounding on fp32 bits, ``plugins/kernels/_fp8.py``) and
    scales equal ``quantize_rows`` exactly, over 9 decades of magnitude and the subnormal range."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(128, 64, generator=gen) * torch.logspace(-6, 3, 128)[:, None]
    x[0] = 0.0
    x[1] = torch.randn(64, generator=gen) * 1e-3
    x[1, 0] = 448.0  # most of the row in E4M3's subnormal range
    x[2, :8] = torch.tensor([448.0, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, -1.0625, -0.0, 2.0**-9 + 2.0**-11])
    q = torch.empty(128, 64, dtype=torch.uint8, device=DEVICE)
    s = torch.empty(128, device=DEVICE)
    _encode[(1,)](x.to(DEVICE), q, s, R=128, D=64, INTERPRETED=DEVICE == "cpu")
    want_q, want_s = quantize_rows(x)
    assert torch.equal(s.cpu(), want_s) and torch.equal(q.cpu(), want_q.view(torch.uint8))


def test_cache_dtype_names():
    assert resolve_cache_dtype("auto", torch.float32) == torch.float32
    assert resolve_cache_dtype(None, torch.bfloat16) == torch.bfloat16
    assert resolve_cache_dtype("bf16", torch.float32) == torch.bfloat16
    assert resolve_cache_dtype("fp8", torch.bfloat16) == FP8
    with pytest.raises(ValueError, match="--kv-cache-dtype 'int4'"):
        resolve_cache_dtype("int4", torch.float32)


def test_references_refuse_an_fp8_pool_without_its_scales():
    paged = Paged([8], [1], 4, seed=2)
    q = paged.randn(1, 2, 16)
    k, ks = quantized_pool(paged, 1, 16)
    with pytest.raises(ValueError, match="k_cache is float8_e4m3fn but no k_cache_scale"):
        paged_attention_reference(q, k, k, *paged.args("cpu"), 0.25)
    with pytest.raises(ValueError, match="k_cache_scale must be float32"):
        paged_attention_reference(q, k, k, *paged.args("cpu"), 0.25, ks[..., :0], ks)



def test_references_read_uint8_code_pools_as_fp8():
    """The ONNX form of an FP8 pool is its E4M3 codes as uint8 (docs/ops.md §9): the three references read such
    a pool exactly as the float8 one (equal outputs, not close: the same bytes are decoded); without its scale
    pool a code pool is refused by name."""
    paged = Paged([9, 3], [2, 1], 4, seed=5)
    hq, hkv, d, bs = 4, 2, 16, 4
    q = paged.randn(paged.tokens, hq, d)
    (k, ks), (v, vs) = quantized_pool(paged, hkv, d), quantized_pool(paged, hkv, d)
    ik, iks = quantized_pool(paged, d)
    k8, v8, ik8 = (t.view(torch.uint8) for t in (k, v, ik))
    args = paged.args("cpu")
    assert torch.equal(paged_attention_reference(q, k8, v8, *args, d**-0.5, ks, vs),
                       paged_attention_reference(q, k, v, *args, d**-0.5, ks, vs))
    iq = paged.randn(paged.tokens, hkv, d)
    sel = lightning_indexer_reference(iq, ik8, *args, bs, 2, 1, 1, iks)
    assert torch.equal(sel, lightning_indexer_reference(iq, ik, *args, bs, 2, 1, 1, iks))
    assert torch.equal(sparse_paged_attention_reference(q, k8, v8, *args, sel, bs, d**-0.5, ks, vs),
                       sparse_paged_attention_reference(q, k, v, *args, sel, bs, d**-0.5, ks, vs))
    with pytest.raises(ValueError, match="v_cache is uint8 \\(E4M3 codes\\) but no v_cache_scale"):
        paged_attention_reference(q, k8, v8, *args, d**-0.5, ks)
    with pytest.raises(ValueError, match="index_k_cache is uint8"):
        lightning_indexer_reference(iq, ik8, *args, bs, 2, 1, 1)

# ------------------------------------------------------------------------------------------------ kernels
FP8_CASES = ("decode-one-token-seqs", "verify-multi-token", "mixed-with-empty-seq", "page-smaller-than-block")


@pytest.fixture(params=[(n, dt) for n in FP8_CASES for dt in (torch.float32, torch.bfloat16)],
                ids=[f"{n}-{dt}" for n in FP8_CASES for dt in ("fp32", "bf16")])
def fp8_case(request, monkeypatch):
    """bf16 cases split the context / selection over programs (merge kernel), fp32 ones run one split."""
    name, dtype = request.param
    sms = 16 if dtype == torch.bfloat16 else 1
    monkeypatch.setattr(_batch, "num_sms", lambda device: sms)
    ctx, new, page, bs, topk, local, init = CASES[name]
    return Paged(ctx, new, page, zlib.crc32(name.encode()) + 8), (bs, topk, local, init), dtype


def test_indexer_on_fp8_keys_selects_as_the_fp8_reference(fp8_case):
    """Same bytes and scales on both sides; selections exact (the kernel scales each key's score column after
    the dot, the reference before: fp32 rounding only, and these random scores have no near-ties)."""
    paged, attrs, dtype = fp8_case
    q = paged.randn(paged.tokens, 2, 32, dtype=dtype)
    ik, iks = quantized_pool(paged, 32)
    ref = lightning_indexer_reference(q, ik, *paged.args("cpu"), *attrs, iks)
    got = lightning_indexer.forward(*_dev(q, ik), *paged.args(), *attrs, iks.to(DEVICE))
    assert torch.equal(got.cpu(), ref)


def test_attention_kernels_on_fp8_pools_match_the_fp8_references(fp8_case):
    """Dense and sparse attention on the same E4M3 pools: the bounds of the unquantised kernels, with V the
    dequantised values (the kernels fold V's scales into P before the product; P is rounded as before)."""
    paged, (bs, topk, local, init), dtype = fp8_case
    hq, hkv, d = 4, 2, 32
    t = paged.tokens
    q = paged.randn(t, hq, d, dtype=dtype)
    (k, ks), (v, vs) = quantized_pool(paged, hkv, d), quantized_pool(paged, hkv, d)
    v_read = dequantize_rows(v, vs).to(dtype)
    ref = paged_attention_reference(q, k, v, *paged.args("cpu"), d**-0.5, ks, vs)
    got = paged_attention.forward(*_dev(q, k, v), *paged.args(), d**-0.5, *_dev(ks, vs))
    _assert_attention_close(got, ref, v_read)
    sel = lightning_indexer_reference(paged.randn(t, hkv, d), paged.pool(d), *paged.args("cpu"), bs, topk, local,
                                      init)
    ref = sparse_paged_attention_reference(q, k, v, *paged.args("cpu"), sel, bs, d**-0.5, ks, vs)
    got = sparse_paged_attention.forward(*_dev(q, k, v), *paged.args(), sel.to(DEVICE), bs, d**-0.5,
                                         *_dev(ks, vs))
    _assert_attention_close(got, ref, v_read)


@pytest.mark.parametrize("settings", [
    {"fp8_widen": "bits"},
    {"fp8_widen": "bits", "block_n": 16, "max_splits": 64, "waves": 8, "num_stages": 3},
    {"fp8_widen": "convert", "block_n": 128, "max_splits": 2},
])
def test_dense_attention_launch_settings_on_fp8_pools(settings, monkeypatch):
    """``paged_attention.DEFAULTS`` entries (what ``bench/decode_profile.py --settings`` tries in the model): the key
    tile, the split count and K / V widened by bit placement keep the FP8 reference's bound; the launch runs the
    settings (bit placement only for bf16 queries over FP8 pools); unknown values are refused by name."""
    monkeypatch.setattr(_batch, "num_sms", lambda device: 16)
    seen = spy_launches(monkeypatch, paged_attention, "_paged_attention")
    ctx, new, page, *_ = CASES["mixed-with-empty-seq"]
    paged = Paged(ctx, new, page, 21)
    hq, hkv, d = 4, 2, 32
    (k, ks), (v, vs) = quantized_pool(paged, hkv, d), quantized_pool(paged, hkv, d)
    config = {"attention_fp8": settings}
    for dtype in (torch.bfloat16, torch.float32):
        q = paged.randn(paged.tokens, hq, d, dtype=dtype)
        ref = paged_attention_reference(q, k, v, *paged.args("cpu"), d**-0.5, ks, vs)
        got = paged_attention.forward(*_dev(q, k, v), *paged.args(), d**-0.5, *_dev(ks, vs), config=config)
        _assert_attention_close(got, ref, dequantize_rows(v, vs).to(dtype))
    bits = settings["fp8_widen"] == "bits"
    assert [kw["FP8_BITS"] for kw in seen] == [bits, False]  # fp32 queries: no bit placement
    fp8 = paged_attention.DEFAULTS["attention_fp8"]
    assert all(kw["BLOCK_N"] == settings.get("block_n", fp8["block_n"]) for kw in seen)
    splits = seen[0]["grid"][2]
    assert splits <= settings.get("max_splits", fp8["max_splits"]) and (splits > 2 if settings.get("block_n") == 16
                                                                         else True)
    with pytest.raises(ValueError, match="fp8_widen 'fast' is not one of"):
        paged_attention.forward(*_dev(q, k, v), *paged.args(), d**-0.5, *_dev(ks, vs),
                                config={"attention_fp8": {"fp8_widen": "fast"}})
    with pytest.raises(ValueError, match="unknown attention_fp8 settings"):
        paged_attention.forward(*_dev(q, k, v), *paged.args(), d**-0.5, *_dev(ks, vs),
                                config={"attention_fp8": {"splits": 4}})
    k16 = paged.pool(hkv, d, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"unknown attention settings \['fp8_widen'\]"):  # 16-bit pools' part
        paged_attention.forward(*_dev(q.bfloat16(), k16, k16), *paged.args(), d**-0.5,
                                config={"attention": {"fp8_widen": "bits"}})


def test_sparse_attention_widens_fp8_by_bits_for_bf16_queries(monkeypatch):
    """``sparse_paged_attention`` settings ``fp8_widen``: its kernel's FP8 flag is 2 (bit placement) for bf16 queries
    over FP8 pools by default, 1 (conversion) when asked or for other queries, 0 for 16-bit pools; results within the
    FP8 reference's bound either way; an unknown value refused by name."""
    seen = spy_launches(monkeypatch, sparse_paged_attention, "_sparse_paged_attention")
    ctx, new, page, bs, topk, local, init = CASES["decode-one-token-seqs"]
    paged = Paged(ctx, new, page, 5)
    hq, hkv, d = 4, 2, 32
    (k, ks), (v, vs) = quantized_pool(paged, hkv, d), quantized_pool(paged, hkv, d)
    sel = lightning_indexer_reference(paged.randn(paged.tokens, hkv, d), paged.pool(d), *paged.args("cpu"), bs, topk,
                                      local, init)
    for dtype, config in ((torch.bfloat16, None), (torch.bfloat16, {"decode": {"fp8_widen": "convert"}}),
                          (torch.float32, None)):
        q = paged.randn(paged.tokens, hq, d, dtype=dtype)
        ref = sparse_paged_attention_reference(q, k, v, *paged.args("cpu"), sel, bs, d**-0.5, ks, vs)
        got = sparse_paged_attention.forward(*_dev(q, k, v), *paged.args(), sel.to(DEVICE), bs, d**-0.5,
                                             *_dev(ks, vs), config=config)
        _assert_attention_close(got, ref, dequantize_rows(v, vs).to(dtype))
    k16 = paged.pool(hkv, d, dtype=torch.bfloat16)
    sparse_paged_attention.forward(*_dev(q.bfloat16(), k16, k16), *paged.args(), sel.to(DEVICE), bs, d**-0.5)
    assert [kw["FP8"] for kw in seen] == [2, 1, 1, 0]
    with pytest.raises(ValueError, match="fp8_widen 'fast' is not one of"):
        sparse_paged_attention.forward(*_dev(q, k, v), *paged.args(), sel.to(DEVICE), bs, d**-0.5, *_dev(ks, vs),
                                       config={"decode": {"fp8_widen": "fast"}})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cache_write_quantises_as_the_model_steps(dtype):
    """``norm_rope`` into FP8 pools (K with V alongside, and the single-head index-key form) against the model's
    own steps (RMSNorm, apply_rope, ``write_pool_fp8``). The normed / rotated rows match as in
    test_norm_rope_cache_write_matches_model_steps (fp32: 1e-6; bf16: one unit, 2^-8, of the row's largest
    value); a row that moved by that much may round to a neighbouring E4M3 code, so the dequantised rows agree
    within that movement plus both sides' E4M3 rounding, and the scales (amax / 448) within twice the movement.
    V is copied before quantising, so its bytes and scales are exact."""
    from m3export.model.batch import write_pool_fp8
    from m3export.model.norm import RMSNorm
    from m3export.model.rope import Rotary, apply_rope
    from m3export.plugins.kernels.qk_norm_rope_cache import norm_rope

    gen = torch.Generator().manual_seed(7)
    t, h, d, rot, page, pages = 5, 3, 32, 16, 4, 4
    norm = RMSNorm(d, 1e-6)
    norm.weight.data = torch.randn(d, generator=gen) * 0.3
    pos = torch.tensor([0, 3, 7, 8, 13])
    cos, sin = Rotary(rot, 10000.0)(pos, dtype)
    x = (torch.randn(t, h, d, generator=gen) * 3).to(dtype)
    v = (torch.randn(t, h, d, generator=gen) * 5).to(dtype)
    slots = torch.randperm(pages * page, generator=gen)[:t]
    k_rows = apply_rope(norm(x), cos, sin)

    def empty(*shape):
        return torch.zeros(*shape, dtype=FP8), torch.zeros(*shape[:-1])

    (pk, sk), (pv, sv) = empty(pages, page, h, d), empty(pages, page, h, d)
    want_k = write_pool_fp8(*empty(pages, page, h, d), slots, k_rows, True)
    want_v = write_pool_fp8(*empty(pages, page, h, d), slots, v, True)
    dev = _dev(pk, sk, pv, sv)
    norm_rope(*_dev(x, norm.weight.data), 1e-6, *_dev(cos, sin), dev[0], slots.to(DEVICE), v.to(DEVICE), dev[2],
              pool_scale=dev[1], v_pool_scale=dev[3])
    pk, sk, pv, sv = (a.cpu() for a in dev)
    assert torch.equal(pv.view(torch.uint8), want_v[0].view(torch.uint8)) and torch.equal(sv, want_v[1])
    moved = 1e-6 if dtype == torch.float32 else 2.0**-8  # relative, of the row's largest value
    at = (slots // page, slots % page)
    got, want = dequantize_rows(pk, sk)[at], dequantize_rows(*want_k)[at]
    y = k_rows.float()
    row_max = y.abs().amax(-1, keepdim=True)
    # |got - want| <= |y' - y| + e(y') + e(y), each E4M3 error e <= 2^-4 |.| + 2^-10 * scale (scale = amax/448)
    bound = 2 * moved * row_max + 2 * (2.0**-4 * (y.abs() + moved * row_max) + 2.0**-10 * row_max / 448)
    assert ((got - want).abs() <= bound).all()
    torch.testing.assert_close(sk, want_k[1], rtol=2 * moved, atol=0)

    ik = x[:, 0]
    ipool, iscale = _dev(*empty(pages, page, d))
    norm_rope(ik.to(DEVICE), norm.weight.data.to(DEVICE), 1e-6, *_dev(cos, sin), ipool, slots.to(DEVICE),
              pool_scale=iscale)
    want_i = write_pool_fp8(*empty(pages, page, d), slots, apply_rope(norm(ik[:, None]), cos, sin)[:, 0], True)
    torch.testing.assert_close(iscale.cpu(), want_i[1], rtol=2 * moved, atol=0)
