"""EXPERIMENTAL: lower ``m3`` nodes to ONNX Runtime's own ``com.microsoft`` kernels where they express the op.

A graph pass with onnx-graphsurgeon (no hand-edited protobuf); ``m3export export --flavour ort-contrib`` writes
each graph lowered as ``<graph>.ort.onnx`` beside it, recorded in the manifest's ``flavours``. Each lowering is kept only once the H200 shows
that the lowered graph matches the reference (block selections and greedy tokens exactly, logits within the
bound verify uses); until then every lowering here is **unverified on GPU**. What each one does:

* ``MoE`` (bf16 / fp16 / fp32 experts) -> ``com.microsoft.MoE`` for the routed experts (SwiGLU with M3's
  alpha, beta = 1 (the ``up + 1``), limit; gate/up rows interleaved by a Reshape/Transpose of ``w13`` that ORT
  folds at load into a copy of the session's own: the onnxruntime backend does not share such a weight,
  ``shared_weights.folded_by_the_session``), the shared expert as the ``m3`` body computes it (two ``Gemm``, the
  body's SwiGLU nodes: ``_shared_expert``). ORT's MoE softmaxes ``router_probs`` over its top-k,
  so M3's routing is passed as ``log(s)`` at the ``top_k`` experts chosen in fp32 by ``s + bias`` (the selection
  stays fp32: rounding it to 16 bits flips choices) and -10000 elsewhere: the weights come out as
  ``s / sum(s)`` over the chosen experts, as M3's. ``routed_scaling_factor`` is a separate Mul. Checked here on
  the CPU provider in fp32 against the conformance oracle (``tests/test_lowering.py``). On the H200 (14:45 UTC,
  snapshot ``a672acc``, `mini` bf16) its decode graph replayed at 1.79x / 1.90x / 2.06x the torch backend (batch 1
  and 8 at 4k, batch 1 at 32k) with the torch backend's greedy tokens (docs/ops.md); at 14:05 UTC its batch-8
  tokens once differed from torch's on what looks like a routing near-tie (ORT's kernel rounds the experts' sum
  its own way).
* ``MXFP8Linear`` -> ``com.microsoft.MatMulBlockQuantizedFp8Weight`` (``block_size`` 32): the E4M3 weight as
  is, the UE8M0 scales expanded to fp32 ``2^(s - 127)`` by nodes ORT folds at load (exact). The op takes fp16 /
  bf16 activations only, so fp32 graphs keep the ``m3`` node. ORT's CPU provider has no kernel for it: checked
  structurally only.

* ``PagedAttention`` (dense layers; **opt-in**, not in :data:`DEFAULT`; **REJECTED**: on the H200 the lowered
  graph's logits are 3.77 off the torch backend's, bound 2.42, :data:`REJECTED`; ``--lower PagedAttention`` still
  writes it for re-measurement, with a warning and the reason in the manifest) -> ``com.microsoft.PagedAttention``.
  ORT's op takes the *projections* (``q_proj`` / ``k_proj`` / ``v_proj`` outputs, ``[T, heads * D]``) and does
  per-head QK RMSNorm, partial NeoX RoPE, the K/V cache write and causal paged GQA itself, updating the pools in
  place. So the pass replaces, per dense layer, the q/k norm + RoPE nodes, the two cache ``ScatterND`` and the
  ``m3`` node; the projections, ``o_proj``, the residual stream and everything outside the layer stay. The op
  gets: the pools (its cache outputs become the graph's ``*_cache_out`` outputs, which the runtime binds to the
  input buffers as it does for the ScatterND), ``query_start_loc`` as ``cumulative_sequence_length``,
  ``past_seqlens = seq_lens - q_len``, ``block_tables``, ``slot_mapping`` (int32), a cos/sin table of width
  ``rotary_dim / 2`` (ORT rotates dims ``0 .. 2 * width``: M3's partial RoPE) indexed by absolute position and
  computed in the graph for positions ``0 .. max_pages * page_size`` (a shape, not data: no device read-back) the
  way the model computes its cos/sin, the gains ``T(1 + w)`` (ORT's gain is ``x * w``; M3 stores ``w`` as an
  offset from one), ``qk_norm_epsilon`` = the model's ``rms_norm_eps`` and the m3 node's ``scale``.
  **Not exact, hence opt-in:** the op takes fp16 / bf16 only (fp32 graphs keep the ``m3`` node) and its gain is
  a ``T`` tensor, so ``1 + w`` is rounded to ``T`` where M3 multiplies in fp32 before its one rounding: in bf16
  that is up to 2^-8 relative per channel (0.54-0.82% off M3's fp32 math measured on the H200,
  ``docs/gpu-kernels.md``), in fp16 2^-11 (0.07%). The manifest records the largest rounding of the actual
  gains (``gain_rounding``: 0 when ``1 + w`` happens to be exact in ``T``). Its pools must be of the activation
  dtype (a quantised KV cache keeps the ``m3`` node). ORT's CPU provider has no kernel for it: CI checks the
  structure and the wiring (the documented op emulated on the CPU, ``tests/test_lowering_attention.py``); the
  numbers are the H200's (``scripts/gpu_ort.sh``).

* ``PagedAttentionCore`` (dense layers; **a default** since 2026-12-02, :data:`VERIFIED`) -> the same
  ``com.microsoft.PagedAttention`` with ``do_rotary=0`` and no ``q_norm_weight`` / ``k_norm_weight`` / cos / sin:
  none of the inexact parts of ``PagedAttention`` above. The graph's own nodes keep computing M3's QK norm (fp32,
  ``(1 + w)`` in fp32, one rounding) and RoPE; the op gets what the ``m3`` node and the cache writes got: the
  node's query (the normed, rotated q, ``[T, H, D]``), the rows the K ``ScatterND`` writes (the normed, rotated
  keys) and those the V ``ScatterND`` writes (the value projection), each flattened to ``[T, heads * D]``, and the
  same pools / ``query_start_loc`` / ``past_seqlens`` / ``block_tables`` / int32 ``slot_mapping`` / ``scale`` as
  ``PagedAttention`` (one shared wiring, ``_ort_paged_attention``). It writes those rows into the pools in place
  and attends over the pages where they lie (no gather of K / V in the graph), for prefill and decode alike; it
  replaces the two ``ScatterND`` and the ``m3`` node of each dense layer and nothing else. 16-bit pools only
  (fp32 and FP8 pools keep the ``m3`` node, the reason in ``kept``); at most one of ``PagedAttention`` /
  ``PagedAttentionCore`` per export (``EXCLUSIVE``). The decode graphs made from the lowered graphs
  (``<graph>.ort.decode.onnx``, ``decode_graph.write_decode_graphs(of=...)``) keep the op: their dense layers are
  lowered too, and ``DecodeAttention`` then finds no dense ``m3`` node there.
  What ONNX Runtime does with it (onnxruntime-gpu 1.31.1: the wheel's schema strings give the inputs in 1.32's
  order, ``query, key, value, key_cache, value_cache, cumulative_sequence_length, past_seqlens, block_table,
  cos_cache, sin_cache, slot_mapping, head_sink, q_norm_weight, k_norm_weight, k_scale, v_scale,
  attention_metadata``, and the attributes ``rotary_offset`` / ``kv_cache_layout`` / ``k_cache_dtype`` in both; the
  CUDA kernel's own checks, read from the wheel's strings and ORT's ``contrib_ops/cuda/bert/paged_attention.cc``
  near that release): cos / sin may be absent with ``do_rotary=0`` (only "both present or both absent" and "required
  when do_rotary = 1" are checked); with neither norm nor rotary and unpacked q, no prologue kernel runs; the cache
  outputs must be the input buffers (the runtime binds ``*_cache_out`` to the pools, as for the ``ScatterND``);
  the page size must be a power of two of at least 16 (1.31.1's input check; the export default 16 is; other
  pages keep the m3 node, the reason in ``kept``: ``MIN_PAGE``). Without
  ``attention_metadata`` (a CPU-memory tensor of replay-wide bounds, not given here) the kernel sizes its launches
  from static capacities (``token_count``; ``block_table`` width x page size) and reads nothing back on a
  decode-shaped step (``T <= B``) with a 16-bit cache: such a step runs the paged decode kernel (FlashAttention
  needs a page size that is a multiple of 128 at head size 128, so not at page 16), which reads K / V in place, so a
  replayed CUDA graph of the decode graph stays valid. A prefill step (general graph, never captured) takes
  memory-efficient attention (CUTLASS), which first gathers the live context into a dense buffer sized by a
  device -> host read of the lengths and a stream sync, once per dense layer. Precision: the paged decode kernel
  is fp32 throughout (q and K / V converted to fp32, QK dot products, scale, online softmax with ``__expf``, P
  kept fp32, P.V accumulated in fp32, split-K partials merged in fp32, the output rounded once to the activation
  dtype); memory-efficient attention and FlashAttention keep fp32 scores, softmax and accumulators (tensor-core
  products of the 16-bit inputs, P rounded to 16 bits for the P.V product), so the bound of the project's own kernel
  applies (``plugins/kernels/paged_attention.output_error_bound``). The paged decode kernel is a CUDA-core
  kernel (one CTA per query token, query head and split; each query head reads its KV head's rows itself): on the
  H200 it took 22.1 ms of the batch-8 / 32k step (2026-12-01, when this lowering was rejected for speed). At page
  128 the paged FlashAttention ran instead (2026-12-02 00:59 UTC): 1.75 ms, one CTA per query head, no split-K
  without ``attention_metadata``. **The decode graphs therefore give the op ``attention_metadata`` = ``[1, table
  width x page size]``** (:func:`decode_bounds`; computed from shapes, in host memory as the op wants it): every
  sequence of a decode step has one query token. With it ORT runs its cuDNN paged SDPA ("one-token decode with
  attention_metadata", cuDNN >= 9.5, sm >= 90), which reads K / V in place at any page size: 0.13 ms of the
  batch-8 / 32k step, which took 5.92 ms against 7.30 with ``DecodeAttention`` (its gathers of K / V were 1.5 ms);
  greedy tokens equal to the torch backend's at batch 1 / 8 x 4k / 32k (:data:`VERIFIED`). cuDNN's kernel
  (``sdpa ... flash_fprop``) keeps fp32 scores, softmax and accumulators and rounds P to 16 bits for P.V, as
  FlashAttention does, so the same bound applies. CI:
  ``tests/test_lowering_attention.py`` checks the structure and
  the wiring (the documented op emulated with ``do_rotary=0``, no norm) against the plain graph in float16.

* ``DecodeAttention`` (dense layers; **a default** since 2026-12-01 23:00 UTC, decode graphs only; since
  ``PagedAttentionCore`` became a default it lowers only the dense m3 nodes a decode graph still holds, which for
  16-bit pools is none;
  ``decode_attention.py``) -> the standard ONNX ``Attention`` op (opset 24) on K / V rows gathered in the pool's
  16-bit dtype, ``nonpad_kv_seqlen`` the step's lengths: ONNX Runtime's CUDA EP runs it as flash attention (fp32
  scores and softmax). Applied by ``decode_graph.write_decode_graphs`` to ``<graph>.ort.decode.onnx`` (the
  ``ort-contrib-decode`` flavour's ``graph_passes`` / ``decode_attention`` record); this pass leaves the general
  graphs' nodes alone. **Measured** (H200, 2026-12-01 20:05 UTC, `mini` bf16, lowered decode graph with MoE +
  MXFP8Linear, replayed): 3.10 / 3.36 / 4.66 / 7.30 ms at batch 1 / 4k, 1 / 32k, 8 / 4k, 8 / 32k against 3.12 /
  3.90 / 4.80 / 8.83 without it (19:46 UTC), greedy tokens equal to the torch backend's in all four; logits at the
  plain graph's distance from torch except at batch 1 / 4k (2.68 against 0.055). Diagnosed at 22:35 UTC
  (``bench/ort_passes.py`` with router taps, ``bench/results/ort_passes_h200_2231.json``): the op's output is
  0.000488 (batch 1) and 0.000977 (batch 8) from the ``m3`` body's, bound 0.063 (``output_error_bound``); at batch
  8 it reroutes one token in the third MoE layer whose 4th / 5th expert scores are 0.0047 apart (the plain decode
  graph itself differs from torch at that seed through a 0.0045 margin), at batch 1 it moves the logits by 0.0625
  and reroutes nothing. So the 2.68 is the signature of a routing near-tie, not of the attention.

Not lowered, and why: ``MoEMXFP8`` (``QMoE``'s fp8 path is not built into the PyPI wheel and its fp8 scales are
square tiles, not MXFP8's 1x32), ``LightningIndexer`` and ``SparsePagedAttention`` (ORT's sparse ops share one
selection across KV heads and mean-pool blocks: not M3's semantics).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from .flavour_files import write_flavour_graphs

MS = "com.microsoft"
LOWERABLE = ("MoE", "MXFP8Linear", "PagedAttention", "PagedAttentionCore", "DecodeAttention")
TARGET = {"PagedAttentionCore": "PagedAttention"}  # lowerings named otherwise than the m3 op they lower
EXCLUSIVE = (("PagedAttention", "PagedAttentionCore"),)  # lowerings of the same nodes: at most one per export
# lowerings of the decode graphs only (``<graph>.ort.decode.onnx``, ``decode_graph.write_decode_graphs``): the
# ``<graph>.ort.onnx`` graphs keep these nodes, their record says why (``kept``)
DECODE_ONLY = ("DecodeAttention",)
# what ``--flavour ort-contrib`` lowers unless ``--lower`` says; ``DecodeAttention`` lowers the dense m3 nodes the
# decode graphs still hold (none where ``PagedAttentionCore`` lowered them: 16-bit pools)
DEFAULT = ("MoE", "MXFP8Linear", "PagedAttentionCore", "DecodeAttention")
OPT_IN = {  # lowerable but not by default, and why
    "PagedAttention": "opt-in (--lower): ORT's QK-norm gain is a 16-bit tensor, so M3's fp32 (1 + w) is rounded to "
                      "the activation dtype (bf16: up to 2^-8 per channel)",
}
# Lowerings the H200 measured NOT to match the reference, or to match it slower than the graph they replace.
# ``--lower`` still writes them (so they can be measured
# again, e.g. on a newer onnxruntime-gpu), with a warning (``warn_rejected``) and the reason in the manifest's
# flavour record (``rejected``); nothing picks a flavour graph by default.
REJECTED = {
    "PagedAttention": "REJECTED on the H200 (onnxruntime-gpu 1.31.1, CUDA EP, 2026-11-30, "
                      "tests/test_ort_cuda_stream.py): bf16 logits of the lowered dense layers differ from the torch "
                      "backend by 3.77 max abs (bound 2.42 = twice the plain graph's own difference; logits ~0.5, "
                      "single elements 0.068 vs 0.586). Inputs and attributes follow the op's schema (scale, pool and "
                      "block-table layout, past_seqlens, slot_mapping, norm gains) except possibly RoPE: the schema "
                      "documents cos_cache as (max seqlen, head_size / 2), a full-head rotation, while M3 rotates "
                      "rotary_dim < head_size dims (pairs i, i + rotary_dim / 2), passed as a narrower table that "
                      "ORT accepts but does not document; a full-width table cannot express M3's pairs",
}
NEG = -10000.0  # router logit of an expert M3 did not choose: exp(-10000 - max) is 0 in every float type


def _gs():
    try:
        import onnx_graphsurgeon as gs
    except ImportError as e:
        from ..errors import BackendUnavailable

        raise BackendUnavailable("the lowering pass needs onnx-graphsurgeon: pip install onnx-graphsurgeon") from e
    return gs


class _Emit:
    """Nodes appended to a graphsurgeon graph, each output a fresh Variable named after the lowered node."""

    def __init__(self, graph, prefix: str):
        self.gs, self.graph, self.prefix, self.count = _gs(), graph, prefix, 0

    def __call__(self, op: str, *inputs, domain: str = "", n_out: int = 1, **attrs):
        self.count += 1
        name = f"{self.prefix}/{op}_{self.count}"
        outs = [self.gs.Variable(f"{name}:{i}") for i in range(n_out)]
        ins = [self.gs.Variable.empty() if i is None else i for i in inputs]
        self.graph.nodes.append(self.gs.Node(op, name, attrs, ins, outs, domain=domain))
        return outs[0] if n_out == 1 else outs

    def const(self, value, dtype=np.int64):
        self.count += 1
        return self.gs.Constant(f"{self.prefix}/c{self.count}", np.asarray(value, dtype=dtype))


def _interleave(e: _Emit, w13):
    """[E, 2I, H] gate rows then up rows -> [E, 2I, H] rows gate0, up0, gate1, up1, ... (``swiglu_fusion=1``)."""
    hidden = e("Shape", w13, start=2)
    split = e("Reshape", w13, e("Concat", e.const([0, 2, -1]), hidden, axis=0))  # [E, 2, I, H]
    swapped = e("Transpose", split, perm=[0, 2, 1, 3])  # [E, I, 2, H]
    return e("Reshape", swapped, e("Concat", e.const([0, -1]), hidden, axis=0))


def _lower_moe(graph, node) -> None:
    x, router, bias, w13, w2, s13, s2 = node.inputs
    (y,) = node.outputs
    a = node.attrs
    e = _Emit(graph, node.name or "moe")
    f32 = onnx.TensorProto.FLOAT
    logits = e("MatMul", e("Cast", x, to=f32), e("Transpose", e("Cast", router, to=f32), perm=[1, 0]))
    s = e("Sigmoid", logits)
    _, idx = e("TopK", e("Add", s, e("Cast", bias, to=f32)), e.const([a["top_k"]]), axis=-1, largest=1, sorted=1,
               n_out=2)
    ones = e("Expand", e.const(1.0, np.float32), e("Shape", idx))
    chosen = e("ScatterElements", e("Mul", s, e.const(0.0, np.float32)), idx, ones, axis=1)
    probs = e("Where", e("Greater", chosen, e.const(0.0, np.float32)), e("Log", s), e.const(NEG, np.float32))
    swiglu = dict(activation_type="swiglu", activation_alpha=float(a["swiglu_alpha"]), activation_beta=1.0,
                  swiglu_limit=float(a["swiglu_limit"]), swiglu_fusion=1, normalize_routing_weights=1)
    routed = e("MoE", x, e("CastLike", probs, x), _interleave(e, w13), None, w2, domain=MS, k=int(a["top_k"]),
               **swiglu)
    shared = _shared_expert(e, x, s13, s2, float(a["swiglu_alpha"]), float(a["swiglu_limit"]))
    scaled = e("Mul", routed, e("CastLike", e.const(float(a["routed_scaling_factor"]), np.float32), x))
    graph.nodes.append(e.gs.Node("Add", f"{e.prefix}/out", {}, [scaled, shared], [y]))
    node.outputs.clear()


def _shared_expert(e: _Emit, x, s13, s2, alpha: float, limit: float):
    """The shared expert as the ``m3::MoE`` body computes it (``functions._linear`` / ``_swiglu``: two ``Gemm`` on
    the weights as they lie, the clamp in fp32 on exact casts), node for node, so its output is the plain graph's
    bit for bit. Not a one-expert ``com.microsoft.MoE``: on the H200 that ran 54.5 us per layer at batch 1 (its
    routing, permutation and grouped GEMM for one expert) where the two GEMMs read the same 113 MB in ~33 us
    (2026-12-01 13:37 UTC, `mini` bf16), and its weights needed the same per-session interleave as the routed
    experts' (``_interleave``)."""
    f32 = onnx.TensorProto.FLOAT
    gate_up = e("Gemm", x, s13, transB=1)
    gate, up = e("Split", gate_up, axis=-1, num_outputs=2, n_out=2)
    bound = e("Cast", e("CastLike", e.const(limit, np.float32), gate_up), to=f32)  # gate_up's rounding of it
    gate = e("CastLike", e("Clip", e("Cast", gate, to=f32), None, bound), gate_up)
    up = e("CastLike", e("Clip", e("Cast", up, to=f32), e("Neg", bound), bound), gate_up)
    sig = e("Mul", gate, e("Sigmoid", e("Mul", gate, e("CastLike", e.const(alpha, np.float32), gate_up))))
    act = e("Mul", e("Add", up, e("CastLike", e.const(1.0, np.float32), gate_up)), sig)
    return e("Gemm", act, s2, transB=1)


def _is_float32(dtype) -> bool:
    """A graphsurgeon dtype is float32 (bfloat16, which numpy lacks, comes as ONNX's enum)."""
    return dtype in (np.float32, onnx.TensorProto.FLOAT) or isinstance(dtype, np.dtype) and dtype == np.float32


def _lower_mxfp8_linear(graph, node) -> bool:
    x, weight, scale = node.inputs
    if x.dtype is not None and _is_float32(x.dtype):
        return False  # the ORT op takes fp16 / bf16 activations only
    (y,) = node.outputs
    e = _Emit(graph, node.name or "mxfp8_linear")
    f32 = onnx.TensorProto.FLOAT
    b_scale = e("Pow", e.const(2.0, np.float32), e("Sub", e("Cast", scale, to=f32), e.const(127.0, np.float32)))
    graph.nodes.append(e.gs.Node("MatMulBlockQuantizedFp8Weight", f"{e.prefix}/ms", {"block_size": 32},
                                 [x, weight, b_scale], [y], domain=MS))
    node.outputs.clear()
    return True


_FLOAT16 = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)  # ORT's PagedAttention's activation types


class _Skip(Exception):
    """A node this pass leaves as an ``m3`` node, with the reason (recorded in the manifest)."""


def _producer(tensor):
    return tensor.inputs[0] if len(tensor.inputs) == 1 else None


def _projection_and_gain(start, which: str, max_nodes: int = 64):
    """Walk back from ``start`` (the normed, rotated q or k, or the new v) through the norm / RoPE nodes of one
    attention layer to the node that applies ``*.{which}_proj.weight``; returns (that projection's output,
    the ``*.{which}_norm.weight`` constant or None). The walk never passes a projection, so it stays inside the
    layer; anything else (two projections, two gains, a long walk) is a graph this pass does not know."""
    gs = _gs()
    proj, gains, seen, todo = [], [], set(), [start]
    while todo:
        t = todo.pop()
        node = _producer(t)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if len(seen) > max_nodes:
            raise _Skip(f"{which}: no {which}_proj within {max_nodes} nodes of the attention input")
        if any(isinstance(i, gs.Constant) and i.name.endswith(f".{which}_proj.weight") for i in node.inputs):
            proj.append(node)
            continue
        for i in node.inputs:
            if isinstance(i, gs.Constant):
                if i.name.endswith(f".{which}_norm.weight"):
                    gains.append(i)
            elif i is not None:
                todo.append(i)
    if len(proj) != 1 or len(gains) != (0 if which == "v" else 1):
        raise _Skip(f"{which}: expected one {which}_proj and {0 if which == 'v' else 1} {which}_norm gain before the "
                    f"attention input, found {len(proj)} and {len(gains)}")
    return proj[0].outputs[0], (gains[0] if gains else None)


class _RopeTable:
    """cos / sin [max_pages * page_size, rotary_dim / 2] in the activation dtype for absolute positions 0 ..,
    computed as the model computes its cos / sin (``m3export/model/rope.py``: fp32 angles, rounded once), built
    once per graph and shared by every lowered layer. Its length is a shape (``block_tables``' second dimension
    times the page size), so building it reads nothing back from the device."""

    def __init__(self, graph, config):
        self.graph, self.config, self.tables = graph, config, {}

    def __call__(self, block_tables, page_size: int, onnx_type: int):
        if onnx_type not in self.tables:
            from ..model.rope import Rotary

            e = _Emit(self.graph, "rope_table")
            inv_freq = Rotary(self.config.rotary_dim, self.config.rope_theta)._inv_freq().numpy()
            f32 = onnx.TensorProto.FLOAT
            rows = e("Mul", e("Shape", block_tables, start=1, end=2), e.const([page_size]))
            pos = e("Range", e.const(0), e("Squeeze", rows, e.const([0])), e.const(1))
            angles = e("Mul", e("Unsqueeze", e("Cast", pos, to=f32), e.const([1])),
                       e.const(inv_freq[None, :], np.float32))
            self.tables[onnx_type] = (e("Cast", e("Cos", angles), to=onnx_type),
                                      e("Cast", e("Sin", angles), to=onnx_type))
        return self.tables[onnx_type]


def _cache_writes(node, types: dict[str, int]) -> tuple[list, int]:
    """The two cache ``ScatterND`` feeding one ``m3::PagedAttention`` node (its K and V pools), checked: each writes
    a graph-input pool, only the attention reads its result, and the pools are of one 16-bit dtype. Returns (the
    scatters, the pools' ONNX type); raises _Skip, touching nothing, otherwise. Shared by both ORT lowerings."""
    scatters = []
    for pool in node.inputs[1:3]:
        sc = _producer(pool)
        if sc is None or sc.op != "ScatterND" or sc.inputs[0].name not in types:
            raise _Skip(f"{pool.name} is not a ScatterND over a graph-input pool")
        if [c for c in pool.outputs if c is not node]:
            raise _Skip(f"{pool.name} is read by other nodes than the attention")
        scatters.append(sc)
    k_pool, v_pool = (sc.inputs[0] for sc in scatters)
    onnx_type = types[k_pool.name]
    if onnx_type not in _FLOAT16 or types[v_pool.name] != onnx_type:
        from ..dtypes import BY_ONNX

        name = BY_ONNX[onnx_type].name if onnx_type in BY_ONNX else onnx.TensorProto.DataType.Name(onnx_type)
        raise _Skip(f"{name} pools: ORT's PagedAttention takes float16 / bfloat16 activations with pools of the "
                    "same dtype")
    return scatters, onnx_type


def _ort_paged_attention(graph, node, e: _Emit, config, scatters: list, query, key, value, rotary=None,
                         gains=None) -> None:
    """``com.microsoft.PagedAttention`` in place of ``node`` and its two cache writes ``scatters`` (both lowerings):
    ``query`` / ``key`` / ``value`` ``[T, heads * D]``, the pools (updated in place; the op's cache outputs are the
    graph's ``*_cache_out`` outputs the scatters produced), ``query_start_loc``, ``past_seqlens = seq_lens - q_len``,
    ``block_tables``, ``slot_mapping`` as int32 (absent from the graph: ORT derives the slots from past_seqlens) and
    the m3 node's ``scale``. ``rotary``: (cos, sin), ``do_rotary=1`` (else 0 and no tables); ``gains``: (q, k) norm
    gains, ``qk_norm_epsilon`` = the model's ``rms_norm_eps`` (else no norm). Then a Reshape to the node's
    ``[T, H, D]`` output."""
    _q, k_new_pool, v_new_pool, block_tables, qsl, seq_lens, _positions = node.inputs
    (out,) = node.outputs
    c = config
    i32 = onnx.TensorProto.INT32
    q_len = e("Sub", e("Slice", qsl, e.const([1]), e.const([2**62])), e("Slice", qsl, e.const([0]), e.const([-1])))
    past = e("Sub", seq_lens, q_len)
    slots = next((t for t in graph.inputs if t.name == "slot_mapping"), None)
    slots = None if slots is None else e("Cast", slots, to=i32)  # absent: ORT derives them from past_seqlens
    k_pool, v_pool = (sc.inputs[0] for sc in scatters)
    for sc in scatters:
        sc.outputs.clear()  # the op writes the pools in place and produces the *_cache_out outputs itself
    attrs = dict(num_heads=c.num_attention_heads, kv_num_heads=c.num_key_value_heads, scale=float(node.attrs["scale"]),
                 do_rotary=int(rotary is not None))
    if rotary is not None:
        attrs["rotary_interleaved"] = 0
    if gains is not None:
        attrs["qk_norm_epsilon"] = float(c.rms_norm_eps)
    attrs["is_causal"] = 1
    none = e.gs.Variable.empty
    cos, sin = rotary if rotary is not None else (None, None)
    inputs = [query, key, value, k_pool, v_pool, qsl, past, block_tables, cos, sin, slots, None,  # no head sink
              *(gains if gains is not None else ())]
    while inputs[-1] is None:  # trailing optional inputs left out
        inputs.pop()
    flat = e.gs.Variable(f"{e.prefix}/ort_paged_attention:0")
    graph.nodes.append(e.gs.Node("PagedAttention", f"{e.prefix}/ort_paged_attention", attrs,
                                 [none() if i is None else i for i in inputs], [flat, k_new_pool, v_new_pool],
                                 domain=MS))
    node.outputs.clear()
    graph.nodes.append(e.gs.Node("Reshape", f"{e.prefix}/heads", {},
                                 [flat, e.const([0, c.num_attention_heads, c.head_dim])], [out]))


def _lower_paged_attention(graph, node, config, rope: _RopeTable, types: dict[str, int]) -> dict:
    """One dense layer's QK norm + RoPE + cache writes + ``m3::PagedAttention`` -> ``com.microsoft.PagedAttention``
    (module docstring). Raises _Skip, touching nothing, when the layer is not the shape this pass knows."""
    q = node.inputs[0]
    scatters, onnx_type = _cache_writes(node, types)
    (k_pool, _, k_rotated), (_, _, v_rows) = (sc.inputs for sc in scatters)
    query, q_gain = _projection_and_gain(q, "q")
    key, k_gain = _projection_and_gain(k_rotated, "k")
    value, _ = _projection_and_gain(v_rows, "v")
    _check_page_size(k_pool)
    page_size = k_pool.shape[1]
    e = _Emit(graph, node.name or "paged_attention")
    f32 = onnx.TensorProto.FLOAT

    def gain(w):  # M3's (1 + w) in fp32, rounded to the activation dtype (ORT's gain is a T tensor)
        return e("Cast", e("Add", e("Cast", w, to=f32), e.const(1.0, np.float32)), to=onnx_type)

    rotary = rope(node.inputs[3], page_size, onnx_type)
    _ort_paged_attention(graph, node, e, config, scatters, query, key, value, rotary=rotary,
                         gains=(gain(q_gain), gain(k_gain)))
    return {"q_gain": q_gain, "k_gain": k_gain}


MIN_PAGE = 16  # onnxruntime-gpu 1.31.1's PagedAttention refuses other pages: a power of two of at least 16


def _page_of(pool):
    """``pool``'s page size (dim 1 of ``[pages, page, ...]``) where the graph gives it statically, else None."""
    return pool.shape[1] if pool.shape is not None and len(pool.shape) > 1 else None


def _check_page_size(pool) -> None:
    """Raises _Skip unless ``pool``'s page size (dim 1) is one ORT's ``PagedAttention`` takes (``MIN_PAGE``): an
    export at ``--page-size 8`` keeps its m3 nodes, with the reason, rather than writing a graph ORT refuses."""
    page = _page_of(pool)
    if not isinstance(page, int) or page < MIN_PAGE or page & (page - 1):
        raise _Skip(f"{pool.name}: page size {page}; ORT's PagedAttention takes a power of two of at least {MIN_PAGE}")


def _heads_of(query, key_rows):
    """The head counts and size ``PagedAttentionCore`` needs, read off the m3 node's query ``[T, H, D]`` and the
    key rows ``[T, Hkv, D]`` when no config is given (``lower(model)`` with the default lowerings)."""
    from types import SimpleNamespace

    dims = [list(t.shape) if t.shape is not None else [] for t in (query, key_rows)]
    if any(len(d) != 3 or not all(isinstance(x, int) for x in d[1:]) for d in dims):
        raise _Skip(f"no config given and the query / key rows' shapes {dims} do not give the head counts")
    (_, h, d), (_, hkv, _) = dims
    return SimpleNamespace(num_attention_heads=h, num_key_value_heads=hkv, head_dim=d)


def _lower_paged_attention_core(graph, node, config, types: dict[str, int]) -> None:
    """One dense layer's cache writes + ``m3::PagedAttention`` -> ``com.microsoft.PagedAttention`` with
    ``do_rotary=0`` and no norm gains (module docstring, ``PagedAttentionCore``): the op gets the m3 node's own
    query and the rows the two ``ScatterND`` write (the graph's normed, rotated keys and its values), each
    ``[T, heads, D]`` flattened to ``[T, heads * D]``; the norm and RoPE nodes stay. Raises _Skip, touching nothing,
    when the layer is not the shape this pass knows."""
    q = node.inputs[0]
    scatters, _ = _cache_writes(node, types)
    c = config if config is not None else _heads_of(q, scatters[0].inputs[2])
    for rows, heads, what in ((q, c.num_attention_heads, "query"), (scatters[0].inputs[2], c.num_key_value_heads,
                                                                     "key rows"),
                              (scatters[1].inputs[2], c.num_key_value_heads, "value rows")):
        dims = list(rows.shape) if rows.shape is not None else None
        if dims is None or len(dims) != 3 or dims[1:] != [heads, c.head_dim]:
            raise _Skip(f"{what} {rows.name}: shape {dims}, expected [T, {heads}, {c.head_dim}] (one row per token)")
    _check_page_size(scatters[0].inputs[0])
    e = _Emit(graph, node.name or "paged_attention")
    query, key, value = (e("Reshape", t, e.const([0, -1])) for t in (q, scatters[0].inputs[2], scatters[1].inputs[2]))
    _ort_paged_attention(graph, node, e, c, scatters, query, key, value)


DECODE_BOUNDS = "PagedAttentionDecodeBounds"  # the decode graphs' pass below (their record's ``graph_passes``)
METADATA_INPUT = 16  # com.microsoft.PagedAttention's ``attention_metadata`` (1.31.1 and 1.32 input order)


def decode_bounds(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """The decode graphs' ``com.microsoft.PagedAttention`` nodes (``PagedAttentionCore``) given ``attention_metadata``
    = ``[1, block-table width x page size]`` (int32; computed from shapes only, so ONNX Runtime keeps it in host
    memory, as the op wants it): every sequence of a decode step has one query token, and none holds more keys
    than its table addresses. Why: without the input the op bounds a sequence's query tokens by the step's token
    count, so a batch-8 decode step is not a one-token decode to it, and onnxruntime-gpu 1.31.1 runs its decode
    tiers only for "one-token decode with attention_metadata" (its cuDNN paged SDPA, cuDNN >= 9.5, sm >= 90; the
    wheel's own message) and otherwise its paged FlashAttention (a page size that is a multiple of 128 at head
    size 128; per query head, so each of the 16 heads of a KV head reads that head's K / V again) or its scalar
    paged decode kernel. Bounds only size launches and pick the tier: the lengths that mask keys are still read
    from ``past_seqlens`` on the device. Only for decode graphs (one token per sequence, ``decode_graph``): the
    general graphs keep the op's static bounds. Returns the model and how many nodes got the input."""
    gs = _gs()
    graph = gs.import_onnx(model)
    done = 0
    for node in [n for n in graph.nodes if n.domain == MS and n.op == "PagedAttention"]:
        k_pool, block_tables = node.inputs[3], node.inputs[7]
        page = _page_of(k_pool)
        if not isinstance(page, int):
            raise ValueError(f"{node.name}: the key pool's page size (dim 1) is not static")
        e = _Emit(graph, f"{node.name}/decode_bounds")
        keys = e("Mul", e("Shape", block_tables, start=1, end=2), e.const([page]))
        metadata = e("Concat", e.const([1], np.int32), e("Cast", keys, to=onnx.TensorProto.INT32), axis=0)
        metadata.dtype, metadata.shape = np.int32, [2]
        inputs = list(node.inputs)[:METADATA_INPUT]
        inputs += [gs.Variable.empty() for _ in range(METADATA_INPUT - len(inputs))] + [metadata]
        node.inputs.clear()
        node.inputs.extend(inputs)
        done += 1
    return (exported(graph, model) if done else model), done


def exclusive_conflict(ops) -> tuple[str, ...] | None:
    """The first ``EXCLUSIVE`` group of which ``ops`` names more than one lowering, else None."""
    return next((one_of for one_of in EXCLUSIVE if len(set(one_of) & set(ops)) > 1), None)


def lower(model: onnx.ModelProto, ops: tuple[str, ...] = DEFAULT, config=None
          ) -> tuple[onnx.ModelProto, dict[str, int]]:
    """``model`` with its ``m3`` nodes of the given op types lowered (see the module docstring); returns the new
    model and how many nodes of each op type were lowered. Functions no node uses any more are dropped.
    ``config`` (the model's ``M3Config``) is needed for ``PagedAttention`` (RoPE and norm constants);
    ``PagedAttentionCore`` reads the head counts off the graph's shapes without it."""
    lowered, done, _ = lower_with_report(model, ops, config)
    return lowered, done


def lower_with_report(model: onnx.ModelProto, ops: tuple[str, ...] = DEFAULT, config=None
                      ) -> tuple[onnx.ModelProto, dict[str, int], dict]:
    """:func:`lower`, plus a report: per op, why nodes were left as ``m3`` nodes (``kept``), and for each
    lowered ``PagedAttention`` the names of its norm gains (``gains``, for :func:`gain_rounding`)."""
    gs = _gs()
    unknown = sorted(set(ops) - set(LOWERABLE))
    if unknown:
        raise ValueError(f"cannot lower {unknown}: lowerable m3 ops are {list(LOWERABLE)}")
    one_of = exclusive_conflict(ops)
    if one_of:
        raise ValueError(f"lower at most one of {list(one_of)}: they lower the same m3 nodes")
    if "PagedAttention" in ops and config is None:
        raise ValueError("lowering PagedAttention needs the model's config (rotary_dim, rope_theta, rms_norm_eps)")
    types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    graph = gs.import_onnx(model)
    done = dict.fromkeys(ops, 0)
    report: dict = {"kept": {}, "gains": []}
    rope = _RopeTable(graph, config)
    for op in DECODE_ONLY:
        if op in ops:
            report["kept"][op] = "decode graphs only: lowered in <graph>.ort.decode.onnx (the ort-contrib-decode " \
                                 "flavour's decode_attention record)"
    target = {TARGET.get(op, op): op for op in ops if op not in DECODE_ONLY}  # m3 op -> the lowering asked for
    for node in list(graph.nodes):
        if node.domain != "m3" or node.op not in target:
            continue
        if node.op == "MoE":
            _lower_moe(graph, node)
            done["MoE"] += 1
        elif node.op == "MXFP8Linear":
            if _lower_mxfp8_linear(graph, node):
                done["MXFP8Linear"] += 1
            else:
                report["kept"]["MXFP8Linear"] = "float32 activations: ORT's op takes float16 / bfloat16"
        elif target[node.op] == "PagedAttentionCore":
            try:
                _lower_paged_attention_core(graph, node, config, types)
            except _Skip as why:
                report["kept"]["PagedAttentionCore"] = f"{node.name}: {why}"
                continue
            done["PagedAttentionCore"] += 1
        elif node.op == "PagedAttention":
            try:
                gains = _lower_paged_attention(graph, node, config, rope, types)
            except _Skip as why:
                report["kept"]["PagedAttention"] = f"{node.name}: {why}"
                continue
            report["gains"] += [gains["q_gain"].name, gains["k_gain"].name]
            done["PagedAttention"] += 1
    return exported(graph, model), done, report


def exported(graph, model: onnx.ModelProto, default_opset: int | None = None) -> onnx.ModelProto:
    """A lowering pass's graphsurgeon ``graph`` (imported from ``model``), cleaned up and sorted, back to ONNX with
    ``model``'s IR version, the functions of ``model`` its nodes still use (the others dropped), ``model``'s opsets
    plus ``com.microsoft`` where a node is of that domain; ``default_opset``: the default domain's raised to at
    least that, in the functions too (``onnx.checker`` wants a function's default opset to be the model's)."""
    graph.cleanup().toposort()
    out = _gs().export_onnx(graph)
    used = {(n.domain, n.op_type) for n in out.graph.node}
    kept = [f for f in model.functions if (f.domain, f.name) in used]
    del out.functions[:]
    out.functions.extend(kept)
    del out.opset_import[:]
    for o in model.opset_import:
        if o.domain in {p.domain for p in out.opset_import}:  # one per domain, the first kept
            continue
        version = max(o.version, default_opset) if o.domain == "" and default_opset else o.version
        out.opset_import.append(onnx.helper.make_opsetid(o.domain, version))
    if any(n.domain == MS for n in out.graph.node) and MS not in {o.domain for o in out.opset_import}:
        out.opset_import.append(onnx.helper.make_opsetid(MS, 1))
    if default_opset:
        for f in out.functions:
            for o in f.opset_import:
                if o.domain == "" and o.version < default_opset:
                    o.version = default_opset
    out.ir_version = model.ir_version
    return out


def gain_rounding(model: onnx.ModelProto, directory: Path, names: list[str], onnx_type: int) -> float:
    """Largest relative change of ``1 + w`` when rounded to ``onnx_type``, over the norm gains ``names`` (read
    from the model's external data in ``directory``): what the lowered ``PagedAttention`` gives up against M3's
    fp32 gain (0.0: exact for these weights)."""
    from ..dtypes import BY_ONNX

    wanted = {t.name: t for t in model.graph.initializer if t.name in names}
    worst = 0.0
    for name in names:
        tensor = wanted[name]
        raw = onnx.numpy_helper.to_array(tensor, base_dir=str(directory))
        w = BY_ONNX[tensor.data_type].to_torch(np.array(raw).view(BY_ONNX[tensor.data_type].storage)).float()
        exact = (1.0 + w).double()  # M3's gain: 1 + w in fp32 (model/norm.py)
        rounded = (1.0 + w).to(BY_ONNX[onnx_type].torch).double()
        worst = max(worst, float(((rounded - exact).abs() / exact.abs().clamp_min(1e-30)).max()))
    return worst


FLAVOUR = "ort-contrib"
STATUS = "experimental: unverified on GPU (kept only once the H200 shows it matches the reference)"
VERIFIED_STATUS = "verified on GPU: "  # how a flavour record whose lowerings are all in VERIFIED begins
# Lowerings the H200 has shown to match the torch backend (greedy tokens equal, logits within twice the plain
# graph's own distance, bench/ort_gpu.py): a flavour whose applied lowerings are all here is recorded as verified.
VERIFIED = {
    "MoE": "matched on the H200 (onnxruntime-gpu 1.31.1, CUDA EP, 2026-12-01 14:45 UTC, snapshot a672acc, mini bf16 "
           "decode graph replayed): greedy tokens the torch backend's at batch 1 / 4k, 8 / 4k and 1 / 32k, logits "
           "0.051 / 0.072 / 0.055 apart (the plain graph's own 0.055 / 0.079 / 0.063); at 14:05 UTC one batch-8 "
           "greedy difference, the signature of a routing near-tie (ORT's kernel rounds the experts' sum its own way)",
    "DecodeAttention": "matched on the H200 (onnxruntime-gpu 1.31.1, CUDA EP, 2026-12-01 20:05 UTC, mini bf16 "
                       "lowered decode graph replayed): greedy tokens the torch backend's at batch 1 / 8 x 4k / 32k; "
                       "at 22:35 UTC the op's output 0.000488 / 0.000977 from the m3 body's at batch 1 / 8 (bound "
                       "0.063), its one logit excursion a routing near-tie (a 0.0047 expert-score margin)",
    "PagedAttentionCore": "matched on the H200 (onnxruntime-gpu 1.31.1, CUDA EP, 2026-12-02 01:13 and 01:32 UTC, "
                          "mini bf16, page 16, decode graph with the one-token bounds replayed, "
                          "bench/results/ort_gpu_decode_h200_s19_core_bounds.json, ..._s19_default.json): greedy "
                          "tokens the torch backend's at batch 1 / 8 x 4k / 32k in both runs, general graphs' too; "
                          "logits at the plain graph's distance but at batch 1 / 4k (2.69 and 3.02 against 0.055), "
                          "where DecodeAttention's flash kernel parted the same way (2.68), diagnosed then as a "
                          "routing near-tie; 5.54 ms at batch 8 / 32k (1.90x torch) against DecodeAttention's 7.30",
}


def status(applied: list[str]) -> str:
    """The flavour record's status: verified where every applied lowering is in ``VERIFIED``, else ``STATUS``
    naming the unverified ones."""
    unverified = [op for op in applied if op not in VERIFIED]
    if applied and not unverified:
        return VERIFIED_STATUS + "; ".join(f"{op}: {VERIFIED[op]}" for op in applied)
    return STATUS + (f"; unverified: {', '.join(unverified)}" if unverified else "")


def warn_rejected(ops: tuple[str, ...]) -> None:
    """A warning naming each requested lowering that the H200 rejected, and why (``REJECTED``)."""
    import warnings

    for op in ops:
        if op in REJECTED:
            warnings.warn(f"--lower {op}: {REJECTED[op]}; written for measurement only", UserWarning, stacklevel=3)


def flavour_file(graph: str) -> str:
    return f"{graph}.ort.onnx"


def write_flavour_files(directory: Path, graphs: dict, ops: tuple[str, ...] = DEFAULT, config=None) -> dict:
    """Write ``<graph>.ort.onnx`` (the graph lowered by :func:`lower`) beside each graph file of ``graphs`` (name ->
    manifest ``GraphInfo``; not the vision graph) in ``directory``, where the external data resolves, through the
    flavours' one writer (``flavour_files.write_flavour_graphs``: atomic, never replacing a file). Inputs and
    outputs are the graph's own, so the manifest's signatures describe the flavour too. Returns the manifest's
    ``flavours["ort-contrib"]`` record: per graph, the file, its source and external data, how many nodes of each
    requested op were lowered (``lowered``), which lowerings were applied (``applied``), why nodes of a requested
    op were kept as ``m3`` nodes (``kept``), why lowerable ops were not requested (``not_requested``) and, where
    ``PagedAttention`` was lowered, the largest rounding of its norm gains (``gain_rounding``)."""
    directory = Path(directory)

    def rewrite(name: str, model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
        lowered, done, report = lower_with_report(model, ops, config)
        fields = {"lowered": done, "applied": sorted(op for op, n in done.items() if n), "kept": report["kept"],
                  "not_requested": {op: OPT_IN.get(op, "not requested") for op in LOWERABLE if op not in ops},
                  "rejected": {op: REJECTED[op] for op in ops if op in REJECTED},
                  "status": status(sorted(op for op, n in done.items() if n))}
        if report["gains"]:
            pool = next(i for i in model.graph.input if i.name.startswith("k_cache"))
            try:
                fields["gain_rounding"] = gain_rounding(model, directory, report["gains"],
                                                        pool.type.tensor_type.elem_type)
            except OSError:  # in place, the data sits in the checkpoint's shards, not yet beside the graphs
                fields["gain_rounding"] = None
        return lowered, fields

    return write_flavour_graphs(directory, graphs, [g for g in graphs if g != "vision"], FLAVOUR, flavour_file,
                                rewrite, protected={g.file for g in graphs.values()})
