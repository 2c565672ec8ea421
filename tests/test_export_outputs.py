"""Where export writes (issue 10 items 1-4, 14, 16): nothing lost, nothing left behind, one clear line per refusal.

Every case here is refused (or interrupted) before any graph is traced, so each test takes seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from m3export.checkpoint.writer import write_checkpoint
from m3export.cli import main as cli
from m3export.config import preset
from m3export.errors import ArtifactError
from m3export.export import exporter
from m3export.export.exporter import export_artifact
from m3export.output_dir import staging_prefix


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "ck", preset("tiny"), "original", "bf16", progress=False)


def _snapshot(d):
    return {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


class Traced(Exception):
    """Raised in place of tracing: the test has seen what happens before the graphs."""


@pytest.fixture
def no_tracing(monkeypatch):
    def trace(*a, **k):
        raise Traced
    monkeypatch.setattr(exporter, "trace_step", trace)


def test_force_never_replaces_the_source_or_a_directory_holding_it(ckpt, tmp_path, monkeypatch, capsys):
    """Item 1: `export --checkpoint C --out C --force` deleted the checkpoint (rc 0)."""
    before = _snapshot(ckpt)
    for out, match in [(ckpt, "is or contains the source"), (ckpt.parent, "is or contains the source"),
                       (ckpt / "art", "lies inside the source")]:
        assert cli(["export", "--checkpoint", str(ckpt), "--out", str(out), "--force"]) == 2
        assert match in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArtifactError, match="is or contains the current directory"):
        export_artifact("tiny", tmp_path, force=True, progress=False)
    assert _snapshot(ckpt) == before


def test_in_place_never_replaces_a_checkpoint_file_even_with_force(tmp_path):
    """Item 2: a shard named weights.safetensors was overwritten by --in-place --force (the message suggested it)."""
    root = write_checkpoint(tmp_path / "w", preset("tiny"), "original", "bf16", with_tokenizer=False, progress=False)
    (root / "model.safetensors").rename(root / "weights.safetensors")
    before = _snapshot(root)
    for force in (False, True):
        with pytest.raises(ArtifactError, match=r"already holds \['weights.safetensors'\].* never replaced") as e:
            export_artifact(str(root), None, dtype="float32", in_place=True, force=force, progress=False)
        assert "--force" not in str(e.value)
    assert _snapshot(root) == before and sorted(p.name for p in root.iterdir()) == ["config.json",
                                                                                   "weights.safetensors"]


def test_in_place_auto_dtype_converts_nothing_and_space_is_checked_first(ckpt, tmp_path, monkeypatch, no_tracing):
    """Item 3: --in-place without --dtype converted every weight to float32 beside the checkpoint (1.7 TB at full
    size). auto keeps the checkpoint's dtype; what must be written is compared with the free space first."""
    import shutil

    root = tmp_path / "c"
    shutil.copytree(ckpt, root)
    written = []
    real_write = exporter.write_safetensors
    monkeypatch.setattr(exporter, "write_safetensors", lambda path, specs, *a, **k: written.append(list(specs))
                        or real_write(path, specs, *a, **k))
    with pytest.raises(Traced):
        export_artifact(str(root), None, in_place=True, progress=False)  # dtype "auto": bfloat16 here
    assert written == []  # every tensor referenced where it is: the router is fp32 in the checkpoint and the model

    free = {"bytes": 10 << 20}
    monkeypatch.setattr("m3export.output_dir.shutil.disk_usage",
                        lambda p: shutil._ntuple_diskusage(1 << 40, (1 << 40) - free["bytes"], free["bytes"]))
    with pytest.raises(ArtifactError, match=r"weights.safetensors .* needs 0.00 GiB but the file system has 0.01 GiB"):
        export_artifact(str(root), None, dtype="float32", in_place=True, progress=False)
    assert written == [] and not [p for p in root.iterdir() if p.name.startswith(".")]
    with pytest.raises(ArtifactError, match="needs .* GiB but the file system has"):
        export_artifact("tiny", tmp_path / "art", progress=False)
    assert not (tmp_path / "art").exists()


def test_help_says_what_the_default_dtype_is(capsys):
    with pytest.raises(SystemExit):
        cli(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Default auto: with --in-place the checkpoint's own dtype" in text


def test_parents_are_created(ckpt, tmp_path, no_tracing):
    """Item 14: the README's `export --checkpoint ckpt/tiny --out art/tiny` failed when art/ did not exist."""
    with pytest.raises(Traced):
        export_artifact(str(ckpt), tmp_path / "a" / "b" / "art", progress=False)
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())


def test_out_that_is_a_file_or_cannot_be_created_is_one_line(ckpt, tmp_path, capsys):
    """Item 16: a file as --out, or a parent that cannot be created, printed a traceback."""
    f = tmp_path / "f"
    f.write_text("x")
    for out, match in [(f, "exists and is not a directory"), (f / "art", "cannot create the output's parent"),
                       (tmp_path / "no" / "art", None)]:
        if match is None:  # an unwritable parent (root ignores permissions, so exercise the check directly)
            (tmp_path / "no").mkdir(mode=0o500)
            if os.access(tmp_path / "no", os.W_OK):
                continue
            match = "not writable"
        assert cli(["export", "--checkpoint", str(ckpt), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and match in err[0], err


def test_stale_staging_of_a_dead_process_is_removed_a_live_one_kept(tmp_path, capsys):
    """Item 4: after a SIGKILL nothing can clean up; the next export of the same target does."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    prefix = staging_prefix("art")
    stale = tmp_path / (prefix.replace(f"-{os.getpid()}-", f"-{dead.pid}-") + "x")
    live = tmp_path / (prefix + "y")  # this very process: alive
    other_host = tmp_path / ".art.partial-otherhost-1-z"
    for d in (stale, live, other_host):
        d.mkdir()
        (d / "weights.safetensors").write_bytes(b"0" * 100)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")  # fails inside the staging directory: the stale scan has run by then
    assert cli(["export", "--checkpoint", str(bad), "--out", str(tmp_path / "art")]) == 2
    assert not stale.exists() and live.exists() and other_host.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other_host.name, "bad"])


def test_sigterm_removes_the_partial_directory(tmp_path):
    """Item 4: SIGTERM during export left .OUT.partial-* with a full weight copy."""
    out = tmp_path / "art"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "m3export.cli", "export", "--preset", "tiny", "--out", str(out)],
                            cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".art.partial-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.glob(".art.partial-*")), "the export never started writing"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM and "terminated" in err
    assert list(tmp_path.iterdir()) == []


def test_synth_out_that_is_a_file_is_one_line_and_its_checkpoint_is_readable(tmp_path, capsys):
    """Item 16 (synth): a file as --out gave a NotADirectoryError traceback; the checkpoint came out mode 0700."""
    import stat

    f = tmp_path / "f"
    f.write_text("x")
    for out in (f, f / "ck"):
        assert cli(["synth", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
    out = tmp_path / "new" / "ck"
    assert cli(["synth", "--out", str(out)]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert sorted(p.name for p in out.parent.iterdir()) == ["ck"]  # no staging directory left beside it
