"""Checkpoint loading: both layouts and dtypes, MTP presence, and a clear error for every malformed case."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

import m3export
from m3export.checkpoint.writer import write_checkpoint
from m3export.config import preset
from m3export.errors import CheckpointError
from m3export.cli import main as cli

CFG = preset("tiny")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for layout in ("original", "hf"):
        for fmt in ("bf16", "mxfp8"):
            out[layout, fmt] = write_checkpoint(root / f"{layout}-{fmt}", CFG, layout, fmt, shard_bytes=100_000,
                                                progress=False)
    return out


def _params(model):
    return {n: p for n, p in model.named_parameters()}


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_layouts_load_identically(ckpts, fmt):
    a = _params(m3export.load_model(ckpts["original", fmt], progress=False))
    b = _params(m3export.load_model(ckpts["hf", fmt], progress=False))
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(_bits(a[n]), _bits(b[n])), n


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_checkpoint_matches_preset_weights(ckpts):
    """bf16 checkpoint == the preset's random weights rounded to bf16; router stays fp32 exactly."""
    ref = _params(m3export.load_model("tiny"))
    got = _params(m3export.load_model(ckpts["original", "bf16"], progress=False))
    for n, p in got.items():
        want = ref[n] if n.endswith(("gate.weight", "e_score_correction_bias")) else ref[n].bfloat16().float()
        assert torch.equal(p, want), n


def test_mxfp8_kept_or_dequantized(ckpts):
    kept = m3export.load_model(ckpts["original", "mxfp8"], progress=False)
    deq = m3export.load_model(ckpts["original", "mxfp8"], dequantize=True, progress=False)
    assert kept.mxfp8 and not deq.mxfp8
    w = kept.model.layers[1].mlp.experts
    assert w.w13.dtype == torch.float8_e4m3fn and w.w13_scale_inv.dtype == torch.uint8
    assert kept.model.layers[1].mlp.gate.weight.dtype == torch.float32
    ids = torch.randint(0, CFG.vocab_size, (1, 30))
    with torch.no_grad():
        a, b = kept(ids), deq(ids)
    assert float((a - b).abs().max() / b.abs().max()) < 1e-5


def test_bf16_model_dtype(ckpts):
    """The bf16 model keeps its router in fp32 and computes what the fp32 model of the same (bf16) weights does,
    within bf16 arithmetic: relative to the largest logit, measured 1.1-1.9e-2 over 5 prompts (activations rounded
    to 2^-8 at each of ~13 stages of the tiny model); 5e-2 leaves a 2.5x margin, while a wrong bf16 path (a norm's
    weight or a scale lost in a cast, a wrong accumulation dtype overflowing) moves logits by O(1)."""
    m = m3export.load_model(ckpts["hf", "bf16"], dtype=torch.bfloat16, progress=False)
    assert m.lm_head.weight.dtype == torch.bfloat16
    assert m.model.layers[1].mlp.gate.weight.dtype == torch.float32
    ids = torch.randint(0, CFG.vocab_size, (1, 12))
    with torch.no_grad():
        got = m(ids)
        want = m3export.load_model(ckpts["hf", "bf16"], dtype=torch.float32, progress=False)(ids)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want).abs().max() / want.abs().max()) < 5e-2


def test_missing_mtp_is_reported_and_model_loads(tmp_path, caplog):
    d = write_checkpoint(tmp_path / "c", CFG, with_mtp=False, progress=False)
    with caplog.at_level(logging.WARNING, logger="m3export.load"):
        m = m3export.load_model(d, progress=False)
    assert len(m.mtp) == 0
    assert "declares 1 MTP modules but the checkpoint ships 0" in caplog.text
    assert "speculative decoding is unavailable" in caplog.text


# ---------------------------------------------------------------- malformed checkpoints
def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _first_shard(d):
    return sorted(d.glob("*.safetensors"))[0]


def _rewrite(shard, fn):
    tensors = load_file(str(shard))
    fn(tensors)
    save_file(tensors, str(shard))


def _index_fix(d, fn):
    idx = d / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    fn(data["weight_map"])
    idx.write_text(json.dumps(data))


def test_missing_tensor(ckpts, tmp_path):
    d = _copy(ckpts["original", "bf16"], tmp_path / "c")
    shard = _first_shard(d)
    victim = sorted(load_file(str(shard)))[0]
    _rewrite(shard, lambda t: t.pop(victim))
    _index_fix(d, lambda wm: wm.pop(victim))
    with pytest.raises(CheckpointError, match=rf"missing from the checkpoint, e.g. \['{victim}'\]"):
        m3export.load_model(d, progress=False)


def test_unexpected_tensor(ckpts, tmp_path):
    d = _copy(ckpts["original", "bf16"], tmp_path / "c")
    shard = _first_shard(d)
    _rewrite(shard, lambda t: t.update({"language_model.model.layers.9.extra.weight": torch.zeros(2)}))
    _index_fix(d, lambda wm: wm.update({"language_model.model.layers.9.extra.weight": shard.name}))
    with pytest.raises(CheckpointError, match="unexpected tensor.*layers.9.extra.weight"):
        m3export.load_model(d, progress=False)


@pytest.mark.parametrize("bad, match", [
    (torch.zeros(63, dtype=torch.bfloat16), r"{shard}: tensor '{name}' has shape \[63\], expected \[64\]"),
    (torch.zeros(64, dtype=torch.int32), r"tensor '{name}' has dtype torch.int32, expected a floating"),
], ids=["shape", "dtype"])
def test_shape_or_dtype_mismatch(ckpts, tmp_path, bad, match):
    d = _copy(ckpts["original", "bf16"], tmp_path / "c")
    name = "language_model.model.norm.weight"
    shard = d / json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]
    _rewrite(shard, lambda t: t.update({name: bad}))
    with pytest.raises(CheckpointError, match=match.format(shard=shard.name, name=name)):
        m3export.load_model(d, progress=False)


def test_fp8_weight_where_bf16_model_expected_needs_scale(ckpts, tmp_path):
    d = _copy(ckpts["original", "mxfp8"], tmp_path / "c")
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    name = "language_model.model.layers.0.self_attn.q_proj.weight_scale_inv"
    _rewrite(d / wm[name], lambda t: t.pop(name))
    _index_fix(d, lambda m: m.pop(name))
    with pytest.raises(CheckpointError, match="missing from the checkpoint.*q_proj.weight_scale_inv"):
        m3export.load_model(d, progress=False)
    with pytest.raises(CheckpointError, match="q_proj.weight' is float8_e4m3fn but its scale .* is missing"):
        m3export.load_model(d, dequantize=True, progress=False)


def test_truncated_shard(ckpts, tmp_path):
    d = _copy(ckpts["original", "bf16"], tmp_path / "c")
    shard = _first_shard(d)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 10])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: tensor '.*' ends at byte \d+ but the file has"):
        m3export.load_model(d, progress=False)
    shard.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        m3export.load_model(d, progress=False)


def test_corrupt_header(ckpts, tmp_path):
    d = _copy(ckpts["original", "bf16"], tmp_path / "c")
    shard = _first_shard(d)
    data = bytearray(shard.read_bytes())
    data[8] = ord("#")
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="header is not valid JSON"):
        m3export.load_model(d, progress=False)


def test_index_pointing_outside(ckpts, tmp_path):
    d = _copy(ckpts["original", "bf16"], tmp_path / "c")
    (tmp_path / "evil.safetensors").write_bytes(_first_shard(d).read_bytes())
    _index_fix(d, lambda wm: wm.update({k: "../evil.safetensors" for k in list(wm)[:1]}))
    with pytest.raises(CheckpointError, match="points outside the checkpoint directory"):
        m3export.load_model(d, progress=False)


def test_index_names_missing_file(ckpts, tmp_path):
    d = _copy(ckpts["original", "bf16"], tmp_path / "c")
    _index_fix(d, lambda wm: wm.update({k: "model-99999.safetensors" for k in list(wm)[:1]}))
    with pytest.raises(CheckpointError, match="model-99999.safetensors, which does not exist"):
        m3export.load_model(d, progress=False)


def test_index_disagrees_with_shard(ckpts, tmp_path):
    d = _copy(ckpts["original", "bf16"], tmp_path / "c")
    shards = sorted(p.name for p in d.glob("*.safetensors"))
    _index_fix(d, lambda wm: wm.update({k: shards[-1] for k in list(wm)[:1] if wm[k] != shards[-1]}))
    with pytest.raises(CheckpointError, match="but that shard does not hold it"):
        m3export.load_model(d, progress=False)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        m3export.load_model(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        m3export.load_model(tmp_path)


def test_no_pickle_files_are_read(ckpts, tmp_path):
    d = _copy(ckpts["original", "bf16"], tmp_path / "c")
    for p in d.glob("*.safetensors"):
        p.unlink()
    (d / "model.safetensors.index.json").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not read")
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        m3export.load_model(d)


def test_synth_cli(tmp_path, capsys):
    assert cli(["synth", "--preset", "tiny", "--out", str(tmp_path / "s"), "--layout", "hf", "--dtype", "mxfp8"]) == 0
    m = m3export.load_model(tmp_path / "s", progress=False)
    assert m.mxfp8 and m.checkpoint_info["layout"] == "hf" and (tmp_path / "s" / "tokenizer.json").exists()
    assert cli(["synth", "--out", str(tmp_path / "s")]) == 2
    assert "not empty" in capsys.readouterr().err
