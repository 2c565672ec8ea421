"""Artifacts shared by the export and verify tests: each tiny export runs once per test session."""

from __future__ import annotations

import pytest

from m3export.checkpoint.writer import write_checkpoint
from m3export.config import preset
from m3export.export.exporter import export_artifact


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory):
    """The tiny preset, float32, page size 16."""
    return export_artifact("tiny", tmp_path_factory.mktemp("art") / "tiny", progress=False)


@pytest.fixture(scope="session")
def fp8_artifact(tmp_path_factory):
    """The tiny preset, float32, page size 16, with an FP8 (E4M3) cache: uint8 code pools and fp32 scale pools."""
    return export_artifact("tiny", tmp_path_factory.mktemp("art") / "tiny-fp8", kv_cache_dtype="fp8",
                           progress=False)


@pytest.fixture(scope="session")
def mxfp8_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-mxfp8", preset("tiny"), "original", "mxfp8",
                            progress=False)


@pytest.fixture(scope="session")
def mxfp8_artifact(tmp_path_factory, mxfp8_checkpoint):
    """An MXFP8 checkpoint exported with its fp8 weights kept, page size 8 (two indexer blocks per page)."""
    return export_artifact(str(mxfp8_checkpoint), tmp_path_factory.mktemp("art") / "tiny-mxfp8", page_size=8,
                           progress=False)
