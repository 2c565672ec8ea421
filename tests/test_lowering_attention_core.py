"""The ``PagedAttentionCore`` lowering (a default of ``--flavour ort-contrib``) (m3export/export/lowering.py): each dense layer's two cache
``ScatterND`` and ``m3::PagedAttention`` -> ``com.microsoft.PagedAttention`` with ``do_rotary=0`` and no norm gains,
fed the m3 node's own (normed, rotated) query and the rows the scatters write.

ONNX Runtime's CPU provider has no kernel for that op, so CI checks (1) the structure: one op per dense layer,
fed exactly those tensors, writing the graph's own cache outputs, and nothing else of the graph changed; (2) the
wiring, in float16 on a prefill + chunk step (general graph) and on a decode step (the lowered decode graph that
``write_decode_graphs(of=...)`` makes): the lowered graph runs on the CPU up to the op's inputs, the op is
emulated from its schema documentation (``tests/test_lowering_attention._emulate_ort_paged_attention`` with no
rotary and no norm: cache write at ``slot_mapping``, causal GQA by the m3 reference), and the result is compared
with the plain graph's attention output and pools. The real kernel's numbers are the H200's (scripts/gpu_ort.sh).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import onnx
import pytest
from onnx import helper

from m3export.config import M3Config
from m3export.export import polygraphy_loader
from m3export.export.lowering import (DECODE_BOUNDS, DEFAULT, METADATA_INPUT, MS, OPT_IN, VERIFIED, lower,
                                      lower_with_report)

from tests.test_lowering_attention import _emulate_ort_paged_attention, _run_until

pytest.importorskip("onnx_graphsurgeon")
CORE = ("MoE", "PagedAttentionCore")
LABELS = ("query", "key", "value", "k_pool", "v_pool", "qsl", "past", "block_tables", None, None, "slots")


@pytest.fixture(scope="module")
def fp16_p16(tmp_path_factory):
    """The tiny preset in float16 at pages of 16, the least ORT's PagedAttention takes (``lowering.MIN_PAGE``)."""
    from m3export.export.exporter import export_artifact

    return export_artifact("tiny", tmp_path_factory.mktemp("art") / "tiny-fp16-p16", dtype="float16", page_size=16,
                           progress=False)


def test_pages_ort_refuses_keep_the_m3_node(fp16_trt_artifact):  # noqa: F811
    """Pages of 8 (ORT's PagedAttention takes a power of two of at least 16): the node stays, with the reason."""
    plain = onnx.load(str(fp16_trt_artifact / "model.onnx"), load_external_data=False)
    lowered, done, report = lower_with_report(plain, ("PagedAttentionCore",), _config(fp16_trt_artifact))
    assert done == {"PagedAttentionCore": 0} and "page size 8" in report["kept"]["PagedAttentionCore"]
    assert len(_dense_m3(lowered)) == len(_dense_m3(plain)) == 1 and not _ops(lowered)


def _config(art) -> M3Config:
    return M3Config.from_dict(json.loads((art / "manifest.json").read_text())["config"])


def _dense_m3(model: onnx.ModelProto) -> list:
    return [n for n in model.graph.node if n.domain == "m3" and n.op_type == "PagedAttention"]


def _ops(model: onnx.ModelProto) -> list:
    return [n for n in model.graph.node if n.domain == MS and n.op_type == "PagedAttention"]


def _check_structure(plain: onnx.ModelProto, lowered: onnx.ModelProto, cfg: M3Config) -> None:
    """One op per dense m3 node of ``plain``, fed the node's query and its scatters' rows (each through one
    Reshape to [T, heads * D]); the scatters and the m3 node gone, every other node of ``plain`` intact."""
    producer = {o: n for n in plain.graph.node for o in n.output}
    lowered_producer = {o: n for n in lowered.graph.node for o in n.output}
    m3_nodes, ops = _dense_m3(plain), _ops(lowered)
    assert m3_nodes and len(ops) == len(m3_nodes) and not _dense_m3(lowered)
    removed = set()
    for m3, op in zip(m3_nodes, ops):
        k_scatter, v_scatter = producer[m3.input[1]], producer[m3.input[2]]
        assert k_scatter.op_type == v_scatter.op_type == "ScatterND"
        removed |= {m3.name, k_scatter.name, v_scatter.name}
        a = {x.name: helper.get_attribute_value(x) for x in op.attribute}
        assert a == {"num_heads": cfg.num_attention_heads, "kv_num_heads": cfg.num_key_value_heads,
                     "scale": pytest.approx(cfg.head_dim ** -0.5), "do_rotary": 0, "is_causal": 1}
        assert len(op.input) == 11 and list(op.input[8:10]) == ["", ""]  # no cos / sin; nothing past slot_mapping
        for slot, source in zip(op.input[:3], (m3.input[0], k_scatter.input[2], v_scatter.input[2])):
            reshape = lowered_producer[slot]
            assert reshape.op_type == "Reshape" and reshape.input[0] == source
        assert list(op.input[3:5]) == [k_scatter.input[0], v_scatter.input[0]]  # the graph-input pools
        assert list(op.output[1:]) == [k_scatter.output[0], v_scatter.output[0]]  # the graph's *_cache_out
        assert op.input[5] == "query_start_loc" and op.input[7] == "block_tables"
        assert lowered_producer[op.input[10]].op_type == "Cast" and lowered_producer[op.input[10]].input == [
            "slot_mapping"]
    before = {n.name: (n.op_type, list(n.input), list(n.output)) for n in plain.graph.node}
    after = {n.name: (n.op_type, list(n.input), list(n.output)) for n in lowered.graph.node}
    assert set(before) - set(after) == removed
    assert all(after[k] == before[k] for k in set(before) & set(after))


def test_core_lowering_structure_and_record(fp16_p16):
    cfg = _config(fp16_p16)
    plain = onnx.load(str(fp16_p16 / "model.onnx"), load_external_data=False)
    lowered, done, report = lower_with_report(plain, ("PagedAttentionCore",), cfg)
    assert done == {"PagedAttentionCore": len(_dense_m3(plain))} and report == {"kept": {}, "gains": []}
    _check_structure(plain, lowered, cfg)
    # without a config (lower(model) with the default lowerings) the head counts come off the graph's shapes
    assert lower(plain, ("PagedAttentionCore",))[0].SerializeToString() == lowered.SerializeToString()
    # a default since the H200 showed it matching and, with the decode graphs' one-token bounds, faster than
    # DecodeAttention (lowering.VERIFIED)
    assert "PagedAttentionCore" not in OPT_IN and "PagedAttentionCore" in DEFAULT and "PagedAttentionCore" in VERIFIED


def test_fp32_and_fp8_pools_keep_the_m3_node(tiny_artifact, fp8_artifact):
    for art, why in ((tiny_artifact, "float32 pools"), (fp8_artifact, "uint8 pools")):
        plain = onnx.load(str(art / "model.onnx"), load_external_data=False)
        lowered, done, report = lower_with_report(plain, ("PagedAttentionCore",), _config(art))
        assert done == {"PagedAttentionCore": 0} and why in report["kept"]["PagedAttentionCore"]
        assert len(_dense_m3(lowered)) == len(_dense_m3(plain)) == 1 and not _ops(lowered)


def test_one_of_the_two_paged_attention_lowerings(tmp_path):
    from m3export.errors import ArtifactError
    from m3export.export.exporter import export_artifact

    with pytest.raises(ValueError, match="at most one of"):
        lower(onnx.ModelProto(), ("PagedAttention", "PagedAttentionCore"), object())
    with pytest.raises(ArtifactError, match="at most one of PagedAttention, PagedAttentionCore"):
        export_artifact("tiny", tmp_path / "a", flavour="ort-contrib", lower=("PagedAttention", "PagedAttentionCore"))


def _check_numbers(plain, lowered, art, feeds, cfg) -> None:
    """Per dense layer: the lowered graph's op inputs through the documented op (no rotary, no norm) give the plain
    graph's pools exactly (the op writes the very rows the scatters write) and its attention output within one
    fp16 rounding: both attend in fp32 over the same fp16 q / K / V (the plain graph's m3 body: fp32 scores,
    softmax and P.V; the emulation: the m3 reference, fp32 accumulation) and round the output once, so the two
    fp32 results differ by a few fp32 ulps and their fp16 roundings by at most one fp16 ulp, <= 2^-10 max|out|."""
    for m3, op in zip(_dense_m3(plain), _ops(lowered)):
        want = _run_until(plain, art, {"out": m3.output[0], "k": m3.input[1], "v": m3.input[2]}, feeds)
        got = _run_until(lowered, art, {k: v for k, v in zip(LABELS, op.input) if k and v}, feeds)
        out, k_pool, v_pool, pos = _emulate_ort_paged_attention(got, cfg, got["k_pool"], got["v_pool"],
                                                                cfg.head_dim ** -0.5)
        assert np.array_equal(pos, feeds["positions"])  # past_seqlens + i is the graph's own position
        assert np.array_equal(got["slots"], feeds["slot_mapping"])
        assert np.array_equal(k_pool.numpy(), want["k"]) and np.array_equal(v_pool.numpy(), want["v"])
        diff = np.abs(out.float().numpy() - want["out"].astype(np.float32)).max()
        assert diff <= 2.0 ** -10 * np.abs(want["out"]).max(), diff
        assert np.abs(want["out"]).max() > 0.05  # a real output, not zeros on both sides


def _random_pools(feeds: dict, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    for name in [n for n in feeds if "cache" in n]:  # visible cached rows are random, not zero
        feeds[name] = rng.standard_normal(feeds[name].shape).astype(np.float16)
    return feeds


def test_core_wiring_matches_the_plain_graph(fp16_p16):
    """A step with a prefill and a chunk after cached tokens on shuffled pages, random pools."""
    cfg = _config(fp16_p16)
    manifest = json.loads((fp16_p16 / "manifest.json").read_text())
    feeds = _random_pools(polygraphy_loader.step_feeds(manifest, "model"), 1)
    plain = onnx.load(str(fp16_p16 / "model.onnx"), load_external_data=False)
    lowered, done = lower(plain, ("PagedAttentionCore",), cfg)
    assert done["PagedAttentionCore"] >= 1
    _check_numbers(plain, lowered, fp16_p16, feeds, cfg)


def test_the_lowered_decode_graph_keeps_the_op_and_its_wiring(fp16_p16, tmp_path):
    """``--flavour ort-contrib --lower MoE,PagedAttentionCore``'s files, written as the exporter writes them (the
    flavour, then its decode graph from the lowered graph): ``model.ort.decode.onnx`` holds the op in place of the
    dense layer's scatters and m3 node, as the plain decode graph's other nodes, and on a decode step (three
    sequences, one token each) its wiring gives the plain decode graph's pools and attention output."""
    from m3export.export.artifact import load_artifact
    from m3export.export.decode_graph import write_decode_graphs
    from m3export.export.lowering import write_flavour_files
    from m3export.model.batch import Segment, build_batch

    art = fp16_p16
    for f in os.listdir(art):  # tiny: a few MB beside the copies, where their external data resolves
        if not f.endswith(".onnx") or f in ("model.onnx", "model.decode.onnx"):
            shutil.copy(art / f, tmp_path / f)
    cfg = _config(art)
    graphs = {"model": load_artifact(art).graphs["model"]}
    record = write_flavour_files(tmp_path, graphs, CORE, cfg)
    assert record["model"]["lowered"] == {"MoE": 3, "PagedAttentionCore": 1} and record["model"]["kept"] == {}
    decode_record = write_decode_graphs(tmp_path, graphs, of=record)
    lowered = onnx.load(str(tmp_path / decode_record["model"]["file"]), load_external_data=False)
    assert decode_record["model"]["file"] == "model.ort.decode.onnx"
    plain = onnx.load(str(tmp_path / "model.decode.onnx"), load_external_data=False)  # the plain decode graph
    assert len(_ops(lowered)) == 1 and not _dense_m3(lowered)
    (op,) = _ops(lowered)
    assert [helper.get_attribute_value(a) for a in op.attribute if a.name == "do_rotary"] == [0]
    assert op.output[1:] == ["k_cache_out.0", "v_cache_out.0"]
    page, rng = 16, np.random.default_rng(2)
    lengths = (37, 9, 58)
    pages = [list(range(i, 3 * 13, 3))[: -(-(n + 1) // page)] for i, n in enumerate(lengths)]  # interleaved pages
    ids, batch = build_batch([Segment(p, n, [int(rng.integers(0, 100))]) for p, n in zip(pages, lengths)], page)
    feeds = {"input_ids": ids.numpy(), "logits_indices": np.arange(len(lengths), dtype=np.int64),
             **{k: v.numpy() for k, v in zip(batch.input_names(), batch.inputs())}}
    for i in plain.graph.input:
        if i.name not in feeds and "cache" in i.name:
            dims = [d.dim_value if d.HasField("dim_value") else 40 for d in i.type.tensor_type.shape.dim]
            feeds[i.name] = rng.standard_normal(dims).astype(np.float16)
    _check_numbers(plain, lowered, tmp_path, feeds, cfg)
    # the one-token bounds (lowering.decode_bounds): [1, table width x page size] as int32, from shapes alone
    assert decode_record["model"]["graph_passes"][DECODE_BOUNDS] == 1 and len(op.input) == METADATA_INPUT + 1
    got = _run_until(lowered, tmp_path, {"metadata": op.input[METADATA_INPUT]}, feeds)["metadata"]
    assert got.dtype == np.int32 and got.tolist() == [1, feeds["block_tables"].shape[1] * page]
    assert page * feeds["block_tables"].shape[1] >= max(lengths) + 1  # a bound on every sequence's keys
