"""The decode-only step graphs: ``<graph>.decode.onnx`` beside ``model.onnx`` and each ``mtp{k}.onnx``, for steps
where every sequence has exactly one new token.

A runtime that can replay a captured step (ONNX Runtime's CUDA graphs, ``enable_cuda_graph``) needs a graph with
no control flow, no size computed from the step's values (on a GPU provider each is a device -> host copy, and a
capture would freeze it) and every node on the device: the general graph has an ``If`` / ``Scan`` in the MoE and
data-dependent sizes in the cache readers (``Tmax``, the context length ``max(positions) + 1``, the sparse body's
union width). The decode graph is the same graph (the same nodes, inputs, outputs and pools, so a runtime binds
the same buffers to either) with the ``m3`` nodes' function bodies specialised (``functions.body(..., decode=True)``):
the context length from the block-table width x the page size, no regrouping of tokens by sequence, the sparse
body's per-token gather of its K selected blocks, the MoE's per-assignment routed sum unconditionally. On a decode
step it computes what the general graph computes (``tests/test_ort_decode_graph.py``); on any other step its
result is undefined, so a runtime picks it only for decode steps (``is_decode_step``).

MXFP8 experts have no decode body (ONNX Runtime's CUDA EP has no float8 ``Gather``; their per-expert ``Scan`` is
control flow): an MXFP8 artifact gets no decode graphs, and asking for one says so.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from ..errors import ArtifactError
from ..ops import DOMAIN
from .flavour_files import write_flavour_graphs
from .functions import DecodeSizes, functions_for
from .compact_rope import PASS as COMPACT_ROPE, compact_ropes
from .element_scatters import PASS as ELEMENT_SCATTERS, element_scatters
from .fused_norms import PASS as FUSED_NORMS, fuse_rms_norms

FLAVOUR = "decode"
CONTROL_FLOW = ("If", "Loop", "Scan")
# ops whose output shape depends on input values (a device -> host copy and a host wait on a GPU provider)
VALUE_SHAPED = ("NonZero", "Unique", "Compress", "NonMaxSuppression")
STATUS = ("decode steps only (every sequence one new token); no control flow, no value-dependent sizes: "
          "replayable as an ONNX Runtime CUDA graph")


# The decode MoE's two forms (``functions.DecodeSizes.moe``), one decode graph each: ``per-assignment`` gathers each
# token's top_k expert weights (a copy: read, written, then read by the products), ``all-experts`` runs every
# expert on every token from the weights where they lie (one pass over all of them, E / (T * top_k) times the
# arithmetic): the first for the smallest batches of models with many experts, the second once GATHER_COST T top_k
# expert reads outweigh E (``moe_form``).
MOE_FORMS = ("per-assignment", "all-experts")
# What one gathered expert costs in expert weights read in place. Measured on the H200 (ONNX Runtime 1.31.1's CUDA
# Gather, `mini` bf16, 2026-12-01 11:13 UTC, bench/ort_kernels.py): ~210 us to copy an expert's 113 MB (~1.1 TB/s
# for its read and write) and ~27 us to read the copy, against ~27 us per expert for the all-experts products
# reading the weights in place (4.2 TB/s): ~9. (3, the copy's bytes alone, took the per-assignment form at batch 1
# of `mini`, 16 experts and top 4, whose weight gathers were then 2.5 ms of a 6.1 ms step.)
GATHER_COST = 9


def moe_form(tokens: int, top_k: int, experts: int) -> str:
    """The decode MoE form for a step of ``tokens`` tokens: per-assignment while GATHER_COST * tokens * top_k
    expert weights cost no more than one pass over all ``experts`` (the full model, 128 experts and top 4: up to 3
    tokens; `mini` and the tiny model: never)."""
    return MOE_FORMS[0] if GATHER_COST * tokens * top_k <= experts else MOE_FORMS[1]


def flavour_name(of: str | None = None, moe: str = MOE_FORMS[0]) -> str:
    """The manifest flavour of the decode graphs made from the plain graphs (``decode``; ``decode-all-experts``
    with the all-experts MoE) or from flavour ``of``'s graphs (``ort-contrib-decode``: the lowered graphs,
    ``com.microsoft`` nodes kept, the ``m3`` bodies specialised)."""
    name = FLAVOUR if of is None else f"{of}-{FLAVOUR}"
    return name if moe == MOE_FORMS[0] else f"{name}-{moe}"


def decode_model(model: onnx.ModelProto, kv_fp8: bool = False, moe: str = MOE_FORMS[0]) -> onnx.ModelProto:
    """``model`` (a step graph, loaded with or without its weights) with every ``m3`` function body replaced by its
    decode-only form; nodes, inputs, outputs and initializers unchanged. ``kv_fp8``: the graph's pools are FP8
    (uint8 codes with scale pools); ``moe``: the MoE's form (``MOE_FORMS``)."""
    used = {n.op_type for n in model.graph.node if n.domain == DOMAIN}
    try:
        sizes = sizes_of(model)
        bodies = {f.name: f for f in functions_for(used, kv_fp8, decode=DecodeSizes(sizes.page_size, sizes.kv_heads,
                                                                                    moe))}
    except ValueError as e:
        raise ArtifactError(f"no decode-only graph for this artifact: {e}") from None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.functions[:]
    out.functions.extend(bodies.get(f.name, f) if f.domain == DOMAIN else f for f in model.functions)
    missing = sorted(used - {f.name for f in out.functions if f.domain == DOMAIN})
    if missing:
        raise ArtifactError(f"{model.graph.name}: m3 nodes {missing} have no function body to specialise")
    return out


def sizes_of(model: onnx.ModelProto) -> DecodeSizes:
    """The page size and KV heads of a step graph, from its first ``k_cache`` pool input ([pages, page_size, Hkv,
    D]): the constants its decode bodies are built with."""
    for i in model.graph.input:
        if i.name.split(".")[0] == "k_cache":
            dims = [d.dim_value if d.HasField("dim_value") else None for d in i.type.tensor_type.shape.dim]
            if len(dims) == 4 and dims[1] and dims[2]:
                return DecodeSizes(page_size=dims[1], kv_heads=dims[2])
            raise ArtifactError(f"{model.graph.name}: pool {i.name} has shape {dims}; a decode graph needs a static "
                                "page size and KV head count")
    raise ArtifactError(f"{model.graph.name}: no k_cache pool input, so no decode graph")


def problems(model: onnx.ModelProto) -> list[str]:
    """What in ``model`` (its graph and its function bodies, subgraphs included) a captured step cannot hold:
    control-flow nodes and nodes whose output shape depends on values. Empty for a decode graph."""
    found = []

    def walk(nodes, where: str) -> None:
        for n in nodes:
            if n.op_type in CONTROL_FLOW or n.op_type in VALUE_SHAPED:
                found.append(f"{where}: {n.op_type} {n.name!r}")
            for a in n.attribute:
                for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    walk(g.node, f"{where}/{n.name}")

    walk(model.graph.node, "graph")
    for f in model.functions:
        walk(f.node, f"{f.domain}.{f.name}")
    return found


def graphs_with_decode_form(graphs: dict) -> list[str]:
    """The graphs of an artifact (name -> manifest ``GraphInfo``) that get a decode form: the step graph and the
    MTP modules (not the split parts, which a runtime does not run, nor the vision graph)."""
    return [g for g in graphs if g == "model" or (g.startswith("mtp") and g[3:].isdigit())]


def write_decode_graphs(directory: Path, graphs: dict, kv_fp8: bool = False, of: dict | None = None,
                        moe: str = MOE_FORMS[0], fuse_norms: bool = False, compact_rope: bool = True,
                        scatter_elements: bool = True, decode_attention: bool = False) -> dict:
    """Write ``<graph>.decode.onnx`` beside ``model.onnx`` and each ``mtp{k}.onnx`` in ``directory`` through the
    flavours' one writer (``flavour_files.write_flavour_graphs``: atomic, never replacing a file); ``of``: a
    flavour's record (e.g. ``ort-contrib``'s), whose graphs ``<graph>.ort.onnx`` get ``<graph>.ort.decode.onnx``;
    ``moe`` all-experts: ``<graph>.decode-all-experts.onnx``; ``fuse_norms``: each RMSNorm as one
    ``SimplifiedLayerNormalization`` node (``fused_norms.py``); ``compact_rope``: each RoPE as four nodes
    (``compact_rope.py``); ``scatter_elements``: each cache write indexed per element (``element_scatters.py``: one
    CUDA thread per element, not per row; the same bytes written). The RoPE and scatter passes are on by default
    and the norm pass off. The RoPE pass is bit-exact on
    ORT's CUDA kernels (H200 2026-12-01 11:13 UTC). The fused norm moves the logits by up to 0.068 (two bf16 ulps;
    logits up to 5.1), and twice at the ORT benchmark's own seed (07:42 and 12:05 UTC, `mini` bf16, batch 8 / 4k) the
    graph with it gave greedy tokens different from the torch backend's (first-step logits 0.95 apart), where the
    graph without it gave the same tokens (0.07 apart, 06:41 UTC). At another seed (11:13 UTC) the graph without it
    also parted from torch, on a routing near-tie (the 4th / 5th expert scores 0.0045 apart), so the fused norm may
    only tip near-ties; until the H200 shows that at the benchmark's seed, a lowering that changes greedy tokens is
    not the default (the two passes together saved 0.37 ms of a 5.95 ms batch-1 step at 07:42 UTC). Returns the
    manifest's record of the flavour ``flavour_name`` (per graph: file, source, external data, ``status``, ``moe``,
    ``graph_passes``: pass name -> nodes it rewrote). ``decode_attention`` (``DecodeAttention``, in ``lowering.DEFAULT``):
    each dense ``m3::PagedAttention`` as ONNX ``Attention``-24 (``decode_attention.py``), applied first; its record
    (lowered, kept and why, status) in ``decode_attention``. Dense layers lowered to ``com.microsoft.PagedAttention``
    (``PagedAttentionCore``) get the one-token bounds (``lowering.decode_bounds``)."""
    from types import SimpleNamespace

    sources = graphs if of is None else {g: SimpleNamespace(file=r["file"]) for g, r in of.items() if g in graphs}

    def rewrite(name: str, model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict]:
        decoded = decode_model(model, kv_fp8, moe)
        left = problems(decoded)
        if left:
            raise ArtifactError(f"{name}: the decode graph still holds {left[:3]}")
        passes, fields = {}, {"status": STATUS, "moe": moe}
        if decode_attention:  # dense attention as ONNX Attention-24, 16-bit pools only (``decode_attention.py``);
            # first: it reads the query's recorded shape, which the RMSNorm pass's rewrite does not keep (after it,
            # every dense node was kept, "query of shape []"); the passes below rewrite the same node counts either way
            from .decode_attention import PASS, lower_decode_attention, record

            decoded, passes[PASS], kept = lower_decode_attention(decoded)
            fields["decode_attention"] = record(passes[PASS], kept)
        if any(n.domain == "com.microsoft" and n.op_type == "PagedAttention" for n in decoded.graph.node):
            # a lowered dense layer (PagedAttentionCore): tell the op every sequence has one query token
            from .lowering import DECODE_BOUNDS, decode_bounds

            decoded, passes[DECODE_BOUNDS] = decode_bounds(decoded)
        if fuse_norms:  # fewer kernels per step: each RMSNorm one ORT kernel (``fused_norms.py``, its bound)
            decoded, passes[FUSED_NORMS] = fuse_rms_norms(decoded)
        if compact_rope:  # and each RoPE four nodes, bit-exact (``compact_rope.py``)
            decoded, passes[COMPACT_ROPE] = compact_ropes(decoded)
        if scatter_elements:  # each cache write one thread per element (``element_scatters.py``), the same bytes
            decoded, passes[ELEMENT_SCATTERS] = element_scatters(decoded)
        fields["graph_passes"] = passes
        return decoded, fields

    def file_of(name: str) -> str:
        return sources[name].file.removesuffix(".onnx") + (".decode.onnx" if moe == MOE_FORMS[0] else
                                                           f".decode-{moe}.onnx")

    protected = {g.file for g in graphs.values()} | {g.file for g in sources.values()}
    return write_flavour_graphs(Path(directory), sources, graphs_with_decode_form(sources), FLAVOUR, file_of,
                                rewrite, protected=protected)
