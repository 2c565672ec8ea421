"""The TensorRT flavour of the tiny model's graphs, the build's profiles and engine checks, ``m3export build`` and
``m3export compare`` without TensorRT (what can be checked on a machine where TensorRT cannot be installed)."""

from __future__ import annotations

import importlib.util
import json
import math

import onnx
import pytest
from onnx import helper

from m3export.build.profiles import Limits, check_engine, dim_range, profile_shapes
from m3export.cli import main as cli
from m3export.errors import ArtifactError, BackendUnavailable
from m3export.export.artifact import load_artifact
from m3export.export.tensorrt_flavour import flavour_graph, write_flavour
from m3export.plugins.tensorrt.shapes import PLUGINS

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None
PLUGIN_ATTRS = {"plugin_namespace", "plugin_version", "aot"}


def _attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("fixture", ["tiny_artifact", "mxfp8_artifact"])
@pytest.mark.parametrize("graph", ["model", "mtp0"])
def test_flavour_graph_has_plugin_nodes_and_no_function_bodies(request, fixture, graph):
    """On the float32 tiny model (MoE) and its MXFP8 export (MoEMXFP8, MXFP8Linear): every m3 node's plugin
    nodes, their wiring and attributes."""
    art = load_artifact(request.getfixturevalue(fixture), verify_checksums=False)
    src = onnx.load(str(art.path(graph)), load_external_data=False)
    mml = 1000
    out, record = flavour_graph(src, mml)
    assert [f.name for f in out.functions if f.domain == "m3"] == []  # the parser would inline them instead
    assert list(out.graph.input) == list(src.graph.input) and list(out.graph.output) == list(src.graph.output)
    assert list(out.graph.initializer) == list(src.graph.initializer)
    router = (".moe.x_f32", ".moe.router_f32", ".moe.logits")  # the MoE router's fp32 Gemm, added (checked below)
    assert [n for n in out.graph.node if n.domain != "m3" and not n.output[0].endswith(router)] == \
        [n for n in src.graph.node if n.domain != "m3"]

    by_output = {o: n for n in out.graph.node for o in n.output}
    for node in src.graph.node:
        if node.domain != "m3":
            continue
        a = _attrs(node)
        if node.op_type == "LightningIndexer":
            topk = by_output[node.output[0]]
            scan = by_output[topk.input[0]]
            assert (topk.op_type, scan.op_type) == ("LightningIndexerTopK", "LightningIndexerScan")
            index_q, kc, bt, qsl, _seq_lens, pos = node.input
            assert list(scan.input) == [index_q, kc, bt, qsl, pos] and list(topk.input) == [scan.output[0], pos]
            ta = _attrs(topk)
            assert {k: ta[k] for k in a} == a and _attrs(scan)["block_size"] == a["block_size"]
            assert ta["max_blocks"] == math.ceil(mml / a["block_size"])
            plugin_nodes = [scan, topk]
        elif node.op_type in ("MoE", "MoEMXFP8"):
            mx = "MXFP8" if node.op_type == "MoEMXFP8" else ""
            x, router, bias = node.input[:3]
            weights = list(node.input[3:])  # w13 [scale], w2 [scale], shared_w13 [scale], shared_w2 [scale]
            per = 2 if mx else 1
            combine = by_output[node.output[0]]
            shared_down = by_output[combine.input[0]]
            down = by_output[shared_down.input[-1]]
            route = by_output[down.input[-2]]
            gate_up, shared_gate_up = by_output[down.input[0]], by_output[shared_down.input[0]]
            gemm = by_output[route.input[0]]
            assert [n.op_type for n in (route, gate_up, shared_gate_up, down, shared_down, combine)] == [
                "MoERoute", f"MoEGateUp{mx}", f"MoESharedGateUp{mx}", f"MoEDown{mx}", f"MoESharedDown{mx}",
                "MoECombine"]
            assert gemm.op_type == "Gemm" and _attrs(gemm)["transB"] == 1 and route.input[1] == bias
            assert [by_output[i].input[0] for i in gemm.input] == [x, router]  # both cast to fp32
            assert list(gate_up.input) == [x, *weights[:per], route.output[0]]
            assert list(shared_gate_up.input) == [x, *weights[2 * per:3 * per]]
            assert list(down.input) == [gate_up.output[0], *weights[per:2 * per], *route.output]
            assert list(shared_down.input)[1:-1] == weights[3 * per:]
            assert _attrs(combine)["routed_scaling_factor"] == pytest.approx(a["routed_scaling_factor"])
            assert all(_attrs(n)["top_k"] == a["top_k"] for n in (route, gate_up, down, shared_down, combine))
            assert _attrs(gate_up)["swiglu_limit"] == pytest.approx(a["swiglu_limit"])
            plugin_nodes = [route, gate_up, shared_gate_up, down, shared_down, combine]
        else:
            (new,) = [by_output[o] for o in node.output][:1]
            assert new.op_type == node.op_type and list(new.input) == list(node.input)
            assert {k: v for k, v in _attrs(new).items() if k not in PLUGIN_ATTRS} == a
            plugin_nodes = [new]
        for n in plugin_nodes:
            na = _attrs(n)
            assert na["plugin_namespace"] == b"m3" and na["plugin_version"] == b"1"
            assert na["aot"] == 1
            # every other attribute is a field the registered plugin declares, and it declares no other
            assert set(na) - PLUGIN_ATTRS == set(PLUGINS[n.op_type].attributes)
    from m3export.plugins.tensorrt.steps import STEPS

    m3_ops = {n.op_type for n in src.graph.node if n.domain == "m3"}
    assert "MoEMXFP8" in m3_ops if fixture == "mxfp8_artifact" else "MoE" in m3_ops  # both MoE forms covered
    assert record["python_impl"] == [] and record["aot"] == sorted(record["plugin_nodes"])
    assert set(record["plugin_nodes"]) == {p for op in m3_ops for p in STEPS[op]}


def test_write_flavour_beside_the_graphs_leaves_the_artifact_valid(tiny_artifact):
    art = load_artifact(tiny_artifact, verify_checksums=False)
    before = {p.name: p.read_bytes() for p in tiny_artifact.iterdir() if p.suffix in (".json", ".onnx")}
    rec = write_flavour(art, 4096)
    try:
        assert set(rec) == {"model", "mtp0"}
        for g in rec.values():
            model = onnx.load(str(tiny_artifact / g["file"]))  # the external data resolves from there
            assert model.graph.initializer and all(t.raw_data for t in model.graph.initializer)
            assert g["external_data"] == ["weights.safetensors"]
        after = {n: (tiny_artifact / n).read_bytes() for n in before}
        assert after == before
        load_artifact(tiny_artifact, verify_checksums=True)  # still a valid artifact
    finally:
        for g in rec.values():
            (tiny_artifact / g["file"]).unlink()


def test_profiles_cover_every_input_of_every_graph(tiny_artifact):
    art = load_artifact(tiny_artifact, verify_checksums=False)
    limits = Limits.for_config(art.config, art.page_size, max_num_tokens=512, max_batch=8, max_model_len=1000)
    for name, graph in art.graphs.items():
        shapes = profile_shapes(graph, limits)
        assert list(shapes) == graph.input_names
        for t in graph.inputs:
            lo, opt, hi = shapes[t.name]
            assert all(a <= b <= c for a, b, c in zip(lo, opt, hi)), (name, t.name)
            for d, a, c in zip(t.shape, lo, hi):
                if isinstance(d, int):
                    assert a == c == d
        assert shapes["query_start_loc"] == ((2,), (9,), (9,))  # B + 1
        assert shapes["block_tables"][2] == (8, math.ceil(1000 / art.page_size))
        assert shapes["input_ids"][2] == (512,)


def test_profile_ranges_reject_unknown_dimensions():
    ranges = Limits(16, 4, 64, 16).ranges()
    assert dim_range("B - 1", ranges, "g") == (0, 3, 3)
    with pytest.raises(ArtifactError, match="dimension 'seq_len' has no build range"):
        dim_range("seq_len", ranges, "g")


def test_limits_are_checked(tiny_artifact):
    cfg = load_artifact(tiny_artifact, verify_checksums=False).config
    with pytest.raises(ArtifactError, match="exceeds the model's max_position_embeddings"):
        Limits.for_config(cfg, 16, max_model_len=cfg.max_position_embeddings + 1)


def test_engines_for_another_gpu_or_tensorrt_are_refused():
    meta = {"format": "m3export.engines", "format_version": 2, "tensorrt": "10.13.0", "compute_capability": [9, 0],
            "device": "H200"}
    check_engine(meta, "10.13.0", (9, 0), "e")
    with pytest.raises(ArtifactError, match="build.json format_version 1, this runtime reads 2: rebuild"):
        check_engine(dict(meta, format_version=1), "10.13.0", (9, 0), "e")
    with pytest.raises(BackendUnavailable, match=r"built for compute capability 9\.0 \(H200\), this GPU is 8\.9"):
        check_engine(meta, "10.13.0", (8, 9), "e")
    with pytest.raises(BackendUnavailable, match="built with TensorRT 10.13.0, this is TensorRT 11.0.0"):
        check_engine(meta, "11.0.0", (9, 0), "e")
    with pytest.raises(ArtifactError, match="not an m3export engine directory"):
        check_engine({}, "11.0.0", (9, 0), "e")


@pytest.mark.skipif(HAS_TENSORRT, reason="TensorRT is installed here; the missing-package path cannot be seen")
def test_build_without_tensorrt_fails_in_one_line_and_writes_nothing(tiny_artifact, tmp_path, capsys):
    out = tmp_path / "engines"
    assert cli(["build", str(tiny_artifact), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'm3export[trt]'" in err[0]
    assert not out.exists()


def test_build_help_has_examples_and_defaults(capsys):
    with pytest.raises(SystemExit):
        cli(["build", "--help"])
    text = capsys.readouterr().out
    assert "m3export build art/mini --out engines/mini" in text and "(default 2048)" in text


def test_compare_torch_and_onnxruntime(tiny_artifact, capsys):
    assert cli(["compare", str(tiny_artifact), "--decode-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "onnxruntime  logits" in out and "onnxruntime  mtp0.logits" in out and "PASSED" in out


@pytest.mark.skipif(HAS_TENSORRT, reason="TensorRT is installed here; the missing-package path cannot be seen")
def test_compare_reports_an_unavailable_backend(tiny_artifact, capsys):
    assert cli(["compare", str(tiny_artifact), "--backends", "torch,onnxruntime,tensorrt",
                "--decode-steps", "1"]) == 1
    out = capsys.readouterr().out
    assert "tensorrt     unavailable: TensorRT is not installed" in out and "FAILED" in out


def test_compare_needs_two_backends(tiny_artifact, capsys):
    assert cli(["compare", str(tiny_artifact), "--backends", "torch"]) == 2
    assert "needs at least two backends" in capsys.readouterr().err


def test_tensorrt_backend_on_an_artifact_without_engines_says_build(tiny_artifact, tmp_path):
    from m3export.runtime.backends import create_backend

    with pytest.raises(BackendUnavailable, match="pip install 'm3export\\[trt\\]'" if not HAS_TENSORRT else
                       "holds no TensorRT engines: build them with 'm3export build"):
        create_backend("tensorrt", tiny_artifact)


@pytest.mark.slow  # the session's float16 export with the flavour (~15-40 s), shared with test_runtime_paths
def test_export_option_writes_the_tensorrt_flavour_into_the_manifest(fp16_trt_artifact):
    out = fp16_trt_artifact  # export_artifact(..., flavour="tensorrt"): tests/export_fixtures.py
    art = load_artifact(out, verify_checksums=True)  # the flavour files are listed with their checksums
    rec = art.manifest.flavours["tensorrt"]
    assert set(rec) == {"model", "mtp0"}
    for name, g in rec.items():
        assert g["file"] in art.manifest.files and g["source"] == art.graphs[name].file
        model = onnx.load(str(out / g["file"]))
        assert {n.op_type for n in model.graph.node if n.domain == "m3"} >= {"LightningIndexerScan", "MoERoute"}
        assert g["max_model_len"] == art.config.max_position_embeddings
    raw = json.loads((out / "manifest.json").read_text())
    assert raw["flavours"]["tensorrt"]["model"]["plugin_namespace"] == "m3"
    with pytest.raises(ArtifactError, match="'tensorrt' is a file of the artifact|model.trt.onnx is a file"):
        write_flavour(art, 1000)  # a build never replaces the exported flavour


def test_manifest_flavours_are_validated(tiny_artifact, tmp_path):
    import shutil

    bad = tmp_path / "art"
    shutil.copytree(tiny_artifact, bad)
    raw = json.loads((bad / "manifest.json").read_text())
    raw["flavours"] = {"tensorrt": "model.trt.onnx"}
    (bad / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match="field 'flavours' must map a flavour name to its graphs"):
        load_artifact(bad, verify_checksums=False)


def test_flavour_refuses_inputs_the_plugins_do_not_take():
    """An FP8-cache node (scale pools as trailing inputs) is refused by name; omitted optional inputs ("") go."""
    names = ["q", "k_cache", "v_cache", "block_tables", "query_start_loc", "seq_lens", "positions"]

    def model(inputs):
        node = helper.make_node("PagedAttention", inputs, ["out"], name="attn.0", domain="m3", scale=0.1)
        return helper.make_model(helper.make_graph([node], "g", [], []))

    with pytest.raises(ArtifactError, match=r"node attn.0: m3::PagedAttention has 9 inputs, its TensorRT plugin "
                                            r"takes 7 .* no FP8 cache"):
        flavour_graph(model(names + ["k_scale", "v_scale"]), 100)
    out, _ = flavour_graph(model(names + ["", ""]), 100)
    (node,) = out.graph.node
    assert list(node.input) == names and _attrs(node)["plugin_namespace"] == b"m3"
