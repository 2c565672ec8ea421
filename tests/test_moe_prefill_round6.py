"""Round 6 of the MXFP8 MoE prefill tiles (``bench/moe.py``'s ``PREFILL_ROUND6``) against the references.

What is left of round 6 after the H200 measured it (``docs/performance.md``; ``SCALES_AHEAD``, ``MX_MODE`` 4 and
``ACT_TMA`` were slower in every pairing and are removed): the integer E4M3 conversion (``MX_MODE`` 3) with the
down GEMM's 128-wide N tile, and ``X_TMA`` (gate-up's activation tile by TMA from rows gathered into block order).
On the CPU each variant runs under the Triton interpreter at tiny, odd sizes (H 96 and I 96 are not multiples of
the 64-wide K tile, so the last K step's scales come from past the row, masked; 40 tokens leave padding rows in
every expert's last block and a partial shared-expert block); the interpreter takes MX_MODE 1 where the GPU takes 2
(``tl.dot_scaled``, no interpreter implementation) and MX_MODE 3's value in fp32 where the GPU runs its PTX. The
``gpu`` tests run the compiled tiles at the ``mini`` dims. Tolerances are ``tests/test_kernels_moe.py``'s ``_close``:
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
    dict(TMA=1, BLOCK_N=64, BLOCK_K=64, MX_MODE=3, X_TMA=1),  # plain gate and up tiles, 2-D grid
    dict(TMA=1, GU_FUSED=1, BLOCK_N=32, BLOCK_K=32, MX_MODE=3, GROUP_M=2, BLOCK_N_DOWN=64),
    dict(TMA=1, BLOCK_N=64, BLOCK_K=64, MX_MODE=1, X_TMA=1, BLOCK_N_DOWN=32),
], ids=["int_xtma_2d", "int_bk32_group2_down64", "bcast_xtma_down32"])
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


def test_integer_conversion_with_128_wide_down_tiles_is_refused():
    # MX_MODE 3 with 128-wide down N tiles gave wrong outputs on the H200: refused, whether the down tile comes
    # from BLOCK_N_DOWN or from BLOCK_N (the shared expert's config carries the same keys).
    case = MoECase(4, 64, 32, 32, 4, 2)
    for cfg in ({"TMA": 1, "MX_MODE": 3, "BLOCK_N": 64, "BLOCK_N_DOWN": 128}, {"TMA": 1, "MX_MODE": 3, "BLOCK_N": 128}):
        with pytest.raises(ValueError, match="MX_MODE 3 takes down N tiles of at most 64, got 128"):
            _check_moe(case, torch.bfloat16, "mxfp8", config=cfg)


def test_round6_keys_need_tma():
    case = MoECase(4, 64, 32, 32, 4, 2)
    with pytest.raises(ValueError, match="MX_MODE 3 .* needs TMA 1"):
        _check_moe(case, torch.float32, "mxfp8", config={"MX_MODE": 3})
    with pytest.raises(ValueError, match="X_TMA needs TMA 1"):
        _check_moe(case, torch.float32, "mxfp8", config={"X_TMA": 1, "MX_MODE": 1})
    with pytest.raises(ValueError, match="TMA takes MX_MODE 1, 2 or 3"):
        _check_moe(case, torch.float32, "mxfp8", config={"TMA": 1, "MX_MODE": 0})
    with pytest.raises(ValueError, match="MX_MODE must be 0, 1, 2 or 3"):  # 4, the removed conversion into smem
        _check_moe(case, torch.float32, "mxfp8", config={"TMA": 1, "MX_MODE": 4})


def test_round6_keys_fall_back_without_tma():
    # Weights TMA cannot read (an odd row length): the launcher's own default drops the TMA-only key and takes
    # MX_MODE 1 for the integer conversion; a config the caller chose is refused.
    rows = torch.zeros(4, 64, 33, dtype=torch.float8_e4m3fn)[:, :, 1:]  # rows of 33 bytes, one byte in
    weights = [moe_kernel._Weights(rows, torch.zeros(4, 64, 1, dtype=torch.uint8))]
    cfg = dict(TMA=1, MX_MODE=3, X_TMA=1, BLOCK_N=64)
    assert moe_kernel._check_tma(cfg, weights, fallback=True) == dict(TMA=0, MX_MODE=1, BLOCK_N=64)
    with pytest.raises(ValueError, match="TMA needs contiguous weight rows"):
        moe_kernel._check_tma(cfg, weights, fallback=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
@pytest.mark.parametrize("config", _round6_cases())
def test_gpu_round6_tiles_mini_dims(config):
    # The compiled tiles (tl.dot_scaled, the PTX conversion into registers or shared memory, the scales carried a
    # step ahead, TMA activation tiles): mini dims, 16 experts, 700 tokens x top-4 (175 assignments per expert:
    # padding rows in every expert's last block of 64, 128 or 256 rows, several groups of 8), against the fp32
    # oracle as in tests/test_kernels_moe.py's prefill sweep test.
    case = MoECase(700, 6144, 3072, 3072, 16, 4, gain=0.02, seed=64)
    args = [a.cuda() for a in case.mxfp8_args(torch.bfloat16)]
    want = ref.moe_mxfp8_reference(*args, *case.attrs())
    want64 = ref.moe_mxfp8_reference(*_as64(args), *case.attrs())
    got = moe_kernel.run_moe(*args[:3], *args[3::2], *case.attrs(), scales=tuple(args[4::2]), config=config)
    _close(got, want, want64)


def _pattern(got: torch.Tensor, want: torch.Tensor, tile: int) -> str:
    """Where two outputs [T, H] differ: how many elements, in how many rows, at which columns within an N tile of
    ``tile`` and which N tiles, the largest difference (a diagnosis for the assertion message)."""
    bad = (got.float() - want.float()).abs() > 2.0 ** -7 * want.float().abs().max()
    rows, cols = bad.nonzero(as_tuple=True)
    return (f"{int(bad.sum())} of {bad.numel()} elements in {rows.unique().numel()} of {bad.shape[0]} rows; "
            f"columns within the tile {sorted(set((cols % tile).tolist()))[:40]}; N tiles "
            f"{sorted(set((cols // tile).tolist()))[:20]}; max |diff| {(got.float() - want.float()).abs().max():.3g} "
            f"of max |want| {want.float().abs().max():.3g}; NaN {int(got.isnan().sum())}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
@pytest.mark.parametrize("routed,bm", [(True, 256), (False, 128)], ids=["routed-bm256", "shared-bm128"])
@pytest.mark.parametrize("bn_down", [128, 64])
def test_gpu_integer_conversion_down_launch(routed, bm, bn_down):
    # The round-6 tiles that FAILED at mini dims all ran the integer conversion (MX_MODE 3) in the down GEMM with
    # 128-wide N tiles, whose MMA is 128 weight rows over both warpgroups (the 64-wide tile splits the block's rows
    # between them instead). The down launch alone, routed (256-row blocks) or the shared expert's (128-row blocks,
    # what the launcher gives it at 700 tokens), on the same activations as with tl.dot_scaled (MX_MODE 2, the
    # default's): both multiply the same exact bf16 weights and activations in fp32, in another order inside an MMA
    # at most, and round each output the same way, so they may differ by one bf16 ulp of the output's magnitude,
    # no more; the message says where they differ.
    from m3export.plugins.kernels import moe_routing

    case = MoECase(700, 6144, 3072, 3072, 16, 4, gain=0.02, seed=65)
    args = [a.cuda() for a in case.mxfp8_args(torch.bfloat16)]
    x, top_k = args[0], case.top_k
    t, h, i = x.shape[0], 6144, 3072
    ids, route_w = moe_routing.route(x, args[1], args[2], top_k)
    blocks = moe_routing.group_by_expert(ids, 16, bm) if routed else None
    rows = blocks.rows.shape[0] if routed else t
    act = torch.randn(rows, i, device="cuda", generator=torch.Generator("cuda").manual_seed(66)).bfloat16()
    w2 = moe_kernel._Weights(*(args[5:7] if routed else args[9:11]))
    moe_kernel._ensure_descriptor_allocator()
    outs = {}
    for mode, repeats in ((2, 1), (3, 3)):  # MX_MODE 3 three times: a race shows as runs that differ
        cfg = {**moe_kernel.gemm_config(bm), **moe_kernel.PREFILL_MXFP8_LARGE, "MX_MODE": mode,
               "BLOCK_N_DOWN": bn_down}
        cfg = {k: v for k, v in cfg.items() if k != "BLOCK_M"}  # not _check_tma: it refuses MX_MODE 3 at 128
        for _ in range(repeats):
            y = torch.zeros((t, top_k + 1, h), dtype=torch.bfloat16, device="cuda")
            moe_kernel._launch_down(act, w2, y, blocks, route_w, t * top_k if routed else t, h, i, top_k, bm, cfg,
                                    False, "tf32")
            outs.setdefault(mode, []).append(y[:, :top_k].reshape(-1, h) if routed else y[:, top_k])
    want = outs[2][0]
    runs = [f"run {r}: {_pattern(got, want, bn_down)}" for r, got in enumerate(outs[3])]
    same = sum(torch.equal(got, outs[3][0]) for got in outs[3][1:])
    worst = max((got.float() - want.float()).abs().max() for got in outs[3])
    assert worst <= 2.0 ** -7 * want.float().abs().max(), f"{same} of 2 repeats equal to the first; " + "; ".join(runs)
