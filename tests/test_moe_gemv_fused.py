"""The MoE decode GEMV's round-5 launches (``moe_gemv.launch``) and the one-row linear's TMA tiles (``gemv.py``).

``SHARED_GRID`` puts the shared expert's tokens into the routed launches' grid (two GEMV launches instead of four),
``COMBINE`` lets the down launch's last program per (token, N tile) write the output (no combine launch), ``TMA``
copies the weight tiles by TMA, ``SPLIT_K_DOWN`` splits the down launch alone, ``PDL`` makes the two launches
programmatic dependents (Hopper), ``ACT_F32`` passes the activations between them as fp32. None of them changes a
product, a sum's order or a rounding point, so each must give exactly the output of the same tile without it
(``torch.equal``, not a tolerance), and that output must be as close to the float64 reference as the bf16
reference is (``test_kernels_moe._close``, whose docstring derives the bound). ``GSUM`` (per-group sums) changes
the order of the fp32 sums only: it is held to that bound alone. CPU tests run under the Triton interpreter at
tiny, odd sizes (H 96 is not a multiple of the 64-wide K tile, I 96 not of a 64-wide N tile: the last K step and
N tile are partly past the edge, where TMA reads zeros or a neighbour's rows); the ``gpu`` tests run the compiled
kernels at the ``mini`` preset's dims.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (the [gpu] extra)")

from m3export.ops import moe as ref  # noqa: E402
from m3export.ops import mxfp8  # noqa: E402
from m3export.plugins.kernels import _batch, gemv  # noqa: E402
from m3export.plugins.kernels import moe as moe_kernel  # noqa: E402
from m3export.plugins.kernels import mxfp8_linear as linear_kernel  # noqa: E402
from tests.test_kernels_moe import (ALPHA, INTERPRETED, LIMIT, SCALING, MoECase, _as64, _close,  # noqa: E402
                                    _off_alignment, cpu_only)

# The base tile of each case: GEMV_DECODE's shape with a 64-wide K tile (so H 96 takes two K steps) and 16 rows.
BASE = dict(GEMV=1, BLOCK_N=16, BLOCK_K=64, num_warps=2, num_stages=4, PIPELINE=4)
# Each key alone is covered by a combination (COMBINE without SHARED_GRID: the shared expert of another width below).
ROUND5 = {"sg_comb": dict(SHARED_GRID=1, COMBINE=1), "sg_comb_tma": dict(SHARED_GRID=1, COMBINE=1, TMA=1),
          "sg_comb_sdown2": dict(SHARED_GRID=1, COMBINE=1, SPLIT_K_DOWN=2),
          "sg_split2_sdown3_tma": dict(SHARED_GRID=1, SPLIT_K=2, SPLIT_K_DOWN=3, TMA=1, COMBINE=1),
          # PDL's waits, trigger and L2 prefetches exist on the GPU only (the interpreter runs launches in order):
          # here the keys' plumbing; the GPU tests below run them, eagerly and replayed from a CUDA graph.
          "sg_comb_pdl2": dict(SHARED_GRID=1, COMBINE=1, PDL=2),
          # fp32 activations between the launches, holding the bf16-rounded values: the same bits out.
          "sg_comb_actf32": dict(SHARED_GRID=1, COMBINE=1, ACT_F32=1),
          # the down launch on 64-row tiles (H 96: the second half past H), split in two, its tickets and split
          # counters counted per its own tiles
          "sg_comb_down64_sdown2": dict(SHARED_GRID=1, COMBINE=1, BLOCK_N_DOWN=64, SPLIT_K_DOWN=2)}


def _run(case: MoECase, fmt: str, config: dict, dt=torch.bfloat16, device="cpu"):
    args = [a.to(device) for a in (case.bf16_args(dt) if fmt == "bf16" else case.mxfp8_args(dt))]
    scales = (None,) * 4 if fmt == "bf16" else tuple(args[4::2])
    weights = args[3:] if fmt == "bf16" else args[3::2]
    got = moe_kernel.run_moe(*args[:3], *weights, *case.attrs(), scales=scales, config=config)
    return got, args


def _reference(case: MoECase, fmt: str, args):
    fn = ref.moe_reference if fmt == "bf16" else ref.moe_mxfp8_reference
    return fn(*args, *case.attrs()), fn(*_as64(args), *case.attrs())


def _check_same_as_base(case: MoECase, fmt: str, extra: dict, base: dict = BASE) -> None:
    want_bits, _ = _run(case, fmt, base)
    got, args = _run(case, fmt, {**base, **extra})
    assert torch.equal(got, want_bits), f"{extra}: not bit-identical to the same tile without it"
    _close(got, *_reference(case, fmt, args))


@cpu_only
@pytest.mark.parametrize("name,fmt", [*((name, "mxfp8") for name in ROUND5), ("sg_comb_tma", "bf16")])
def test_round5_keys_leave_the_output_unchanged(fmt, name):
    # Three tokens x top-2 of 5 experts (6 assignments and 3 shared rows in one grid), clamps active (gain 2).
    _check_same_as_base(MoECase(3, 96, 64, 64, 5, 2, gain=2.0, seed=51), fmt, ROUND5[name])


@cpu_only
@pytest.mark.parametrize("fmt", ["mxfp8", "bf16"])
def test_one_token_most_experts_without_tokens(fmt):
    # The decode case these are for: one token, top-2 of 16 experts (14 experts get nothing), I 96 in 64-wide N
    # tiles (the last one half past I: with TMA the gate tile's last rows are the up matrix's first, never stored;
    # the down tile's rows past H are the descriptor's zeros).
    _check_same_as_base(MoECase(1, 96, 96, 96, 16, 2, seed=52), fmt, ROUND5["sg_comb_tma"], {**BASE, "BLOCK_N": 64})


@cpu_only
def test_shared_expert_of_another_width_runs_its_own_launches():
    # SHARED_GRID needs the shared expert's I and row strides to be the routed experts': a shared expert of another
    # width (64 against 32) keeps its own gate-up and down launches; COMBINE still counts its slot.
    _check_same_as_base(MoECase(2, 96, 32, 64, 5, 2, seed=53), "mxfp8", ROUND5["sg_comb_tma"])


@cpu_only
def test_fp32_activations():
    # fp32 activations (the precision runs): the same identity, the fp32 tolerance of _close.
    case = MoECase(2, 96, 64, 64, 5, 2, seed=54)
    want_bits, _ = _run(case, "mxfp8", BASE, torch.float32)
    got, args = _run(case, "mxfp8", {**BASE, **ROUND5["sg_comb_tma"]}, torch.float32)
    assert torch.equal(got, want_bits)
    _close(got, ref.moe_mxfp8_reference(*args, *case.attrs()))


@cpu_only
@pytest.mark.parametrize("fmt,dt", [("mxfp8", torch.bfloat16), ("mxfp8", torch.float16), ("mxfp8", torch.float32),
                                    ("bf16", torch.bfloat16)], ids=["mxfp8-bf16", "mxfp8-fp16", "mxfp8-fp32", "bf16"])
def test_group_sums_are_as_accurate(fmt, dt):
    # GSUM reorders the fp32 sums (per 32-column group, scaled once per group with MXFP8 weights, but for fp16
    # activations): not the base tile's bits, but within the bound every summation order meets (_close: fp32 to
    # 1e-5 of the output's magnitude; 16-bit activations no less accurate than the 16-bit reference, plus one ulp).
    # 512-wide K steps over H 608 (the second step mostly past H), clamps active.
    case = MoECase(2, 608, 64, 64, 5, 2, gain=2.0, seed=58)
    got, args = _run(case, fmt, {**BASE, "BLOCK_K": 512, "PIPELINE": 3, "GSUM": 1, **ROUND5["sg_comb"]}, dt)
    want, want64 = _reference(case, fmt, args)
    _close(got, want, want64 if dt != torch.float32 else None)


@cpu_only
def test_combine_puts_its_ticket_counters_back_to_zero():
    # COMBINE's tickets (_batch.ticket_counters) must read 0 before every launch: the last program of each
    # (token, N tile) resets its counter, so a second call (as a graph replay) gives the same bits.
    case = MoECase(2, 96, 64, 64, 5, 2, seed=55)
    cfg = {**BASE, **ROUND5["sg_comb"]}
    first, _ = _run(case, "mxfp8", cfg)
    assert not _batch.ticket_counters(torch.device("cpu"), 2 * 6).any()
    second, _ = _run(case, "mxfp8", cfg)
    assert torch.equal(first, second)


@cpu_only
def test_tma_rejects_weights_it_cannot_read_unless_it_is_the_default(monkeypatch):
    # Weights a descriptor cannot address (w2 one element past a 16-byte boundary): a TMA config given explicitly
    # (a benchmark) is an error naming the layout; as the launcher's own default (inside a model step) the same
    # tile runs without TMA.
    case = MoECase(1, 96, 64, 64, 5, 2, seed=56)
    args = list(case.bf16_args(torch.bfloat16))
    args[4] = _off_alignment(args[4])
    with pytest.raises(ValueError, match="TMA needs contiguous weight rows with 16-byte aligned"):
        moe_kernel.run_moe(*args, *case.attrs(), config={**BASE, "TMA": 1})
    monkeypatch.setattr(moe_kernel, "GEMV_DECODE_BF16", {**BASE, "TMA": 1, "SHARED_GRID": 1})
    got = moe_kernel.forward(*args, *case.attrs())
    _close(got, ref.moe_reference(*args, *case.attrs()), ref.moe_reference(*_as64(args), *case.attrs()))


@cpu_only
def test_tma_rejects_tiles_it_cannot_copy():
    case = MoECase(1, 96, 64, 64, 5, 2, seed=57)
    with pytest.raises(ValueError, match="TMA goes with PREFETCH 0, BLOCK_K and BLOCK_N <= 256"):
        _run(case, "mxfp8", {**BASE, "TMA": 1, "BLOCK_K": 512})
    with pytest.raises(ValueError, match="SPLIT_K / SPLIT_K_DOWN must be >= 1"):
        _run(case, "mxfp8", {**BASE, "SPLIT_K_DOWN": 0})


@cpu_only
@pytest.mark.parametrize("config", [dict(GEMV=1, BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=4, PIPELINE=4),
                                    dict(GEMV=1, BLOCK_N=8, BLOCK_K=128, num_warps=4, num_stages=6, PIPELINE=6)],
                         ids=["bn16_bk256", "bn8_bk128_pipe6"])
def test_linear_tma_is_the_same_gemv(config):
    # The one-row linear with TMA weight tiles: N 40 (the last N tile partly past N, zeros from the descriptor),
    # K 1120 (the last K step partly past K): bit-identical to the same tile by cp.async, close to the reference.
    w, s = mxfp8.quantize(torch.randn(40, 1120))
    x = torch.randn(1, 1120).bfloat16()
    want_bits = linear_kernel.run_linear(x, w, s, config=config)
    got = linear_kernel.run_linear(x, w, s, config={**config, "TMA": 1})
    assert torch.equal(got, want_bits)
    _close(got, ref.mxfp8_linear_reference(x, w, s), ref.mxfp8_linear_reference(x.double(), w, s))
    with pytest.raises(ValueError, match="mxfp8_linear: TMA needs contiguous weight rows"):
        linear_kernel.run_linear(x, _off_alignment(w), s, config={**config, "TMA": 1})


@cpu_only
def test_linear_group_sums():
    # The one-row linear with GSUM (alone and with TMA): K 1120 in 512-wide steps, N 40 in 16-row tiles.
    w, s = mxfp8.quantize(torch.randn(40, 1120))
    x = torch.randn(1, 1120).bfloat16()
    for extra in ({}, {"TMA": 1, "BLOCK_K": 256}):
        cfg = {**dict(GEMV=1, BLOCK_N=16, BLOCK_K=512, num_warps=4, num_stages=3, PIPELINE=3, GSUM=1), **extra}
        got = linear_kernel.run_linear(x, w, s, config=cfg)
        _close(got, ref.mxfp8_linear_reference(x, w, s), ref.mxfp8_linear_reference(x.double(), w, s))


def test_tma_kw_is_empty_without_tma():
    assert gemv.tma_kw({"GEMV": 1}, "moe", []) == {}
    assert gemv.gsum_kw({"GEMV": 1}, "moe") == {}
    with pytest.raises(ValueError, match="GSUM goes with PREFETCH 0"):
        gemv.gsum_kw({"GEMV": 1, "GSUM": 1, "PREFETCH": 2}, "moe")


# ---------------------------------------------------------------------------------------------------- GPU
def _bench_round5():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import moe as bench_moe

    return bench_moe


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
TOP_K = 4


@pytest.fixture(scope="module")
def mini():
    """One MoE layer at the mini preset's dims with 16 experts, MXFP8 weights made on the GPU once for the module
    (quantising 3.6 GB of fp32 weights per test on the host would take most of a GPU call), 4 bf16 token rows;
    gains keep the SwiGLU inputs O(1). The op's arguments in ``moe_mxfp8``'s order."""
    g = torch.Generator(device="cuda").manual_seed(60)
    e, h, i = 16, 6144, 3072

    def rand(*shape, gain):
        return torch.randn(*shape, device="cuda", generator=g) * gain

    x = rand(4, h, gain=1.0).bfloat16()
    weights = [a for w in (rand(e, 2 * i, h, gain=0.02), rand(e, h, i, gain=0.02), rand(2 * i, h, gain=0.02),
                           rand(h, i, gain=0.02)) for a in mxfp8.quantize(w)]
    return [x, rand(e, h, gain=0.3), rand(e, gain=0.05), *weights]


def _mini_run(args, cfg, t):
    x = args[0][:t]
    return moe_kernel.run_moe(x, *args[1:3], *args[3::2], TOP_K, SCALING, ALPHA, LIMIT, scales=tuple(args[4::2]),
                              config=cfg)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", ["gemv_bn4_pipe4_sg_comb", "gemv_bn4_pipe4_sg_comb_tma", "gemv_bn4_pipe6_sg_comb_tma",
                                  "gemv_bn8_pipe4_sg_comb_tma", "gemv_bn8_pipe4_sg_comb_sdown2",
                                  "gemv_bn4_pipe4_sg_comb_pdl", "gemv_bn4_pipe4_sg_comb_tma_pdl2",
                                  "gemv_bn4_bk512_pipe3_sg_comb_gsum", "gemv_bn4_bk512_pipe3_sg_comb_gsum_pdl2",
                                  "gemv_bn4_bk512_pipe3_sg_comb_gsum_actf32_pdl2",
                                  "gemv_bn4_bk512_pipe3_sg_gsum_actf32_down16"])
def test_gpu_round5_mini_dims(mini, name):
    # bench/moe.py's round-5 decode variants compiled (TMA, the cross-program tickets and split partials, PDL race
    # only on a device): one token and four, against the float64 reference's bound; called twice (the tickets reset
    # themselves) and equal across calls. Without TMA the output must equal the same tile's without the round-5
    # keys bit for bit (TMA changes nothing either, but its compiled arithmetic may fuse differently; GSUM reorders
    # the sums).
    cfg = _bench_round5().DECODE_ROUND5[name]
    base = {k: v for k, v in cfg.items()
            if k not in ("SHARED_GRID", "COMBINE", "TMA", "SPLIT_K_DOWN", "PDL", "GSUM", "ACT_F32", "BLOCK_N_DOWN")}
    for t in (1, 4):
        got = _mini_run(mini, cfg, t)
        args = [mini[0][:t], *mini[1:]]
        want = ref.moe_mxfp8_reference(*args, TOP_K, SCALING, ALPHA, LIMIT)
        _close(got, want, ref.moe_mxfp8_reference(*_as64(args), TOP_K, SCALING, ALPHA, LIMIT))
        assert torch.equal(got, _mini_run(mini, cfg, t))
        if not cfg.get("TMA") and not cfg.get("GSUM"):
            assert torch.equal(got, _mini_run(mini, base, t))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", ["gemv_bn4_pipe4_sg_comb_pdl2", "gemv_bn4_pipe4_sg_comb_tma_pdl2",
                                  "gemv_bn4_bk512_pipe3_sg_comb_gsum_pdl2"])
def test_gpu_round5_graph_replay_equals_eager(mini, name):
    # How the model runs them: captured in a CUDA graph (programmatic dependent launches become graph edges, the
    # COMBINE tickets must be back at 0 before each replay), replayed three times with new inputs copied into the
    # captured one; each replay must equal the eager call on the same inputs bit for bit.
    cfg = _bench_round5().DECODE_ROUND5[name]
    args = [mini[0][:1].clone(), *mini[1:]]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            _mini_run(args, cfg, 1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _mini_run(args, cfg, 1)
    for r in range(3):
        args[0].copy_(mini[0][r + 1:r + 2])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _mini_run(args, cfg, 1))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", ["gemv_pipe4_tma", "gemv_bn4_pipe4_tma", "gemv_pipe6_tma", "gemv_bk512_pipe3_gsum"])
def test_gpu_linear_tma_mini_dims(name):
    # The one-row linear's TMA and GSUM tiles at the fused q/k/v/index projection's shape (9856 x 6144) and o
    # (6144 x 8192).
    cfg = _bench_round5().LINEAR_ROUND5[name]
    g = torch.Generator(device="cuda").manual_seed(7)
    for n, k in ((9856, 6144), (6144, 8192)):
        w, s = mxfp8.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.02)
        x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
        _close(linear_kernel.run_linear(x, w, s, config=cfg), ref.mxfp8_linear_reference(x, w, s),
               ref.mxfp8_linear_reference(x.double(), w, s))
