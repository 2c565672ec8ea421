"""The ONNX side of the custom-op contract: one ``OpSpec`` per op in domain ``m3``, version 1.

The same table drives the ``onnx.defs`` schema registration (so ``onnx.checker`` and the dynamo exporter accept
``m3::*`` nodes), the inputs / outputs / attributes of the ONNX function bodies, and the manifest. ``docs/ops.md``
is the prose version; ``m3export.ops`` holds the reference implementations.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import AttributeProto, TensorProto, defs

from ..ops import DOMAIN, OPS, OPSET_VERSION

ONNX_OPSET = 20
"""Default-domain opset of every exported graph and function body (ORT 1.20+ runs it; fp8 Cast needs >= 19)."""

FLOATS = ("tensor(float)", "tensor(float16)", "tensor(bfloat16)")
INT = AttributeProto.INT
FLOAT = AttributeProto.FLOAT


@dataclass(frozen=True)
class Port:
    name: str
    type_var: str  # a key of OpSpec.types, or a concrete "tensor(...)" type
    doc: str


@dataclass(frozen=True)
class Attr:
    name: str
    kind: int  # AttributeProto.INT / FLOAT
    doc: str


@dataclass(frozen=True)
class OpSpec:
    name: str  # ONNX op type in domain m3
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    attributes: tuple[Attr, ...]
    types: dict[str, tuple[str, ...]]
    doc: str
    optional_inputs: tuple[Port, ...] = ()  # trailing inputs a node may leave out (the FP8 cache's scale pools)

    @property
    def torch_op(self) -> str:
        return OPS[self.name]


def _p(name: str, type_var: str, doc: str) -> Port:
    return Port(name, type_var, doc)


_PAGED = (
    _p("block_tables", "tensor(int32)", "[B, max_pages] pool page of each sequence's logical page"),
    _p("query_start_loc", "tensor(int32)", "[B + 1] first token of each sequence in the flattened batch; last = T"),
    _p("seq_lens", "tensor(int32)", "[B] context length of each sequence after this step"),
    _p("positions", "tensor(int64)", "[T] absolute position of each token (key j visible iff j <= position)"),
)
_MOE_ATTRS = (
    Attr("top_k", INT, "experts per token"),
    Attr("routed_scaling_factor", FLOAT, "multiplies the routed sum (not the shared expert)"),
    Attr("swiglu_alpha", FLOAT, "sigmoid gain of SwiGLU-OAI"),
    Attr("swiglu_limit", FLOAT, "clamp: gate <= limit, -limit <= up <= limit"),
)
_F8 = "tensor(float8e4m3fn)"
_U8 = "tensor(uint8)"
_POOLS = (*FLOATS, _U8)  # a cache pool: the model's float type, or E4M3 codes as uint8 (export/kv_fp8_onnx.py)
_F32 = "tensor(float)"


def _scale(name: str, pool: str, shape: str) -> Port:
    return _p(name, _F32, f"{shape} fp32 scale of each {pool} row; given iff {pool} holds E4M3 codes (uint8)")
_KV_SCALES = (_scale("k_scale", "k_cache", "[pages, page_size, Hkv]"),
              _scale("v_scale", "v_cache", "[pages, page_size, Hkv]"))

SPECS: tuple[OpSpec, ...] = (
    OpSpec(
        "LightningIndexer",
        inputs=(
            _p("index_q", "T", "[T, H, D] index queries (normed, roped)"),
            _p("index_k_cache", "P", "[pages, page_size, D] paged index-key pool (this step's keys already written)"),
            *_PAGED,
        ),
        optional_inputs=(_scale("index_k_scale", "index_k_cache", "[pages, page_size]"),),
        outputs=(_p("selected_blocks", "tensor(int32)", "[T, H, topk_blocks] block ids, forced first, -1 padded"),),
        attributes=(
            Attr("block_size", INT, "tokens per selection block"),
            Attr("topk_blocks", INT, "blocks kept per (token, index head)"),
            Attr("local_blocks", INT, "trailing blocks always kept, counting the query's own"),
            Attr("init_blocks", INT, "leading blocks always kept"),
        ),
        types={"T": FLOATS, "P": _POOLS},
        doc="Per-token, per-index-head top-k block selection by causal block max score.",
    ),
    OpSpec(
        "PagedAttention",
        inputs=(
            _p("q", "T", "[T, Hq, D] queries"),
            _p("k_cache", "P", "[pages, page_size, Hkv, D] key pool"),
            _p("v_cache", "P", "[pages, page_size, Hkv, Dv] value pool"),
            *_PAGED,
        ),
        optional_inputs=_KV_SCALES,
        outputs=(_p("out", "T", "[T, Hq, Dv]"),),
        attributes=(Attr("scale", FLOAT, "softmax scale applied to q.k"),),
        types={"T": FLOATS, "P": _POOLS},
        doc="Causal GQA over paged K/V pools.",
    ),
    OpSpec(
        "SparsePagedAttention",
        inputs=(
            _p("q", "T", "[T, Hq, D] queries"),
            _p("k_cache", "P", "[pages, page_size, Hkv, D] key pool"),
            _p("v_cache", "P", "[pages, page_size, Hkv, Dv] value pool"),
            *_PAGED,
            _p("block_idx", "tensor(int32)", "[T, Hkv, K] blocks each KV group may see (-1 = none)"),
        ),
        optional_inputs=_KV_SCALES,
        outputs=(_p("out", "T", "[T, Hq, Dv]"),),
        attributes=(
            Attr("block_size", INT, "tokens per selection block"),
            Attr("scale", FLOAT, "softmax scale applied to q.k"),
        ),
        types={"T": FLOATS, "P": _POOLS},
        doc="Causal GQA restricted to the lightning indexer's blocks.",
    ),
    OpSpec(
        "MoE",
        inputs=(
            _p("x", "T", "[T, H] activations"),
            _p("router_weight", "R", "[E, H] router (evaluated in fp32)"),
            _p("e_score_correction_bias", "R", "[E] added to the scores for selection only"),
            _p("w13", "W", "[E, 2I, H] gate rows then up rows"),
            _p("w2", "W", "[E, H, I] down projections"),
            _p("shared_w13", "W", "[2Is, H] shared expert gate rows then up rows"),
            _p("shared_w2", "W", "[H, Is] shared expert down projection"),
        ),
        outputs=(_p("y", "T", "[T, H]"),),
        attributes=_MOE_ATTRS,
        types={"T": FLOATS, "R": FLOATS, "W": FLOATS},
        doc="Sigmoid-routed top-k MoE with renormalised weights, routed scaling and an ungated shared expert.",
    ),
    OpSpec(
        "MoEMXFP8",
        inputs=(
            _p("x", "T", "[T, H] activations"),
            _p("router_weight", "R", "[E, H] router (evaluated in fp32)"),
            _p("e_score_correction_bias", "R", "[E] added to the scores for selection only"),
            _p("w13", _F8, "[E, 2I, H] E4M3 gate rows then up rows"),
            _p("w13_scale", _U8, "[E, 2I, H/32] UE8M0 exponents"),
            _p("w2", _F8, "[E, H, I] E4M3 down projections"),
            _p("w2_scale", _U8, "[E, H, I/32] UE8M0 exponents"),
            _p("shared_w13", _F8, "[2Is, H] E4M3 shared expert gate rows then up rows"),
            _p("shared_w13_scale", _U8, "[2Is, H/32] UE8M0 exponents"),
            _p("shared_w2", _F8, "[H, Is] E4M3 shared expert down projection"),
            _p("shared_w2_scale", _U8, "[H, Is/32] UE8M0 exponents"),
        ),
        outputs=(_p("y", "T", "[T, H]"),),
        attributes=_MOE_ATTRS,
        types={"T": FLOATS, "R": FLOATS},
        doc="MoE with MXFP8 weights, dequantised to the activation dtype (weight-only).",
    ),
    OpSpec(
        "MXFP8Linear",
        inputs=(
            _p("x", "T", "[..., K] activations"),
            _p("weight", _F8, "[N, K] E4M3 values"),
            _p("weight_scale", _U8, "[N, K/32] UE8M0 exponents (multiplied: 2^(s - 127))"),
        ),
        outputs=(_p("y", "T", "[..., N]"),),
        attributes=(),
        types={"T": FLOATS},
        doc="Bias-free linear layer with an MXFP8 weight, computed in the activation dtype.",
    ),
)
SPEC_BY_NAME = {s.name: s for s in SPECS}
assert set(SPEC_BY_NAME) == set(OPS), "every op of m3export.ops.OPS needs an ONNX spec"


def _inference(spec: OpSpec):
    """Output type and shape of an m3 node from its inputs, so shape inference sees through custom nodes."""
    from onnx import helper

    def infer(ctx) -> None:
        def tensor(i):
            t = ctx.get_input_type(i)
            return t.tensor_type if t is not None and t.HasField("tensor_type") else None

        def dims(t):
            return list(t.shape.dim) if t is not None and t.HasField("shape") else None

        def out(elem_type, shape):
            tp = helper.make_tensor_type_proto(elem_type, None)
            if shape is not None:
                for d in shape:
                    tp.tensor_type.shape.dim.add().CopyFrom(d)
            ctx.set_output_type(0, tp)

        first = tensor(0)
        if first is None:
            return
        lead = dims(first)
        if spec.name == "LightningIndexer":
            k = onnx.TensorShapeProto.Dimension(dim_value=ctx.get_attribute("topk_blocks").i)
            out(TensorProto.INT32, None if lead is None else lead[:2] + [k])
        elif spec.name in ("PagedAttention", "SparsePagedAttention"):
            v = dims(tensor(2))
            out(first.elem_type, None if lead is None or v is None else lead[:2] + v[3:4])
        elif spec.name == "MXFP8Linear":
            w = dims(tensor(1))
            out(first.elem_type, None if lead is None or w is None else lead[:-1] + w[:1])
        else:
            out(first.elem_type, lead)

    return infer


def _schema(spec: OpSpec) -> defs.OpSchema:
    def formal(p: Port, option=defs.OpSchema.FormalParameterOption.Single) -> defs.OpSchema.FormalParameter:
        return defs.OpSchema.FormalParameter(p.name, p.type_var, p.doc, param_option=option)

    schema = defs.OpSchema(
        spec.name, DOMAIN, OPSET_VERSION, spec.doc,
        inputs=[formal(p) for p in spec.inputs]
        + [formal(p, defs.OpSchema.FormalParameterOption.Optional) for p in spec.optional_inputs],
        outputs=[formal(p) for p in spec.outputs],
        type_constraints=[(k, list(v), "") for k, v in spec.types.items()],
        attributes=[defs.OpSchema.Attribute(a.name, defs.OpSchema.AttrType(a.kind), a.doc) for a in spec.attributes],
    )
    schema.set_type_and_shape_inference_function(_inference(spec))
    return schema


def register_schemas() -> None:
    """Make ``m3::*`` known to onnx in this process (idempotent)."""
    for spec in SPECS:
        if not defs.has(spec.name, DOMAIN):
            defs.register_schema(_schema(spec))


def opset_imports() -> list[onnx.OperatorSetIdProto]:
    return [onnx.helper.make_opsetid("", ONNX_OPSET), onnx.helper.make_opsetid(DOMAIN, OPSET_VERSION)]
