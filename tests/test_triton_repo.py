"""``m3export triton-repo``: the repository layout Triton expects, the config it parses, what gets referenced or
copied, and one-line errors for everything a user can get wrong. (test_triton_server.py loads it for real.)"""

import hashlib
import json
import re
from pathlib import Path

import pytest

from m3export.cli import main
from m3export.config import preset
from m3export.errors import M3Error
from m3export.runtime import Engine, SamplingParams
from m3export.serve.protocol import INPUTS, OUTPUTS
from m3export.serve.repo import RepositoryError, load_engine, parse_engine_args, write_repository


def parse_config(model_dir: Path):
    """Parse config.pbtxt with Triton's own ModelConfig schema, as the server will."""
    text_format = pytest.importorskip("google.protobuf.text_format")
    model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    return text_format.Parse((model_dir / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def parameters(cfg) -> dict[str, str]:
    return {k: v.string_value for k, v in cfg.parameters.items()}


def fake_artifact(root: Path, files: dict[str, bytes] | None = None, listed: list[str] | None = None) -> Path:
    """A structurally valid artifact (what the writer inspects: the tensor map matches the tiny model, over a
    sparse weight file); the server tests use real engines."""
    import torch

    from m3export.checkpoint.loader import build_empty
    from m3export.safetensors_io import write_safetensors

    root.mkdir(parents=True)
    files = files if files is not None else {"model.onnx": b"graph bytes"}
    for name, data in files.items():
        (root / name).write_bytes(data)
    meta = build_empty(preset("tiny"), torch.float32, "meta", num_mtp_modules=0)
    tensors = write_safetensors(root / "weights.safetensors",
                                [(n, p.dtype, tuple(p.shape)) for n, p in meta.named_parameters()], progress=False)
    files = {**files, "weights.safetensors": (root / "weights.safetensors").read_bytes()}
    entries = {n: {"sha256": hashlib.sha256(d).hexdigest(), "bytes": len(d)} for n, d in files.items()}
    for name in listed or []:
        entries[name] = {"sha256": "0" * 64, "bytes": 0}
    manifest = {
        "format": "m3export.artifact", "format_version": 1, "config": preset("tiny").to_text_dict(),
        "dtype": "float32", "mxfp8": False, "page_size": 16, "mtp_modules": 0, "source": "test", "opset": {},
        "graphs": {"model": {"file": "model.onnx", "inputs": [], "outputs": [], "aliases": {}}},
        "tensors": {n: e.to_json() for n, e in tensors.items()}, "files": entries, "tools": {},
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def test_preset_repository_layout_and_config(tmp_path):
    model_dir = write_repository("tiny", tmp_path / "repo", instances=2)
    assert model_dir == (tmp_path / "repo" / "m3").resolve()
    assert sorted(p.relative_to(model_dir).as_posix() for p in model_dir.rglob("*")) == [
        "1", "1/model.py", "config.pbtxt"]
    cfg = parse_config(model_dir)
    assert cfg.name == "m3" and cfg.backend == "python" and cfg.max_batch_size == 0
    assert cfg.model_transaction_policy.decoupled
    assert [(i.name, list(i.dims), i.optional) for i in cfg.input] == [(s.name, list(s.dims), s.optional)
                                                                      for s in INPUTS]
    assert [o.name for o in cfg.output] == [s.name for s in OUTPUTS] == [
        "text_output", "output_ids", "finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens",
        "num_output_tokens"]
    assert cfg.instance_group[0].count == 2
    assert parameters(cfg) == {"source_kind": "preset", "source": "tiny", "backend": "torch", "engine_args": "{}"}
    compile((model_dir / "1" / "model.py").read_text(), "model.py", "exec")


def test_checkpoint_link_and_copy_load_the_same_engine(tmp_path):
    from m3export.checkpoint.writer import write_checkpoint

    ckpt = write_checkpoint(tmp_path / "ckpt", preset("tiny"), "original", "fp32", with_tokenizer=True)
    linked = write_repository(str(ckpt), tmp_path / "repo", name="linked",
                              engine_args=parse_engine_args(["max_model_len=64"]))
    copied = write_repository(str(ckpt), tmp_path / "repo", name="copied", copy=True)
    p_link, p_copy = parameters(parse_config(linked)), parameters(parse_config(copied))
    assert p_link["source"] == str(Path(ckpt).resolve()) and p_link["source_kind"] == "checkpoint"
    assert p_copy["source"] == "checkpoint" and (copied / "1" / "checkpoint" / "config.json").is_file()
    assert json.loads(p_link["engine_args"]) == {"max_model_len": 64}

    params = SamplingParams(temperature=0.7, seed=3, max_tokens=5)
    want = Engine.from_checkpoint(ckpt).generate(["abc"], params)[0].token_ids
    eng = load_engine(p_link, linked / "1")
    assert eng.max_model_len == 64 and eng.generate(["abc"], params)[0].token_ids == want
    assert load_engine(p_copy, copied / "1").generate(["abc"], params)[0].token_ids == want


def test_artifact_backends_copy_and_link(tmp_path):
    art = fake_artifact(tmp_path / "art")
    linked = write_repository(str(art), tmp_path / "repo", backend="onnxruntime")
    assert parameters(parse_config(linked))["source"] == str(art.resolve())
    copied = write_repository(str(art), tmp_path / "repo", name="c", backend="tensorrt", copy=True)
    assert parameters(parse_config(copied))["source"] == "artifact"
    assert (copied / "1" / "artifact" / "manifest.json").is_file()


def test_copy_refuses_artifacts_that_reach_outside(tmp_path):
    (tmp_path / "elsewhere.safetensors").write_bytes(b"")
    art = fake_artifact(tmp_path / "art", listed=["../elsewhere.safetensors"])
    with pytest.raises(M3Error, match=r"'\.\./elsewhere.safetensors' is not inside the artifact directory"):
        write_repository(str(art), tmp_path / "repo", copy=True)  # refused as every loader refuses it
    assert not (tmp_path / "repo" / "m3").exists()


def test_cli_writes_and_refuses_to_overwrite(tmp_path, capsys):
    out = str(tmp_path / "repo")
    assert main(["triton-repo", "tiny", "--out", out, "--instances", "3", "--name", "tiny-m3"]) == 0
    assert "tiny-m3" in capsys.readouterr().out
    assert parse_config(tmp_path / "repo" / "tiny-m3").instance_group[0].count == 3
    assert main(["triton-repo", "tiny", "--out", out, "--name", "tiny-m3"]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["triton-repo", "tiny", "--out", out, "--name", "tiny-m3", "--force"]) == 0


@pytest.mark.parametrize("argv, match", [
    (["nope"], "no such directory, and not a preset"),
    (["tiny", "--backend", "onnxruntime"], "torch backend only; export it first"),
    (["tiny", "--copy"], "nothing to copy"),
    (["tiny", "--name", "a/b"], "model name"),
    (["tiny", "--instances", "0"], "instances must be >= 1"),
    (["tiny", "--engine-arg", "max_model_len"], "expected KEY=VALUE"),
    (["tiny", "--engine-arg", "warp_speed=9"], "not an engine parameter"),
    (["tiny", "--engine-arg", "dtype=int8"], "dtype='int8'"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, argv, match):
    assert main(["triton-repo", *argv, "--out", str(tmp_path / "repo")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert re.search(match, err), err


def test_sources_that_are_neither(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for src, match in ((tmp_path / "empty", "neither an exported artifact"), (tmp_path / "file", "got a file")):
        assert main(["triton-repo", str(src), "--out", str(tmp_path / "repo")]) == 2
        assert match in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_text("{")
    assert main(["triton-repo", str(bad), "--out", str(tmp_path / "repo")]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_load_engine_names_what_is_missing(tmp_path):
    with pytest.raises(RepositoryError, match="lack"):
        load_engine({"source_kind": "preset"}, tmp_path)
    with pytest.raises(RepositoryError, match="missing"):
        load_engine({"source_kind": "artifact", "source": "artifact", "backend": "torch"}, tmp_path)


def test_force_never_deletes_the_artifact_it_serves(tmp_path, capsys):
    """Issue 10 item 1: `triton-repo X/m3 --out X --name m3 --force` deleted the artifact and wrote a config that
    pointed at it."""
    art = fake_artifact(tmp_path / "X" / "m3")
    before = sorted(p.name for p in art.iterdir())
    assert main(["triton-repo", str(art), "--out", str(tmp_path / "X"), "--name", "m3", "--force"]) == 2
    assert "is or contains the source" in capsys.readouterr().err
    assert sorted(p.name for p in art.iterdir()) == before


def test_out_that_is_a_file_is_one_line(tmp_path, capsys):
    """Issue 10 item 16: a file as --out (or under it) gave FileExistsError / NotADirectoryError tracebacks."""
    f = tmp_path / "f"
    f.write_text("x")
    for out in (f, f / "repo"):
        assert main(["triton-repo", "tiny", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
    assert f.read_text() == "x"


def test_non_ascii_and_quoted_paths_survive_config_pbtxt(tmp_path):
    """Issue 10 item 16: json.dumps wrote 'ä' as \\u00e4, which tritonserver 2.51 did not decode (model load
    failed: "the artifact this model serves is missing")."""
    art = fake_artifact(tmp_path / 'ärt "q" \\ x')
    model_dir = write_repository(str(art), tmp_path / "repo")
    assert parameters(parse_config(model_dir))["source"] == str(art.resolve())
    # Python's protobuf reads \u escapes, tritonserver 2.51's does not: the text must hold the UTF-8 itself
    text = (model_dir / "config.pbtxt").read_text(encoding="utf-8")
    assert 'ärt \\"q\\" \\\\ x' in text and "\\u00e4" not in text


def test_an_artifact_defaults_to_the_backend_it_was_exported_for(tmp_path):
    """Issue 10 item 15: an exported artifact ran on torch unless --backend onnxruntime was given."""
    art = fake_artifact(tmp_path / "art")
    assert parameters(parse_config(write_repository(str(art), tmp_path / "repo")))["backend"] == "onnxruntime"
    assert parameters(parse_config(write_repository("tiny", tmp_path / "repo", name="t")))["backend"] == "torch"


def test_cli_artifact_defaults_to_onnxruntime_unless_a_gpu_is_asked_for(tmp_path, capsys):
    art = fake_artifact(tmp_path / "art")
    assert main(["triton-repo", str(art), "--out", str(tmp_path / "repo")]) == 0
    assert "(onnxruntime backend" in capsys.readouterr().out
    assert parameters(parse_config(tmp_path / "repo" / "m3"))["backend"] == "onnxruntime"
    assert main(["triton-repo", str(art), "--out", str(tmp_path / "repo"), "--name", "g",
                 "--engine-arg", 'device="cuda"']) == 0
    assert parameters(parse_config(tmp_path / "repo" / "g"))["backend"] == "torch"
