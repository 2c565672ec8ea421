"""The one safetensors reader / writer against the ``safetensors`` library, and both checkpoint writers sharing it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from m3export.checkpoint.shards import Checkpoint
from m3export.checkpoint.sparse import write_sparse_checkpoint
from m3export.checkpoint.writer import write_checkpoint
from m3export.config import M3Config, preset
from m3export.errors import CheckpointError
from m3export.safetensors_io import read_header, read_tensor, write_safetensors


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(3, 5, generator=g),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "c": torch.randint(0, 255, (2, 4), generator=g, dtype=torch.uint8),
        "d": torch.randn(4, 32, generator=g).to(torch.float8_e4m3fn),
    }


def test_written_file_reads_back_through_the_library_and_the_byte_ranges(tmp_path):
    tensors = _tensors()
    path = tmp_path / "x.safetensors"
    entries = write_safetensors(path, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], tensors.__getitem__,
                                progress=False)
    with safe_open(str(path), "pt") as f:
        for name, want in tensors.items():
            assert torch.equal(f.get_tensor(name).view(torch.uint8), want.view(torch.uint8))
    parsed = read_header(path)
    for name, want in tensors.items():
        assert parsed[name].offset == entries[name].offset and parsed[name].length == want.numel() * want.itemsize
        assert parsed[name].torch_dtype == want.dtype and parsed[name].shape == tuple(want.shape)
        got = read_tensor(tmp_path, name, entries[name])
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert entries["a"].offset % 8 == 0  # the data section starts 8-byte aligned


def test_without_values_the_file_is_sparse_and_valid(tmp_path):
    path = tmp_path / "s.safetensors"
    entries = write_safetensors(path, [("w", torch.float32, (1024, 1024))], progress=False)
    assert path.stat().st_size == entries["w"].offset + 4 * 1024 * 1024
    with safe_open(str(path), "pt") as f:
        assert not f.get_tensor("w").any()  # a hole reads as zeros


def test_header_checks_name_the_file_and_tensor(tmp_path):
    path = tmp_path / "bad.safetensors"
    write_safetensors(path, [("w", torch.float32, (4,))], lambda n: torch.ones(4), progress=False)
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header["w"]["data_offsets"] = [0, 12]  # 3 floats for a shape of 4
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)  # same length: "12" for "16"
    path.write_bytes(raw[:8] + text[:n] + raw[8 + n:])
    with pytest.raises(CheckpointError, match=r"bad.safetensors: tensor 'w': data_offsets \[0, 12\] do not match"):
        read_header(path)


def test_sparse_and_real_checkpoints_plan_the_same_tensors_and_config(tmp_path):
    """The two writers once drifted (the sparse one dropped an hf MXFP8 config's quantization_config)."""
    cfg = preset("tiny")
    real = write_checkpoint(tmp_path / "real", cfg, "hf", "mxfp8", shard_bytes=1 << 30, with_tokenizer=False,
                            progress=False)
    sparse = write_sparse_checkpoint(tmp_path / "sparse", cfg, "hf", "mxfp8", shard_bytes=1 << 30)

    def planned(d):
        return {n: (e.dtype, e.shape) for n, e in Checkpoint(d).tensors.items()}

    assert planned(real) == planned(sparse)
    assert json.loads((real / "config.json").read_text()) == json.loads((sparse / "config.json").read_text())
    assert M3Config.from_pretrained(sparse).quantization is not None


def _rewrite_header(path, edit):
    """Rewrite ``path``'s header through ``edit(header)``, keeping the data section's bytes as they are."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def _two_tensor_file(tmp_path):
    path = tmp_path / "two.safetensors"
    write_safetensors(path, [("a", torch.float32, (4,)), ("b", torch.float32, (4,))], lambda n: torch.ones(4),
                      progress=False)
    return path


def _library_rejects(path) -> bool:
    try:
        with safe_open(str(path), "pt") as f:
            [f.get_tensor(k) for k in f.keys()]
    except Exception:  # noqa: BLE001 - the library raises its own error types
        return True
    return False


@pytest.mark.parametrize("edit, match", [
    (lambda h: h["b"].update(data_offsets=[0, 16]), "tensors overlap or leave a gap"),  # b aliases a's bytes
    (lambda h: h["a"].update(data_offsets=[0.0, 16.0]), "must be non-negative integers"),
    (lambda h: h["a"].update(data_offsets=["0", "16"]), "must be non-negative integers"),
    (lambda h: h["a"].update(shape=["4"]), "must be non-negative integers"),
    (lambda h: h["a"].update(data_offsets=[True, 16]), "must be non-negative integers"),
    (lambda h: h.pop("b"), "the tensors cover 16 of the 32 data bytes"),  # trailing bytes nobody owns
])
def test_headers_the_library_rejects_are_rejected_with_the_tensor_named(tmp_path, edit, match):
    """Issue 10 items 6 / 16: every path (loading, copying export, zero-copy references) parses headers here, so it
    must refuse what the safetensors library refuses, with one clear line instead of a TypeError."""
    path = _two_tensor_file(tmp_path)
    _rewrite_header(path, edit)
    assert _library_rejects(path)
    with pytest.raises(CheckpointError, match=match):
        read_header(path)


def test_a_fifo_shard_or_index_is_refused_not_opened(tmp_path):
    """Issue 10 item 10: opening a FIFO blocks until a writer comes; only regular files are read."""
    import os

    import threading

    def opened_without_blocking(fifo):
        """Checkpoint(ckpt)'s error; a reader stuck in open() is released by opening the FIFO's write end."""
        result = []

        def target():
            try:
                Checkpoint(ckpt)
            except CheckpointError as e:
                result.append(str(e))

        t = threading.Thread(target=target, daemon=True)
        t.start()
        t.join(30)
        if t.is_alive():
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            t.join()
            pytest.fail(f"reading the checkpoint blocked in open({fifo.name})")
        return result[0] if result else ""

    ckpt = write_checkpoint(tmp_path / "c", preset("tiny"), "original", "bf16", with_tokenizer=False, progress=False)
    (ckpt / "model.safetensors").rename(ckpt / "a.safetensors")
    os.mkfifo(ckpt / "zz.safetensors")
    assert "zz.safetensors: not a regular file" in opened_without_blocking(ckpt / "zz.safetensors")
    (ckpt / "zz.safetensors").unlink()
    os.mkfifo(ckpt / "model.safetensors.index.json")
    assert "index.json: not a regular file" in opened_without_blocking(ckpt / "model.safetensors.index.json")


def test_hugging_face_cache_layout_with_symlinked_shards_loads(tmp_path):
    """Issue 10 item 16: in the HF cache every shard is a link into ../../blobs; the index names files inside the
    snapshot, so the checkpoint is valid (an index *name* leaving the directory is still refused)."""
    real = write_checkpoint(tmp_path / "real", preset("tiny"), "original", "bf16", shard_bytes=300_000,
                            with_tokenizer=False, progress=False)
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for p in real.iterdir():
        (blobs / p.name).write_bytes(p.read_bytes())
        (snap / p.name).symlink_to(f"../../blobs/{p.name}")
    assert len(list(snap.glob("model-*.safetensors"))) > 1
    got = Checkpoint(snap)
    assert got.tensors.keys() == Checkpoint(real).tensors.keys()
    name = next(iter(got.tensors))
    assert torch.equal(got.get(name), Checkpoint(real).get(name))
