"""Both flavours (TensorRT plugin graphs, ONNX Runtime contrib graphs) are written by the one writer
(``m3export/export/flavour_files.py``) and get its protections: an atomic write that leaves nothing behind when it
fails, the artifact's own files never replaced, the record's file / source / external data, and a flavour that
would read weights its source does not is refused."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import onnx
import pytest

from m3export.errors import ArtifactError
from m3export.export import lowering, tensorrt_flavour
from m3export.export.artifact import load_artifact
from m3export.export.flavour_files import RECORD_KEYS, write_flavour_graphs, write_graph

pytest.importorskip("onnx_graphsurgeon")  # the ort-contrib flavour's graph pass


def _tensorrt(directory, graphs, protected=frozenset()):
    return tensorrt_flavour.write_flavour_files(directory, graphs, 4096, protected=protected)


def _ort_contrib(directory, graphs, protected=frozenset()):
    assert not protected  # its writer protects the graph files itself
    return lowering.write_flavour_files(directory, graphs)


WRITERS = {"tensorrt": (_tensorrt, tensorrt_flavour.flavour_file), "ort-contrib": (_ort_contrib, lowering.flavour_file)}


@pytest.fixture
def art(tiny_artifact, tmp_path):
    """A copy of the tiny artifact (its graphs' weights in weights.safetensors beside them)."""
    root = Path(shutil.copytree(tiny_artifact, tmp_path / "art"))
    return root, load_artifact(root, verify_checksums=False).graphs


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.endswith(".partial"))


@pytest.mark.parametrize("flavour", WRITERS)
def test_each_flavour_records_its_file_source_and_weights(art, flavour):
    root, graphs = art
    write, file_of = WRITERS[flavour]
    record = write(root, graphs)
    assert set(record) == {"model", "mtp0"}
    for name, rec in record.items():
        assert list(rec)[:3] == list(RECORD_KEYS)
        assert rec["file"] == file_of(name) and rec["source"] == graphs[name].file
        assert rec["external_data"] == ["weights.safetensors"]
        onnx.load(str(root / rec["file"]), load_external_data=False)  # a whole graph, where the record says
    assert not _leftovers(root)


@pytest.mark.parametrize("flavour", WRITERS)
def test_a_failed_write_leaves_no_file_behind(art, flavour, monkeypatch):
    root, graphs = art
    write, file_of = WRITERS[flavour]

    def full(self, target):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "replace", full)
    with pytest.raises(ArtifactError, match=rf"cannot write the {flavour} flavour of model.onnx as "
                                            rf"{file_of('model')} \(No space left on device\)"):
        write(root, graphs)
    assert not (root / file_of("model")).exists() and not _leftovers(root)


def test_the_artifacts_own_files_are_never_replaced(art):
    """The TensorRT flavour, written beside an exported artifact, never replaces a file its manifest lists
    (``write_flavour`` protects them) but does replace an earlier build's flavour file; the ort-contrib flavour,
    written at export, replaces nothing."""
    root, graphs = art
    (root / "model.trt.onnx").write_bytes(b"exported")
    with pytest.raises(ArtifactError, match="model.trt.onnx is a file of the artifact itself; not replacing it"):
        _tensorrt(root, graphs, protected={"model.trt.onnx"})
    assert (root / "model.trt.onnx").read_bytes() == b"exported"
    _tensorrt(root, graphs)  # not the artifact's: an earlier build's, replaced
    assert (root / "model.trt.onnx").read_bytes() != b"exported"
    (root / "model.ort.onnx").write_bytes(b"someone's")
    with pytest.raises(ArtifactError, match="model.ort.onnx exists; not replacing it"):
        _ort_contrib(root, graphs)
    assert (root / "model.ort.onnx").read_bytes() == b"someone's" and not _leftovers(root)


def test_a_flavour_never_replaces_its_source_or_leaves_the_directory(art):
    root, graphs = art
    source = (root / "model.onnx").read_bytes()
    with pytest.raises(ArtifactError, match="model.onnx is a file of the artifact itself"):
        write_flavour_graphs(root, graphs, ["model"], "test", lambda name: f"{name}.onnx",
                             lambda name, model: (model, {}), replace=True)
    assert (root / "model.onnx").read_bytes() == source
    for bad in ("../model.x.onnx", "sub/model.x.onnx", ".hidden.onnx", ""):
        with pytest.raises(ArtifactError, match="must be a plain file name in the artifact"):
            write_graph(root, bad, onnx.ModelProto(), "a test graph")


def test_a_flavour_reading_other_weights_is_refused(art):
    """A rewrite that points an initializer at a file its source does not read would ship a graph whose weights
    are not the artifact's."""
    root, graphs = art

    def elsewhere(name, model):
        moved = onnx.ModelProto()
        moved.CopyFrom(model)
        for tensor in moved.graph.initializer:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = "other.safetensors"
        return moved, {}

    with pytest.raises(ArtifactError, match=r"reads external data \['other.safetensors'\], which model.onnx does "
                                            "not"):
        write_flavour_graphs(root, graphs, ["model"], "test", lambda name: f"{name}.test.onnx", elsewhere)
    assert not (root / "model.test.onnx").exists()
    with pytest.raises(ValueError, match=r"record fields \['file'\] are the writer's own"):
        write_flavour_graphs(root, graphs, ["model"], "test", lambda name: f"{name}.test.onnx",
                             lambda name, model: (model, {"file": "x"}))
