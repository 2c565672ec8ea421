"""bench/engine_host.py and bench/long_prefill.py on the CPU at tiny sizes: the scripts the lead runs on the H200
run end to end and write the rows they promise (they measure nothing meaningful here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(script: str, *args: str) -> None:
    run = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=300,
                         env=ENV)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def test_engine_host_splits_the_step_into_phases(tmp_path):
    out = tmp_path / "eh.json"
    _run("engine_host.py", "--batches", "1,2", "--modes", "greedy,sampled", "--new-tokens", "3", "--json", str(out))
    res = json.loads(out.read_text())
    assert [(r["mode"], r["batch"]) for r in res["rows"]] == [("greedy", 1), ("greedy", 2), ("sampled", 1),
                                                             ("sampled", 2)]
    for r in res["rows"]:
        phases = r["us_per_step"]
        assert set(phases) == {"schedule", "build_batch", "backend", "sample", "detokenize", "draft", "other"}
        assert r["decode_steps"] == 2 and phases["sample"] > 0 and phases["schedule"] > 0
        assert phases["draft"] == 0 and r["host_reads_per_step"] == 1


def test_engine_host_refuses_a_device_step_without_a_gpu():
    """--device-step-us keeps a GPU busy (torch.cuda._sleep): on the CPU it is refused by name, not ignored."""
    run = subprocess.run([sys.executable, str(BENCH / "engine_host.py"), "--device-step-us", "1340"],
                         capture_output=True, text=True, timeout=120, env=ENV)
    assert run.returncode != 0 and "--device-step-us needs --device cuda" in run.stderr


def test_engine_host_times_speculative_rounds(tmp_path):
    out = tmp_path / "eh.json"
    _run("engine_host.py", "--batches", "2", "--modes", "greedy", "--new-tokens", "6", "--speculative", "2",
         "--json", str(out))
    (r,) = json.loads(out.read_text())["rows"]
    assert r["speculative"] == 2 and r["us_per_step"]["draft"] > 0
    assert r["host_reads_per_step"] == 1  # the verify decision; the drafts stay where the logits are


def test_long_prefill_runs_every_length_in_chunks(tmp_path):
    out = tmp_path / "lp.json"
    _run("long_prefill.py", "--device", "cpu", "--lengths", "40,80", "--chunk", "32,64", "--json", str(out))
    res = json.loads(out.read_text())
    assert [(r["tokens"], r["chunk"], r["steps"]) for r in res["rows"]] == [(40, 32, 2), (80, 32, 3), (40, 64, 1),
                                                                            (80, 64, 2)]
    assert all(r["tokens_per_s"] > 0 for r in res["rows"])


def test_engine_host_windows_report_a_step_cost_per_window(tmp_path):
    """--windows: one long generation per batch and mode, the engine's us a step per window of steps, with the
    embedded tokenizer's vocabulary."""
    out = tmp_path / "growth.json"
    tok = Path(__file__).resolve().parents[1] / "m3export" / "embedded" / "code-tiny" / "tokenizer.json"
    _run("engine_host.py", "--batches", "2", "--modes", "greedy,logprobs", "--new-tokens", "9", "--windows", "4",
         "--tokenizer", str(tok), "--json", str(out))
    res = json.loads(out.read_text())
    from tokenizers import Tokenizer

    assert res["vocab"] == Tokenizer.from_file(str(tok)).get_vocab_size(with_added_tokens=True) < 200064
    assert [(r["mode"], r["batch"], len(r["engine_us_per_step"])) for r in res["rows"]] == [("greedy", 2, 2),
                                                                                          ("logprobs", 2, 2)]
    assert all(v > 0 for r in res["rows"] for v in r["engine_us_per_step"])
