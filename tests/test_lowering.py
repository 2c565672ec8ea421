"""The experimental lowering to com.microsoft kernels (m3export/export/lowering.py): numbers on the CPU provider
where ORT has a CPU kernel (MoE), structure where it has none (MatMulBlockQuantizedFp8Weight). GPU: the MoE lowering
matched on the H200 (``lowering.VERIFIED``, scripts/gpu_ort.sh); MXFP8Linear unverified."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper

from m3export.export import polygraphy_loader
from m3export.export.functions import BUILDERS
from m3export.export.lowering import MS, lower
from m3export.export.schemas import SPEC_BY_NAME, opset_imports, register_schemas
from m3export.ops import conformance as conf



def _one_node(op: str, inputs: list[torch.Tensor], attrs: dict, out_dtype: torch.dtype) -> onnx.ModelProto:
    register_schemas()
    names = [p.name for p in SPEC_BY_NAME[op].inputs]
    graph = helper.make_graph(
        [helper.make_node(op, names, ["y"], domain="m3", name="node0", **attrs)], op,
        [helper.make_tensor_value_info(n, conf._onnx_type(t.dtype), list(t.shape)) for n, t in zip(names, inputs)],
        [helper.make_tensor_value_info("y", conf._onnx_type(out_dtype), None)],
    )
    model = helper.make_model(graph, opset_imports=opset_imports(), functions=[BUILDERS[op]()])
    model.ir_version = 10
    return model


MOE_CASES = [c.id for c in conf.cases_for("MoE") if c.cpu and c.tags & {"small", "adversarial"}]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case_id", MOE_CASES)
def test_moe_lowered_to_com_microsoft_moe_matches_the_oracle(case_id, dtype):
    """ORT's MoE kernel (CPU provider) with M3's routing passed as log-scores: within the conformance suite's MoE
    tolerance (routing ties included: the selection stays the fp32 TopK of the contract)."""
    case = conf.CASES[case_id]
    inputs, attrs = case.inputs(dtype)
    lowered, done = lower(_one_node("MoE", inputs, attrs, dtype), ops=("MoE",))
    assert done == {"MoE": 1} and not lowered.functions
    sess = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [p.name for p in SPEC_BY_NAME["MoE"].inputs]
    (y,) = sess.run(None, {n: t.numpy() for n, t in zip(names, inputs)})
    verdict = conf.compare(case, dtype, torch.from_numpy(y), inputs, attrs)
    assert verdict.ok, verdict.failures


def test_tiny_model_lowered_keeps_its_outputs(tiny_artifact):  # noqa: F811
    """The whole tiny model with every MoE lowered: graph shape, attributes, and the same step outputs as the
    plain graph on the CPU provider (fp32: 1e-4 of the logits' scale, a few ulp of fp32 sums reordered)."""
    model = onnx.load(str(tiny_artifact / "model.onnx"), load_external_data=False)
    lowered, done = lower(model)
    m3_before = [n.op_type for n in model.graph.node if n.domain == "m3"]
    m3_after = [n.op_type for n in lowered.graph.node if n.domain == "m3"]
    moe = [n for n in lowered.graph.node if n.domain == MS and n.op_type == "MoE"]
    assert done["MoE"] == m3_before.count("MoE") > 0 and "MoE" not in m3_after
    assert done["MXFP8Linear"] == 0  # fp32 graph: the ORT op takes 16-bit activations only
    assert sorted(m3_after) == sorted(op for op in m3_before if op != "MoE")  # nothing else touched
    assert len(moe) == done["MoE"]  # the routed experts (the shared expert: the m3 body's Gemm nodes)
    cfg = json.loads((tiny_artifact / "manifest.json").read_text())["config"]
    for node in moe:
        a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
        assert a["activation_type"] == b"swiglu" and a["swiglu_fusion"] == 1
        assert a["activation_alpha"] == pytest.approx(cfg["swiglu_alpha"])
        assert a["swiglu_limit"] == pytest.approx(cfg["swiglu_limit"]) and a["activation_beta"] == 1.0
        assert a["k"] == cfg["num_experts_per_tok"]
    assert {f.name for f in lowered.functions} == {f.name for f in model.functions} - {"MoE"}
    assert any(o.domain == MS for o in lowered.opset_import)

    path = tiny_artifact / "model.lowered-test.onnx"  # beside the weights: external data resolves
    onnx.save(lowered, str(path))
    try:
        feeds = polygraphy_loader.step_feeds(json.loads((tiny_artifact / "manifest.json").read_text()), "model")
        plain = ort.InferenceSession(str(tiny_artifact / "model.onnx"), providers=["CPUExecutionProvider"])
        low = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        want, got = plain.run(["logits", "hidden"], feeds), low.run(["logits", "hidden"], feeds)
    finally:
        path.unlink()
    for w, g in zip(want, got):
        assert np.abs(g - w).max() <= 1e-4 * np.abs(w).max()


def test_mxfp8_linear_lowered_structure():
    """fp16 activations: one MatMulBlockQuantizedFp8Weight (block 32) fed the E4M3 weight as is and fp32 scales
    2^(s - 127) computed from the UE8M0 bytes (ORT's CPU provider has no kernel for it: structure only)."""
    inputs, attrs = conf.CASES["MXFP8Linear/rows7"].inputs(torch.float16)
    lowered, done = lower(_one_node("MXFP8Linear", inputs, attrs, torch.float16))
    assert done["MXFP8Linear"] == 1 and not lowered.functions
    (ms,) = [n for n in lowered.graph.node if n.domain == MS]
    assert ms.op_type == "MatMulBlockQuantizedFp8Weight"
    assert {x.name: helper.get_attribute_value(x) for x in ms.attribute} == {"block_size": 32}
    assert list(ms.input[:2]) == ["x", "weight"] and list(ms.output) == ["y"]
    producers = {o: n for n in lowered.graph.node for o in n.output}
    chain, name = [], ms.input[2]
    while name in producers:
        node = producers[name]
        chain.append(node.op_type)
        name = next((i for i in node.input if i in producers or i == "weight_scale"), "")
    assert chain == ["Pow", "Sub", "Cast"] and name == "weight_scale"
    fp32 = conf.CASES["MXFP8Linear/rows7"].inputs(torch.float32)[0]
    _, kept = lower(_one_node("MXFP8Linear", fp32, attrs, torch.float32))
    assert kept["MXFP8Linear"] == 0


def test_export_records_the_ort_contrib_flavour(tmp_path):
    """`export --flavour ort-contrib`: <graph>.ort.onnx beside each graph, recorded (and checksummed) in the
    manifest, run by PagedSession.from_artifact(flavour=...) with the graph's outputs (fp32, CPU provider)."""
    from m3export.export.artifact import load_artifact
    from m3export.export.exporter import export_artifact
    from m3export.plugins.onnxruntime.session import PagedSession

    root = export_artifact("tiny", tmp_path / "art", page_size=16, progress=False, flavour="ort-contrib")
    art = load_artifact(root)
    record = art.manifest.flavours["ort-contrib"]
    assert set(record) == {"model", "mtp0"} and record["model"]["lowered"]["MoE"] > 0
    # the tiny fp32 graphs apply the MoE lowering only, which the H200 has shown to match (lowering.VERIFIED)
    assert all(r["file"] in art.manifest.files and r["status"].startswith("verified on GPU: MoE:")
               for r in record.values())
    # DecodeAttention is a default too (lowering.DEFAULT): the decode graphs' pass ran and kept the fp32 pools' node
    decode = art.manifest.flavours["ort-contrib-decode"]["model"]["decode_attention"]
    assert decode["lowered"] == 0 and list(decode["kept"].values()) == [decode["kept"]["node_paged_attention"]]
    assert decode["kept"]["node_paged_attention"].startswith("FLOAT pools"), decode
    manifest = json.loads((root / "manifest.json").read_text())
    outs = []
    for flavour in (None, "ort-contrib"):
        sess = PagedSession.from_artifact(art, "model", flavour=flavour)
        feeds = polygraphy_loader.step_feeds(manifest, "model")
        sess.allocate(feeds[sess.pool_inputs[0]].shape[0])
        outs.append(sess.run({k: v for k, v in feeds.items() if k not in sess.pool_inputs}))
    for name in ("logits", "hidden"):
        assert np.abs(outs[1][name] - outs[0][name]).max() <= 1e-4 * np.abs(outs[0][name]).max()
    # the onnxruntime backend runs this verified flavour on the CUDA EP only (auto_flavour); the plain graphs elsewhere
    from m3export.plugins.onnxruntime.providers import parse_provider
    from m3export.runtime.backends.onnxruntime_backend import auto_flavour

    assert auto_flavour(art, parse_provider("cuda")) == "ort-contrib"
    assert auto_flavour(art, parse_provider("cpu")) is None
    record["mtp0"]["status"] = lowering_status(["MXFP8Linear"])  # one graph with an unverified lowering: plain
    assert auto_flavour(art, parse_provider("cuda")) is None
    del art.manifest.flavours["ort-contrib"]  # an artifact exported without the flavour: plain
    assert auto_flavour(art, parse_provider("cuda")) is None


def lowering_status(applied):
    from m3export.export.lowering import status

    return status(applied)


def test_flavour_status_names_what_the_gpu_has_not_verified():
    from m3export.export import lowering

    assert lowering.status(["MoE"]).startswith("verified on GPU: MoE: matched on the H200")
    assert lowering.status(["MXFP8Linear", "MoE"]) == lowering.STATUS + "; unverified: MXFP8Linear"
    assert lowering.status([]) == lowering.STATUS
