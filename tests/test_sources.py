"""One precedence for "preset, checkpoint directory or artifact?", whoever asks."""

from __future__ import annotations

import pytest

from m3export.serve.repo import RepositoryError, resolve_source
from m3export.sources import ARTIFACT, CHECKPOINT, PRESET, source_kind


def test_precedence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert source_kind("tiny") == PRESET
    assert source_kind("no-such-dir") == CHECKPOINT  # the checkpoint loader then says it does not exist
    (tmp_path / "tiny").mkdir()  # a directory wins over the preset of the same name
    assert source_kind("tiny") == CHECKPOINT
    (tmp_path / "tiny" / "manifest.json").write_text("{}")  # e.g. an in-place export next to the shards
    assert source_kind("tiny") == ARTIFACT
    assert source_kind(tmp_path / "tiny") == ARTIFACT


def test_repository_writer_uses_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_source("tiny", "torch").kind == PRESET
    (tmp_path / "tiny").mkdir()
    with pytest.raises(RepositoryError, match="neither an exported artifact"):
        resolve_source("tiny", "torch")
    (tmp_path / "f").write_text("")
    with pytest.raises(RepositoryError, match="got a file"):
        resolve_source("f", "torch")
    with pytest.raises(RepositoryError, match="no such directory, and not a preset"):
        resolve_source("nope", "torch")
    with pytest.raises(RepositoryError, match="runs on the torch backend only"):
        resolve_source("mini", "onnxruntime")
