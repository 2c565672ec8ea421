"""The indexer's chunked top-k compiles for sm_90 (the interpreter runs its loop of ``tl.join`` / ``tl.topk`` merges
but never lowers it): ``scripts/compile_indexer_sm90.py`` builds the launch ``block_topk`` makes with Triton's own
compiler and ptxas, without a GPU, in a process without the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_chunked_topk_compiles_for_sm90_without_spills(tmp_path):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_indexer_sm90.py"), "--part", "topk",
                           "--context", "4096", "--topk-variants", "bitonic-w4-c256", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["default", "bitonic-w4-c256"]
    assert all(r["stack"] == 0 and r["sass_instructions"] > 0 for r in rows), rows
