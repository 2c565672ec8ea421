"""The ``DecodeAttention`` lowering (a default of ``--flavour ort-contrib``'s decode graphs) (``m3export/export/decode_attention.py``): in a decode graph each dense
``m3::PagedAttention`` node becomes the standard ONNX ``Attention``-24 on K / V rows gathered in the pool's own
16-bit dtype. Checked here: the structure (the op, its attributes, no widening cast of K / V, the m3 node gone,
``onnx.checker``), the nodes it keeps (fp32 and FP8 pools) and, on ORT's CPU EP, the numbers in float16 (the CPU EP
has float / float16 kernels for Attention-24 and none for bfloat16: the bf16 numbers are the H200's,
``scripts/gpu_ort.sh`` with ``GPU_ORT_LOWER``)."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
import torch

from m3export.export.decode_attention import PASS, lower_decode_attention
from m3export.export.decode_graph import decode_model
from m3export.model.batch import Segment, build_batch

ort = pytest.importorskip("onnxruntime")
gs = pytest.importorskip("onnx_graphsurgeon")


def _decode_graph(art_dir, kv_fp8: bool = False) -> onnx.ModelProto:
    return decode_model(onnx.load(str(art_dir / "model.onnx"), load_external_data=False), kv_fp8)


def _beside(art_dir, tmp_path, keep=lambda name: True) -> None:
    """The artifact's files (its external data) copied into ``tmp_path`` (tiny: a few MB; ``onnx.checker`` refuses
    external data behind a symlink or a hard link)."""
    import shutil

    for f in os.listdir(art_dir):
        if keep(f):
            shutil.copy(art_dir / f, tmp_path / f)


def _producer(model: onnx.ModelProto, name: str):
    return next(n for n in model.graph.node if name in n.output)


def test_dense_attention_becomes_onnx_attention_24_on_16_bit_rows(bf16_artifact, tmp_path):
    model = _decode_graph(bf16_artifact)
    m3 = next(n for n in model.graph.node if n.domain == "m3" and n.op_type == "PagedAttention")
    scale = next(a.f for a in m3.attribute if a.name == "scale")
    lowered, count, kept = lower_decode_attention(model)
    assert count == 1 and kept == {}  # the tiny model: one dense layer (layer 0), three sparse
    assert not [n for n in lowered.graph.node if n.domain == "m3" and n.op_type == "PagedAttention"]
    assert "PagedAttention" not in {f.name for f in lowered.functions}
    assert {o.domain: o.version for o in lowered.opset_import}[""] == 24
    (att,) = [n for n in lowered.graph.node if n.op_type == "Attention"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in att.attribute}
    assert attrs == {"q_num_heads": 4, "kv_num_heads": 2, "scale": pytest.approx(scale, rel=0, abs=0),
                     "softmax_precision": onnx.TensorProto.FLOAT, "is_causal": 0}
    assert att.domain == "" and att.input[3:6] == ["", "", ""] and att.input[6]  # no mask / past; nonpad lengths
    assert list(att.output) == [att.name + ":0"] and _producer(lowered, m3.output[0]).op_type == "Reshape"
    for kv, pool in ((att.input[1], m3.input[1]), (att.input[2], m3.input[2])):
        gather = _producer(lowered, kv)  # K / V: Gather(Reshape(pool)): the pool's own dtype, no Cast on the way
        assert gather.op_type == "Gather" and _producer(lowered, gather.input[0]).op_type == "Reshape"
        assert _producer(lowered, gather.input[0]).input[0] == pool
    lengths = _producer(lowered, att.input[6])  # positions + 1: keys 0 .. position, the decode body's `visible`
    assert lengths.op_type == "Add" and _producer(lowered, lengths.input[0]).input[0] == "positions"
    _beside(bf16_artifact, tmp_path, lambda f: not f.endswith(".onnx"))
    onnx.save(lowered, str(tmp_path / "lowered.onnx"))
    onnx.checker.check_model(str(tmp_path / "lowered.onnx"))


def test_fp32_and_fp8_pools_keep_the_m3_node(tiny_artifact, fp8_artifact):
    for art, fp8, why in ((tiny_artifact, False, "FLOAT pools"), (fp8_artifact, True, "FP8 pools")):
        model = _decode_graph(art, fp8)
        lowered, count, kept = lower_decode_attention(model)
        assert count == 0 and lowered is model
        (reason,) = kept.values()
        assert why in reason, reason


def _with_output(model: onnx.ModelProto, name: str, elem: int) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.output.append(onnx.helper.make_tensor_value_info(name, elem, None))
    return out


def test_lowered_attention_matches_the_m3_body_in_float16(fp16_trt_artifact, tmp_path):
    """One decode step of three sequences through the float16 decode graph, plain and lowered, on ORT's CPU EP:
    the dense layer's attention output compared. Everything upstream of it is the same nodes on the same kernels,
    so q and the pools are equal in both and the difference is the attention's own."""
    from plugins.kernels.paged_attention import output_error_bound

    art = fp16_trt_artifact
    plain = _decode_graph(art)
    m3 = next(n for n in plain.graph.node if n.domain == "m3" and n.op_type == "PagedAttention")
    lowered, count, _ = lower_decode_attention(plain)
    assert count == 1
    _beside(art, tmp_path, lambda f: not f.endswith(".onnx"))  # the graphs' external data
    f16 = onnx.TensorProto.FLOAT16
    sessions = []
    for tag, model in (("plain", plain), ("lowered", lowered)):
        onnx.save(_with_output(model, m3.output[0], f16), str(tmp_path / f"{tag}.onnx"))
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        sessions.append(ort.InferenceSession(str(tmp_path / f"{tag}.onnx"), opts, providers=["CPUExecutionProvider"]))
    page, rng = 8, np.random.default_rng(0)
    lengths, pages_total = (37, 9, 58), 40
    pages = [list(range(i, 3 * 13, 3))[: -(-(n + 1) // page)] for i, n in enumerate(lengths)]  # interleaved pages
    ids, batch = build_batch([Segment(p, n, [int(rng.integers(0, 100))]) for p, n in zip(pages, lengths)], page,
                             min_table_width=10)  # wider than any sequence: slots past the length are replaced
    feeds = {"input_ids": ids.numpy(), "logits_indices": np.arange(len(lengths), dtype=np.int64),
             **{k: v.numpy() for k, v in zip(batch.input_names(), batch.inputs())}}
    for i in sessions[0].get_inputs():
        if i.name not in feeds:  # the pools: random contents (a context of normal keys and values)
            shape = [pages_total if isinstance(d, str) else d for d in i.shape]
            feeds[i.name] = rng.standard_normal(shape).astype(np.float16)
    names = [o.name for o in sessions[0].get_outputs()]
    feeds = {i.name: feeds[i.name] for i in sessions[0].get_inputs()}
    want = dict(zip(names, sessions[0].run(None, feeds)))[m3.output[0]].astype(np.float64)
    got = dict(zip(names, sessions[1].run(names, {i.name: feeds[i.name] for i in sessions[1].get_inputs()})))
    got = got[m3.output[0]].astype(np.float64)
    assert got.shape == want.shape == (3, 4, 32)
    # the m3 body: fp32 scores, softmax and P.V, one rounding to fp16. The lowered op: whatever its kernel rounds,
    # at most what a flash kernel rounds (P to fp16 for P.V, fp32 accumulation): output_error_bound's derivation
    # (3u + u^2 + 2^-12) max|V|, u = 2^-11, over the values it weighs (the pool after this step's write: the
    # pool after the write is a graph output, ``v_cache_out.0``). A wrong key set, scale or head grouping moves outputs by a large
    # fraction of max|V| (the bound's docstring: 5% off in the scale exceeds it 1.6x).
    v_max = float(np.abs(dict(zip(names, sessions[0].run(None, feeds)))[m3.input[2]].astype(np.float64)).max())
    bound = output_error_bound(torch.float16, v_max)
    assert np.abs(got - want).max() <= bound, (np.abs(got - want).max(), bound)
    assert np.abs(want).max() > 0.05  # a real output, not zeros on both sides


def test_the_pass_is_a_default_verified_and_recorded_in_the_decode_flavour(bf16_artifact, tmp_path):
    from m3export.export.artifact import load_artifact
    from m3export.export.decode_graph import write_decode_graphs
    from m3export.export.lowering import DECODE_ONLY, DEFAULT, LOWERABLE, OPT_IN, VERIFIED

    assert PASS in LOWERABLE and PASS in DECODE_ONLY and PASS in DEFAULT and PASS not in OPT_IN
    assert "0.0047" in VERIFIED[PASS]  # the H200's diagnosis of its one logit excursion: a routing near-tie
    art = load_artifact(bf16_artifact)
    _beside(bf16_artifact, tmp_path, lambda f: ".decode" not in f)  # plain graphs and data; decode graphs: here
    # with the RMSNorm pass too (off by default): the lowering runs before it, which does not keep the query's shape
    record = write_decode_graphs(tmp_path, art.graphs, decode_attention=True, fuse_norms=True)
    assert record["model"]["graph_passes"][PASS] == 1 and record["model"]["decode_attention"]["lowered"] == 1
    assert record["model"]["graph_passes"]["rms_norm"] > 0, record["model"]["graph_passes"]
    assert record["model"]["decode_attention"]["status"].startswith("a default of the ort-contrib decode graphs")
    written = onnx.load(str(tmp_path / record["model"]["file"]), load_external_data=False)
    assert [n.op_type for n in written.graph.node].count("Attention") == 1
