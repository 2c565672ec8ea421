"""A manifest is data: it must not make a loader read, hash or run files outside the artifact, nor allocate what
its config claims before the tensor map is checked against it (issue 10 items 5 and 16)."""

from __future__ import annotations

import json
import shutil

import pytest

from m3export.errors import ArtifactError
from m3export.export.artifact import load_artifact, load_torch_model
from m3export.export.manifest import sha256_file


@pytest.fixture
def art(tiny_artifact, tmp_path):  # noqa: F811
    copy = tmp_path / "art"
    shutil.copytree(tiny_artifact, copy)
    return copy


def _edit(art, fn):
    path = art / "manifest.json"
    manifest = json.loads(path.read_text())
    fn(manifest)
    path.write_text(json.dumps(manifest))


def _point_tensor_at(art, name, outside):
    """Make ``name``'s bytes come from ``outside`` with a correct size and checksum, as an attacker would."""
    def fn(m):
        m["files"][str(outside)] = {"bytes": outside.stat().st_size, "sha256": sha256_file(outside)}
        m["tensors"][name].update(file=str(outside), offset=0)
    _edit(art, fn)


def test_absolute_and_dotdot_names_are_refused(art, tmp_path):
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"\0" * 4096)  # enough bytes for model.norm.weight (64 x float32)
    _point_tensor_at(art, "model.norm.weight", outside)
    with pytest.raises(ArtifactError, match="is not inside the artifact directory"):
        load_torch_model(art)

    art2 = tmp_path / "art2"
    shutil.copytree(art, art2)
    (tmp_path / "outside").mkdir()
    shutil.copy(art / "model.onnx", tmp_path / "outside" / "evil.onnx")

    def graph_outside(m):
        rel = "../outside/evil.onnx"
        m["files"][rel] = m["files"]["model.onnx"]
        m["graphs"]["model"]["file"] = rel
    _edit(art2, graph_outside)
    with pytest.raises(ArtifactError, match=r"'\.\./outside/evil\.onnx' is not inside the artifact directory"):
        load_artifact(art2, verify_checksums=False)


@pytest.mark.parametrize("name", ["weights.safetensors", "model.onnx"])
def test_symlinks_leaving_the_artifact_are_refused(art, tmp_path, name):
    outside = tmp_path / f"elsewhere-{name}"
    (art / name).rename(outside)  # same bytes, same checksum: only the link gives it away
    (art / name).symlink_to(outside)
    with pytest.raises(ArtifactError, match=rf"'{name}' is a symbolic link leading outside the artifact"):
        load_artifact(art)


def test_a_symlink_inside_the_artifact_is_fine(art):
    (art / "weights.safetensors").rename(art / "real-weights")
    (art / "weights.safetensors").symlink_to("real-weights")
    load_artifact(art)


@pytest.mark.parametrize("edit, match", [
    (lambda m: m["config"].update(hidden_size=10 ** 9), r"tensor '.*' has shape .* the config implies"),
    (lambda m: m["tensors"]["model.norm.weight"].update(offset=-8), "negative offset"),
    (lambda m: m.update(parts=[{"graph": "model", "layers": []}]), "malformed part"),
    (lambda m: m.update(dtype="int64"), "'int64' is not a model dtype"),
    (lambda m: m["tensors"]["model.norm.weight"].update(dtype="bfloat16", length=128), "is stored as"),
])
def test_absurd_manifests_are_one_clear_error_before_any_allocation(art, edit, match):
    """hidden_size 1e9 once allocated 1.28 TB before the shapes were compared; now every loader (both backends,
    verify) checks the tensor map on a meta model first."""
    _edit(art, edit)
    with pytest.raises(ArtifactError, match=match):
        load_artifact(art, verify_checksums=False)


def _page_size(m, size, signatures=False):
    m["page_size"] = size
    if signatures:  # a consistent lie: the signatures claim pages of `size` too
        for g in m["graphs"].values():
            for t in (*g["inputs"], *g["outputs"]):
                if "cache" in t["name"]:
                    t["shape"][1] = size


def test_a_manifest_that_contradicts_its_graphs_is_refused(art):
    """Issue 10 item 13: the onnxruntime backend ran (and verify failed generically) with page_size 8 over graphs
    built for 16, and with mtp_modules -1 ran without MTP."""
    from m3export.errors import BackendUnavailable
    from m3export.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

    original = (art / "manifest.json").read_text()
    _edit(art, lambda m: _page_size(m, 8))
    with pytest.raises(ArtifactError, match=r"pool k_cache.0 has shape \['pages', 16, 2, 32\], but page_size is 8"):
        load_artifact(art, verify_checksums=False)
    (art / "manifest.json").write_text(original)
    _edit(art, lambda m: m.update(mtp_modules=-1))
    with pytest.raises(ArtifactError, match="mtp_modules must be >= 0"):
        load_artifact(art, verify_checksums=False)
    (art / "manifest.json").write_text(original)
    _edit(art, lambda m: _page_size(m, 8, signatures=True))
    load_artifact(art, verify_checksums=False)  # self-consistent: only the graph files can tell
    with pytest.raises(BackendUnavailable, match=r"model.onnx: input k_cache.0 has shape \['pages', 16, 2, 32\] in "
                                                 r"the graph, manifest.json says \['pages', 8, 2, 32\]"):
        OnnxRuntimeBackend.from_artifact(art)


def test_flavour_files_must_be_checksummed_files_of_the_artifact(art, tmp_path):
    """A flavour's graph is loaded and run (PagedSession.from_artifact(flavour=...), the TensorRT build), so its
    file must be a listed, contained file like every graph file, not any path the manifest names."""
    (tmp_path / "outside").mkdir()
    shutil.copy(art / "model.onnx", tmp_path / "outside" / "evil.onnx")
    _edit(art, lambda m: m.update(flavours={"ort-contrib": {"model": {"file": "../outside/evil.onnx"}}}))
    with pytest.raises(ArtifactError, match=r"files \['\.\./outside/evil\.onnx'\] are used but have no checksum"):
        load_artifact(art, verify_checksums=False)

    _edit(art, lambda m: m.update(flavours={"ort-contrib": {"model": {"source": "model.onnx"}}}))
    with pytest.raises(ArtifactError, match=r"flavours\['ort-contrib'\]\['model'\] must be a record with a 'file'"):
        load_artifact(art, verify_checksums=False)


def test_unknown_dtype_of_a_pieced_tensor_is_one_clear_error(art):
    """A parameter stored as pieces carries its own dtype; an unknown one is an ArtifactError naming the tensor
    (it was a KeyError deep in the tensor-map check)."""
    def pieced(m):
        whole = m["tensors"]["model.norm.weight"]
        m["tensors"]["model.norm.weight"] = {"dtype": "float33", "shape": whole["shape"],
                                             "pieces": [{"index": [], **whole}]}
    _edit(art, pieced)
    with pytest.raises(ArtifactError, match=r"tensor 'model.norm.weight' has unknown dtype 'float33'"):
        load_artifact(art, verify_checksums=False)


def test_pieces_must_fill_their_slices(art):
    """Pieces are copied into the parameter's slices; a piece smaller than its slice would broadcast silently and
    a missing one would leave rows unset, so both are refused with the tensor named."""
    whole = json.loads((art / "manifest.json").read_text())["tensors"]["model.norm.weight"]  # [hidden] float32

    def pieced(index, shape):
        def fn(m):
            piece = {**whole, "shape": shape, "length": 4 * shape[0], "index": index}
            m["tensors"]["model.norm.weight"] = {"dtype": whole["dtype"], "shape": whole["shape"], "pieces": [piece]}
        return fn
    _edit(art, pieced([[0, 64]], [1]))
    with pytest.raises(ArtifactError, match=r"'model.norm.weight': piece \[\(0, 64\)\] has shape \[1\]"):
        load_artifact(art, verify_checksums=False)
    _edit(art, pieced([[0, 32]], [32]))
    with pytest.raises(ArtifactError, match=r"'model.norm.weight': its pieces hold 32 of its 64 elements"):
        load_artifact(art, verify_checksums=False)
