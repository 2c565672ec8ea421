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


def test_profile_gives_per_phase_host_work_per_decode_step(tmp_path):
    """``--profile`` on the CPU stand-in of the graphed backend (``torch-padded``: the padded shapes a graph
    replays, run eagerly): per k, the decode steps after each prompt's, each with one target call, every target
    and MTP call of a round in a bucket shape (an eager one would cost an eager step on the GPU), the phases'
    calls consistent with that, and the profiler's ranges present."""
    out = tmp_path / "profile.json"
    run = subprocess.run([sys.executable, str(BENCH), "--profile", "--backends", "torch-padded", "--prompts", "1",
                          "--prompt-len", "16", "--new-tokens", "8", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    res = json.loads(out.read_text())
    rows = {r["k"]: r for r in res["rows"]}
    assert res["complete"] and set(rows) == {0, 1, 2, 3} and all(r["backend"] == "torch-padded" for r in rows.values())
    for k, r in rows.items():
        ph, steps = r["phases"], r["decode_steps"]
        assert r["tokens"] == 7 and 0 < steps <= 7  # the prompt's step emitted the first of the 8
        assert ph["engine.step"]["calls_per_step"] == 1 and ph["target.forward"]["calls_per_step"] == 1
        assert r["counters_per_step"]["eager_steps"] == 0 and r["counters_per_step"]["eager_mtp_steps"] == 0
        calls = ph["target.forward"]["calls_per_step"] + ph["mtp.forward"]["calls_per_step"] \
            + ph["mtp.chain"]["calls_per_step"]  # a round replayed as one chain fills one bucket's inputs
        assert abs(ph["inputs.fill"]["calls_per_step"] - calls) < 1e-9  # every call filled a bucket's inputs
        assert (ph["draft"]["calls_per_step"] > 0) == (k > 0) and (r["verify_steps"] > 0) == (k > 0)
        assert ph["engine.step"]["host_us_per_step"] >= ph["target.forward"]["host_us_per_step"] > 0
        assert ph["engine.step"]["profiled_host_us_per_step"] > 0
        base = rows[0]
        assert abs(r["step_cost_in_plain_steps"] - r["wall_us_per_step"] / base["wall_us_per_step"]) < 1e-9
        assert abs(r["speedup_vs_k0"] - base["wall_us_per_token"] / r["wall_us_per_token"]) < 1e-9
