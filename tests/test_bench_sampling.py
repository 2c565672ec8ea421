"""bench/sampling.py on the CPU (the kernels under the Triton interpreter): both paths run, their tokens are
compared and the rows it promises are written (the CPU's times mean nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_sampling_bench_compares_both_paths_and_writes_its_rows(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "sampling.json"
    run = subprocess.run([sys.executable, str(BENCH / "sampling.py"), "--device", "cpu", "--vocab", "500",
                          "--batches", "1,3", "--modes", "temp,topk_topp,topp", "--calls", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["mode"]) for r in rows] == [(b, m) for b in (1, 3) for m in ("temp", "topk_topp", "topp")]
    assert all(r["same_tokens"] for r in rows)


def test_sampling_bench_refuses_an_unknown_mode():
    run = subprocess.run([sys.executable, str(BENCH / "sampling.py"), "--device", "cpu", "--modes", "beam"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "unknown mode 'beam'" in run.stderr
