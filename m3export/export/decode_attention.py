"""A default of ``--flavour ort-contrib`` (``lowering.DEFAULT``; a ``--lower`` list without it leaves it out): in the
lowered DECODE graphs
(``<graph>.ort.decode.onnx``) each dense layer's ``m3::PagedAttention`` node becomes the standard ONNX
``Attention`` op (opset 24, domain ""), which ONNX Runtime's CUDA EP runs as one flash-attention kernel.

Why: the decode body (``functions.paged_attention_decode``) gathers K and V head-major, casts them to fp32 and
does fp32 MatMuls; what grows with the context is those bytes (at batch 8 / 32k ~6-7x the minimal ones, issue 16).
Here the rows are gathered in the pool's own dtype, slot-major (``[T, L, Hkv * D]``: the pool's own row layout,
``[pages, page, Hkv, D]``, so each gathered row is one contiguous copy, and the 3-D "BSNH" form the CUDA kernel
reads as is: no transposes of K, V, Q or the output), and ``Attention`` takes them with:

* ``Q`` = the node's ``q`` ``[T, H, D]`` as ``[T, 1, H * D]`` (one query token per sequence: a decode step);
* ``nonpad_kv_seqlen`` = ``positions + 1`` (int64, per sequence): keys ``0 .. position`` are visible, exactly the
  decode body's ``visible`` (``DecodeContext``; on a decode step ``position = seq_len - 1``); no ``attn_mask``,
  ``is_causal`` 0 (one query: the causal frontier is the length itself);
* ``q_num_heads`` / ``kv_num_heads`` (GQA, query head h reads KV head h // (H / Hkv), as M3's grouping), ``scale`` =
  the m3 node's, ``softmax_precision`` = 1 (FLOAT).

Gather indices are in range by construction, as in the decode body: slots past a sequence's length (whatever its
table holds there) are replaced by the token's own slot, and the op ignores those keys (``nonpad_kv_seqlen``).

Numerics (onnxruntime-gpu 1.31.1's ``onnxruntime/core/providers/cuda/llm/attention.cc``; the wheel's strings show
its dispatch cascade cuDNN SDPA (only with ``ORT_ENABLE_CUDNN_FLASH_ATTENTION``) -> Flash -> memory-efficient ->
unfused): a bf16 / fp16 GQA decode with ``nonpad_kv_seqlen``, no mask, head size <= 256 and a multiple of 8, takes
Flash (``mha_fwd_kvcache`` with ``seqlens_k`` = ``nonpad_kv_seqlen``): QK^T on tensor cores with fp32 accumulation,
scale and online softmax in fp32, P rounded to bf16 / fp16 for the P.V product with fp32 accumulation, split-K
partials merged in fp32, the output rounded once. That is what the project's Triton kernel rounds, so its bound
applies (``plugins/kernels/paged_attention.output_error_bound``: (3u + u^2 + 2^-12) max|V|, u = 2^-8 in bf16).
The fallbacks round no more (memory-efficient: fp32 accumulators; unfused: an fp32 QK scratch and fp32 softmax).

Not lowered (the ``m3`` node kept, with the reason in the manifest): float32 pools (the fp32 graph is the
reference form; the CUDA Flash path takes 16-bit types only) and FP8 pools (uint8 codes with scale pools: no
standard op decodes them). ORT's CPU EP has float32 / float16 kernels for Attention-24 but none for bfloat16
(it falls back to the op's function body, whose ``Expand`` has no CPU bfloat16 kernel): CI checks the numbers in
float16 (``tests/test_lowering_decode_attention.py``); the bf16 numbers are the H200's (``scripts/gpu_ort.sh``):
``STATUS`` says what they showed (the lowering is a default of ``--flavour ort-contrib``, ``lowering.DEFAULT``).
"""

from __future__ import annotations

import onnx

PASS = "DecodeAttention"
OPSET = 24  # Attention with nonpad_kv_seqlen
STATUS = ("a default of the ort-contrib decode graphs: dense decode attention as ONNX Attention-24 (16-bit pools). "
          "Measured on the H200 (2026-12-01, onnxruntime-gpu 1.31.1, mini bf16): greedy tokens equal to the torch "
          "backend's at batch 1 / 8 x 4k / 32k, 7.30 against 8.83 ms at batch 8 / 32k; the op's output within "
          "output_error_bound of the m3 body's (0.000977, bound 0.063); one logit excursion (2.68 at batch 1 / 4k) "
          "the signature of a routing near-tie (bench/ort_passes.py's router taps: a 0.0047 expert-score margin)")
_16BIT = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


class _Skip(Exception):
    """A node left as an ``m3`` node, with the reason (recorded in the manifest)."""


class _Slots:
    """Per sequence, the pool slot of each key ``0 .. L-1`` (L = table width x page size, a shape) as ``[T, L]``
    int64, keys past the sequence's length at the token's own slot (``functions.DecodeContext`` / ``own_slots``'
    rule: every gathered row is a row of the sequence, never an id the table happens to hold past its end). Built
    once per graph; every dense layer reads the same."""

    def __init__(self, graph):
        self.graph, self.built = graph, {}

    def __call__(self, emit, block_tables, seq_lens, positions, page: int):
        key = (block_tables.name, seq_lens.name, positions.name, page)
        if key not in self.built:
            e = emit("decode_attention_slots")
            i64 = onnx.TensorProto.INT64
            tables = e("Cast", block_tables, to=i64)
            length = e("Mul", e("Shape", block_tables, start=1, end=2), e.const([page]))
            key_pos = e("Range", e.const(0), e("Squeeze", length, e.const([0])), e.const(1))  # [L]
            pages = e("Gather", tables, e("Div", key_pos, e.const(page)), axis=1)  # [T, L]
            slots = e("Add", e("Mul", pages, e.const(page)), e("Mod", key_pos, e.const(page)))
            pos = e("Unsqueeze", e("Cast", positions, to=i64), e.const([1]))  # [T, 1]
            own_page = e("GatherElements", tables, e("Div", pos, e.const(page)), axis=1)
            own = e("Add", e("Mul", own_page, e.const(page)), e("Mod", pos, e.const(page)))  # [T, 1]
            inside = e("Less", e("Unsqueeze", key_pos, e.const([0])),
                       e("Unsqueeze", e("Cast", seq_lens, to=i64), e.const([1])))
            self.built[key] = e("Where", inside, slots, own)
        return self.built[key]


def _dims(tensor) -> list:
    return list(tensor.shape) if tensor.shape is not None else []


def _lower(graph, node, emit, slots: _Slots, types: dict) -> None:
    """One ``m3::PagedAttention`` node of a decode graph -> gathers + ``Attention``; raises _Skip, touching
    nothing, for a node this pass does not lower."""
    if len(node.inputs) != 7:
        raise _Skip(f"{len(node.inputs)} inputs: FP8 pools (uint8 codes with scale pools) keep the m3 node")
    q, k_pool, v_pool, block_tables, _qsl, seq_lens, positions = node.inputs
    writer = k_pool.inputs[0] if len(k_pool.inputs) == 1 else None  # the cache write of this layer's K pool
    pool_type = types.get(writer.inputs[0].name) if writer is not None and writer.inputs else None
    if pool_type not in _16BIT:
        name = onnx.TensorProto.DataType.Name(pool_type) if pool_type is not None else "unknown"
        raise _Skip(f"{name} pools: the lowering takes float16 / bfloat16 pools (an fp32 graph is the reference "
                    "form; an FP8 pool has no standard decode)")
    kd, vd, qd = _dims(k_pool), _dims(v_pool), _dims(q)
    if len(kd) != 4 or len(vd) != 4 or not all(isinstance(d, int) for d in kd[1:] + vd[1:]):
        raise _Skip(f"{k_pool.name} / {v_pool.name}: pools of shape {kd} / {vd}; need [pages, page, Hkv, D] with "
                    "static page, Hkv, D")
    if len(qd) != 3 or not isinstance(qd[1], int):
        raise _Skip(f"{q.name}: query of shape {qd}; need [T, H, D] with a static head count")
    page, hkv, d, dv, heads = kd[1], kd[2], kd[3], vd[3], qd[1]
    if vd[1] != page or vd[2] != hkv or heads % hkv:
        raise _Skip(f"pools {kd} / {vd} and {heads} query heads do not form GQA")
    (out,) = node.outputs
    e = emit(node.name or "decode_attention")
    rows = slots(emit, block_tables, seq_lens, positions, page)  # [T, L]
    keys = e("Gather", e("Reshape", k_pool, e.const([-1, hkv * d])), rows, axis=0)  # [T, L, Hkv * D], pool dtype
    values = e("Gather", e("Reshape", v_pool, e.const([-1, hkv * dv])), rows, axis=0)
    query = e("Reshape", q, e.const([0, 1, heads * d]))  # [T, 1, H * D]
    lengths = e("Add", e("Cast", positions, to=onnx.TensorProto.INT64), e.const(1))  # keys 0 .. position
    none = e.gs.Variable.empty
    flat = e.gs.Variable(f"{e.prefix}/attention:0")
    graph.nodes.append(e.gs.Node("Attention", f"{e.prefix}/attention",
                                 dict(q_num_heads=heads, kv_num_heads=hkv, scale=float(node.attrs["scale"]),
                                      softmax_precision=onnx.TensorProto.FLOAT, is_causal=0),
                                 [query, keys, values, none(), none(), none(), lengths], [flat]))
    node.outputs.clear()
    graph.nodes.append(e.gs.Node("Reshape", f"{e.prefix}/heads", {}, [flat, e.const([0, heads, dv])], [out]))


def lower_decode_attention(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int, dict[str, str]]:
    """``model`` (a decode graph: ``decode_graph.decode_model``'s output) with each dense ``m3::PagedAttention``
    node lowered (module docstring) -> (the new model, how many were lowered, node name -> why it was kept). The
    default-domain opset is raised to 24, the graph's and its functions' alike (``onnx.checker`` wants them equal),
    where a node was lowered: of the ops these graphs use, those with a newer version by 24 (Cast, CastLike,
    Constant, Cos, Sin, Flatten, If, Pad, Reshape, Shape, Squeeze, TopK, Transpose, Unsqueeze) only widen their
    types; functions no node uses any more are dropped."""
    from .lowering import _Emit, _gs, exported

    gs = _gs()
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    graph = gs.import_onnx(model)
    slots = _Slots(graph)
    count, kept = 0, {}
    for node in list(graph.nodes):
        if node.domain != "m3" or node.op != "PagedAttention":
            continue
        try:
            _lower(graph, node, lambda prefix: _Emit(graph, prefix), slots, types)
        except _Skip as why:
            kept[node.name] = str(why)
            continue
        count += 1
    if not count:
        return model, 0, kept
    return exported(graph, model, default_opset=OPSET), count, kept


def record(count: int, kept: dict[str, str]) -> dict:
    """The decode flavour record's ``decode_attention`` field."""
    return {"lowered": count, "kept": kept, "status": STATUS}


__all__ = ["PASS", "STATUS", "lower_decode_attention", "record"]
