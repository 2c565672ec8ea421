"""The sm_90 SASS of the MXFP8 prefill tiles: no write to a register that a still-pending wgmma reads as its A operand.

tl.dot_scaled (MX_MODE 2, the prefill defaults) converts each E4M3 weight tile in registers and feeds it to the
wgmma as its register operand A; Triton 3.6 pipelines the K loop with all but 3 wgmmas retired at the end of a step,
so the registers of those 3 must not be written before they retire, which is left to ptxas's register allocation.
The integer conversion's tiles (MX_MODE 3) broke that (``scripts/compile_moe_kernels_sm90.py``'s
``pending_a_writes``: 1-12 writes per loop) and gave wrong outputs on the H200, not in every run; they are refused
now (``moe._check_tma``). These tests compile for sm_90 with Triton's own ptxas (no GPU), in a process without
TRITON_INTERPRET: the defaults' loops have no such write, and the check does find them in a loop of the integer
conversion's shape (``_integer_conversion_loop``), so that it cannot pass for want of seeing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="the kernels need triton (the [gpu] extra)")
import triton.language as tl  # noqa: E402

from m3export.plugins.kernels.moe import _e4m3_tile_bf16  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLEAN_ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@triton.jit
def _integer_conversion_loop(x_ptr, w_ptr, s_ptr, out_ptr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             BK: tl.constexpr):
    """The K loop of the refused MX_MODE 3 tiles, reduced: the E4M3 tile converted by integer operations
    (``moe._e4m3_tile_bf16``) in the transposed product, the converted weights the wgmma's register operand."""
    r = tl.arange(0, BM)
    n = tl.arange(0, BN)
    k = tl.arange(0, BK)
    g = tl.arange(0, BK // 32)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(x_ptr + r[:, None] * K + k0 + k[None, :])
        w = tl.load(w_ptr + n[:, None] * K + k0 + k[None, :])
        s = tl.load(s_ptr + n[:, None] * (K // 32) + k0 // 32 + g[None, :])
        acc = tl.trans(tl.dot(_e4m3_tile_bf16(w, s), tl.trans(x), tl.trans(acc)))
    tl.store(out_ptr + r[:, None] * BN + n[None, :], acc)


def _control_pending_a_writes() -> int:
    """``pending_a_writes`` of ``_integer_conversion_loop`` at the 128-wide down tile's shape (256 rows, 8 warps)."""
    from triton.compiler import ASTSource

    sys.path.insert(0, str(ROOT / "scripts"))
    import compile_moe_kernels_sm90 as sm90

    sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*u8", "out_ptr": "*fp32"}
    consts = dict(K=3072, BM=256, BN=128, BK=64)
    kernel = triton.compile(ASTSource(_integer_conversion_loop, {**sig, **{c: "constexpr" for c in consts}}, consts,
                                      {(i,): [["tt.divisibility", 16]] for i in range(4)}),
                            target=sm90.TARGET, options=dict(num_warps=8, num_stages=3))
    return sm90.pending_a_writes(sm90.sass(kernel.asm["cubin"]))


def test_prefill_defaults_write_no_register_of_a_pending_wgmma():
    # The TMA tiles of the three prefill defaults (moe.PREFILL_MXFP8 / PREFILL_MXFP8_LARGE / PREFILL_BF16), gate-up
    # and down: the script's last column.
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_moe_kernels_sm90.py"), "--quick",
                           "--match", "g8 tma"], capture_output=True, text=True, cwd=ROOT, env=CLEAN_ENV, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.endswith(tuple("0123456789")) and "wgmma" in line]
    assert len(rows) == 6, done.stdout
    assert all(re.search(r" 0$", line) for line in rows), done.stdout


def test_the_check_finds_the_integer_conversion_race():
    code = "from tests.test_moe_sass_wgmma import _control_pending_a_writes as f; print(f())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=CLEAN_ENV,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) > 0
