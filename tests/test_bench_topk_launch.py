"""bench/topk_launch.py on the CPU (Triton interpreter): every setting's ids are checked against the reference
before anything is timed, and the rows it promises are written (nothing is timed here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_topk_launch_checks_each_setting_and_writes_its_rows(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "topk.json"
    run = subprocess.run([sys.executable, str(BENCH / "topk_launch.py"), "--device", "cpu", "--contexts", "300,4500",
                          "--variants", "bitonic-w4,rounds-w4", "--reps", "1", "--table-context", "9000",
                          "--json", str(out)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["context"], r["blocks"], r["setting"]) for r in rows] == [
        (c, 71, s) for c in (300, 4500) for s in ("default", "bitonic-w4", "rounds-w4")]  # a 9000-token table
    assert all("warm_us" not in r for r in rows)  # the interpreter times nothing


def test_topk_launch_refuses_an_unknown_variant():
    run = subprocess.run([sys.executable, str(BENCH / "topk_launch.py"), "--device", "cpu", "--variants", "heap"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "unknown ['heap']" in run.stderr
