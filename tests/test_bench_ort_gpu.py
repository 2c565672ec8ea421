"""bench/ort_gpu.py's --smoke mode: the script runs end to end on the CPU EP (it measures nothing here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


BENCH = Path(__file__).resolve().parents[1] / "bench" / "ort_gpu.py"


def test_smoke_run_writes_rows_with_both_backends(tiny_artifact, tmp_path):  # noqa: F811
    out = tmp_path / "ort.json"
    run = subprocess.run([sys.executable, str(BENCH), "--smoke", "--artifact", str(tiny_artifact), "--json",
                          str(out), "--reps", "2"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["provider"] == "CPUExecutionProvider" and len(res["rows"]) == 2
    for row in res["rows"]:
        assert row["greedy_same"] and row["torch_ms"] > 0 and row["ort_plain_ms"] > 0
        # the torch backend of the GPU run (graphed: one scratch page more than asked for) fills ORT's pools
        assert row["pool_pages"]["torch"] == row["pool_pages"]["ort"] + 1
