"""Round 6 of the MXFP8 MoE prefill tiles (``bench/moe.py``'s ``PREFILL_ROUND6``) against the references.

What is left of round 6 after the H200 measured it (``docs/performance.md``; ``SCALES_AHEAD``, ``MX_MODE`` 4 and
``ACT_TMA`` were slower in every pairing and are removed, the integer conversion ``MX_MODE`` 3 raced in its
pipelined loop and is refused, ``moe._check_tma``): ``X_TMA`` (gate-up's activation tile by TMA from rows gathered
into block order) on the two MXFP8 prefill defaults. On the CPU each variant runs under the Triton interpreter at
tiny, odd sizes (H 96 and I 96 are not multiples of the 64-wide K tile, so the last K step's scales come from past
the row, masked; 40 tokens leave padding rows in every expert's last block and a partial shared-expert block); the
interpreter takes MX_MODE 1 where the GPU takes 2 (``tl.dot_scaled``, no interpreter implementation). The ``gpu``
test runs the compiled tiles at the ``mini`` dims. Tolerances are ``tests/test_kernels_moe.py``'s ``_close``:
the kernel must be no less accurate than the bf16 reference against the float64 evaluation (one bf16 ulp of slack
for roundings placed differently); fp32 activations 1e-5 of the largest output (summation order only).
"""

from __future__ import annotations

import pytest
import torch

from bench.moe import NAMES, PREFILL_ROUND6, PREFILL_SWEEP
from tests.test_kernels_moe import INTERPRETED, MoECase, _as64, _check_moe, _close, cpu_only
from m3export.ops import moe as ref
from m3export.plugins.kernels import moe as moe_kernel


def _round6_cases():
    return [pytest.param(c, id=name) for name, c in PREFILL_ROUND6.items()]


def test_round6_variants_are_named_and_outside_the_plain_sweep():
    # Swept by name (--prefill-variants): every round-6 tile has its own name and a new config, and the plain sweep
    # (PREFILL_SWEEP) keeps its length.
    assert all(NAMES[name] == c for name, c in PREFILL_ROUND6.items())
    swept = [c for sweep in PREFILL_SWEEP.values() for c in sweep]
    assert not any(c in swept for c in PREFILL_ROUND6.values())
    assert len({tuple(sorted(c.items())) for c in PREFILL_ROUND6.values()}) == len(PREFILL_ROUND6)


@cpu_only
@pytest.mark.parametrize("config", _round6_cases())
def test_round6_tiles_bf16_activations(config):
    _check_moe(MoECase(40, 96, 96, 64, 3, 2, gain=2.0, seed=61), torch.bfloat16, "mxfp8", config=config)


@cpu_only
@pytest.mark.parametrize("config", [
    dict(TMA=1, BLOCK_N=64, BLOCK_K=64, MX_MODE=1, X_TMA=1),  # plain gate and up tiles, 2-D grid
    dict(TMA=1, GU_FUSED=1, BLOCK_N=32, BLOCK_K=32, MX_MODE=1, X_TMA=1, GROUP_M=2, BLOCK_N_DOWN=64),
    dict(TMA=1, BLOCK_N=64, BLOCK_K=64, MX_MODE=1, X_TMA=1, BLOCK_N_DOWN=32),
], ids=["xtma_2d", "xtma_gu_bk32_group2_down64", "xtma_down32"])
def test_round6_keys_fp32_activations(config):
    # fp32 activations (every product exact, only the summation order differs): the 2-D grid (X_TMA's row count
    # from the grid's first axis), GROUP_M's 1-D grid with a short group, a 32-wide K tile (one scale per step),
    # the down GEMM's own N tile, and the clamps active (gain 2).
    _check_moe(MoECase(40, 96, 96, 64, 3, 2, gain=2.0, seed=62), torch.float32, "mxfp8", config=config)


@cpu_only
def test_round6_activation_tma_with_bf16_weights():
    # X_TMA is not MXFP8's: bf16 weights take it as well.
    config = dict(TMA=1, BLOCK_N=64, BLOCK_K=64, X_TMA=1, GROUP_M=2)
    _check_moe(MoECase(40, 96, 96, 64, 3, 2, gain=2.0, seed=63), torch.bfloat16, "bf16", config=config)


def test_round6_keys_need_tma():
    case = MoECase(4, 64, 32, 32, 4, 2)
    with pytest.raises(ValueError, match="X_TMA needs TMA 1"):
        _check_moe(case, torch.float32, "mxfp8", config={"X_TMA": 1, "MX_MODE": 1})
    with pytest.raises(ValueError, match="TMA takes MX_MODE 1 or 2"):
        _check_moe(case, torch.float32, "mxfp8", config={"TMA": 1, "MX_MODE": 0})
    with pytest.raises(ValueError, match="MX_MODE must be 0, 1 or 2"):  # 4, the removed conversion into smem
        _check_moe(case, torch.float32, "mxfp8", config={"TMA": 1, "MX_MODE": 4})


def test_round6_keys_fall_back_without_tma():
    # Weights TMA cannot read (an odd row length): the launcher's own default drops the TMA-only key; a config the
    # caller chose is refused.
    rows = torch.zeros(4, 64, 33, dtype=torch.float8_e4m3fn)[:, :, 1:]  # rows of 33 bytes, one byte in
    weights = [moe_kernel._Weights(rows, torch.zeros(4, 64, 1, dtype=torch.uint8))]
    cfg = dict(TMA=1, MX_MODE=2, X_TMA=1, BLOCK_N=64)
    assert moe_kernel._check_tma(cfg, weights, fallback=True) == dict(TMA=0, MX_MODE=2, BLOCK_N=64)
    with pytest.raises(ValueError, match="TMA needs contiguous weight rows"):
        moe_kernel._check_tma(cfg, weights, fallback=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
@pytest.mark.parametrize("config", _round6_cases())
def test_gpu_round6_tiles_mini_dims(config):
    # The compiled tiles (tl.dot_scaled, the gate-up's activation tiles by TMA): mini dims, 16 experts, 700 tokens
    # x top-4 (175 assignments per expert: padding rows in every expert's last block of 64 or 256 rows, several
    # groups of 8), against the fp32 oracle as in tests/test_kernels_moe.py's prefill sweep test.
    case = MoECase(700, 6144, 3072, 3072, 16, 4, gain=0.02, seed=64)
    args = [a.cuda() for a in case.mxfp8_args(torch.bfloat16)]
    want = ref.moe_mxfp8_reference(*args, *case.attrs())
    want64 = ref.moe_mxfp8_reference(*_as64(args), *case.attrs())
    got = moe_kernel.run_moe(*args[:3], *args[3::2], *case.attrs(), scales=tuple(args[4::2]), config=config)
    _close(got, want, want64)
