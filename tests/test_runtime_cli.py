"""``m3export generate`` and ``Engine.from_checkpoint`` on the tiny preset (deterministic random weights)."""

import pytest

from m3export.cli import main
from m3export.runtime import Engine, SamplingParams


def test_generate_streams_ids_and_reports_stats(capsys):
    rc = main(["generate", "tiny", "--prompt-ids", "1,2,3", "--temperature", "0", "--max-tokens", "6",
               "--speculative", "2", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "prefill" in err and "decode" in err and "acceptance length" in err and "finish: length" in err
    engine = Engine.from_checkpoint("tiny", num_speculative_tokens=0)
    ref = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    # the tiny preset has a tokenizer, so the stream is text: the same text greedy decoding gives without MTP
    assert out == ref.text + "\n"


def test_generate_rejects_what_it_cannot_run(capsys):
    assert main(["generate", "tiny", "--prompt", "hi", "--backend", "onnxruntime"]) == 2
    assert "not an exported artifact" in capsys.readouterr().err
    assert main(["generate", "tiny", "--prompt", "hi", "--top-p", "2"]) == 2
    assert "SamplingParams.top_p" in capsys.readouterr().err
    assert main(["generate", "tiny", "--prompt", ""]) == 2
    assert "prompt is empty" in capsys.readouterr().err


def test_preset_engine_has_text_in_and_out():
    engine = Engine.from_checkpoint("tiny")
    assert engine.tokenizer is not None and engine.max_model_len == 4096
    ids = engine.tokenizer.encode("héllo")
    assert engine.tokenizer.decode(ids) == "héllo"
    out = engine.generate(["héllo"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.prompt_token_ids == ids and len(out.token_ids) == 8
    assert out.text == engine.tokenizer.decode(out.token_ids)


@pytest.mark.parametrize("flag, value, field", [("--max-tokens", "0", "max_tokens"),
                                               ("--temperature", "-1", "temperature")])
def test_generate_validates_params(capsys, flag, value, field):
    """Through the command line: a bad sampling parameter is exit code 2 and one message naming the field."""
    assert main(["generate", "tiny", "--prompt-ids", "1,2", flag, value]) == 2
    assert f"SamplingParams.{field}" in capsys.readouterr().err


def test_generate_reports_mxfp8_weights_kept_as_they_are(tmp_path, capsys):
    """On an MXFP8 checkpoint ``generate`` says what the model holds by dtype against the checkpoint's bytes: the
    experts stay E4M3 values + UE8M0 scales (about the checkpoint's bytes, not a bf16 copy's 2x)."""
    import re

    from m3export.checkpoint.writer import write_checkpoint
    from m3export.config import preset

    ckpt = write_checkpoint(tmp_path / "ckpt", preset("tiny"), fmt="mxfp8", progress=False)
    assert main(["generate", str(ckpt), "--prompt-ids", "1,2,3", "--temperature", "0", "--max-tokens", "2",
                 "--dtype", "bfloat16"]) == 0
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("weights:"))
    size = r"([\d.]+ (?:GB|MB|kB|B))"
    m = re.fullmatch(rf"weights: {size} resident on cpu \((.*)\); the source's safetensors: {size}", line)
    assert m, line

    def num(text):
        value, unit = text.split()
        return float(value) * {"GB": 1e9, "MB": 1e6, "kB": 1e3, "B": 1}[unit]

    parts = {name: num(v) for name, v in (p.split(" ", 1) for p in m[2].split(", "))}
    assert parts["float8_e4m3fn"] > 0 and parts["uint8"] > 0
    disk = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    assert num(m[3]) == pytest.approx(disk, rel=1e-3) and num(m[1]) <= 1.1 * disk
