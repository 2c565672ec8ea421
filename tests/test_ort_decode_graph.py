"""The decode-only step graphs (``model.decode.onnx``, ``export/decode_graph.py``) on ONNX Runtime's CPU EP: on
decode steps they compute what the general graphs compute (logits, hidden states, every cache pool row written,
block selections), whatever the block-table width; they hold no control flow and no size computed from the step's
values (graph inspection, and the CUDA EP placement predicted by ``bench/ort_step_host.py``: no Memcpy node);
an MXFP8 model has none, with a clear error.

Both graphs of a case run in one process on one set of pools (``PagedSession.allocate(pools_of=...)``): the
decode graph first, then the general graph on the same step, which rewrites the same rows; the rows the decode
graph wrote are compared with the general graph's."""

from __future__ import annotations

from collections import Counter

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from m3export.errors import ArtifactError
from m3export.export.artifact import load_artifact
from m3export.export.decode_graph import FLAVOUR, decode_model, flavour_name, problems
from m3export.model.batch import Segment, build_batch
from m3export.plugins.onnxruntime.session import PagedSession

pytest.importorskip("onnxruntime")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

ALL_EXPERTS = flavour_name(moe="all-experts")  # the decode graphs whose MoE runs every expert
PAGES = 40
LENGTHS = (37, 9, 58)  # contexts past several indexer blocks (tiny: 4 keys a block, top 3 of them, 1 local)


def _sessions(path, flavour: str = FLAVOUR):
    art = load_artifact(path)
    general = PagedSession.from_artifact(art, threads=1)
    decode = PagedSession.from_artifact(art, flavour=flavour, threads=1)
    general.allocate(PAGES)
    decode.allocate(PAGES, pools_of=general)
    return art, general, decode


def _feeds(ids, batch):
    return {"input_ids": ids, **dict(zip(batch.input_names(), batch.inputs())),
            "logits_indices": torch.arange(ids.shape[0], dtype=torch.int64)}


def _pages(page_size: int):
    """Each sequence's block table: pages laid out so that the sequences interleave in the pool."""
    need = [-(-(n + 8) // page_size) for n in LENGTHS]
    return [list(range(i, len(LENGTHS) * n, len(LENGTHS)))[:n] for i, n in enumerate(need)]


def _compare(art, general, decode, steps: int, extra_width: int = 0):
    """A prefill of ``LENGTHS`` through the general graph, then ``steps`` decode steps through both graphs (the
    decode graph's tables ``extra_width`` pages wider, as a CUDA-graph runtime pads them). -> the largest relative
    difference of logits / hidden, and of the pool rows written."""
    rng = np.random.default_rng(0)
    page, pages = art.page_size, _pages(art.page_size)
    prompts = [rng.integers(0, art.config.vocab_size, n).tolist() for n in LENGTHS]
    ids, batch = build_batch([Segment(p, 0, t) for p, t in zip(pages, prompts)], page)
    general.run(_feeds(ids, batch))
    lengths = list(LENGTHS)
    worst = {"out": 0.0, "pools": 0.0}
    for _ in range(steps):
        tokens = rng.integers(0, art.config.vocab_size, len(lengths)).tolist()
        segments = [Segment(p, n, [t]) for p, n, t in zip(pages, lengths, tokens)]
        ids, batch = build_batch(segments, page)
        wide_ids, wide = build_batch(segments, page, min_table_width=batch.block_tables.shape[1] + extra_width)
        got = {k: v.copy() for k, v in decode.run(_feeds(wide_ids, wide)).items()}
        written = {k: v.clone() for k, v in general.pool_tensors.items()}
        want = general.run(_feeds(ids, batch))
        for name, w in want.items():
            g = got[name]
            if name.startswith("selection"):  # block ids: exact (both bodies rank with the same tie rule)
                assert np.array_equal(g, w), f"{name}: decode graph selections differ"
                continue
            g, w = g.astype(np.float64), w.astype(np.float64)
            worst["out"] = max(worst["out"], float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30)))
        for name, t in general.pool_tensors.items():
            d = (written[name].double() - t.double()).abs().max() / t.double().abs().max().clamp_min(1e-30)
            worst["pools"] = max(worst["pools"], float(d))
        lengths = [n + 1 for n in lengths]
    return worst


@pytest.mark.parametrize("flavour,extra_width", [(FLAVOUR, 0), (FLAVOUR, 3), (ALL_EXPERTS, 3)])
def test_decode_graph_equals_general_graph_fp32(tiny_artifact, flavour, extra_width):
    art, general, decode = _sessions(tiny_artifact, flavour)
    with general, decode:
        worst = _compare(art, general, decode, steps=4, extra_width=extra_width)
    # fp32: the same products over the same keys in the same order (the sparse body lays a lone token's blocks
    # out as the general body lays out its union; bit-equal on this machine); what may differ is the summation
    # grouping of a longer masked row (softmax / MatMul over L = the table's width instead of max(position) + 1)
    # and the all-experts MoE's fp32 sum over experts in id order (the general graph's in top-k order): a few fp32
    # ulps, amplified by the 4 layers; 1e-5 relative is 100x that and far below a real difference (excluding the
    # token's own key, a mutation of the mask, fails the selections outright)
    assert worst["out"] <= 1e-5 and worst["pools"] <= 1e-5, worst


def test_decode_graph_equals_general_graph_fp8_cache(fp8_artifact):
    """An FP8 (E4M3) cache: the decode bodies read uint8 codes and decode them with their scale pools, as the
    general bodies do; the codes and scales written are the general graph's (the same fp32 K / V rows)."""
    art, general, decode = _sessions(fp8_artifact)
    with general, decode:
        worst = _compare(art, general, decode, steps=3, extra_width=2)
    # the fp32 bound of the fp32 test: the same arithmetic after the (exact) decode of the codes; a code that
    # flips between two E4M3 neighbours would be 2^-3 relative, far outside it
    assert worst["out"] <= 1e-5 and worst["pools"] <= 1e-5, worst


@pytest.mark.parametrize("flavour", [FLAVOUR, ALL_EXPERTS])
def test_decode_graph_equals_general_graph_fp16(fp16_trt_artifact, flavour):
    # the session's tiny float16 export, pages of 8 (two indexer blocks a page); its TensorRT flavour files are unread
    art, general, decode = _sessions(fp16_trt_artifact, flavour)
    with general, decode:
        worst = _compare(art, general, decode, steps=3, extra_width=2)
    # fp16 activations: each fp32 difference above can move a rounding to fp16 (2^-11 = 4.9e-4 relative) in a
    # cast, and a moved rounding propagates through the 4 layers; 4e-3 is 8 fp16 ulps
    assert worst["out"] <= 4e-3 and worst["pools"] <= 4e-3, worst


# the op types the passes remove or add (fused_norms.py, compact_rope.py): every other node is the general graph's
REWRITTEN = {"Pow", "ReduceMean", "Sqrt", "Reciprocal", "Mul", "Add", "Sub", "Slice", "Concat", "Gather", "Constant",
             "Shape", "CastLike", "Expand", "Neg", "SimplifiedLayerNormalization", "Unsqueeze"}


def test_decode_graph_has_no_control_flow_or_value_shapes(tiny_artifact):
    """Graph inspection: no If / Scan / Loop and no value-shaped op (NonZero, ...) in the decode graph or its bodies
    (the general graph has the MoE's If and Scan); the same inputs and outputs as the general graph, and its nodes
    but for the RoPE and cache-scatter graph passes' rewrites (on by default, the norm pass off,
    ``write_decode_graphs``; the flavour records them: the tiny model's 14 rotations and 11 cache writes; the passes'
    own tests are tests/test_ort_fused_norms*.py and tests/test_element_scatters.py)."""
    art = load_artifact(tiny_artifact)
    general = onnx.load(str(art.path("model")), load_external_data=False)
    assert any("If" in p or "Scan" in p for p in problems(general))  # the inspection sees what it looks for
    for flavour in (FLAVOUR, ALL_EXPERTS):
        record = art.manifest.flavours[flavour]["model"]
        decoded = onnx.load(str(art.root / record["file"]), load_external_data=False)
        assert problems(decoded) == [] and record["source"] == "model.onnx"
        assert record["graph_passes"] == {"rope": 14, "cache_scatter": 11}  # 4 layers' K, V, 3 index-key writes
        # the same nodes but for the rewrites: the traced rotations' ops gone, the traced norms kept (no fused norm)
        ops, traced = [n.op_type for n in decoded.graph.node], [n.op_type for n in general.graph.node]
        assert "SimplifiedLayerNormalization" not in ops and ops.count("Pow") == traced.count("Pow") > 0
        kept = Counter(o for o in ops if o not in REWRITTEN)  # the passes re-sort the nodes: compare counts
        assert kept == Counter(o for o in traced if o not in REWRITTEN), (kept, Counter(traced))
        assert [i.name for i in decoded.graph.input] == [i.name for i in general.graph.input]
        assert [o.name for o in decoded.graph.output] == [o.name for o in general.graph.output]


def test_decode_graph_places_every_node_on_the_cuda_ep(fp16_trt_artifact):
    """The placement ORT's CUDA EP would make (``bench/ort_step_host.cuda_placement``) of the fp16 decode graphs
    (the closest CPU-runnable stand-in for bf16) needs no Memcpy node: no size comes from a value on the device,
    and the nodes left on the CPU EP are shape arithmetic (ORT's CUDA-graph capture tolerates those)."""
    from ort_step_host import cuda_placement

    art = load_artifact(fp16_trt_artifact)
    for flavour in (FLAVOUR, ALL_EXPERTS):
        for graph, record in art.manifest.flavours[flavour].items():
            p = cuda_placement(art.root / record["file"])
            assert p["memcpy_to_host"] == 0 and p["memcpy_from_host"] == 0, (flavour, graph, p)
    assert cuda_placement(art.path("model"))["memcpy_to_host"] > 0  # the general graph's data-dependent sizes


def test_mxfp8_artifact_has_no_decode_graph(mxfp8_artifact):
    art = load_artifact(mxfp8_artifact)
    assert FLAVOUR not in art.manifest.flavours and ALL_EXPERTS not in art.manifest.flavours
    model = onnx.load(str(art.path("model")), load_external_data=False)
    with pytest.raises(ArtifactError, match="MXFP8 experts.*float8 Gather"):
        decode_model(model)


@pytest.mark.slow  # the session's bf16 export (~25 s on the 2-core machine), shared with test_ort_cuda_kernel_types
def test_every_bf16_decode_node_has_a_cuda_kernel(bf16_artifact):
    """Every node of the bf16 decode graphs (bodies inlined) has a kernel in ORT's CUDA EP for the types it is fed
    (``tests/test_ort_cuda_kernel_types.py``'s table): no node falls back to the CPU EP, which a captured CUDA
    graph could not hold."""
    from tests.test_ort_cuda_kernel_types import CUDA_EP, typed_nodes

    art = load_artifact(bf16_artifact)
    for flavour in (FLAVOUR, ALL_EXPERTS):
        for graph, record in art.manifest.flavours[flavour].items():
            model = onnx.load(str(art.root / record["file"]), load_external_data=False)
            missing, checked = [], 0
            for _, node, types in typed_nodes(model):
                assert node.op_type in CUDA_EP, f"{flavour}/{graph}: {node.op_type} is not in the table"
                positions, allowed = CUDA_EP[node.op_type]
                for i in range(len(types)) if positions is None else positions:
                    if i < len(types) and node.input[i]:
                        checked += 1
                        if types[i] not in allowed:
                            missing.append(f"{node.op_type} input {i}: {types[i]}")
            assert checked > 500 and not missing, (flavour, graph, checked, sorted(set(missing)))


def test_moe_form_weighs_a_gathered_expert_at_its_measured_cost():
    """``moe_form``: per-assignment while GATHER_COST (9, H200-measured) x T x top_k expert reads cost no more than
    reading all E experts: the full model (128 experts, top 4) gathers up to 3 tokens' experts, `mini` (16, top
    4) and the tiny model (8, top 2) never (at 3, the copy's bytes alone, `mini` gathered at batch 1: 2.5 ms)."""
    from m3export.export.decode_graph import moe_form

    assert [moe_form(t, 4, 128) for t in (1, 3, 4)] == ["per-assignment", "per-assignment", "all-experts"]
    assert moe_form(1, 4, 16) == "all-experts" and moe_form(1, 2, 8) == "all-experts"
