"""What sm_90 makes of the indexer launches the interpreter cannot lower: the two-level top-k of a 128k row (a group
max, two ``tl.topk`` and a reload) and the FP8 key scan's TF32 and bit-placement dots.
``scripts/compile_indexer_sm90.py`` builds the launches ``block_topk`` / ``scan`` make, with Triton's own compiler
and ptxas, without a GPU, in a process without the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TF32 = "tma-host-n128-w4-s8-waves2-max1024-tf32"
BF16 = "tma-host-n128-w4-s8-waves2-max1024"  # the same launch, FP8 keys widened to bf16 (the default until 2026-12-01)


def test_grouped_topk_and_the_fp8_scan_dots_compile_for_sm90(tmp_path):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_indexer_sm90.py"), "--keys", "fp8",
                           "--context", "131072", "--scan-variants", f"{BF16},{TF32}",
                           "--topk-variants", "bitonic-w4", "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {(r["part"], r["variant"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("scan", "default"), ("scan", BF16), ("scan", TF32), ("topk", "default"),
                         ("topk", "bitonic-w4")}
    assert all(r["stack"] == 0 and r["sass_instructions"] > 0 for r in rows.values()), rows  # no spills
    # the point of the TF32 dot: the slow f16 -> bf16 conversions gone (FP8_DOTS in lightning_indexer.py)
    plain, tf32 = rows["scan", BF16], rows["scan", TF32]
    assert tf32["conversions"] * 2 < plain["conversions"], (plain, tf32)
    # the default's bit placement (fp8_dot "bits"): no conversion instruction at all (the PTX's prmt / shl / and /
    # mul.bf16x2), and the dot in bf16, half the TF32 dot's MMA instructions (k16 against k8)
    bits = rows["scan", "default"]
    assert bits["conversions"] == 0 and 2 * bits["mma"]["HMMA"] == tf32["mma"]["HMMA"], (bits, tf32)
    # the default top-k ranks a 128k row (1025 blocks, padded to 2048) in two levels: sorts of 128 and 256 keys
    # compile to less code than the whole-row sort of the earlier default (2936 against 3544 SASS instructions a
    # thread with Triton 3.6's ptxas)
    assert rows["topk", "default"]["sass_instructions"] < rows["topk", "bitonic-w4"]["sass_instructions"], rows
