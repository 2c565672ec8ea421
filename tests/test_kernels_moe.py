"""The MoE / MXFP8 Triton kernels (``plugins/kernels``) against the references in ``m3export.ops.moe``.

On a machine without CUDA they run under the Triton interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``
before any kernel is imported) at tiny sizes; the ``gpu`` tests run the compiled kernels at the ``mini`` preset's
dims. Tolerances:

* fp32 activations: the kernels and the references do the same fp32 products and differ only in summation order
  (K up to 192 terms; the MoE adds top_k + 1 expert outputs): 1e-5 relative to the output's largest magnitude.
* bf16 activations: both round to bf16 at the same points except that the kernels sum the routed experts in fp32
  (the reference sums in bf16, in expert order); so each is compared to the same reference evaluated in float64
  on the same bf16 inputs, and the kernel must be no less accurate than the bf16 reference (with 1 bf16 ulp at
  the output's magnitude of slack for the roundings the two share but place differently).
* Routing: the chosen experts must be identical (ties included: lowest expert id first); weights to 1e-6.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="the kernels need triton (the [gpu] extra)")
import triton.language as tl  # noqa: E402

from m3export.ops import moe as ref  # noqa: E402
from m3export.ops import mxfp8  # noqa: E402
from m3export.plugins.kernels import moe as moe_kernel  # noqa: E402
from m3export.plugins.kernels import moe_mxfp8 as moe_mxfp8_kernel  # noqa: E402
from m3export.plugins.kernels import moe_prefill_ws  # noqa: E402
from m3export.plugins.kernels import moe_routing  # noqa: E402
from m3export.plugins.kernels import mxfp8_linear as linear_kernel  # noqa: E402
from m3export.plugins.kernels.moe import _E4M3_BF16_NO_NAN_ASM, _e4m3_tile_bf16  # noqa: E402

INTERPRETED = bool(triton.knobs.runtime.interpret)
cpu_only = pytest.mark.skipif(not INTERPRETED, reason="TRITON_INTERPRET=0 in this process: CPU tensors cannot run")
ALPHA, LIMIT, SCALING = 1.702, 7.0, 2.0


def _close(got: torch.Tensor, want: torch.Tensor, want64: torch.Tensor | None = None) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
        return
    scale = want64.abs().max().item()
    ulp = 2.0 ** (torch.tensor(scale).log2().floor().item() - 7)  # bf16 ulp at the output's magnitude
    err_kernel = (got.double() - want64).abs().max().item()
    err_ref = (want.double() - want64).abs().max().item()
    assert err_kernel <= err_ref + ulp, f"kernel error {err_kernel} vs bf16 reference {err_ref} (ulp {ulp})"


class MoECase:
    """Random M3 MoE weights at tiny sizes; ``gain`` scales the experts so that the SwiGLU clamps engage."""

    def __init__(self, t, h, i, i_shared, e, top_k, gain=0.2, seed=0, tie_rows=()):
        g = torch.Generator().manual_seed(seed)
        self.top_k = top_k
        self.x = torch.randn(t, h, generator=g)
        self.router = torch.randn(e, h, generator=g) * 0.3
        for a, b in tie_rows:  # identical router rows and biases: identical scores, a tie on every token
            self.router[b] = self.router[a]
        self.bias = torch.randn(e, generator=g) * 0.05
        for a, b in tie_rows:
            self.bias[b] = self.bias[a]
        self.w13 = torch.randn(e, 2 * i, h, generator=g) * gain
        self.w2 = torch.randn(e, h, i, generator=g) * gain
        self.s13 = torch.randn(2 * i_shared, h, generator=g) * gain
        self.s2 = torch.randn(h, i_shared, generator=g) * gain

    def attrs(self):
        return (self.top_k, SCALING, ALPHA, LIMIT)

    def bf16_args(self, dt):
        return (self.x.to(dt), self.router, self.bias, self.w13.to(dt), self.w2.to(dt), self.s13.to(dt),
                self.s2.to(dt))

    def mxfp8_args(self, dt):
        q = [a for w in (self.w13, self.w2, self.s13, self.s2) for a in mxfp8.quantize(w)]
        return (self.x.to(dt), self.router, self.bias, *q)


def _as64(args):
    return [a.double() if a.is_floating_point() and a.dtype != torch.float8_e4m3fn else a for a in args]


def _check_moe(case: MoECase, dt: torch.dtype, fmt: str, config: dict | None = None) -> None:
    if fmt == "bf16":
        args, kernel, reference = case.bf16_args(dt), moe_kernel.forward, ref.moe_reference
    else:
        args, kernel, reference = case.mxfp8_args(dt), moe_mxfp8_kernel.forward, ref.moe_mxfp8_reference
    if config:  # the same launcher with tiles / MXFP8 mode overridden
        scales = (None,) * 4 if fmt == "bf16" else args[4::2]
        weights = args[3:] if fmt == "bf16" else args[3::2]
        got = moe_kernel.run_moe(*args[:3], *weights, *case.attrs(), scales=scales, config=config)
    else:
        got = kernel(*args, *case.attrs())
    want = reference(*args, *case.attrs())
    want64 = reference(*_as64(args), *case.attrs()) if dt != torch.float32 else None
    _close(got, want, want64)


# ---------------------------------------------------------------------------------------------------- routing
@cpu_only
# (20, 12, 4): more tokens than route's 16-token program (two programs, the second partial); (2, 128, 4): the
# release's 128 experts (one 128-wide expert tile). Apart: the logits kernel runs one program per (token, expert).
@pytest.mark.parametrize("t,e,top_k", [(1, 8, 2), (7, 6, 4), (20, 12, 4), (2, 128, 4), (3, 5, 5)])
def test_routing_matches_reference(t, e, top_k):
    case = MoECase(t, 32, 32, 32, e, top_k, seed=t + e)
    ids, w = moe_routing.route(case.x, case.router, case.bias, top_k)
    want_ids, want_w = ref.route(case.x, case.router, case.bias, top_k)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=0)  # fp32 sigmoid / sum of top_k: a few ulps
    torch.testing.assert_close(w.sum(-1), torch.ones(t), rtol=0, atol=1e-6)


@cpu_only
def test_routing_ties_go_to_the_lower_expert_id():
    # Experts 1, 4 and 6 score identically for every token; with the bias picking them, top-3 must be 1, 4, 6 in
    # that order, and top-2 must drop 6 (the highest id among the equals).
    e, h = 8, 32
    x = torch.randn(5, h)
    router = torch.randn(e, h) * 0.1
    router[4] = router[1]
    router[6] = router[1]
    bias = torch.zeros(e)
    bias[[1, 4, 6]] = 10.0  # selection only: the weights stay the unbiased scores
    for top_k, expected in ((3, [1, 4, 6]), (2, [1, 4])):
        ids, w = moe_routing.route(x, router, bias, top_k)
        assert ids.tolist() == [expected] * 5
        want_ids, want_w = ref.route(x, router, bias, top_k)
        assert torch.equal(ids.long(), want_ids)
        torch.testing.assert_close(w, want_w, rtol=1e-6, atol=0)


def test_grouping_pads_each_expert_and_keeps_token_order():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2]])  # expert 3 x4, 0 x2, 1 x1, 2 x1; experts 4, 5 unused
    blocks = moe_routing.group_by_expert(ids, num_experts=6, block_m=2)
    n = ids.numel()
    # Blocks in expert order: e0 [a1, a4], e1 [a3, pad], e2 [a7, pad], e3 [a0, a2], e3 [a5, a6], then unused
    # blocks (the bound from shapes is larger than this routing needs).
    assert blocks.rows.tolist()[:10] == [1, 4, 3, n, 7, n, 0, 2, 5, 6]
    assert blocks.block_expert.tolist()[:5] == [0, 1, 2, 3, 3]
    assert all(b == -1 for b in blocks.block_expert.tolist()[5:])
    assert blocks.num_blocks == moe_routing.max_blocks(n, 6, 2)


def _group_by_expert_reference(ids: torch.Tensor, num_experts: int, block_m: int):
    """The permutation in torch ops (the launcher's before ``_group``): a stable sort of the flat ids, each
    expert's run padded to a multiple of block_m, blocks tagged by a search of the padded ends."""
    flat = ids.reshape(-1).long()
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat))
    order = torch.sort(flat, stable=True).indices
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(counts, 0) - counts
    padded_end = torch.cumsum(padded, 0)
    expert = flat[order]
    dest = (padded_end - padded)[expert] + torch.arange(n) - start[expert]
    nb = moe_routing.max_blocks(n, num_experts, block_m)
    rows = torch.full((nb * block_m,), n, dtype=torch.int64).scatter_(0, dest, order)
    block_expert = torch.searchsorted(padded_end, torch.arange(nb) * block_m, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return rows.to(torch.int32), block_expert.to(torch.int32)


def _ids(kind: str, t: int, top_k: int, e: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "random":  # distinct experts per token, as routing picks them
        return torch.rand(t, e, generator=g).argsort(dim=1)[:, :top_k].to(torch.int32)
    if kind == "one":  # every assignment to expert e - 1 (top_k 1) or to the last top_k experts
        return (torch.arange(e - top_k, e, dtype=torch.int32)[None, :]).expand(t, top_k).contiguous()
    if kind == "sparse":  # three experts in use (top_k <= 3), the others have zero assignments
        used = torch.tensor([1, e // 2, e - 1], dtype=torch.int32)
        return used[torch.rand(t, 3, generator=g).argsort(dim=1)[:, :top_k]]
    raise ValueError(kind)


@pytest.mark.parametrize("kind,t,top_k,e,bm", [
    ("random", 37, 4, 10, 16),  # E not a power of two, n not a multiple of block_m
    ("random", 16, 4, 8, 16),  # n an exact multiple of block_m, every expert used
    ("random", 3, 1, 7, 64),  # n < block_m, most experts empty
    ("random", 300, 4, 128, 16),  # the release's 128 experts; several chunks of ids (n = 1200)
    ("random", 100, 2, 33, 256),
    ("random", 2100, 1, 5, 64),  # n > one chunk of 2048 ids, top_k 1
    ("one", 40, 1, 6, 16),
    ("one", 64, 4, 6, 64),
    ("one", 300, 1, 3, 256),  # one expert, two blocks of 256
    ("sparse", 50, 3, 12, 16),
    ("random", 0, 4, 8, 16),  # no assignments: one block, all padding
])
@cpu_only
def test_grouping_kernel_equals_the_stable_sort(kind, t, top_k, e, bm):
    ids = _ids(kind, t, top_k, e) if t else torch.zeros((0, top_k), dtype=torch.int32)
    blocks = moe_routing.group_by_expert(ids, e, bm)
    rows, block_expert = _group_by_expert_reference(ids, e, bm)
    assert blocks.rows.dtype == torch.int32 and blocks.block_expert.dtype == torch.int32
    assert torch.equal(blocks.rows, rows)
    assert torch.equal(blocks.block_expert, block_expert)
    assert (blocks.block_m, blocks.num_assignments) == (bm, ids.numel())


@cpu_only
def test_grouping_kernel_splits_of_several_chunks(monkeypatch):
    # 5 chunks of 2048 ids in 2 splits of 3 and 2 chunks: each split's ranks start after the expert's count in the
    # chunks before it (the default splits only exceed one chunk each above 16k ids, too slow to interpret).
    monkeypatch.setattr(moe_routing, "GROUP_SPLITS", 2)
    for kind, top_k in (("random", 1), ("sparse", 3)):
        ids = _ids(kind, 9000 // top_k, top_k, 12, seed=5)
        blocks = moe_routing.group_by_expert(ids, 12, 64)
        rows, block_expert = _group_by_expert_reference(ids, 12, 64)
        assert torch.equal(blocks.rows, rows) and torch.equal(blocks.block_expert, block_expert)


@pytest.mark.parametrize("top_k,bm", [(1, 16), (4, 64)])
@cpu_only
def test_grouping_kernel_skips_the_not_ours_expert(top_k, bm):
    # run_moe's expert parallelism: ids of other ranks' experts become expert e (one past the owned ones); their
    # rows keep their place in the permutation and their blocks are tagged -1.
    e_all, first, e = 12, 4, 5
    ids = _ids("random", 45, top_k, e_all, seed=3)
    local = ids.long() - first
    ids = torch.where((local >= 0) & (local < e), local, e).to(ids.dtype)
    blocks = moe_routing.group_by_expert(ids, e + 1, bm, skip=e)
    rows, block_expert = _group_by_expert_reference(ids, e + 1, bm)
    assert torch.equal(blocks.rows, rows)
    assert (block_expert == e).any()
    assert torch.equal(blocks.block_expert, torch.where(block_expert == e, -1, block_expert))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
def test_gpu_grouping_kernel_at_prefill_sizes():
    # The compiled kernel (tl.histogram's warp-ballot lowering, the chunked scans) at the bench's prefill sizes,
    # bit-equal to the stable sort; then captured in a CUDA graph and replayed on other ids of the same shape.
    for kind, t, top_k, e, bm in [("random", 16384, 4, 128, 64), ("random", 16384, 4, 128, 256),
                                  ("random", 4096, 4, 128, 128), ("random", 1, 4, 128, 16),
                                  ("one", 16384, 4, 128, 64), ("sparse", 5000, 3, 200, 64), ("random", 3000, 1, 7, 16)]:
        ids = _ids(kind, t, top_k, e, seed=t)
        blocks = moe_routing.group_by_expert(ids.cuda(), e, bm)
        rows, block_expert = _group_by_expert_reference(ids, e, bm)
        assert torch.equal(blocks.rows.cpu(), rows), (kind, t, top_k, e, bm)
        assert torch.equal(blocks.block_expert.cpu(), block_expert), (kind, t, top_k, e, bm)
    ids = _ids("random", 2048, 4, 128, seed=1).cuda()
    moe_routing.group_by_expert(ids, 128, 64)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        blocks = moe_routing.group_by_expert(ids, 128, 64)
    for kind in ("random", "one"):  # another routing, then every assignment on the last four experts
        ids.copy_(_ids(kind, 2048, 4, 128, seed=2).cuda())
        graph.replay()
        rows, block_expert = _group_by_expert_reference(ids.cpu(), 128, 64)
        assert torch.equal(blocks.rows.cpu(), rows) and torch.equal(blocks.block_expert.cpu(), block_expert)


@pytest.mark.parametrize("n,e,bm", [(1, 128, 16), (4, 128, 16), (256, 128, 16), (16384, 128, 64), (3, 2, 128)])
def test_block_bound_covers_the_worst_routing(n, e, bm):
    # Worst case for padding: as many experts in use as possible, each with one row more than a multiple of bm.
    counts = torch.zeros(e, dtype=torch.int64)
    used = min(e, n)
    counts[:used] = 1
    rest = n - used
    j = 0
    while rest > 0:  # top up experts by bm at a time (each still ends one row into a block)
        add = min(bm, rest)
        counts[j % used] += add
        rest -= add
        j += 1
    needed = int(((counts + bm - 1) // bm).sum())
    assert needed <= moe_routing.max_blocks(n, e, bm)


# ---------------------------------------------------------------------------------------------------- MoE
@cpu_only
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_matches_reference(fmt, dt):
    # 9 tokens x top-3 over 7 experts at odd sizes (H = 96 is not a multiple of the K tile; I = 32, shared 64).
    _check_moe(MoECase(9, 96, 32, 64, 7, 3, seed=1), dt, fmt)


@cpu_only
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_mxfp8_scale_gather_mode(dt):
    # MX_MODE 0 (each element's scale byte gathered; the defaults use mode 1, the broadcast) with a K tile of 64.
    _check_moe(MoECase(9, 96, 32, 64, 7, 3, seed=7), dt, "mxfp8", config={"MX_MODE": 0, "BLOCK_K": 64})


@cpu_only
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_gemv_path(fmt, dt):
    # The CUDA-core decode path (moe_gemv.py) at odd sizes: H 96 is not a multiple of the K tile (128) nor of the
    # N tile (64 here); I 32 is smaller than the N tile.
    _check_moe(MoECase(5, 96, 32, 64, 7, 3, seed=8), dt, fmt, config={"GEMV": 1, "BLOCK_N": 64, "BLOCK_K": 128})


@cpu_only
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
@pytest.mark.parametrize("dt,split,prefetch", [(torch.float32, 3, 0), (torch.bfloat16, 3, 0),
                                               (torch.bfloat16, 1, 1), (torch.bfloat16, 3, 2),
                                               (torch.float32, 1, 2)])
def test_moe_gemv_split_k_and_prefetch(fmt, dt, split, prefetch):
    # SPLIT_K 3 over H 160 in K tiles of 64: splits of 64 columns, the last one half past H (masked); over I 32
    # the second and third splits lie wholly past I (their partials are zeros). PREFETCH loads 1 or 2 K steps
    # ahead, past each split's end too (masked). Two tokens x top-2 (four assignments: several rows of split
    # counters), shared expert wider than the routed ones.
    _check_moe(MoECase(2, 160, 32, 64, 7, 2, seed=15), dt, fmt,
               config={"GEMV": 1, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": split, "PREFETCH": prefetch})


# bench/moe.py's batch-1 GEMV variants with PIPELINE (cp.async stages named on the K loop), here with their own
# BLOCK_N / warps / stages / SPLIT_K and a 64-wide K tile, so that H 224 gives 4 K steps (the last one half past
# H, masked; with SPLIT_K 2, 2 per split) and the pipelined loop has a prologue, a steady state and an epilogue
# (6 stages: more than the loop has steps); I 96 gives the down projection 2 K steps, the second half masked. The interpreter ignores the stages (the loads and sums are the same, which is the point: PIPELINE
# must not change what is computed); the H200 test below runs them compiled.
PIPELINE_CONFIGS = [dict(GEMV=1, BLOCK_N=8, BLOCK_K=64, num_warps=4, num_stages=4, PIPELINE=4),
                    dict(GEMV=1, BLOCK_N=8, BLOCK_K=64, num_warps=4, num_stages=6, PIPELINE=6),
                    dict(GEMV=1, BLOCK_N=4, BLOCK_K=64, num_warps=2, num_stages=4, PIPELINE=4),
                    dict(GEMV=1, BLOCK_N=8, BLOCK_K=64, num_warps=4, num_stages=4, SPLIT_K=2, PIPELINE=4)]
PIPELINE_IDS = ["pipe4", "pipe6", "bn4_pipe4", "split2_pipe4"]


# Under the interpreter pipe6 is pipe4 (the same BLOCK_N, BLOCK_K and warps; only the ignored stages differ), so the
# CPU runs pipe4 for both; the H200 test runs each.
CPU_PIPELINE = [(c, i) for c, i in zip(PIPELINE_CONFIGS, PIPELINE_IDS) if i != "pipe6"]


@cpu_only
@pytest.mark.parametrize("config,fmt", [(PIPELINE_CONFIGS[0], "bf16"), *((c, "mxfp8") for c, _ in CPU_PIPELINE)],
                         ids=["pipe4-bf16", *(f"{i}-mxfp8" for _, i in CPU_PIPELINE)])
def test_moe_gemv_pipeline(fmt, config):
    # One token (the bucket these variants are for), bf16 activations as the model runs; MXFP8 weights for every
    # variant (the format they are meant for), bf16 weights for one. Top-1 of 5 experts and a narrower shared expert
    # (I 32): the tile's K loop is what varies here, and each row / N tile is as many programs again (top-2 at one
    # token through the default pipelined GEMV tile: test_moe_one_token_most_experts_empty).
    _check_moe(MoECase(1, 224, 96, 32, 5, 1, seed=31), torch.bfloat16, fmt, config=config)


# bench/moe.py's round-4 batch-1 tiles with more bytes per load step (BYTES_SWEEP there), at their own BLOCK_K of
# 512 / 1024: H 544 (a multiple of the 32-wide scale blocks) gives the gate-up loop 2 K steps at BK 512 (the second
# mostly past H, masked) and one partly masked step at BK 1024; I 32 leaves the down projection one K step, mostly
# masked. Stages as the bench runs them (the interpreter ignores them). H is the smallest with those steps, and one
# token goes to one expert (top-1, and the shared expert), because the down projection's N tiles (H / BLOCK_N
# programs per row) are most of the interpreter's time.
BYTES_CONFIGS = [dict(GEMV=1, BLOCK_N=4, BLOCK_K=512, num_warps=2, num_stages=3, PIPELINE=3),
                 dict(GEMV=1, BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=3, PIPELINE=3),
                 dict(GEMV=1, BLOCK_N=16, BLOCK_K=512, num_warps=8, num_stages=3, PIPELINE=3),
                 dict(GEMV=1, BLOCK_N=8, BLOCK_K=1024, num_warps=8, num_stages=2, PIPELINE=2),
                 dict(GEMV=1, BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=2, PIPELINE=2)]
BYTES_IDS = ["bn4_bk512", "bk512", "bn16_bk512", "bk1024", "bn4_bk1024"]


@cpu_only
@pytest.mark.parametrize("config,fmt", [(BYTES_CONFIGS[1], "bf16"), *((c, "mxfp8") for c in BYTES_CONFIGS)],
                         ids=["bk512-bf16", *(f"{i}-mxfp8" for i in BYTES_IDS)])
def test_moe_gemv_big_k_tiles(fmt, config):
    _check_moe(MoECase(1, 544, 32, 32, 5, 1, seed=33), torch.bfloat16, fmt, config=config)


@cpu_only
@pytest.mark.parametrize("config", BYTES_CONFIGS, ids=BYTES_IDS)
def test_mxfp8_linear_gemv_big_k_tiles(config):
    # The same tiles on the one-row linear: K 1120 (the last K step mostly masked), N 40 (the last N tile partly
    # masked at BN 16).
    w, s = mxfp8.quantize(torch.randn(40, 1120))
    x = torch.randn(1, 1120).bfloat16()
    got = linear_kernel.run_linear(x, w, s, config=config)
    _close(got, ref.mxfp8_linear_reference(x, w, s), ref.mxfp8_linear_reference(x.double(), w, s))


@cpu_only
def test_moe_gemv_pipeline_rejects_prefetch():
    case = MoECase(1, 64, 32, 32, 4, 2)
    with pytest.raises(ValueError, match="PIPELINE must be >= 1 and goes with PREFETCH 0"):
        _check_moe(case, torch.float32, "bf16", config={"GEMV": 1, "PIPELINE": 3, "PREFETCH": 1})


@cpu_only
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_gate_up_fused_tile(fmt, dt):
    # GU_FUSED: gate and up rows interleaved in one weight tile; I 96 is not a multiple of the N tile (64), so the
    # last tile's gate and up rows are half masked; 16-row blocks (9 tokens) and 64-row ones (40 tokens, 3
    # experts), clamps active (gain 2).
    for t, e, gain in ((9, 7, 0.2), (40, 3, 2.0)):
        _check_moe(MoECase(t, 64, 96, 64, e, 3 if e > 3 else 2, gain=gain, seed=20 + t), dt, fmt,
                   config={"GU_FUSED": 1, "BLOCK_N": 64, "BLOCK_K": 32, "MX_MODE": 1})


@cpu_only
def test_moe_gemv_ties_and_clamps():
    case = MoECase(6, 64, 32, 32, 6, 2, gain=2.0, seed=9, tie_rows=((2, 5),))
    case.bias[1] += 10.0
    case.bias[2] += 5.0
    case.bias[5] += 5.0
    for fmt in ("bf16", "mxfp8"):
        _check_moe(case, torch.float32, fmt, config={"GEMV": 1})


@cpu_only
@pytest.mark.parametrize("config", [None, {"BLOCK_M": 16}], ids=["default", "grouped"])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_moe_one_token_most_experts_empty(fmt, config):
    # One token reaches 2 of 16 experts: 14 experts have no rows. The default launch at one token is the GEMV path
    # (moe.default_config); the grouped tiles, where the permutation has a single used block, are forced too.
    _check_moe(MoECase(1, 64, 32, 32, 16, 2, seed=2), torch.float32, fmt, config=config)


@cpu_only
@pytest.mark.parametrize("t,e,fmt", [(1, 3, "mxfp8"), (1, 3, "bf16"), (8, 3, "bf16"), (8, 3, "mxfp8"),
                                     (20, 3, "mxfp8"), (80, 3, "mxfp8"), (80, 3, "bf16"), (300, 2, "mxfp8")])
def test_moe_default_config_per_batch_bucket(t, e, fmt):
    # Each branch of moe.default_config through the launcher's own default, bf16 activations as the model runs:
    # the GEMV tiles at 1 token (MXFP8: BN 4 / 2 warps; bf16: BN 8 / 4 warps; both PIPELINE 4), the 16-row
    # tensor-core tiles from 2 tokens (GU_FUSED with MXFP8: 8 and 20 tokens), the round-4 prefill tiles (TMA,
    # GROUP_M 8): MXFP8 64-row GU_FUSED blocks (80 tokens x top-2 over 3 experts: 53 assignments per expert),
    # 256-row ones (300 tokens over 2 experts: 300 per expert, above the 256 split), bf16 128 x 128 tiles (53 per
    # expert, block_m_for's 128-row bucket).
    _check_moe(MoECase(t, 96, 32, 64, e, 2, seed=10 + t), torch.bfloat16, fmt)


def test_moe_default_config_buckets():
    # Which tiles each bucket gets (the sweep's winners; moe.default_config's docstring has the measurements).
    d = moe_kernel.default_config
    assert d(1, 4, 128, True) == moe_kernel.GEMV_DECODE and d(1, 4, 128, False) == moe_kernel.GEMV_DECODE_BF16
    assert d(8, 32, 128, True) == {"GU_FUSED": 1} == d(64, 256, 128, True)
    assert d(8, 32, 128, False) == {} == d(64, 256, 128, False)
    # Prefill, bf16 activations: MXFP8 up to WS_LEAST_MEAN (64) assignments per expert the 64-row Triton tile, above
    # it the warp-specialised GEMMs; bf16 weights from block_m_for's 128-row bucket (mean > 48); its 64-row bucket
    # (16 < mean <= 48) keeps block_m_for's tiles.
    assert moe_kernel.WS_LEAST_MEAN == 64
    assert d(2048, 8192, 128, True) == moe_kernel.PREFILL_MXFP8  # 64 per expert
    assert d(2049, 8196, 128, True) == moe_prefill_ws.WS_TILE == d(8192, 32768, 128, True) == d(16384, 65536, 128, True)
    # fp16 activations (no WS): the 64-row Triton tile up to 256 per expert, the 256-row one above.
    assert d(8192, 32768, 128, True, torch.float16) == moe_kernel.PREFILL_MXFP8
    assert d(16384, 65536, 128, True, torch.float16) == moe_kernel.PREFILL_MXFP8_LARGE
    assert d(4096, 16384, 128, False) == moe_kernel.PREFILL_BF16 == d(16384, 65536, 128, False)
    assert d(1024, 4096, 128, False) == {}  # 32 per expert
    # fp32 activations keep the tiles from before round 4 (the round-4 stages do not fit shared memory in fp32).
    f32 = torch.float32
    assert d(4096, 16384, 128, True, f32) == {"BLOCK_M": 64, "GU_FUSED": 1}
    assert d(16384, 65536, 128, True, f32) == {"BLOCK_M": 128, "BLOCK_N": 128}
    assert d(4096, 16384, 128, False, f32) == {}
    assert d(1, 4, 128, True, f32) == moe_kernel.GEMV_DECODE


def _off_alignment(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` whose storage starts one element past a 16-byte boundary (as a view at an odd offset)."""
    base = torch.empty(t.numel() + 16, dtype=t.dtype)
    start = next(i for i in range(1, 17) if (base.data_ptr() + i * t.element_size()) % 16)
    out = base[start:start + t.numel()].view(t.shape)
    out.copy_(t)
    return out


@cpu_only
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_moe_default_falls_back_without_tma_where_weights_do_not_allow_it(fmt):
    # The default prefill tiles read weights by TMA; weights a descriptor cannot address (here w2 at an odd offset)
    # must run the same tile without TMA inside a model step, not raise. 80 tokens x top-2 over 3 experts (53 per
    # expert: the TMA defaults in both formats), bf16 activations; then the same config given explicitly (a
    # benchmark asking for TMA) is an error naming the tensor's layout.
    case = MoECase(80, 64, 64, 64, 3, 2, seed=70)
    args = list(case.bf16_args(torch.bfloat16) if fmt == "bf16" else case.mxfp8_args(torch.bfloat16))
    w2 = 4 if fmt == "bf16" else 5
    args[w2] = _off_alignment(args[w2])
    weights = args[3:] if fmt == "bf16" else args[3::2]
    scales = (None,) * 4 if fmt == "bf16" else tuple(args[4::2])
    stacks = [moe_kernel._Weights(w, sc) for w, sc in zip(weights, scales)]
    assert moe_kernel.tma_unusable(stacks) is not None
    default = moe_kernel.default_config(80, 160, 3, fmt == "mxfp8")
    assert default["TMA"] == 1
    reference = ref.moe_reference if fmt == "bf16" else ref.moe_mxfp8_reference
    want = reference(*args, *case.attrs())
    _close(moe_kernel.run_moe(*args[:3], *weights, *case.attrs(), scales=scales), want,
           reference(*_as64(args), *case.attrs()))
    with pytest.raises(ValueError, match="TMA needs contiguous weight rows with 16-byte aligned"):
        moe_kernel.run_moe(*args[:3], *weights, *case.attrs(), scales=scales, config=default)


def test_tma_descriptor_memory_is_on_the_current_device_at_launch(monkeypatch):
    # Triton's allocator is process-wide (per thread); the descriptors of a launch must live on the device the
    # launch runs on (torch.cuda.current_device() then), not on the device of the first TMA launch. No GPU here:
    # torch.empty and the current device are stand-ins that record what was asked.
    current, asked = [1], []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch, "empty", lambda size, dtype, device: asked.append((size, dtype, device)) or size)
    moe_kernel._descriptor_memory(256, 128, None)
    current[0] = 0
    moe_kernel._descriptor_memory(128, 64, 7)
    assert asked == [(256, torch.int8, torch.device("cuda", 1)), (128, torch.int8, torch.device("cuda", 0))]


def test_tma_descriptor_allocator_is_installed_once_and_never_replaces_another():
    import contextvars

    from triton.runtime import _allocation

    def installed(preset=None):
        if preset is not None:
            triton.set_allocator(preset)
        moe_kernel._ensure_descriptor_allocator()
        return _allocation._allocator.get()

    # Fresh contexts (as a new thread has): Triton's null allocator is replaced, someone else's is kept.
    assert contextvars.Context().run(installed) is moe_kernel._descriptor_memory

    def other(size, alignment, stream):
        raise AssertionError("not called")

    assert contextvars.Context().run(installed, other) is other


@cpu_only
def test_moe_clamps_are_active():
    case = MoECase(6, 64, 32, 32, 5, 2, gain=2.0, seed=3)
    gate_up = case.x @ case.w13[0].t()
    gate, up = gate_up.chunk(2, dim=-1)
    assert (gate > LIMIT).any() and (up > LIMIT).any() and (up < -LIMIT).any()  # all three clamps bind
    for fmt in ("bf16", "mxfp8"):
        _check_moe(case, torch.float32, fmt)


@cpu_only
def test_moe_ties_in_router_scores():
    # Experts 2 and 5 are identical for the router and tie for the second place on every token (expert 1 is
    # first): the lower id must win, otherwise expert 5's weights enter the output.
    case = MoECase(8, 64, 32, 32, 6, 2, seed=4, tie_rows=((2, 5),))
    case.bias[1] += 10.0
    case.bias[2] += 5.0
    case.bias[5] += 5.0
    _check_moe(case, torch.float32, "bf16")


# Prefill tile order and TMA weight tiles (moe._tile_ids, moe._gate_up / _down TMA). 40 tokens x top-2 over 3
# experts; H = I = 96 with 64-wide N and K tiles, so every last N tile and K step is half past the edge (TMA reads
# zeros there, the ordinary loads mask); clamps active. GROUP_M 3 over 16-row blocks (8 blocks: groups of 3, 3 and
# a short last one of 2); a GROUP_M that skipped or repeated a tile would leave rows of the empty activation
# buffer unwritten. TMA unfused (two copies per K step) and GU_FUSED (one [1, 2, BN, BK] copy, gate and up
# stacked). MX_MODE 1: tl.dot_scaled (MX_MODE 2) has no interpreter implementation.
@cpu_only
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
@pytest.mark.parametrize("config", [dict(GROUP_M=3, BLOCK_M=16),
                                    dict(TMA=1, BLOCK_N=64, BLOCK_K=64, MX_MODE=1),
                                    dict(TMA=1, GU_FUSED=1, GROUP_M=2, BLOCK_N=64, BLOCK_K=64, MX_MODE=1)],
                         ids=["group3", "tma", "tma_gu_group2"])
def test_moe_tile_order_and_tma(fmt, config):
    _check_moe(MoECase(40, 96, 96, 64, 3, 2, gain=2.0, seed=51), torch.float32, fmt, config=config)


def _prefill_sweep_cases():
    from bench.moe import PREFILL_ROUND4, PREFILL_ROUND5, PREFILL_SWEEP

    return [pytest.param(c, fmt, id=f"{name}-{fmt}") for name, c in {**PREFILL_ROUND4, **PREFILL_ROUND5}.items()
            for fmt in ("mxfp8", "bf16") if c in PREFILL_SWEEP[fmt]]


@cpu_only
@pytest.mark.parametrize("config,fmt", _prefill_sweep_cases())
def test_moe_prefill_sweep_tiles(config, fmt):
    # bench/moe.py's prefill variants of rounds 4 and 5 (PREFILL_ROUND4 / PREFILL_ROUND5, imported so that the
    # tested tiles are the swept ones) in the formats the sweep runs them, bf16 activations as the model runs: 64-,
    # 128- and 256-row blocks, 128-wide N tiles, GROUP_M 8 (5 row blocks here: one short group), TMA, 128-wide down
    # tiles; odd H / I as above. The interpreter takes MX_MODE 1 where the GPU takes 2 (tl.dot_scaled); the sweep checks
    # MX_MODE 2 against the fp32 oracle on the H200.
    _check_moe(MoECase(40, 96, 96, 64, 3, 2, gain=2.0, seed=52), torch.bfloat16, fmt, config=config)


@triton.jit
def _convert_tile(w_ptr, s_ptr, out_ptr, BN: tl.constexpr, BK: tl.constexpr):
    r = tl.program_id(0) * BN + tl.arange(0, BN)
    k = tl.arange(0, BK)
    g = tl.arange(0, BK // 32)
    w = tl.load(w_ptr + r[:, None] * BK + k[None, :])
    s = tl.load(s_ptr + r[:, None] * (BK // 32) + g[None, :])
    tl.store(out_ptr + r[:, None] * BK + k[None, :], _e4m3_tile_bf16(w, s))


def _e4m3_codes_times_scales(scale_bytes: list[int], device: str = "cpu"):
    """Every E4M3 code (one row of 256 per scale byte, 8 scale blocks of 32 codes each) against the reference's
    dequantisation rounded to bf16 (its fp32 product is exact, so that is one correct rounding)."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(len(scale_bytes), 1)
    w = codes.view(torch.float8_e4m3fn).to(device)
    s = torch.tensor(scale_bytes, dtype=torch.uint8)[:, None].repeat(1, 8).to(device)
    out = torch.empty(w.shape, dtype=torch.bfloat16, device=device)
    _convert_tile[(len(scale_bytes),)](w, s, out, BN=1, BK=256)
    want = mxfp8.dequantize(w, s, torch.float32).to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan], want[~nan])  # bit for bit: +-0, subnormals, infinities included


@cpu_only
def test_e4m3_integer_conversion_is_exact_for_every_code():
    # The integer E4M3 conversion (moe._e4m3_tile_bf16, the PTX moe_prefill_ws runs; under the interpreter its
    # element-wise form with fp32
    # products) for all 256 codes (NaN 0x7F / 0xFF, +-0, the subnormals) times scale bytes 10-255: exact products,
    # overflow to inf (247-254), +inf (255: 0 x inf is NaN). Bytes 0-9 make bf16 subnormals, which Triton 3.6's
    # interpreter flushes to zero on its own bf16 stores: those are checked compiled, on the GPU, below.
    _e4m3_codes_times_scales(list(range(10, 256)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
def test_gpu_e4m3_integer_conversion_is_exact_for_every_code_and_scale():
    # The integer conversion's PTX (four codes per register, prmt / shifts / masks) for every code times every
    # scale byte, roundings to bf16 subnormals and overflow to inf included.
    _e4m3_codes_times_scales(list(range(256)), "cuda")


@triton.jit
def _convert_tile_fast(w_ptr, s_ptr, out_ptr, BN: tl.constexpr, BK: tl.constexpr):
    """``moe_prefill_ws``'s FAST_CONVERT conversion (its PTX and its folded factor) in a Triton kernel."""
    r = tl.program_id(0) * BN + tl.arange(0, BN)
    k = tl.arange(0, BK)
    g = tl.arange(0, BK // 32)
    w = tl.load(w_ptr + r[:, None] * BK + k[None, :]).to(tl.uint8, bitcast=True)
    s = tl.load(s_ptr + r[:, None] * (BK // 32) + g[None, :]).to(tl.uint16)
    v = tl.inline_asm_elementwise(_E4M3_BF16_NO_NAN_ASM, "=r,=r,r", [w], dtype=tl.bfloat16, is_pure=True, pack=4)
    f = ((s + 120) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    out = tl.reshape(tl.reshape(v, (BN, BK // 32, 32)) * f[:, :, None], (BN, BK))
    tl.store(out_ptr + r[:, None] * BK + k[None, :], out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
def test_gpu_fast_conversion_is_exact_for_every_code_but_nan_and_scales_to_134():
    # FAST_CONVERT (moe_prefill_ws): no NaN flag, one multiply by 2^(s - 7); for every non-NaN code and every scale
    # byte it admits (0-134, bf16 subnormal results included), the reference's bits.
    from m3export.plugins.kernels.moe_prefill_ws import FAST_SCALE_MOST

    scale_bytes = list(range(FAST_SCALE_MOST + 1))
    codes = torch.arange(256, dtype=torch.uint8).repeat(len(scale_bytes), 1)
    w = codes.view(torch.float8_e4m3fn).cuda()
    s = torch.tensor(scale_bytes, dtype=torch.uint8)[:, None].repeat(1, 8).cuda()
    out = torch.empty(w.shape, dtype=torch.bfloat16, device="cuda")
    _convert_tile_fast[(len(scale_bytes),)](w, s, out, BN=1, BK=256)
    want = mxfp8.dequantize(w, s, torch.float32).to(torch.bfloat16)
    ok = (codes.cuda() & 0x7F) != 0x7F
    assert torch.equal(out[ok].view(torch.int16), want[ok].view(torch.int16))  # bit for bit, +-0 and subnormals


def test_fast_convert_is_taken_only_by_weights_without_nan_codes_or_large_scales(monkeypatch):
    from m3export.plugins.kernels.moe_prefill_ws import FAST_SCALE_MOST, fast_convert_ok

    class Stack:
        def __init__(self, w, s):
            self.w, self.s = w, s

    w, s = mxfp8.quantize(torch.randn(4, 64, 64))
    stack = Stack(w, s)
    assert fast_convert_ok(stack)
    w.view(torch.uint8)[1, 2, 3] = 0xFF  # a NaN code: the answer follows the tensor's new version
    assert not fast_convert_ok(stack)
    w3, s3 = mxfp8.quantize(torch.randn(8, 64, 64))
    w3.view(torch.uint8)[7, 63, 63] = 0x7F  # in the last of several scan steps
    monkeypatch.setattr("m3export.plugins.kernels.moe_prefill_ws._FAST_SCAN_BYTES", 1000)
    assert not fast_convert_ok(Stack(w3, s3))
    w2, s2 = mxfp8.quantize(torch.randn(2, 32, 64))
    s2[1, 5, 0] = FAST_SCALE_MOST + 1
    assert not fast_convert_ok(Stack(w2, s2))
    s2[1, 5, 0] = FAST_SCALE_MOST
    assert fast_convert_ok(Stack(w2, s2))


def test_moe_tma_rejects_scale_gather_mode_and_unaligned_rows():
    case = MoECase(4, 64, 32, 32, 4, 2)
    with pytest.raises(ValueError, match="TMA takes MX_MODE 1 or 2"):
        _check_moe(case, torch.float32, "mxfp8", config={"TMA": 1, "MX_MODE": 0})
    odd = MoECase(4, 34, 32, 32, 4, 2)  # fp32 rows of 34 values: 136 bytes, not a multiple of 16
    with pytest.raises(ValueError, match="TMA needs contiguous weight rows with 16-byte aligned"):
        _check_moe(odd, torch.float32, "bf16", config={"TMA": 1})
    for cfg in ({"MX_MODE": 3}, {"TMA": 1, "MX_MODE": 3}):  # the integer conversion raced in its pipelined loop
        with pytest.raises(ValueError, match="MX_MODE must be 0, 1 or 2 .* raced"):
            _check_moe(case, torch.bfloat16, "mxfp8", config=cfg)


@cpu_only
def test_moe_large_block_path():
    # Enough assignments per expert for 64-row blocks (block_m_for) with padding in several experts.
    case = MoECase(40, 64, 32, 32, 3, 2, seed=5)
    assert moe_kernel.block_m_for(40 * 2, 3) == 64
    _check_moe(case, torch.float32, "mxfp8")


def test_moe_rejects_mismatched_weights():
    case = MoECase(2, 64, 32, 32, 4, 2)
    with pytest.raises(ValueError, match="w2 has shape"):
        moe_kernel.forward(case.x, case.router, case.bias, case.w13, case.w2[:, :, :16], case.s13, case.s2,
                           *case.attrs())
    q = case.mxfp8_args(torch.float32)
    with pytest.raises(TypeError, match="moe_mxfp8 w13: MXFP8 scales must be uint8"):
        moe_mxfp8_kernel.forward(*q[:4], q[4].to(torch.int32), *q[5:], *case.attrs())


# ---------------------------------------------------------------------------------------------------- linear
def _linear_cases():
    # Each mode at three shapes: one row (N 40, K 96), [2, 3] rows (N 17, K 64) and the third (N 70: the last 16-row
    # GEMV tile partly past N; K 160: three 64-wide K steps, the last half past K, PREFETCH 2 reaching past the end).
    # There the tensor-core modes take 20 rows (tile_config's 17-64-row bucket: one 64-row M tile, partly past M) and
    # the GEMV modes 3 (one program per row and N tile: more rows are more of the same programs).
    cases = []
    for mode in (0, 1, "gemv", "gemv_prefetch", "gemv_pipeline", "default"):
        rows = (3,) if str(mode).startswith("gemv") else (20,)
        for lead, n, k in [((1,), 40, 96), ((2, 3), 17, 64), (rows, 70, 160)]:
            cases.append(pytest.param(lead, n, k, mode, id=f"{'x'.join(map(str, lead))}-{n}-{k}-{mode}"))
    return cases


@cpu_only
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lead,n,k,mode", _linear_cases())
def test_mxfp8_linear_matches_reference(dt, lead, n, k, mode):
    w, s = mxfp8.quantize(torch.randn(n, k))
    s[0, 0] = 0  # the subnormal scale 2^-127 (one UE8M0 byte that cannot be built by an exponent shift)
    x = torch.randn(*lead, k).to(dt)
    # "default": no config, i.e. mxfp8_linear.gemv_config at one row (the GEMV tile), tile_config above.
    config = ({"GEMV": 1, "BLOCK_N": 16, "BLOCK_K": 64} if mode == "gemv" else None if mode == "default"
              else {"GEMV": 1, "BLOCK_N": 16, "BLOCK_K": 64, "PREFETCH": 2} if mode == "gemv_prefetch"
              else {"GEMV": 1, "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4, "PIPELINE": 4} if mode == "gemv_pipeline"
              else {"MX_MODE": mode, "BLOCK_K": 64})
    got = linear_kernel.run_linear(x, w, s, config=config)
    want = ref.mxfp8_linear_reference(x, w, s)
    _close(got, want, ref.mxfp8_linear_reference(x.double(), w, s) if dt != torch.float32 else None)


def test_mxfp8_linear_rejects_bad_scales():
    w, s = mxfp8.quantize(torch.randn(8, 64))
    with pytest.raises(ValueError, match="scale shape"):
        linear_kernel.forward(torch.randn(2, 64), w, s[:, :1])


# ---------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
@pytest.mark.parametrize("t", [1, 8, 64, 700])
def test_gpu_moe_mxfp8_mini_dims(t):
    # mini preset dims (H 6144, I 3072) with 16 experts; bf16 activations as the model runs.
    case = MoECase(t, 6144, 3072, 3072, 16, 4, gain=0.02, seed=6)
    args = [a.cuda() for a in case.mxfp8_args(torch.bfloat16)]
    got = moe_mxfp8_kernel.forward(*args, *case.attrs())
    want = ref.moe_mxfp8_reference(*args, *case.attrs())
    want64 = ref.moe_mxfp8_reference(*_as64(args), *case.attrs())
    _close(got, want, want64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
@pytest.mark.parametrize("config", [{"GEMV": 1, "BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4, "SPLIT_K": 2,
                                     "PREFETCH": 1},
                                    {"GEMV": 1, "BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 2, "SPLIT_K": 3,
                                     "PREFETCH": 2}], ids=["split2_pf1", "split3_pf2"])
def test_gpu_moe_gemv_split_k_mini_dims(config):
    # Split-K's arrival counters and cross-program partials only race on a real device: mini dims, 16 experts, one
    # token and four, replayed twice from the same buffers (the counters are zeroed per call).
    for t in (1, 4):
        case = MoECase(t, 6144, 3072, 3072, 16, 4, gain=0.02, seed=12 + t)
        args = [a.cuda() for a in case.mxfp8_args(torch.bfloat16)]
        want = ref.moe_mxfp8_reference(*args, *case.attrs())
        want64 = ref.moe_mxfp8_reference(*_as64(args), *case.attrs())
        first = None
        for _ in range(2):
            got = moe_kernel.run_moe(*args[:3], *args[3::2], *case.attrs(), scales=tuple(args[4::2]), config=config)
            _close(got, want, want64)
            assert first is None or torch.equal(got, first)  # deterministic: partials added in split order
            first = got


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
@pytest.mark.parametrize("config", PIPELINE_CONFIGS, ids=PIPELINE_IDS)
def test_gpu_moe_gemv_pipeline_mini_dims(config):
    # The cp.async-pipelined GEMV compiled (the interpreter ignores the stages): mini dims, 16 experts, one token
    # (and four with split-K, whose cross-program partials meet the pipelined loads), bench/moe.py's K tile of 256
    # (BLOCK_K 128 for the 6-stage one, as the bench runs it).
    config = {**config, "BLOCK_K": 128 if config["PIPELINE"] == 6 else 256}
    for t in (1, 4) if config.get("SPLIT_K") else (1,):
        case = MoECase(t, 6144, 3072, 3072, 16, 4, gain=0.02, seed=40 + t)
        args = [a.cuda() for a in case.mxfp8_args(torch.bfloat16)]
        want = ref.moe_mxfp8_reference(*args, *case.attrs())
        want64 = ref.moe_mxfp8_reference(*_as64(args), *case.attrs())
        _close(moe_kernel.run_moe(*args[:3], *args[3::2], *case.attrs(), scales=tuple(args[4::2]), config=config),
               want, want64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
@pytest.mark.parametrize("config,fmt", _prefill_sweep_cases())
def test_gpu_moe_prefill_sweep_mini_dims(config, fmt):
    # The prefill tiles of rounds 4 and 5 compiled: tl.dot_scaled (MX_MODE 2) on TMA-loaded weight tiles, the
    # grouped order over 1-D grids and the device-made descriptors exist only there. mini dims, 16 experts, 700
    # tokens x top-4 (175 assignments per expert: 3 row blocks of 64 or 2 of 128 per expert, several groups of 8).
    case = MoECase(700, 6144, 3072, 3072, 16, 4, gain=0.02, seed=60)
    args = [a.cuda() for a in (case.mxfp8_args(torch.bfloat16) if fmt == "mxfp8" else case.bf16_args(torch.bfloat16))]
    scales = tuple(args[4::2]) if fmt == "mxfp8" else (None,) * 4
    weights = args[3::2] if fmt == "mxfp8" else args[3:]
    reference = ref.moe_mxfp8_reference if fmt == "mxfp8" else ref.moe_reference
    want = reference(*args, *case.attrs())
    want64 = reference(*_as64(args), *case.attrs())
    _close(moe_kernel.run_moe(*args[:3], *weights, *case.attrs(), scales=scales, config=config), want, want64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
def test_gpu_mxfp8_checkpoint_stays_mxfp8_and_generates(tmp_path):
    # Bring-up on a real (synthetic, tiny) MXFP8 checkpoint: the weights stay E4M3 + UE8M0 on the GPU (resident
    # bytes about the checkpoint's, not the 2x of a bf16 dequantisation) and greedy decoding through the MXFP8
    # kernels equals the CPU reference ops (fp32 activations: the two differ by summation order only).
    import m3export
    from m3export.checkpoint.writer import write_checkpoint
    from m3export.config import preset
    from m3export.plugins.kernels import register
    from m3export.runtime import Engine, SamplingParams

    ckpt = write_checkpoint(tmp_path / "ckpt", preset("tiny"), fmt="mxfp8", progress=False)
    ckpt_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    model = m3export.load_model(ckpt, device="cuda", dtype=torch.bfloat16)
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"MXFP8 tiny checkpoint: {ckpt_bytes} bytes on disk, {resident} bytes resident on the GPU")
    assert model.model.layers[1].mlp.experts.w13.dtype == torch.float8_e4m3fn
    assert resident <= 1.1 * ckpt_bytes  # same tensors in the same dtypes (shard headers aside)
    register()
    prompts = [list(range(1, 12)), list(range(30, 37))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = {dev: [o.token_ids for o in Engine.from_checkpoint(ckpt, device=dev, dtype=torch.float32, page_size=8)
                 .generate(prompts, params)] for dev in ("cpu", "cuda")}
    assert out["cuda"] == out["cpu"]
