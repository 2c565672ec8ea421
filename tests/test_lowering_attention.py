"""The opt-in lowering of M3's dense attention to ``com.microsoft.PagedAttention`` (m3export/export/lowering.py).

ONNX Runtime's CPU provider has no kernel for that op, so CI checks (1) the structure: one op per dense layer
with M3's attributes, fed by the layer's projections, writing the graph's own cache outputs, and every node
outside the replaced norm / RoPE / cache-write / attention nodes intact; and (2) the wiring: the lowered graph
runs on the CPU up to the op's inputs, the op is emulated from its schema documentation (RMSNorm with gain
``w``, NeoX rotation of dims ``0 .. 2 * cos.shape[1]`` at position ``past_seqlens + i``, cache write at
``slot_mapping``, causal GQA: the m3 reference ``paged_attention``), and the result is compared with the plain
graph's attention output and cache rows. Numbers of the real kernel: the H200 (scripts/gpu_ort.sh).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper

from m3export.config import M3Config
from m3export.export import polygraphy_loader
from m3export.export.lowering import DEFAULT, EXCLUSIVE, LOWERABLE, MS, OPT_IN, lower, lower_with_report

INT32_LABELS = ("qsl", "past", "block_tables", "slots")  # the op's int32 inputs; the rest are fp16 here
# every lowering but PagedAttentionCore, which lowers the same nodes as PagedAttention (EXCLUSIVE)
ALL_BUT_CORE = tuple(op for op in LOWERABLE if op != "PagedAttentionCore")


@pytest.fixture(scope="module")
def fp16_artifact(tmp_path_factory):
    """The tiny preset in float16 (ORT's PagedAttention takes 16-bit activations only), page size 16 (the least it
    takes, ``lowering.MIN_PAGE``), with the ort-contrib flavour lowering every lowerable op but PagedAttentionCore
    (PagedAttention lowers those nodes)."""
    from m3export.export.exporter import export_artifact

    return export_artifact("tiny", tmp_path_factory.mktemp("art") / "tiny-fp16", dtype="float16", page_size=16,
                           progress=False, flavour="ort-contrib", lower=ALL_BUT_CORE)


def _config(art) -> M3Config:
    return M3Config.from_dict(json.loads((art / "manifest.json").read_text())["config"])


def _dense_layers(cfg: M3Config) -> list[int]:
    return [i for i, t in enumerate(cfg.layer_types) if "sparse" not in t]


def _ancestors(graph: onnx.GraphProto, names: set[str]) -> set[str]:
    """Names of the nodes that (transitively) produce any of the tensors ``names``."""
    producer = {o: n for n in graph.node for o in n.output}
    found, todo = set(), list(names)
    while todo:
        node = producer.get(todo.pop())
        if node is not None and node.name not in found:
            found.add(node.name)
            todo.extend(node.input)
    return found


@pytest.mark.slow  # the float16 export (~20 s) is shared by this module's tests
def test_dense_attention_lowered_structure(fp16_artifact):
    cfg = _config(fp16_artifact)
    plain = onnx.load(str(fp16_artifact / "model.onnx"), load_external_data=False)
    lowered, done = lower(plain, ALL_BUT_CORE, cfg)
    dense = _dense_layers(cfg)
    assert dense and done["PagedAttention"] == len(dense)
    ops = [n for n in lowered.graph.node if n.domain == MS and n.op_type == "PagedAttention"]
    assert len(ops) == len(dense)
    assert "PagedAttention" not in [n.op_type for n in lowered.graph.node if n.domain == "m3"]
    producer = {o: n for n in lowered.graph.node for o in n.output}
    for layer, op in zip(dense, ops):
        a = {x.name: helper.get_attribute_value(x) for x in op.attribute}
        assert a == {"num_heads": cfg.num_attention_heads, "kv_num_heads": cfg.num_key_value_heads,
                     "scale": pytest.approx(cfg.head_dim ** -0.5), "do_rotary": 1, "rotary_interleaved": 0,
                     "qk_norm_epsilon": pytest.approx(cfg.rms_norm_eps), "is_causal": 1}
        for slot, proj in zip(op.input[:3], ("q_proj", "k_proj", "v_proj")):  # the projections themselves
            assert f"model.layers.{layer}.self_attn.{proj}.weight" in producer[slot].input
        assert list(op.input[3:5]) == [f"k_cache.{layer}", f"v_cache.{layer}"]
        assert list(op.output[1:]) == [f"k_cache_out.{layer}", f"v_cache_out.{layer}"]
        assert op.input[5] == "query_start_loc" and op.input[7] == "block_tables"
        assert op.input[11] == ""  # no head sink
        for slot, norm in ((12, "q_norm"), (13, "k_norm")):  # T(1 + w): Cast(Add(Cast(w), 1))
            add = producer[producer[op.input[slot]].input[0]]
            assert add.op_type == "Add" and producer[add.input[0]].input == [f"model.layers.{layer}.self_attn."
                                                                             f"{norm}.weight"]
    # every node outside the replaced ones is intact; the replaced ones all lie between the layer's projections
    # and its attention output (norms, RoPE, cache writes, the m3 node)
    after = {n.name: (n.op_type, list(n.input), list(n.output)) for n in lowered.graph.node}
    moe_only, _ = lower(plain, ("MoE", "MXFP8Linear"))
    before = {n.name: (n.op_type, list(n.input), list(n.output)) for n in moe_only.graph.node}
    removed = set(before) - set(after)
    assert all(after[k] == before[k] for k in set(before) & set(after))
    m3_nodes = [n for n in moe_only.graph.node if n.domain == "m3" and n.op_type == "PagedAttention"]
    inside = _ancestors(moe_only.graph, {o for n in m3_nodes for o in n.output})
    projections = _ancestors(moe_only.graph, {i for op in ops for i in op.input[:3]})
    assert removed and removed <= inside - projections
    assert {before[k][0] for k in removed} >= {"ScatterND", "PagedAttention", "ReduceMean"}
    assert not any(n.op_type == "ScatterND" and n.output[0].startswith(("k_cache_out.", "v_cache_out."))
                   and int(n.output[0].rsplit(".", 1)[1]) in dense for n in lowered.graph.node)


@pytest.mark.slow  # the float16 export
def test_manifest_records_the_lowerings(fp16_artifact):
    """The flavour record says which lowerings were applied to each graph, and how far the actual norm gains
    moved when rounded to fp16 (at most half an fp16 ulp: 2^-11 relative)."""
    from m3export.export.artifact import load_artifact

    art = load_artifact(fp16_artifact)
    record = art.manifest.flavours["ort-contrib"]
    model, mtp = record["model"], record["mtp0"]
    assert model["applied"] == ["MoE", "PagedAttention"]
    assert set(model["kept"]) == {"DecodeAttention"}  # decode graphs only: the general graphs keep those nodes
    assert model["lowered"]["PagedAttention"] == len(_dense_layers(art.config))
    assert model["not_requested"] == {"PagedAttentionCore": "not requested"}  # a default, left out by --lower
    assert 0.0 < model["gain_rounding"] <= 2.0 ** -11
    assert set(model["rejected"]) == {"PagedAttention"} and "REJECTED" in model["rejected"]["PagedAttention"]
    assert mtp["lowered"]["PagedAttention"] == 0 and "gain_rounding" not in mtp  # MTP layers are sparse
    plain = onnx.load(str(fp16_artifact / "model.onnx"), load_external_data=False)
    again, _ = lower(plain, ALL_BUT_CORE, art.config)
    assert (fp16_artifact / model["file"]).read_bytes() == again.SerializeToString(deterministic=True)


def test_lower_needs_the_ort_contrib_flavour(tmp_path):
    from m3export.errors import ArtifactError
    from m3export.export.exporter import export_artifact

    with pytest.raises(ArtifactError, match="--lower applies to --flavour ort-contrib only"):
        export_artifact("tiny", tmp_path / "a", lower=("PagedAttention",))
    with pytest.raises(ArtifactError, match="--lower takes m3 ops among"):
        export_artifact("tiny", tmp_path / "a", flavour="ort-contrib", lower=("SparsePagedAttention",))


def test_rejected_paged_attention_lowering_warns_with_the_measurement(tmp_path):
    """The H200 rejected the PagedAttention lowering (docs/ops.md §9): asking for it warns with the measurement
    before any export work (here the export then stops at a separate refusal, the fp8 cache, so nothing runs)."""
    from m3export.errors import ArtifactError
    from m3export.export.exporter import export_artifact
    from m3export.export.lowering import REJECTED

    assert "PagedAttention" in REJECTED and "3.77" in REJECTED["PagedAttention"]
    with pytest.warns(UserWarning, match=r"--lower PagedAttention: REJECTED on the H200 .*3\.77"), \
            pytest.raises(ArtifactError):
        export_artifact("tiny", tmp_path / "a", dtype="bfloat16", flavour="ort-contrib", lower=("PagedAttention",),
                        kv_cache_dtype="fp8")


def test_fp32_graph_keeps_the_m3_node_and_says_why(tiny_artifact):
    """ORT's op has no fp32 kernel: fp32 graphs keep the m3 node; the report names the reason."""
    plain = onnx.load(str(tiny_artifact / "model.onnx"), load_external_data=False)
    lowered, done, report = lower_with_report(plain, ("PagedAttention",), _config(tiny_artifact))
    assert done == {"PagedAttention": 0}
    assert "float32 pools" in report["kept"]["PagedAttention"]
    assert [n.op_type for n in lowered.graph.node if n.domain == "m3"].count("PagedAttention") == 1


def test_paged_attention_needs_the_config_and_is_opt_in():
    with pytest.raises(ValueError, match="needs the model's config"):
        lower(onnx.ModelProto(), ("PagedAttention",))
    assert "PagedAttention" not in DEFAULT and "PagedAttention" in OPT_IN


def _emulate_ort_paged_attention(f: dict, cfg: M3Config, k_pool, v_pool, scale: float):
    """com.microsoft.PagedAttention as its schema documents it, in fp32 from the fp16 inputs: returns (output
    [T, Hq, D], key pool, value pool) in fp16, and the positions. Without ``cos`` in ``f`` (``do_rotary=0``) no
    rotation, without ``q_gain`` no norm: q and k are the inputs as they are (PagedAttentionCore)."""
    t = f["query"].shape[0]
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qsl, past = f["qsl"].astype(np.int64), f["past"].astype(np.int64)
    pos = np.concatenate([past[b] + np.arange(qsl[b + 1] - qsl[b]) for b in range(len(past))])
    rotary = "cos" in f
    if rotary:
        cos, sin = (torch.from_numpy(f[n][pos]).float()[:, None, :] for n in ("cos", "sin"))
        half = cos.shape[-1]

    def norm_rope(x, heads, gain):
        x = torch.from_numpy(x).view(t, heads, d)
        if gain is None and not rotary:
            return x
        x = x.float()
        if gain is not None:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * torch.from_numpy(gain).float()
        if rotary:
            x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
            x = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)
        return x.half()

    q, k = norm_rope(f["query"], hq, f.get("q_gain")), norm_rope(f["key"], hkv, f.get("k_gain"))
    v = torch.from_numpy(f["value"]).view(t, hkv, d)
    k_pool, v_pool = torch.from_numpy(k_pool).clone(), torch.from_numpy(v_pool).clone()
    page = k_pool.shape[1]
    slots = torch.from_numpy(f["slots"].astype(np.int64))
    k_pool[slots // page, slots % page], v_pool[slots // page, slots % page] = k, v
    seq_lens = torch.from_numpy((past + qsl[1:] - qsl[:-1]).astype(np.int32))
    out = torch.ops.m3.paged_attention(q, k_pool, v_pool, torch.from_numpy(f["block_tables"]),
                                       torch.from_numpy(f["qsl"]), seq_lens, torch.from_numpy(pos), scale)
    return out, k_pool, v_pool, pos


def _run_until(model: onnx.ModelProto, art, outputs: dict[str, str], feeds) -> dict[str, np.ndarray]:
    """Run ``model`` (external data in ``art``) on the CPU provider with ``outputs`` (label -> tensor name) as
    its only outputs; nodes not needed for them (e.g. ORT's PagedAttention, which has no CPU kernel) drop out."""
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(model)
    tensors = graph.tensors()
    graph.outputs = [tensors[n] for n in outputs.values()]
    for label, t in zip(outputs, graph.outputs):
        t.dtype = t.dtype or (np.int32 if label in INT32_LABELS else np.float16)
    graph.cleanup(remove_unused_graph_inputs=False)
    cut = gs.export_onnx(graph, do_type_check=False)
    del cut.graph.value_info[:]  # let ORT infer the cut outputs' types
    cut.ir_version = model.ir_version
    path = art / "cut-test.onnx"  # beside the weights: external data resolves
    onnx.save(cut, str(path))
    try:
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]
        got = sess.run(list(outputs.values()), {k: v for k, v in feeds.items() if k in names})
    finally:
        path.unlink()
    return dict(zip(outputs, got))


@pytest.mark.slow  # the float16 export
def test_lowered_wiring_matches_the_plain_graph_through_the_documented_op(fp16_artifact):
    """The lowered graph's op inputs, put through the op as documented, give the plain graph's attention output
    and cache rows, on a step with a prefill and a chunk after cached tokens on shuffled pages (random pools)."""
    cfg = _config(fp16_artifact)
    manifest = json.loads((fp16_artifact / "manifest.json").read_text())
    feeds = polygraphy_loader.step_feeds(manifest, "model")
    rng = np.random.default_rng(1)
    for name in [n for n in feeds if "cache" in n]:  # visible cached rows are random, not zero
        feeds[name] = rng.standard_normal(feeds[name].shape).astype(np.float16)
    plain = onnx.load(str(fp16_artifact / "model.onnx"), load_external_data=False)
    lowered, done = lower(plain, ("PagedAttention",), cfg)
    assert done["PagedAttention"] >= 1
    for layer, op in zip(_dense_layers(cfg), [n for n in lowered.graph.node if n.op_type == "PagedAttention"]):
        m3 = next(n for n in plain.graph.node if n.domain == "m3" and n.op_type == "PagedAttention"
                  and n.input[1] == f"k_cache_out.{layer}")
        want = _run_until(plain, fp16_artifact, {"out": m3.output[0], "k": m3.input[1], "v": m3.input[2]}, feeds)
        labels = ("query", "key", "value", "k_pool", "v_pool", "qsl", "past", "block_tables", "cos", "sin",
                  "slots", None, "q_gain", "k_gain")
        got = _run_until(lowered, fp16_artifact, {k: v for k, v in zip(labels, op.input) if k and v}, feeds)
        assert got["cos"].shape[1] == cfg.rotary_dim // 2 and got["cos"].shape[0] >= feeds["positions"].max() + 1
        out, k_pool, v_pool, pos = _emulate_ort_paged_attention(got, cfg, got["k_pool"], got["v_pool"],
                                                                cfg.head_dim ** -0.5)
        assert np.array_equal(pos, feeds["positions"])  # past_seqlens + i is the graph's own position
        assert np.array_equal(got["slots"], feeds["slot_mapping"])
        # The plain graph rounds the normed q/k to fp16 before rotating and rotates in fp16 ops; the emulation
        # keeps fp32 until one rounding: q and k differ by at most ~3 fp16 roundings of unit-RMS values
        # (3 * 2^-11 * max|x|), the attention output by the same relative amount of the values it averages.
        eps16 = 2.0 ** -11
        rows = feeds["slot_mapping"]
        page = k_pool.shape[1]
        for name, mine, theirs in (("k", k_pool, want["k"]), ("v", v_pool, want["v"])):
            mine = mine.float().numpy()
            written = mine[rows // page, rows % page]
            assert np.abs(written - theirs[rows // page, rows % page]).max() <= 3 * eps16 * np.abs(written).max(), name
            keep = np.ones(mine.shape[:2], bool)
            keep[rows // page, rows % page] = False
            assert np.array_equal(mine[keep], theirs[keep].astype(np.float32)), name  # other rows untouched
        diff = np.abs(out.float().numpy() - want["out"].astype(np.float32)).max()
        assert diff <= 3 * eps16 * np.abs(want["v"]).max(), diff


def test_mxfp8_linear_lowered_in_bfloat16():
    """bfloat16 activations (graphsurgeon keeps ONNX's enum for them, numpy has no bfloat16) lower like fp16."""
    from m3export.ops import conformance as conf
    from tests.test_lowering import _one_node

    inputs, attrs = conf.CASES["MXFP8Linear/rows7"].inputs(torch.bfloat16)
    lowered, done = lower(_one_node("MXFP8Linear", inputs, attrs, torch.bfloat16))
    assert done["MXFP8Linear"] == 1
    assert [n.op_type for n in lowered.graph.node if n.domain == MS] == ["MatMulBlockQuantizedFp8Weight"]
