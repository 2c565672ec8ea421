"""The one-row ``mxfp8_linear`` GEMV tiles that ``bench/moe.py --only linear`` sweeps, and that the sweep runs them.

The H200 round-5 call of the linear sweep reported its default as the best of every row ("best config None") and
timed none of the GSUM tiles: ``--decode-variants`` keeps only the named tiles, and the call named the TMA ones.
Here: every GSUM tile the sweep lists (``LINEAR_ROUND5``'s and ``LINEAR_ROUND6``'s) exists by name, runs under the
Triton interpreter at a tiny odd shape (N 42: the last 4- or 8-row tile half past N; K 1120: the last 512- or
1024-wide K step mostly past K) and is as close to the float64 reference as the bf16 reference is (``_close``:
GSUM reorders the fp32 sums only); the script run with those names (``--smoke``) times each of them in its one-row
rows, and a name no part of the run sweeps is refused instead of dropped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (the [gpu] extra)")

from bench.moe import LINEAR_ROUND5, LINEAR_ROUND6, NAMES, linear_variants  # noqa: E402
from m3export.ops import moe as ref  # noqa: E402
from m3export.ops import mxfp8  # noqa: E402
from m3export.plugins.kernels import mxfp8_linear as linear_kernel  # noqa: E402
from tests.test_kernels_moe import INTERPRETED, _close, cpu_only  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GSUM_TILES = [name for name, c in {**LINEAR_ROUND5, **LINEAR_ROUND6}.items() if c.get("GSUM")]


def test_gsum_tiles_are_named_and_in_the_one_row_sweep():
    assert len(GSUM_TILES) >= 9
    one_row = linear_variants(1)
    for name in GSUM_TILES:
        assert NAMES[name] == {**LINEAR_ROUND5, **LINEAR_ROUND6}[name]
        assert NAMES[name] in one_row, name


@cpu_only
@pytest.mark.parametrize("name", GSUM_TILES)
def test_gsum_tile_against_the_reference(name):
    g = torch.Generator().manual_seed(71)
    w, s = mxfp8.quantize(torch.randn(42, 1120, generator=g))
    x = torch.randn(1, 1120, generator=g).bfloat16()
    got = linear_kernel.run_linear(x, w, s, config=NAMES[name])
    _close(got, ref.mxfp8_linear_reference(x, w, s), ref.mxfp8_linear_reference(x.double(), w, s))


def _bench(tmp_path, names, *extra):
    out = tmp_path / "linear.json"
    cmd = [sys.executable, str(ROOT / "bench" / "moe.py"), "--smoke", "--experts", "6", "--only", "linear",
           "--decode-variants", ",".join(names), "--json", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600), out


@cpu_only
def test_the_sweep_times_every_named_gsum_tile(tmp_path):
    done, out = _bench(tmp_path, GSUM_TILES)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["linear"]
    swept = [r for r in rows if r["rows"] == 1 and len(r["variants"]) > 1]  # the one-row rows with the sweep
    assert swept
    # every named tile but the one the default is (mxfp8_linear.gemv_config, not run twice)
    others = [name for name in GSUM_TILES if NAMES[name] != linear_kernel.gemv_config(1)]
    assert len(others) == len(GSUM_TILES) - 1
    for r in swept:
        assert [v["name"] for v in r["variants"]] == [None, *others] and not r["failed"]
        assert r["best_name"] in ("default", *others)


def test_a_name_the_run_does_not_sweep_is_refused(tmp_path, monkeypatch, capsys):
    # A MoE decode tile (SHARED_GRID) with --only linear: refused by name before anything runs. The script's main in
    # this process (the refusal comes before any kernel runs; a second interpreter would spend its time importing):
    # the module globals and the environment variable that main sets are restored afterwards.
    import bench.moe as bench_moe

    for name in ("VARIANTS", "H", "I", "I_SHARED", "TOP_K", "DEV", "SMOKE", "ORACLE_MAX_TOKENS"):
        monkeypatch.setattr(bench_moe, name, getattr(bench_moe, name))
    monkeypatch.setitem(os.environ, "TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    monkeypatch.setattr(sys, "argv", ["moe.py", "--smoke", "--experts", "6", "--only", "linear", "--decode-variants",
                                      "gemv_bn4_bk512_pipe3_sg_gsum", "--json", str(tmp_path / "linear.json")])
    with pytest.raises(SystemExit) as done:
        bench_moe.main()
    assert done.value.code == 2 and "not swept by the parts of this run" in capsys.readouterr().err
    assert not (tmp_path / "linear.json").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
@pytest.mark.parametrize("name", GSUM_TILES)
def test_gpu_gsum_tile_mini_dims(name):
    # The compiled tiles at the shapes the decode step runs them (the fused q/k/v/index projection 9856 x 6144, q
    # 8192 x 6144, o 6144 x 8192) with bf16 activations, and at the first with fp16 (which keeps the per-weight
    # rounding) and fp32 (held to 1e-5 of the largest output: summation order only); four compiles per tile.
    g = torch.Generator(device="cuda").manual_seed(72)
    for n, k in ((9856, 6144), (8192, 6144), (6144, 8192)):
        w, s = mxfp8.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.02)
        for dt in (torch.bfloat16, torch.float16, torch.float32) if n == 9856 else (torch.bfloat16,):
            x = torch.randn(1, k, device="cuda", generator=g).to(dt)
            got = linear_kernel.run_linear(x, w, s, config=NAMES[name])
            _close(got, ref.mxfp8_linear_reference(x, w, s),
                   ref.mxfp8_linear_reference(x.double(), w, s) if dt != torch.float32 else None)
