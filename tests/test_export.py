"""Export: graph contract, onnx.checker, external weights + tensor map, manifest, determinism, clear errors."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import onnx
import pytest
import torch
from safetensors import safe_open

import m3export
from m3export.checkpoint.writer import write_checkpoint
from m3export.cli import main as cli
from m3export.config import ConfigError, preset
from m3export.errors import ArtifactError, CheckpointError
from m3export.export.artifact import load_artifact, load_torch_model
from m3export.export.exporter import export_artifact, quantize_model
from m3export.export.graphs import mtp_signature, step_signature
from m3export.plugins.onnxruntime.session import PagedSession

CFG = preset("tiny")
SPARSE = [i for i in range(CFG.num_hidden_layers) if CFG.is_sparse_layer(i)]


def _graph(path, name="model.onnx") -> onnx.ModelProto:
    return onnx.load(str(path / name), load_external_data=False)


def _sig(values):
    return {v.name: (v.type.tensor_type.elem_type,
                     tuple(d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim)) for v in values}


F, I32, I64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT32, onnx.TensorProto.INT64


def test_model_signature(tiny_artifact):
    m = _graph(tiny_artifact)
    kv, ik = ("pages", 16, 2, 32), ("pages", 16, 32)
    want_in = {"input_ids": (I64, ("T",)), "positions": (I64, ("T",)), "query_start_loc": (I32, ("B + 1",)),
               "seq_lens": (I32, ("B",)), "block_tables": (I32, ("B", "max_pages")), "slot_mapping": (I64, ("T",)),
               "logits_indices": (I64, ("N",))}
    want_out = {"logits": (F, ("N", 320)), "hidden": (F, ("T", 64))}
    for i in range(CFG.num_hidden_layers):
        for name, shape in [("k_cache", kv), ("v_cache", kv)] + ([("index_k_cache", ik)] if i in SPARSE else []):
            want_in[f"{name}.{i}"] = (F, shape)
            want_out[f"{name}_out.{i}"] = (F, shape)
    for i in SPARSE:
        want_out[f"selection.{i}"] = (I32, ("T", 2, 3))
    assert [v.name for v in m.graph.input] == list(want_in) == list(step_signature(m3export.load_model("tiny")).inputs)
    assert [v.name for v in m.graph.output] == list(want_out)
    assert _sig(m.graph.input) == want_in and _sig(m.graph.output) == want_out


def test_mtp_signature(tiny_artifact):
    m = _graph(tiny_artifact, "mtp0.onnx")
    sig = mtp_signature()
    assert [v.name for v in m.graph.input] == list(sig.inputs)
    assert [v.name for v in m.graph.output] == list(sig.outputs)
    ins, outs = _sig(m.graph.input), _sig(m.graph.output)
    assert ins["hidden"] == (F, ("T", 64)) and outs["hidden_out"] == (F, ("T", 64))
    assert outs["logits"] == (F, ("N", 320)) and outs["selection"] == (I32, ("T", 2, 3))
    assert ins["index_k_cache"] == outs["index_k_cache_out"] == (F, ("pages", 16, 32))


@pytest.mark.parametrize("which", ["tiny", "mxfp8"])
@pytest.mark.parametrize("graph", ["model.onnx", "mtp0.onnx"])
def test_checker_and_shape_inference(tiny_artifact, mxfp8_artifact, which, graph):
    path = (tiny_artifact if which == "tiny" else mxfp8_artifact) / graph
    onnx.checker.check_model(str(path), full_check=True)
    inferred = onnx.shape_inference.infer_shapes(onnx.load(str(path), load_external_data=False), strict_mode=True)
    known = {v.name for v in inferred.graph.value_info}
    m3_outputs = [o for n in inferred.graph.node if n.domain == "m3" for o in n.output]
    assert m3_outputs and all(o in known or o in {v.name for v in inferred.graph.output} for o in m3_outputs)
    assert inferred.ir_version == 10
    assert {(o.domain, o.version) for o in inferred.opset_import} == {("", 20), ("m3", 1)}


def test_one_m3_node_per_op_and_a_body_for_each(tiny_artifact, mxfp8_artifact):
    for art, mx in ((tiny_artifact, False), (mxfp8_artifact, True)):
        m = _graph(art)
        ops = Counter(n.op_type for n in m.graph.node if n.domain == "m3")
        moe = "MoEMXFP8" if mx else "MoE"
        assert ops["LightningIndexer"] == ops["SparsePagedAttention"] == ops[moe] == len(SPARSE)
        assert ops["PagedAttention"] == CFG.num_hidden_layers - len(SPARSE)
        # q, k, v, o per layer, index q / k per sparse layer, gate_up / down per dense MLP (the shared expert's
        # weights are inputs of the MoE node)
        dense_mlps = sum(not CFG.is_moe_layer(i) for i in range(CFG.num_hidden_layers))
        assert ops["MXFP8Linear"] == (4 * CFG.num_hidden_layers + 2 * len(SPARSE) + 2 * dense_mlps if mx else 0)
        assert sorted(f.name for f in m.functions) == sorted(ops) and {f.domain for f in m.functions} == {"m3"}
        assert not any(p.key.startswith("pkg.torch") for n in m.graph.node for p in n.metadata_props)


@pytest.mark.parametrize("graph", ["model.onnx", "mtp0.onnx"])
def test_cache_outputs_are_scatters_over_their_inputs(tiny_artifact, graph):
    m = _graph(tiny_artifact, graph)
    producer = {o: n for n in m.graph.node for o in n.output}
    readers = Counter(i for n in m.graph.node for i in n.input)
    aliases = load_artifact(tiny_artifact).graphs[graph.removesuffix(".onnx")].aliases
    assert aliases
    for out, inp in aliases.items():
        node = producer[out]
        assert node.op_type == "ScatterND" and node.input[0] == inp, out
        assert readers[inp] == 1, f"{inp} is read by more than its ScatterND: an in-place write would race"


def test_weights_are_external_and_match_the_tensor_map(tiny_artifact):
    art = load_artifact(tiny_artifact)
    model = m3export.load_model("tiny")
    state = model.state_dict()
    assert set(art.manifest.tensors) == set(state)
    with safe_open(str(tiny_artifact / "weights.safetensors"), "pt") as f:
        assert set(f.keys()) == set(state)
        for name, value in state.items():
            assert torch.equal(f.get_tensor(name), value), name
    seen = set()
    for graph in ("model.onnx", "mtp0.onnx"):
        m = _graph(tiny_artifact, graph)
        for init in m.graph.initializer:
            if init.name not in art.manifest.tensors:
                assert init.data_location != onnx.TensorProto.EXTERNAL  # small constants stay inline
                continue
            seen.add(init.name)
            e = art.manifest.tensors[init.name].single
            ext = {kv.key: kv.value for kv in init.external_data}
            assert init.data_location == onnx.TensorProto.EXTERNAL
            assert ext == {"location": e.file, "offset": str(e.offset), "length": str(e.length)}
    assert seen == set(state)  # every parameter is used by some graph
    assert (tiny_artifact / "model.onnx").stat().st_size < 300_000  # the graph, not the weights


def test_manifest_and_torch_model_roundtrip(tiny_artifact):
    art = load_artifact(tiny_artifact)
    m = art.manifest
    assert m.config == CFG and m.page_size == 16 and m.dtype == "float32" and not m.mxfp8 and m.mtp_modules == 1
    assert m.opset == {"domain": "m3", "version": 1, "onnx_opset": 20, "ops": dict(m3export.ops.OPS)}
    assert set(m.files) == {p.name for p in tiny_artifact.iterdir()} - {"manifest.json"}
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(m.files)
    assert set(m.tools) >= {"m3export", "torch", "onnx", "onnxscript"}
    ref = dict(m3export.load_model("tiny").named_parameters())
    got = dict(load_torch_model(tiny_artifact).named_parameters())
    assert got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in ref)
    half = load_torch_model(tiny_artifact, dtype=torch.bfloat16)
    assert half.lm_head.weight.dtype == torch.bfloat16
    assert half.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router stays fp32


def test_mxfp8_checkpoint_artifact(mxfp8_checkpoint, mxfp8_artifact):
    art = load_artifact(mxfp8_artifact)
    assert art.manifest.mxfp8 and art.page_size == 8
    assert art.manifest.tensors["model.layers.1.mlp.experts.w13"].dtype == "float8_e4m3fn"
    assert art.manifest.tensors["model.layers.1.mlp.experts.w13_scale_inv"].dtype == "uint8"
    assert art.manifest.source == f"checkpoint:{mxfp8_checkpoint.resolve()}"
    ref = dict(m3export.load_model(mxfp8_checkpoint, progress=False).named_parameters())
    got = dict(load_torch_model(art).named_parameters())
    assert got.keys() == ref.keys()
    for n in ref:
        assert got[n].dtype == ref[n].dtype and torch.equal(got[n].view(torch.uint8), ref[n].view(torch.uint8)), n
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (mxfp8_artifact / name).read_bytes() == (mxfp8_checkpoint / name).read_bytes()


def test_quantize_model_matches_the_mxfp8_preset():
    """--weights mxfp8 on a floating-point checkpoint quantises exactly as the MXFP8 preset / synth do."""
    got = dict(quantize_model(m3export.load_model("tiny")).named_parameters())
    ref = dict(m3export.load_model("tiny", mxfp8=True).named_parameters())
    assert got.keys() == ref.keys()
    for n in ref:
        assert got[n].dtype == ref[n].dtype and torch.equal(got[n].view(torch.uint8), ref[n].view(torch.uint8)), n


def test_export_is_deterministic_and_force_replaces(tiny_artifact, tmp_path):
    out = tmp_path / "again"
    out.mkdir()
    (out / "stale.txt").write_text("from an older export")
    with pytest.raises(ArtifactError, match="not empty"):
        export_artifact("tiny", out, progress=False)
    export_artifact("tiny", out, force=True, progress=False)
    names = sorted(p.name for p in tiny_artifact.iterdir())
    assert sorted(p.name for p in out.iterdir()) == names
    for name in names:
        assert (out / name).read_bytes() == (tiny_artifact / name).read_bytes(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]  # no temporary directories left behind


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-bf16", CFG, progress=False)


def _broken(tmp_path, small_checkpoint, how: str):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(small_checkpoint, ckpt)
    shard = next(ckpt.glob("*.safetensors"))
    if how == "no weights":
        shard.unlink()
    elif how == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:4000])
    elif how == "no config":
        (ckpt / "config.json").unlink()
    elif how == "inconsistent config":
        cfg = json.loads((ckpt / "config.json").read_text())
        cfg["text_config"]["num_attention_heads"] = 3
        (ckpt / "config.json").write_text(json.dumps(cfg))
    elif how == "config of another size":
        cfg = json.loads((ckpt / "config.json").read_text())
        cfg["text_config"]["hidden_size"] = 96
        (ckpt / "config.json").write_text(json.dumps(cfg))
    return ckpt


@pytest.mark.parametrize("how,error,match", [
    ("missing dir", CheckpointError, "does not exist"),
    ("no weights", CheckpointError, "safetensors"),
    ("truncated shard", CheckpointError, "truncated"),
    ("no config", ConfigError, "config.json"),
    ("inconsistent config", ConfigError, "num_attention_heads"),
    ("config of another size", CheckpointError, "shape"),
])
def test_malformed_inputs_fail_clearly_and_leave_nothing(tmp_path, small_checkpoint, capsys, how, error, match):
    ckpt = tmp_path / "missing" if how == "missing dir" else _broken(tmp_path, small_checkpoint, how)
    out = tmp_path / "art"
    with pytest.raises(error, match=match):
        export_artifact(str(ckpt), out, progress=False)
    assert cli(["export", "--checkpoint", str(ckpt), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and match in err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no half-written temp directory


@pytest.mark.parametrize("kwargs,match", [({"dtype": "int8"}, "--dtype"), ({"page_size": 0}, "--page-size"),
                                          ({"weights": "fp4"}, "--weights")])
def test_bad_options(tmp_path, kwargs, match):
    with pytest.raises(ArtifactError, match=match):
        export_artifact("tiny", tmp_path / "x", progress=False, **kwargs)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage,match", [
    ("manifest", "no manifest.json"), ("json", "not valid JSON"), ("bitflip", "sha256"), ("missing", "missing"),
    ("truncate", "bytes"), ("version", "format_version"), ("tensor", "tensor map"),
])
def test_load_artifact_errors(tiny_artifact, tmp_path, damage, match):
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    manifest = json.loads((art / "manifest.json").read_text())
    if damage == "manifest":
        (art / "manifest.json").unlink()
    elif damage == "json":
        (art / "manifest.json").write_text("{not json")
    elif damage == "bitflip":
        data = bytearray((art / "weights.safetensors").read_bytes())
        data[-1] ^= 1
        (art / "weights.safetensors").write_bytes(bytes(data))
    elif damage == "missing":
        (art / "mtp0.onnx").unlink()
    elif damage == "truncate":
        (art / "model.onnx").write_bytes((art / "model.onnx").read_bytes()[:100])
    elif damage == "version":
        manifest["format_version"] = 99
    elif damage == "tensor":
        manifest["tensors"].pop("lm_head.weight")
    if damage in ("version", "tensor"):
        (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=match):
        load_torch_model(art)


def test_session_runs_a_step_that_wants_no_logits(tiny_artifact):
    """N = 0 (a step of prefill chunks that all stop short of their end) is a valid, empty logits output."""
    sess = PagedSession.from_artifact(load_artifact(tiny_artifact))
    sess.allocate(4)
    out = sess.run({"input_ids": np.array([5, 7]), "positions": np.array([0, 1]),
                    "query_start_loc": np.array([0, 2], np.int32), "seq_lens": np.array([2], np.int32),
                    "block_tables": np.array([[3]], np.int32), "slot_mapping": np.array([48, 49]),
                    "logits_indices": np.zeros(0, np.int64)})
    assert out["logits"].shape == (0, 320) and out["hidden"].shape == (2, 64)
    assert sess.pools["k_cache.0"][3, :2].any() and not sess.pools["k_cache.0"][3, 2:].any()


def test_in_place_step_writes_only_its_rows_into_the_bound_pools(tiny_artifact):
    """Why a step's cost does not grow with the pool, checked structurally (no clock): on a 4096-page pool every
    cache output is the very buffer bound as its input (PagedSession also checks this after each run) and only
    the step's own rows change, so ONNX Runtime neither copies nor rewrites the pool."""
    art = load_artifact(tiny_artifact)
    feeds = {"input_ids": np.array([5, 7]), "positions": np.array([3, 0]),
             "query_start_loc": np.array([0, 1, 2], np.int32), "seq_lens": np.array([4, 1], np.int32),
             "block_tables": np.array([[2], [1]], np.int32), "slot_mapping": np.array([35, 16]),
             "logits_indices": np.array([0, 1])}
    sess = PagedSession.from_artifact(art)
    sess.allocate(64 * 64)
    addresses = {name: pool.__array_interface__["data"][0] for name, pool in sess.pools.items()}
    sess.run(feeds)
    assert {name: pool.__array_interface__["data"][0] for name, pool in sess.pools.items()} == addresses
    for name, pool in sess.pools.items():
        written = np.zeros(pool.shape[:2], dtype=bool)
        written[2, 3] = written[1, 0] = True  # slots 35 and 16 with pages of 16
        assert pool[written].any(), name
        assert not pool[~written].any(), f"{name}: rows outside the step's slots changed"
