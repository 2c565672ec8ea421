"""The command line as a new user meets it (issue 10 items 16 and 17): --version, every default in --help, bad
values as one line naming the option (never a traceback), pasteable demo commands, random weights said so."""

from __future__ import annotations

import argparse
import json
import shlex

import pytest
import torch

from m3export import __version__
from m3export.cli import build_parser, main


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"m3export {__version__}"


@pytest.mark.parametrize("command", list(_subparsers()))
def test_help_shows_every_default(command):
    """Every option with a default value says it in --help (its own words, or the formatter's '(default: X)')."""
    sub = _subparsers()[command]
    text = " ".join(sub.format_help().split())
    for action in sub._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.option_strings[0]} has no help text"
        if any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            continue  # no value to show (a flag, or an option that is off unless given)
        help_text = " ".join(sub._get_formatter()._get_help_string(action).split())
        assert "default" in help_text.lower(), f"{command} {action.option_strings[0]}: default not shown"
        assert help_text.replace("%(default)s", str(action.default)).split("%")[0][:30] in text


@pytest.mark.parametrize("argv, message", [
    (["generate", "tiny", "--prompt-ids", "1,2", "--speculative", "-2"], "argument --speculative: must be >= 0, got -2"),
    (["generate", "tiny", "--prompt-ids", "1,2", "--max-model-len", "1"], "argument --max-model-len: must be >= 2"),
    (["generate", "tiny", "--prompt-ids", "1,2", "--num-pages", "0"], "argument --num-pages: must be >= 1"),
    (["generate", "tiny", "--prompt-ids", "1,2", "--seed", str(2**64)], "argument --seed: must be in [0, "),
    (["generate", "tiny", "--prompt-ids", "1,2", "--seed", "x"], "argument --seed: expected an integer, got 'x'"),
    (["demo", "--max-tokens", "0"], "argument --max-tokens: must be >= 1, got 0"),  # before any step runs
    (["export", "--preset", "tiny", "--out", "unused", "--page-size", "0"], "argument --page-size: must be in [1, 1024]"),
    (["export", "--preset", "tiny", "--out", "unused", "--page-size", "100000"], "argument --page-size: must be in"),
])
def test_out_of_range_values_are_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err


def _run(capsys, argv) -> tuple[int, str]:
    rc = main(argv)
    return rc, capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda_is_one_line(capsys):
    rc, err = _run(capsys, ["generate", "tiny", "--prompt-ids", "1,2", "--device", "cuda"])
    assert rc == 2 and err.strip().splitlines()[-1].startswith("error: --device cuda: no CUDA device")


def test_bad_device_and_invalid_utf8_prompt_are_one_line(capsys):
    rc, err = _run(capsys, ["generate", "tiny", "--prompt-ids", "1,2", "--device", "gpu7"])
    assert rc == 2 and "error: --device 'gpu7' is not a torch device" in err and "Traceback" not in err
    # What Python makes of the argv bytes b"ab\xff": the undecodable byte as a lone surrogate.
    bad = b"ab\xff".decode("utf-8", "surrogateescape")
    rc, err = _run(capsys, ["generate", "tiny", "--prompt", bad])
    assert rc == 2 and "error: --prompt is not valid UTF-8 text: byte(s) ff at character 2" in err
    rc, err = _run(capsys, ["demo", "--prompt", bad])
    assert rc == 2 and "error: --prompt is not valid UTF-8 text" in err


def test_engine_size_errors_are_one_line(capsys):
    """Sizes that only the engine can judge (pool vs length) are still one line."""
    rc, err = _run(capsys, ["generate", "tiny", "--prompt-ids", "1,2", "--num-pages", "1", "--max-model-len", "64"])
    assert rc == 2 and err.strip().splitlines()[-1].startswith("error: num_pages=1") and "Traceback" not in err


def test_demo_echoes_pasteable_commands(monkeypatch, tmp_path, capsys):
    import m3export.cli

    ran = []
    monkeypatch.setattr(m3export.cli, "main", lambda argv: ran.append(list(argv)) or 0)
    prompt = """def f(x):  # it's "quoted" $HOME"""
    assert main(["demo", "--workdir", str(tmp_path / "work dir"), "--prompt", prompt, "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "== model: the embedded default code-tiny" in out  # it says which model it runs
    echoed = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("== ") and ": m3export " in line]
    assert len(echoed) == len(ran) == 3
    assert [shlex.split(line) for line in echoed] == [["m3export", *argv] for argv in ran]
    assert ran[2][ran[2].index("--prompt") + 1] == prompt


def test_random_weights_are_said_to_be_random(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert main(["synth", "--preset", "tiny", "--out", str(ckpt), "--dtype", "fp32"]) == 0
    assert "random weights" in capsys.readouterr().out
    assert json.loads((ckpt / "config.json").read_text())["m3export_random_weights"] == {"seed": 0}
    assert main(["generate", str(ckpt), "--prompt-ids", "1,2", "--max-tokens", "1", "--temperature", "0"]) == 0
    assert "holds random weights" in capsys.readouterr().err
    from m3export.embedded import default_model

    assert main(["generate", str(default_model()), "--prompt", "def f", "--max-tokens", "1", "--backend", "torch",
                 "--temperature", "0"]) == 0
    assert "random" not in capsys.readouterr().err  # the embedded model is trained


def test_no_progress_bar_before_input_validation(tmp_path, capsys):
    """A checkpoint whose config.json is bad is refused before the export's progress bar appears."""
    ckpt = tmp_path / "ckpt"
    assert main(["synth", "--preset", "tiny", "--out", str(ckpt), "--dtype", "fp32"]) == 0
    raw = json.loads((ckpt / "config.json").read_text())
    raw["text_config"]["eos_token_id"] = [{}]
    (ckpt / "config.json").write_text(json.dumps(raw))
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "art")]) == 2
    err = capsys.readouterr().err
    assert "eos_token_id must be a list of integers" in err and "export:" not in err and "%|" not in err


def test_artifacts_of_random_weights_are_recognised(tmp_path):
    """An artifact's manifest names its source: a preset, or a checkpoint that synth marked, is random."""
    from m3export.commands.synth import RANDOM_WEIGHTS_KEY, has_random_weights
    from m3export.embedded import default_model

    ckpt, trained = tmp_path / "ckpt", tmp_path / "trained"
    for d, mark in ((ckpt, True), (trained, False)):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({RANDOM_WEIGHTS_KEY: {"seed": 0}} if mark else {}))
    for source, random in ((f"checkpoint:{ckpt}", True), ("preset:tiny", True), (f"checkpoint:{trained}", False),
                           (f"checkpoint:{tmp_path / 'moved'}", False)):
        art = tmp_path / "art"
        art.mkdir(exist_ok=True)
        (art / "manifest.json").write_text(json.dumps({"source": source}))
        assert has_random_weights(str(art)) is random, source
    (ckpt / "manifest.json").write_text(json.dumps({"source": f"checkpoint:{ckpt}"}))  # exported in place
    assert has_random_weights(str(ckpt))
    assert not has_random_weights(str(default_model()))


def test_generate_parses_the_provider_before_anything_loads(capsys):
    """``generate`` reads ``--provider`` as ``serve`` and ``triton-repo`` do (``provider_engine_arg``): an unknown
    execution provider is the one error, before the source is even looked at."""
    rc, err = _run(capsys, ["generate", "tiny", "--prompt-ids", "1,2", "--backend", "onnxruntime",
                            "--provider", "nosuchep"])
    assert rc == 2 and "error: unknown execution provider 'nosuchep'" in err and "Traceback" not in err
