"""bench/mtp_speculation.py end to end at toy sizes on the CPU (it measures nothing here): one run gives, per
backend and temperature, a row for k = 0 and each k with drafts, speed-ups against that run's k = 0, and the
greedy exactness check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "mtp_speculation.py"


def test_one_run_gives_acceptance_speed_and_exactness_per_backend(tmp_path):
    out = tmp_path / "mtp.json"
    run = subprocess.run([sys.executable, str(BENCH), "--backends", "torch,torch-eager", "--prompts", "2",
                          "--prompt-len", "16", "--new-tokens", "6", "--repeats", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["complete"] and res["device"] == "cpu"
    rows = {(r["backend"], r["temperature"], r["k"]): r for r in res["rows"]}
    assert set(rows) == {(b, t, k) for b in ("torch", "torch-eager") for t in (0.0, 0.8) for k in (0, 1, 2, 3)}
    for (backend, temperature, k), r in rows.items():
        assert r["decode_tokens"] > 0 and r["decode_tok_s"] > 0 and r["tokens"] == 2 * 6
        base = rows[(backend, temperature, 0)]
        assert abs(r["speedup_vs_k0"] - r["decode_tok_s"] / base["decode_tok_s"]) < 1e-9
        assert (r["acceptance_length"] is None) == (k == 0)
        if temperature == 0.0:
            assert r["same_output_as_k0"] is True
