"""One validation of a checkpoint's tensors for every path (issue 10 items 12, 13): what `generate` (loading)
rejects, export rejects too, copying or zero-copy; non-finite weights are named; verify never calls NaN ok."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import m3export
from m3export.checkpoint.writer import write_checkpoint
from m3export.config import preset
from m3export.errors import CheckpointError
from m3export.export import exporter
from m3export.export.exporter import export_artifact
from m3export.export.verify import Report, Stat

NORM = "language_model.model.norm.weight"  # the original layout's name of model.norm.weight


class Traced(Exception):
    """Raised in place of tracing: every check of the weights has run by then."""


@pytest.fixture
def no_tracing(monkeypatch):
    def trace(*a, **k):
        raise Traced
    monkeypatch.setattr(exporter, "trace_step", trace)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "ck", preset("tiny"), "original", "bf16",
                            with_tokenizer=False, progress=False)


def _variant(ckpt, tmp_path, edit):
    d = tmp_path / "c"
    shutil.copytree(ckpt, d)
    shard = d / "model.safetensors"
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard))
    return d


def _nan(tensors):
    tensors[NORM] = tensors[NORM].clone()
    tensors[NORM][5] = float("nan")


@pytest.mark.parametrize("edit, match", [
    (_nan, rf"tensor '{NORM}' holds 1 NaN or infinite value"),
    (lambda t: t.update({NORM: torch.ones(64, dtype=torch.int32)}), "int32, expected a floating-point weight"),
    (lambda t: t.update({"language_model.model.layers.9.extra.weight": torch.zeros(2)}), "unexpected tensor"),
], ids=["nan", "int32", "extra"])
@pytest.mark.parametrize("path", ["load", "export", "in-place"])
def test_every_path_rejects_what_loading_rejects(ckpt, tmp_path, no_tracing, edit, match, path):
    """NaN weights exported without a word; an int32 weight was cast and extra tensors ignored by export while
    `generate` refused them."""
    d = _variant(ckpt, tmp_path, edit)
    with pytest.raises(CheckpointError, match=match):
        if path == "load":
            m3export.load_model(d, progress=False)
        elif path == "export":
            export_artifact(str(d), tmp_path / "art", progress=False)
        else:  # auto dtype: the NaN norm weight is referenced in place, not converted
            export_artifact(str(d), None, in_place=True, progress=False)
    assert not (tmp_path / "art").exists() and not (d / "manifest.json").exists()


def test_nan_is_a_named_mismatch_never_ok():
    """max(0.0, nan) is 0.0: a NaN output once read as a perfect match and verify PASSED."""
    nan = float("nan")
    s = Stat()
    s.update(torch.tensor([nan, 1.0]), torch.tensor([1.0, 1.0]))
    assert not s.ok(1e-4) and s.nonfinite_got == 1 and "NaN/Inf in 1 ONNX Runtime value" in s.status(1e-4)
    both = Stat()
    both.update(torch.tensor([nan, 1.0]), torch.tensor([nan, 1.0]))  # a broken model: the reference is NaN too
    assert not both.ok(1e-4) and both.nonfinite_ref == 1 and both.max_abs == 0.0
    fine = Stat()
    fine.update(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
    report = Report(tolerance=1e-4, outputs={"model:hidden": s, "model:logits": fine})
    assert not report.passed
    lines = report.lines()
    assert any("model:hidden" in line and "NaN/Inf" in line and "MISMATCH" in line for line in lines)
    assert lines[-1].endswith("FAILED")


def test_page_size_is_bounded_by_the_position_limit(tmp_path, no_tracing):
    """Item 16: --page-size 100000000 exported, then verify / generate died allocating 95 GiB."""
    from m3export.errors import ArtifactError

    limit = preset("tiny").max_position_embeddings
    with pytest.raises(ArtifactError, match=rf"--page-size {limit + 1} exceeds the model's max_position_embeddings"):
        export_artifact("tiny", tmp_path / "art", page_size=limit + 1, progress=False)
    assert not (tmp_path / "art").exists()


def test_in_place_over_symlinked_shards_says_to_export_a_copy(ckpt, tmp_path, no_tracing):
    """Item 16: a Hugging Face cache snapshot (shards are links into ../../blobs) loads, but ONNX Runtime refuses
    external data through links; --in-place failed late inside onnx.checker."""
    from m3export.errors import ArtifactError

    blobs, snap = tmp_path / "blobs", tmp_path / "snap"
    blobs.mkdir()
    snap.mkdir()
    for p in ckpt.iterdir():
        (blobs / p.name).write_bytes(p.read_bytes())
        (snap / p.name).symlink_to(blobs / p.name)
    m3export.load_model(snap, progress=False)
    with pytest.raises(ArtifactError, match="is a symbolic link .* export this checkpoint with --out DIR"):
        export_artifact(str(snap), None, in_place=True, progress=False)
    assert sorted(p.name for p in snap.iterdir()) == sorted(p.name for p in ckpt.iterdir())


def test_a_config_that_does_not_fit_the_tensors_is_an_error_before_allocating(ckpt, tmp_path):
    """Item 16 (absurd sizes): loading allocated the model the config describes (1.28 TB for hidden_size 1e9)
    before comparing a single tensor shape."""
    import json

    d = tmp_path / "c"
    shutil.copytree(ckpt, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["hidden_size"] = 10 ** 9
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"has shape \[\d+(, \d+)*\], expected \[.*1000000000"):
        m3export.load_model(d, progress=False)


def test_a_fifo_config_is_refused_not_opened(ckpt, tmp_path):
    """Item 10: only regular files are opened; a FIFO config.json blocked the load forever."""
    import os
    import threading

    d = tmp_path / "c"
    shutil.copytree(ckpt, d)
    (d / "config.json").unlink()
    os.mkfifo(d / "config.json")
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(CheckpointError, m3export.load_model, d,
                                                                    progress=False)), daemon=True)
    t.start()
    t.join(30)
    if t.is_alive():
        os.close(os.open(d / "config.json", os.O_WRONLY | os.O_NONBLOCK))
        t.join()
        pytest.fail("loading blocked in open(config.json)")
    assert "config.json: not a regular file" in str(errors[0].value)
