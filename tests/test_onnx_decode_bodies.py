"""The decode-only attention bodies (``functions.paged_attention_decode`` / ``sparse_paged_attention_decode``, the
bodies of ``model.decode.onnx``) on decode steps, one ``m3`` node at a time on ONNX Runtime's CPU provider: against
the float64 reference and against the general body on the same inputs.

What they do differently and must not change the result of: the probability-weighted value sum runs as partial
sums over chunks of the keys (``_partial_value_sums``: 256-key chunks of the dense context, its length rounded up
to whole chunks past the table, one per selected block), and the slots past a sequence's length read the token's own row instead of pool row 0 (``own_slots``), so
the values are not zeroed. The batches are the conformance suite's adversarial kind: every page no sequence owns
is NaN (page 0 included), the rows past each sequence's length in its last page are NaN, the tables are padded with
page ids outside the pool and are wider than the longest sequence (as a CUDA-graph runtime pads them); a NaN row
reaching a sum would show as NaN. Contexts up to 6000 keys at tiny head dims (375 indexer blocks)."""

from __future__ import annotations

import pytest
import torch

from m3export.export.functions import DecodeSizes
from m3export.ops import conformance as conf

pytest.importorskip("onnxruntime")

CONTEXTS = [6000, 37, 5, 1, 130]  # one decode token each; 1: a sequence whose only key is the new one
PAGE = 16
HEADS = dict(hq=4, hkv=2, d=8)
INDEX = dict(block_size=16, topk_blocks=4, local_blocks=1, init_blocks=1)


def _widened(inputs: list[torch.Tensor], extra: int) -> list[torch.Tensor]:
    """The block tables (input 3) ``extra`` columns wider, filled with a page id outside the pool."""
    out = list(inputs)
    tables = out[3]
    out[3] = torch.cat([tables, torch.full((tables.shape[0], extra), 10**6, dtype=tables.dtype)], dim=1)
    return out


def _case(op: str, selection: str = "indexer"):
    gen = torch.Generator().manual_seed(sum(map(ord, op + selection)))
    new = [1] * len(CONTEXTS)
    if op == "PagedAttention":
        return conf._attention_case(CONTEXTS, new, PAGE, nan_tails=True, **HEADS)(gen)
    return conf._sparse_case(CONTEXTS, new, PAGE, INDEX, selection, nan_tails=True, **HEADS)(gen)


@pytest.mark.parametrize("op,selection", [("PagedAttention", ""), ("SparsePagedAttention", "indexer"),
                                          ("SparsePagedAttention", "random")])
@pytest.mark.parametrize("extra", [0, 7])  # 377 pages (dense chunks: 7 pages past the table), 384 (none past it)
def test_decode_attention_body_matches_the_reference_and_the_general_body(op, selection, extra):
    inputs, attrs = _case(op, selection)
    sizes = DecodeSizes(page_size=PAGE, kv_heads=HEADS["hkv"])
    got = conf.run_onnx(op, _widened(inputs, extra), attrs, torch.float32, decode=sizes).double()
    general = conf.run_onnx(op, inputs, attrs, torch.float32).double()
    want = conf.reference_function(op)(*conf.upcast(inputs), *attrs.values())
    assert torch.isfinite(got).all(), "a NaN row (unowned page, tail past a length, padding id) reached a sum"
    # fp32 against float64: each output is a convex combination of values ~N(0, 1) (|out| <= max |v| ~ 4), its
    # terms and their running sums rounded at 2^-24 relative, mostly cancelling (measured 1.3e-7; the general body
    # 1.4e-7): 2e-6 is 8 fp32 ulps at the largest outputs
    assert (got - want).abs().max() <= 2e-6, float((got - want).abs().max())
    # against the general body: the same products, other summation grouping (chunks, then their sum) and a longer
    # masked row where the table is wider: a few fp32 ulps of outputs up to ~2.5 (2.4e-7 each; measured <= 9e-8)
    assert (got - general).abs().max() <= 1e-6, float((got - general).abs().max())


@pytest.mark.gpu
@pytest.mark.skipif("CUDAExecutionProvider" not in __import__("onnxruntime").get_available_providers(),
                    reason="needs onnxruntime-gpu and a CUDA device")
@pytest.mark.parametrize("op,selection", [("PagedAttention", ""), ("SparsePagedAttention", "indexer"),
                                          ("SparsePagedAttention", "random")])
def test_decode_attention_body_on_the_cuda_ep(op, selection):
    """The same bodies on ONNX Runtime's CUDA kernels (fp32, TF32 off: ``providers.EXACT_FP32``): finite, and
    within the float64 bound of the CPU test (cuBLAS sums in another order: still a few fp32 ulps)."""
    inputs, attrs = _case(op, selection)
    sizes = DecodeSizes(page_size=PAGE, kv_heads=HEADS["hkv"])
    got = conf.run_onnx(op, _widened(inputs, 7), attrs, torch.float32, decode=sizes,
                        providers=[("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]).double()
    want = conf.reference_function(op)(*conf.upcast(inputs), *attrs.values())
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() <= 2e-6, float((got - want).abs().max())


def test_decode_bodies_zero_no_values_and_sum_in_chunks():
    """The structure the H200 numbers depend on (no timing here): neither decode attention body has a ``Where``
    over the gathered values (a pass over the context per layer and step) and each sums the values in partial
    products reduced over a chunk axis (``ReduceSum``), where the general bodies take one long product."""
    from m3export.export.functions import body

    sizes = DecodeSizes(page_size=PAGE, kv_heads=HEADS["hkv"])
    for op in ("PagedAttention", "SparsePagedAttention"):
        nodes = body(op, decode=sizes).node
        wheres = [n for n in nodes if n.op_type == "Where"]
        gathered = {o for n in nodes if n.op_type == "Gather" for o in n.output}
        casts = {o for n in nodes if n.op_type == "Cast" and n.input[0] in gathered for o in n.output}
        assert not [n for n in wheres if set(n.input) & (gathered | casts)], f"{op}: a Where over gathered rows"
        assert any(n.op_type == "ReduceSum" for n in nodes), op
