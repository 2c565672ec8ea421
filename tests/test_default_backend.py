"""`generate ART` runs an exported artifact on the backend it was exported for (issue 10 item 15): its ONNX graphs
in ONNX Runtime, as the stats line says; checkpoints and presets stay on torch."""

from __future__ import annotations

from m3export.cli import main as cli


def test_generate_runs_an_artifact_on_onnxruntime_by_default(tiny_artifact, capsys):  # noqa: F811
    assert cli(["generate", str(tiny_artifact), "--prompt-ids", "1,2,3", "--max-tokens", "2",
                "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert "[backend onnxruntime," in err and "plain graphs on CPUExecutionProvider]" in err  # which graphs ran
    assert cli(["generate", "tiny", "--prompt-ids", "1,2,3", "--max-tokens", "2", "--temperature", "0"]) == 0
    assert "[backend torch," in capsys.readouterr().err
