"""``bench/moe_prefill_ab.py`` end to end at tiny dims on the CPU (``--smoke``, the Triton interpreter): the rounds
are interleaved and recorded per setting, and the table's fields are in the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_writes_each_settings_rounds(tmp_path):
    out = tmp_path / "ab.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "moe_prefill_ab.py"), "--smoke", "--json", str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [row["tokens"] for row in res["rows"]] == [48]
    s = res["rows"][0]["settings"]["default"]
    assert s["same_bits"] and s["rel_diff"] == 0.0
    assert len(s["rounds"]) == res["rounds"] and all(len(r) == res["calls"] for r in s["rounds"])
    assert s["median_ms"] > 0 and {"first_round_ms", "last_round_ms", "tflops"} <= set(s)


def test_unknown_variant_is_refused_by_name():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "moe_prefill_ab.py"), "--variants", "no_such_tile"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2 and "unknown name(s) ['no_such_tile']" in proc.stderr
