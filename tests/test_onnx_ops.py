"""Op conformance: each m3 op as one ONNX node + its function body, run in ONNX Runtime vs the torch reference.

Cases cover what the paged, ragged runtime produces: prefills long enough that the indexer must choose (more
visible blocks than top-k), page sizes that do not divide the lengths, shuffled block tables padded with
garbage, decode batches, multi-token verify steps with context, mixed prefill + decode batches, forced local /
init blocks, exact ties, and pools whose unused pages hold NaN. Block selections are compared exactly.
"""

from __future__ import annotations

import zlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import m3export.ops  # noqa: F401  (registers torch.ops.m3.*)
from m3export.export.functions import BUILDERS
from m3export.export.schemas import SPEC_BY_NAME, opset_imports, register_schemas
from m3export.ops import mxfp8

register_schemas()

ONNX_TYPE = {torch.float32: TensorProto.FLOAT, torch.int32: TensorProto.INT32, torch.int64: TensorProto.INT64,
             torch.uint8: TensorProto.UINT8, torch.float8_e4m3fn: TensorProto.FLOAT8E4M3FN}


def _ort_value(t: torch.Tensor):
    t = t.contiguous()
    raw = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(raw.numpy(), ONNX_TYPE[t.dtype])


def run_onnx(op: str, inputs: list[torch.Tensor], attrs: dict, out_like: torch.Tensor) -> torch.Tensor:
    """One ``m3::op`` node whose body is the model-local function; checked by onnx, run by ORT (CPU EP)."""
    spec = SPEC_BY_NAME[op]
    names = [p.name for p in spec.inputs]
    graph = helper.make_graph(
        [helper.make_node(op, names, [spec.outputs[0].name], domain="m3", **attrs)], op,
        [helper.make_tensor_value_info(n, ONNX_TYPE[t.dtype], [f"{n}_{i}" for i in range(t.dim())])
         for n, t in zip(names, inputs)],
        [helper.make_tensor_value_info(spec.outputs[0].name, ONNX_TYPE[out_like.dtype], None)],
    )
    model = helper.make_model(graph, opset_imports=opset_imports(), functions=[BUILDERS[op]()])
    model.ir_version = 10
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    out_type = inferred.graph.output[0].type.tensor_type
    assert out_type.elem_type == ONNX_TYPE[out_like.dtype]
    assert len(out_type.shape.dim) == out_like.dim()
    onnx.checker.check_model(inferred, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (out,) = sess.run_with_ort_values(None, {n: _ort_value(t) for n, t in zip(names, inputs)})
    return torch.from_numpy(out.numpy())


def assert_close(got: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    """Max error relative to the output's scale: fp32 sums in a different order differ by a few ulp of the
    largest term, which elementwise relative error would flag wherever terms cancel."""
    assert got.shape == ref.shape and torch.isfinite(got).all()
    err = (got.double() - ref.double()).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max abs error {err:.3e} vs output scale {ref.abs().max():.3e}"


# ----------------------------------------------------------------------------------------------- paged cases
class Paged:
    """A ragged paged batch: sequence b has ``ctx[b]`` tokens after the step, the last ``new[b]`` of them new.

    Pages are shuffled (never page 0, so a body that read slot 0 for real data would be caught), tables are
    padded with an out-of-range page id, and every page no sequence owns is filled with NaN.
    """

    def __init__(self, ctx: list[int], new: list[int], page: int, gen: torch.Generator, spare: int = 3):
        need = [-(-n // page) for n in ctx]
        self.num_pages = sum(need) + spare + 1
        perm = (torch.randperm(self.num_pages - 1, generator=gen) + 1).tolist()
        self.owned = set()
        self.block_tables = torch.full((len(ctx), max(need) + 2), self.num_pages + 7, dtype=torch.int32)
        i = 0
        for b, k in enumerate(need):
            self.block_tables[b, :k] = torch.tensor(perm[i:i + k], dtype=torch.int32)
            self.owned.update(perm[i:i + k])
            i += k
        self.page = page
        self.positions = torch.cat([torch.arange(n - q, n) for n, q in zip(ctx, new)])
        self.query_start_loc = torch.tensor([0, *np.cumsum(new)], dtype=torch.int32)
        self.seq_lens = torch.tensor(ctx, dtype=torch.int32)
        self.gen = gen

    @property
    def args(self):
        return [self.block_tables, self.query_start_loc, self.seq_lens, self.positions]

    def pool(self, *rest: int) -> torch.Tensor:
        p = torch.randn(self.num_pages, self.page, *rest, generator=self.gen)
        unused = [i for i in range(self.num_pages) if i not in self.owned]
        p[unused] = float("nan")
        return p


# (context lengths, new tokens, page size, block size, top-k, local blocks, init blocks)
CASES = {
    "prefill-selects": ([37], [37], 8, 4, 3, 1, 0),
    "decode-batch": ([37, 5, 20], [1, 1, 1], 8, 4, 3, 1, 0),
    "verify-multi-token": ([29, 21], [4, 3], 8, 4, 3, 1, 0),
    "mixed-prefill-decode": ([30, 19, 12], [30, 1, 5], 5, 4, 4, 2, 1),
    "page-smaller-than-block": ([26, 9], [6, 9], 3, 4, 2, 1, 1),
    "no-forced-blocks": ([33, 14], [33, 2], 7, 2, 5, 0, 0),
    "wide-blocks": ([40, 3], [2, 3], 4, 16, 2, 1, 0),
}


@pytest.fixture(params=sorted(CASES))
def case(request):
    ctx, new, page, bs, topk, local, init = CASES[request.param]
    gen = torch.Generator().manual_seed(zlib.crc32(request.param.encode()))
    return Paged(ctx, new, page, gen), dict(block_size=bs, topk_blocks=topk, local_blocks=local, init_blocks=init)


def test_lightning_indexer(case):
    paged, attrs = case
    t, h, d = paged.positions.numel(), 2, 16
    q = torch.randn(t, h, d, generator=paged.gen)
    pool = paged.pool(d)
    ref = torch.ops.m3.lightning_indexer(q, pool, *paged.args, *attrs.values())
    got = run_onnx("LightningIndexer", [q, pool, *paged.args], attrs, ref)
    assert torch.equal(got, ref)


def test_indexer_case_exercises_selection():
    """The cases are only meaningful if some token sees more blocks than it may keep."""
    ctx, new, page, bs, topk, *_ = CASES["prefill-selects"]
    paged = Paged(ctx, new, page, torch.Generator().manual_seed(0))
    assert int((paged.positions // bs + 1).max()) > topk


def test_indexer_ties_forced_first_then_lower_id():
    """All-equal scores (zero keys): forced blocks first in ascending id, then the lowest ids, then -1."""
    paged = Paged([23, 6], [23, 6], 4, torch.Generator().manual_seed(1))
    attrs = dict(block_size=4, topk_blocks=4, local_blocks=2, init_blocks=1)
    q = torch.randn(29, 2, 8)
    pool = torch.zeros(paged.num_pages, 4, 8)
    ref = torch.ops.m3.lightning_indexer(q, pool, *paged.args, *attrs.values())
    assert ref[22, 0].tolist() == [0, 4, 5, 1]  # position 22: own block 5, local {4, 5}, init {0}, then 1
    assert ref[23, 0].tolist() == [0, -1, -1, -1]  # sequence 2, position 0: one visible block
    assert ref[28, 1].tolist() == [0, 1, -1, -1]  # position 5: blocks 0 (init and local) and 1 (local)
    got = run_onnx("LightningIndexer", [q, pool, *paged.args], attrs, ref)
    assert torch.equal(got, ref)


def test_paged_attention(case):
    paged, _ = case
    t, hq, hkv, d = paged.positions.numel(), 4, 2, 16
    q = torch.randn(t, hq, d, generator=paged.gen)
    k, v = paged.pool(hkv, d), paged.pool(hkv, d)
    ref = torch.ops.m3.paged_attention(q, k, v, *paged.args, 0.25)
    got = run_onnx("PagedAttention", [q, k, v, *paged.args], dict(scale=0.25), ref)
    assert_close(got, ref)


@pytest.mark.parametrize("selection", ["indexer", "random"])
def test_sparse_paged_attention(case, selection):
    paged, attrs = case
    t, hq, hkv, d = paged.positions.numel(), 4, 2, 16
    q = torch.randn(t, hq, d, generator=paged.gen)
    k, v = paged.pool(hkv, d), paged.pool(hkv, d)
    if selection == "indexer":
        sel = torch.ops.m3.lightning_indexer(torch.randn(t, hkv, d, generator=paged.gen), paged.pool(d),
                                             *paged.args, *attrs.values())
    else:  # any order, duplicates, -1, ids past the sequence; the own block kept so no row is empty
        own = (paged.positions // attrs["block_size"]).to(torch.int32)
        noise = torch.randint(-1, 12, (t, hkv, 3), generator=paged.gen, dtype=torch.int32)
        sel = torch.cat([noise, own.view(t, 1, 1).expand(t, hkv, 1)], dim=-1)
    ref = torch.ops.m3.sparse_paged_attention(q, k, v, *paged.args, sel, attrs["block_size"], 0.25)
    got = run_onnx("SparsePagedAttention", [q, k, v, *paged.args, sel],
                   dict(block_size=attrs["block_size"], scale=0.25), ref)
    assert_close(got, ref)


# ----------------------------------------------------------------------------------------------- MoE / MXFP8
MOE_ATTRS = dict(routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0)


def _moe_weights(gen, t=9, h=64, e=8, i=32, shared=64):
    x = torch.randn(t, h, generator=gen) * 2  # large enough that the SwiGLU clamps engage
    return (x, torch.randn(e, h, generator=gen) * 0.3, torch.randn(e, generator=gen) * 0.3,
            torch.randn(e, 2 * i, h, generator=gen) * 0.3, torch.randn(e, h, i, generator=gen) * 0.3,
            torch.randn(2 * shared, h, generator=gen) * 0.3, torch.randn(h, shared, generator=gen) * 0.3)


@pytest.mark.parametrize("top_k,tokens", [(2, 9), (1, 1), (8, 5)])
def test_moe(top_k, tokens):
    args = _moe_weights(torch.Generator().manual_seed(top_k), t=tokens)
    attrs = dict(top_k=top_k, **MOE_ATTRS)
    ref = torch.ops.m3.moe(*args, *attrs.values())
    got = run_onnx("MoE", list(args), attrs, ref)
    assert_close(got, ref)


def test_moe_mxfp8():
    x, rw, bias, *weights = _moe_weights(torch.Generator().manual_seed(3))
    quantized = [part for w in weights for part in mxfp8.quantize(w)]
    attrs = dict(top_k=2, **MOE_ATTRS)
    ref = torch.ops.m3.moe_mxfp8(x, rw, bias, *quantized, *attrs.values())
    got = run_onnx("MoEMXFP8", [x, rw, bias, *quantized], attrs, ref)
    assert_close(got, ref)


@pytest.mark.parametrize("lead", [(7,), (2, 3)])
def test_mxfp8_linear(lead):
    gen = torch.Generator().manual_seed(4)
    w, s = mxfp8.quantize(torch.randn(48, 96, generator=gen))
    s[0, 0], s[1, 1] = 100, 140  # far-from-one scales, exact in fp32
    x = torch.randn(*lead, 96, generator=gen)
    ref = torch.ops.m3.mxfp8_linear(x, w, s)
    got = run_onnx("MXFP8Linear", [x, w, s], {}, ref)
    assert_close(got, ref)


def test_every_op_has_a_body_and_schema():
    assert set(BUILDERS) == set(SPEC_BY_NAME) == set(m3export.ops.OPS)
    for name, build in BUILDERS.items():
        fn = build()
        assert (fn.domain, fn.name) == ("m3", name)
        assert list(fn.attribute) == [a.name for a in SPEC_BY_NAME[name].attributes]
        assert onnx.defs.has(name, "m3")
