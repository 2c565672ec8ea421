"""Zero-copy export at real per-layer dimensions from a sparse checkpoint (the full-size path, scaled down)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import onnx
import pytest
import torch
from safetensors import safe_open

from m3export.checkpoint.layout import Layout
from m3export.checkpoint.shards import Checkpoint
from m3export.checkpoint.sparse import write_sparse_checkpoint
from m3export.config import preset
from m3export.errors import ArtifactError, CheckpointError
from m3export.export.artifact import load_artifact
from m3export.export.exporter import export_artifact
from m3export.safetensors_io import read_tensor

# `mini`'s per-layer dimensions (hidden 6144, 64 heads, expert width 3072), 8 experts, cut where no per-layer
# dimension changes: the vocabulary from 200064 to 4096 (token ids below it; the 200064 x 6144 bf16 embedding and
# lm_head were 4.9 of the 7.4 GB every test here reads: finite check, shard hashes, copies) and the layers from 4
# to 3 (a dense one and two sparse ones, as SAMPLES need; the fourth was a third copy of a sparse layer). Still
# several 1 GiB shards, an MTP layer, MXFP8 experts, bf16 and fp32 tensors.
_MINI = preset("mini")
CFG = _MINI.replace(num_local_experts=8, num_experts_per_tok=2, vocab_size=4096, bos_token_id=4000,
                    eos_token_id=[4001], num_hidden_layers=3, layer_types=_MINI.layer_types[:3],
                    mlp_layer_types=_MINI.mlp_layer_types[:3])
SAMPLES = (
    "language_model.model.layers.2.block_sparse_moe.experts.3.w1.weight",
    "language_model.model.layers.2.block_sparse_moe.experts.3.w3.weight_scale_inv",
    "language_model.model.layers.1.self_attn.index_q_proj.weight",
    "language_model.model.mtp.layers.0.transformer_layer.block_sparse_moe.experts.7.w2.weight",
    "language_model.model.norm.weight",
)


def _fill(ckpt_dir, names):
    """Give a few tensors real random bytes (the rest stay holes), so reading both sides compares something."""
    ck = Checkpoint(ckpt_dir)
    g = torch.Generator().manual_seed(0)
    for name in names:
        info = ck.tensors[name]
        data = torch.randint(1, 120, (info.length,), generator=g, dtype=torch.uint8).numpy().tobytes()
        with open(info.file, "r+b") as f:
            f.seek(info.offset)
            f.write(data)


def _sparse_copy(src, dst) -> None:
    """``shutil.copy2`` that keeps a sparse file's holes (``SEEK_DATA`` / ``SEEK_HOLE``): the shards here are ~8 GB
    of holes and a few MB of data, and a plain copy writes every byte (two such copies were ~2 minutes of CI)."""
    size = os.path.getsize(src)
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        fd, offset = fi.fileno(), 0
        while offset < size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:  # no data past offset
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            fi.seek(start)
            fo.seek(start)
            while start < end:
                chunk = fi.read(min(end - start, 1 << 24))
                fo.write(chunk)
                start += len(chunk)
            offset = end
        fo.truncate(size)
    shutil.copystat(src, dst)


def _copy(artifact: Path, to: Path) -> Path:
    shutil.copytree(artifact, to, copy_function=_sparse_copy)
    return to


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("zc") / "ckpt"
    write_sparse_checkpoint(root, CFG, "original", "mxfp8", shard_bytes=1 << 30)
    _fill(root, SAMPLES)
    export_artifact(str(root), None, dtype="bfloat16", in_place=True, progress=False)
    return root


def test_nothing_copied(exported):
    files = json.loads((exported / "manifest.json").read_text())["files"]
    shards = {n for n, f in files.items() if "header_sha256" in f}
    assert shards == {p.name for p in exported.glob("model-*.safetensors")}
    written = sum(f["bytes"] for n, f in files.items() if n not in shards)
    assert not (exported / "weights.safetensors").exists()  # MXFP8 + bf16 + fp32 router: every dtype matches
    assert written < 2_000_000  # graphs only
    # sparse files: the checkpoint data regions are still holes, so the export wrote no tensor bytes
    assert sum(os.stat(p).st_blocks * 512 for p in exported.iterdir()) < 200_000_000


def test_references_point_at_exactly_their_tensor(exported):
    art = load_artifact(exported, verify_checksums=False)  # hashing the shards is test_verify_hashes_...'s part
    ck = Checkpoint(exported)
    by_range = {(Path(i.file).name, i.offset): (name, i) for name, i in ck.tensors.items()}
    layout = Layout("original", art.config)
    for pname, entry in art.manifest.tensors.items():
        pieces = layout.pieces(pname)
        assert len(pieces) == len(entry.pieces), pname
        for want, got in zip(pieces, entry.pieces):
            name, info = by_range[(got.entry.file, got.entry.offset)]
            assert name == want.name and info.length == got.entry.length
            assert tuple(info.shape) == tuple(got.entry.shape) and got.torch_index() == want.index
    # read a sample through the artifact and through safetensors: same (non-zero) values
    for name in SAMPLES:
        info = ck.tensors[name]
        with safe_open(str(info.file), "pt") as f:
            want = f.get_tensor(name)
        entry = next(pc.entry for e in art.manifest.tensors.values() for pc in e.pieces
                     if (pc.entry.file, pc.entry.offset) == (Path(info.file).name, info.offset))
        got = read_tensor(exported, name, entry)
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert got.view(torch.uint8).any()


def test_checker_passes_without_loading_external_data(exported):
    for graph in ("model.onnx", "mtp0.onnx"):
        path = exported / graph
        onnx.checker.check_model(str(path), full_check=True)  # a path: external data is located, never loaded
        m = onnx.load(str(path), load_external_data=False)
        ext = [t for t in m.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        assert ext and all({kv.key for kv in t.external_data} >= {"location", "offset", "length"} for t in ext)
        fp8 = [t for t in ext if t.data_type == onnx.TensorProto.FLOAT8E4M3FN]
        assert fp8  # MXFP8 stays MXFP8 in the graph
        assert path.stat().st_size < 2_000_000


def test_replaced_shard_is_detected(exported, tmp_path):
    copy = _copy(exported, tmp_path / "c")
    shard = sorted(copy.glob("model-*.safetensors"))[0]
    with open(shard, "rb") as f:
        data = bytearray(f.read(4096))
    data[12] ^= 1
    with open(shard, "r+b") as f:
        f.write(bytes(data))
    with pytest.raises(ArtifactError, match="header differs from the one exported"):
        load_artifact(copy)


def test_truncated_or_inconsistent_shard_gives_clear_error(tmp_path):
    cfg = CFG.replace(num_hidden_layers=2, layer_types=CFG.layer_types[:2], mlp_layer_types=CFG.mlp_layer_types[:2])
    root = write_sparse_checkpoint(tmp_path / "t", cfg, "original", "mxfp8", shard_bytes=1 << 29)
    shard = sorted(root.glob("model-*.safetensors"))[-1]
    os.truncate(shard, shard.stat().st_size - 1)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: tensor .* ends at byte \d+ but the file has"):
        export_artifact(str(root), None, dtype="bfloat16", in_place=True, progress=False)
    assert not (root / "manifest.json").exists() and not list(root.glob("*.onnx"))

    root2 = write_sparse_checkpoint(tmp_path / "u", cfg, "original", "mxfp8", shard_bytes=1 << 29)
    idx = root2 / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    name = "language_model.model.norm.weight"
    other = next(f for f in sorted(set(data["weight_map"].values())) if f != data["weight_map"][name])
    data["weight_map"][name] = other
    idx.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="but that shard does not hold it"):
        export_artifact(str(root2), None, dtype="bfloat16", in_place=True, progress=False)
    assert not list(root2.glob("*.onnx"))


@pytest.fixture(scope="module")
def in_place_tiny(tmp_path_factory):
    """A tiny MXFP8 checkpoint (one shard) exported in place once, for the two tests below (an export is most of
    their time): (root, the checkpoint's files' bytes before, the names moved into root during the export, in
    order). Without the MTP module (one graph fewer to trace in each of the two exports): in-place MTP graphs are
    ``exported``'s (test_checker_passes_without_loading_external_data)."""
    from m3export.checkpoint.writer import write_checkpoint

    root = write_checkpoint(tmp_path_factory.mktemp("inplace") / "c", preset("tiny").replace(num_mtp_modules=0),
                            "original", "mxfp8", progress=False)
    before = {p.name: p.read_bytes() for p in root.iterdir()}
    moved, replace = [], Path.replace

    def recording(self, target):
        if Path(target).parent == root:
            moved.append(Path(target).name)
        return replace(self, target)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "replace", recording)
        export_artifact(str(root), None, dtype="float32", in_place=True, progress=False)  # norms etc. converted
    return root, before, moved


def test_in_place_export_again_needs_force_and_keeps_the_checkpoint_loadable(in_place_tiny):
    import m3export

    root, before, _ = in_place_tiny
    assert (root / "weights.safetensors").exists()
    with pytest.raises(ArtifactError, match="already holds .* pass --force"):
        export_artifact(str(root), None, dtype="float32", in_place=True, progress=False)
    export_artifact(str(root), None, dtype="float32", in_place=True, force=True, progress=False)
    assert all((root / n).read_bytes() == b for n, b in before.items())  # the checkpoint's files untouched
    assert m3export.load_model(root, progress=False).mxfp8  # our weight file is not mistaken for a shard
    assert load_artifact(root).manifest.mxfp8


def test_verify_hashes_linked_shards_start_up_does_not(exported, tmp_path):
    """Issue 10 item 12: a same-size corruption of a linked shard's data (a permuted lm_head once passed verify)
    leaves the header alone; the shard's full sha256, recorded at export, catches it when verifying."""
    files = json.loads((exported / "manifest.json").read_text())["files"]
    linked = sorted(n for n, meta in files.items() if "header_sha256" in meta)
    assert linked and all(len(files[n]["sha256"]) == 64 for n in linked)
    copy = _copy(exported, tmp_path / "c")
    ck = Checkpoint(copy)
    info = ck.tensors[SAMPLES[-1]]  # language_model.model.norm.weight: real (non-hole) bytes
    with open(info.file, "rb") as f:  # the copy is whole (a lost extent would fail the check below for nothing)
        assert hashlib.file_digest(f, "sha256").hexdigest() == files[Path(info.file).name]["sha256"]
    with open(info.file, "r+b") as f:
        f.seek(info.offset)
        first = f.read(2)
        f.seek(info.offset)
        f.write(first[::-1] if first[0] != first[1] else bytes([first[0] ^ 1, first[1]]))
    load_artifact(copy, verify_checksums=False)  # start-up: size and header only, as before
    with pytest.raises(ArtifactError, match=r"sha256 does not match manifest.json \(shard corrupted or modified\)"):
        load_artifact(copy)


def test_in_place_export_moves_the_manifest_last(in_place_tiny):
    """The manifest is the commit point of an in-place export: moved after every graph and weight file, so a kill
    mid-move never leaves a manifest beside graphs it does not describe."""
    _, _, moved = in_place_tiny
    assert "model.onnx" in moved and moved[-1] == "manifest.json"
