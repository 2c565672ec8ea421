"""The sparse attention kernel's one-launch split-K merge ("_fused") and TMA key / value tiles ("_tma") against the
reference (issue 11: decode at batch 16 under 60 % of copy bandwidth).

Under ``TRITON_INTERPRET=1`` on CPU at tiny sizes (on a GPU the same cases run compiled): key tiles of 16 inside
pages of 16 or 32 keys and blocks of 16 (so a tile is one bulk copy, as at M3's 128 / 128 / 128), the device made to
look like it has 16 multiprocessors so that every launch splits its selections and merges them. The pools hold NaN
in every slot no sequence owns (``Paged``): a bulk copy cannot be masked, so a kernel that let one of those rows reach
P V would fail here. Every launch is checked to have run the path named (TMA on, splits > 1). The fused merge's
counters must be back at 0 after every launch (the next launch, or a CUDA-graph replay, starts from them) and a
repeated call must give the same bits (the merge sums splits in split order, not in arrival order).

The interpreter runs a launch's programs one after another and its ``tl.atomic_add`` returns the old value (the
``sem`` / ``scope`` arguments are accepted and have nothing to order there), so on CPU the ticket logic (the last of
SPLITS tickets merges and resets) is what these cases check; the memory ordering between concurrent programs is
checked by the GPU test at the end (graph replays, M3 dims).
"""

from __future__ import annotations

import pytest
import torch

from tests.test_kernels_attention import (DEVICE, Paged, _assert_attention_close,  # sets TRITON_INTERPRET
                                         spy_launches)

from m3export.ops.attention import sparse_paged_attention_reference  # noqa: E402
from m3export.ops.indexer import lightning_indexer_reference  # noqa: E402
from m3export.plugins.kernels import _batch  # noqa: E402
from m3export.plugins.kernels import sparse_paged_attention as SPA  # noqa: E402
from m3export.plugins.kernels._tile_plan import tile_plan, tile_unions, union_choosers  # noqa: E402

# (context lengths, new tokens, index block): decode with one-token sequences; decode between sequences without new
# tokens (the counted sequence search must skip them as the binary search does); prefill mixing decode-like,
# one-token and page-crossing sequences whose odd tile tails leave tiles partly empty. Blocks of 32 (two key tiles
# each) put the last position at every place in its block: after one whole tile and a partial one (60), at a tile's
# end (48, 64), inside the first tile (40), so the TMA walks' whole-tile count and partial tile are both exercised.
# The prefill batches are as few tokens as keep that (the interpreter's time grows with tokens x query heads, the
# non-fused merge's programs): "prefill" in tiles of 4 has a full tile across a block and page boundary (positions
# 29-32), a full tile inside one block, tails of 1 and 3 tokens, a tile ending at its block's end (15: whole key
# tiles only) and others ending inside one (a partial tile); "prefill-blocks-of-32" ends its 4-token tiles after a
# whole key tile and a partial one (59), at a key tile's end (47, 63) and inside the first key tile (46, 6).
BATCHES = {"decode": ([50, 1, 33, 17], [1, 1, 1, 1], 16),
           "decode-empty-seqs": ([12, 40, 30, 5, 17], [0, 1, 0, 1, 0], 16),
           "decode-blocks-of-32": ([64, 48, 40, 60, 1], [1, 1, 1, 1, 1], 32),
           "prefill": ([50, 1, 34, 16], [1, 1, 9, 7], 16),
           "prefill-blocks-of-32": ([64, 48, 60, 7], [2, 5, 2, 3], 32),
           "prefill-short": ([40, 20], [5, 3], 32)}
LOOPS = {"decode": ["flat_fused", "flat_tma", "flat_tma_fused", "flat_tma_host_fused"], "decode-empty-seqs": ["flat_fused", "flat_tma_fused"],
         "decode-blocks-of-32": ["flat_tma_fused", "flat_tma_lean"],
         "prefill": ["union_fused", "union_tma", "union_tma_fused", "union_tma_lean", "union_tma_host_lean", "flat_tma",
                     "union_tma_host_lean_chosen_rescale"],
         "prefill-blocks-of-32": ["union_tma_fused", "union_tma_lean"]}


@pytest.fixture(autouse=True)
def _sixteen_sms(monkeypatch):
    monkeypatch.setattr(_batch, "num_sms", lambda device: 16)


@pytest.fixture
def launches(monkeypatch):
    """The kernel's launches (grid and keyword arguments) as ``forward`` made them; each still runs."""
    return spy_launches(monkeypatch, SPA, "_sparse_paged_attention")


def _case(batch: str, page: int, dtype=torch.bfloat16, fp8: bool = False):
    """q, k, v (and FP8 scales), args, the indexer's selection (forced local and init blocks) with -1 entries,
    repeats and ids past the token's own block mixed in, and the reference output."""
    ctx, new, bs = BATCHES[batch]
    paged = Paged(ctx, new, page, seed=page + len(batch))
    # decode: 16 query heads per KV head, as M3 (a one-token program's 16 rows are all real heads). prefill: 8, so a
    # 4-token tile is 32 rows, all real and more than 16 (the launcher fits them to shared memory, as M3's 64), with
    # half the programs of the non-fused merge (one per token and query head: the interpreter's largest cost here)
    t, hq, hkv, d = paged.tokens, 32 if batch.startswith("decode") else 16, 2, 32
    q = paged.randn(t, hq, d, dtype=dtype)
    scales = ()
    if fp8:
        from m3export.ops.kv_fp8 import quantize_rows

        (k, ks), (v, vs) = quantize_rows(paged.pool(hkv, d)), quantize_rows(paged.pool(hkv, d))
        scales = (ks, vs)
    else:
        k, v = paged.pool(hkv, d, dtype=dtype), paged.pool(hkv, d, dtype=dtype)
    sel = lightning_indexer_reference(paged.randn(t, hkv, d), paged.pool(d), *paged.args("cpu"), bs, 3, 1, 1)
    noise = torch.randint(-1, max(ctx) // bs + 2, (t, hkv, 2), generator=paged.gen, dtype=torch.int32)
    sel = torch.cat([sel, noise, sel[..., :1]], dim=-1)
    ref = sparse_paged_attention_reference(q, k, v, *paged.args("cpu"), sel, bs, d**-0.5, *scales)
    return paged, (q, k, v), scales, sel, bs, d**-0.5, ref


def _run(paged, qkv, scales, sel, bs, scale, mode, loop):
    cfg = {"loop": loop, "block_n": 16, **({"tile_tokens": 4} if mode == "prefill" else {})}
    return SPA.forward(*[x.to(DEVICE) for x in qkv], *paged.args(), sel.to(DEVICE), bs, scale,
                       *[s.to(DEVICE) for s in scales], config={mode: cfg})


def _counters_zero() -> bool:
    return all(int(b.abs().sum()) == 0 for b in [*_batch._TICKETS.values(), *_batch._OUTGROWN])


@pytest.mark.parametrize("batch, loop, page", [(b, lp, 16) for b, lps in LOOPS.items() for lp in lps]
                         + [("decode", "flat_tma_fused", 32), ("prefill", "union_tma_fused", 32)])
def test_fused_and_tma_loops_match_reference(batch, loop, page, launches):
    mode = batch.split("-")[0]
    paged, qkv, scales, sel, bs, scale, ref = _case(batch, page)
    got = _run(paged, qkv, scales, sel, bs, scale, mode, loop)
    _assert_attention_close(got, ref, qkv[2])
    (kw,) = launches
    assert bool(kw["TMA"]) == ("tma" in loop) and kw["FUSED"] == ("fused" in loop) and kw["LEAN"] == ("lean" in loop)
    if "tma" in loop:  # whole tiles by bulk copies where the walk allows it (module docstring), else V rows zeroed
        assert kw["TMA"] == (2 if loop.startswith("union") or kw["TOKENS"] == 1 else 1)
    assert kw.get("HOST_DESC", False) == ("host" in loop)  # descriptors made at launch
    assert kw["SPLITS"] > 1, "the case must split its selections for the merge to be exercised"
    if "fused" in loop:
        assert _counters_zero()
        assert (kw["SEQS_PAD"] > 0) == (mode == "decode")  # the counted sequence search in one-token programs
        again = _run(paged, qkv, scales, sel, bs, scale, mode, loop)
        assert torch.equal(got.view(torch.int16), again.view(torch.int16))
        assert _counters_zero()


@pytest.mark.parametrize("batch, loop", [("decode", "flat_tma_fused"), ("prefill", "union_tma_fused")])
def test_tma_reads_fp8_pools_as_the_fp8_reference(batch, loop, launches):
    """E4M3 pools with per-row scales through bulk copies; fp32 queries (the bound of tests/test_kernels_attention's
    fp32 cases: the E4M3 values and scales are exact in fp32)."""
    mode = batch.split("-")[0]
    paged, qkv, scales, sel, bs, scale, ref = _case(batch, 16, dtype=torch.float32, fp8=True)
    got = _run(paged, qkv, scales, sel, bs, scale, mode, loop)
    from m3export.ops.kv_fp8 import dequantize_rows

    _assert_attention_close(got, ref, dequantize_rows(qkv[2], scales[1]))
    assert launches[0]["TMA"] and launches[0]["SPLITS"] > 1 and _counters_zero()


def test_lean_step_on_fp32_pools_and_not_on_fp8(launches):
    """fp32 pools (the `mini` model tests' dtype) take the lean step and stay within the fp32 bound (only the
    exponent's FMA rounds differently); FP8 pools keep the plain step (their per-key scales sit in the scores)."""
    paged, qkv, scales, sel, bs, scale, ref = _case("prefill-short", 16, dtype=torch.float32)
    _assert_attention_close(_run(paged, qkv, scales, sel, bs, scale, "prefill", "union_tma_lean"), ref, qkv[2])
    paged, qkv, scales, sel, bs, scale, ref = _case("prefill-short", 16, dtype=torch.float32, fp8=True)
    from m3export.ops.kv_fp8 import dequantize_rows

    got = _run(paged, qkv, scales, sel, bs, scale, "prefill", "union_tma_lean")
    _assert_attention_close(got, ref, dequantize_rows(qkv[2], scales[1]))
    assert [kw["LEAN"] for kw in launches] == [True, False] and all(kw["TMA"] == 2 for kw in launches)


def test_tma_falls_back_where_a_key_tile_crosses_pages(launches):
    """Pages of 8 keys under 16-key tiles: no tile is one box, so the same walk runs with pointer loads."""
    paged, qkv, scales, sel, bs, scale, ref = _case("decode", 8)
    got = _run(paged, qkv, scales, sel, bs, scale, "decode", "flat_tma_fused")
    _assert_attention_close(got, ref, qkv[2])
    assert launches[0]["TMA"] == 0 and launches[0]["FUSED"] is True


@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_launches_of_every_size_run_the_default(fp8, launches):
    """A short 16-bit prefill launch runs ``DEFAULTS["prefill"]`` with its chooser bits (since the launch's plan is one
    kernel the short launches' own setting without them was slower, H200 14:20 UTC), the reference's output; FP8
    pools never get the bits made (their step does not read them)."""
    paged, qkv, scales, sel, bs, scale, ref = _case("prefill", 16, fp8=fp8)
    got = SPA.forward(*[x.to(DEVICE) for x in qkv], *paged.args(), sel.to(DEVICE), bs, scale,
                      *[s.to(DEVICE) for s in scales])
    if not fp8:
        _assert_attention_close(got, ref, qkv[2])
    (kw,) = launches
    assert (kw["TOKENS"], kw["TMA"], kw["RESCALE"]) == (SPA.DEFAULTS["prefill"]["tile_tokens"], 2, True)
    assert (kw["CHOSEN"], kw["cho_ptr"] is not None, kw["LEAN"]) == (not fp8, not fp8, not fp8)


def test_rescale_and_chosen_bits_give_the_lean_steps_bits(launches):
    """'_rescale' multiplies the accumulator by alpha at every tile where the lean step first tests whether any row's
    max grew (where none did, every alpha is exp2(0) = 1 exactly); '_chosen' takes each key tile's wanting rows and
    its mask test from the union's bits instead of comparing the rows' selections. Both are the same computation, so
    the same output bits (a wrong alpha, a skipped rescale or a wrong bit changes them). Half the selection entries
    are dropped (-1) so that a tile's tokens choose different blocks: on the indexer's own selections at these sizes
    every token chooses every block it may see, and giving every row every union block went unnoticed. Rows left
    with nothing are NaN, as in the reference, in both. The other prefill batch runs
    union_tma_host_lean_chosen_rescale against the reference."""
    paged, qkv, scales, sel, bs, scale, ref = _case("prefill", 16, dtype=torch.float32)
    sel = torch.where(torch.rand(sel.shape, generator=torch.Generator().manual_seed(7)) < 0.5, -1, sel)
    lean = _run(paged, qkv, scales, sel, bs, scale, "prefill", "union_tma_lean")
    for loop in ("union_tma_lean_rescale", "union_tma_lean_chosen"):
        got = _run(paged, qkv, scales, sel, bs, scale, "prefill", loop)
        torch.testing.assert_close(got, lean, rtol=0, atol=0, equal_nan=True, msg=loop)
    assert [(kw["LEAN"], kw["RESCALE"], kw["CHOSEN"]) for kw in launches] == [(True, False, False),
                                                                              (True, True, False),
                                                                              (True, False, True)]
    assert launches[2]["cho_ptr"] is not None


def test_union_choosers_are_the_tokens_that_chose_each_union_block():
    """Against sets built in Python per (tile, KV head, union entry): bit i iff token i of the tile selected the
    block and may see it (id >= 0, not after its own block; repeats count once); padding entries and tokens past
    the tile's end have none. The torch definition and the launch's kernel (``tile_plan``, DEVICE) alike."""
    gen = torch.Generator().manual_seed(5)
    positions = torch.tensor([3, 4, 5, 6, 7, 20, 21])  # blocks of 4: own blocks 0, 1, 1, 1, 1, 5, 5
    sel = torch.randint(-1, 7, (7, 2, 3), generator=gen, dtype=torch.int32)
    start, end, tokens = torch.tensor([0, 4, 5, 7]).int(), torch.tensor([4, 5, 7, 7]).int(), 4
    union, count = tile_unions(sel, positions, start, end, tokens, 4)
    bits = union_choosers(sel, positions, start, end, tokens, 4, union)
    qsl = torch.tensor([0, 4, 5, 7], dtype=torch.int32, device=DEVICE)  # three sequences: tiles [0, 4), [4, 5), [5, 7)
    *_, k_union, _, k_bits = tile_plan(qsl, sel.to(DEVICE), positions.to(DEVICE), 7, tokens, 4, union=True,
                                       chosen=True)
    assert torch.equal(k_union.cpu(), union) and torch.equal(k_bits.cpu(), bits)
    assert bits.shape == union.shape and bits.dtype == torch.int32
    for s in range(4):
        for h in range(2):
            for e in range(union.shape[-1]):
                c = union[s, h, e].item()
                want = sum(1 << (i - start[s].item()) for i in range(start[s], end[s])
                           if c in sel[i, h].tolist() and c <= positions[i] // 4)
                assert bits[s, h, e].item() == want, (s, h, e)
    assert (bits > 0).sum() == count.sum()  # every union block was chosen by some token
    assert any(0 < b < (1 << (end[s] - start[s]).item()) - 1 for s in range(3) for b in bits[s].flatten().tolist())


@pytest.mark.parametrize("loop, message", [("flat_fused_tma", "in that order"), ("flat_dma", "in that order"),
                                           ("spiral_tma", "is not one of"), ("halves_tma", "is not one of"),
                                           ("union_lean", "whole-tile TMA walks"), ("flat_host", "follows '_tma'"),
                                           ("nested_tma_lean", "whole-tile TMA walks"),
                                           ("union_tma_rescale", "form of the '_lean' step"),
                                           ("flat_tma_lean_chosen", "union walk's '_lean'"),
                                           ("union_tma_chosen", "union walk's '_lean'")])
def test_loop_forms_refuse_what_the_kernel_has_not(loop, message):
    with pytest.raises(ValueError, match=message):
        SPA.settings({"decode": {"loop": loop}}, "decode")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("loop", ["flat_fused", "flat_tma_fused", "flat_tma_host_fused"])
def test_fused_merge_replays_from_a_cuda_graph_with_the_same_bits(loop):
    """M3's dims (64 / 4 heads of 128, blocks and pages of 128, top-16), batch 16 at 4k, bf16: eager calls and
    CUDA-graph replays of the one-launch kernel give the same bits, the counters are 0 after each, and the output is
    within the bf16 bound of the reference."""
    from m3export.plugins.kernels import paged_attention

    torch.manual_seed(0)
    dev, b, ctx, page, bs, topk = torch.device("cuda"), 16, 4096, 128, 128, 16
    per = ctx // page
    pages = b * per + 4
    kc = torch.randn(pages, page, 4, 128, device=dev, dtype=torch.bfloat16)
    vc = torch.randn(pages, page, 4, 128, device=dev, dtype=torch.bfloat16)
    bt = torch.randperm(pages, device=dev)[:b * per].view(b, per).to(torch.int32)
    qsl = torch.arange(b + 1, device=dev, dtype=torch.int32)
    sl = torch.full((b,), ctx, device=dev, dtype=torch.int32)
    pos = torch.full((b,), ctx - 1, device=dev, dtype=torch.long)
    sel = torch.stack([torch.randperm(per, device=dev)[:topk] for _ in range(b * 4)]).view(b, 4, topk).int()
    sel[:, :, 0] = per - 1  # the local block
    q = torch.randn(b, 64, 128, device=dev, dtype=torch.bfloat16)
    cfg = {"decode": {**SPA.VARIANTS["decode"][f"{loop}-n128-w4-s3-waves2"]}}

    def call():
        return SPA.forward(q, kc, vc, bt, qsl, sl, pos, sel, bs, 128**-0.5, config=cfg)

    eager = call()
    torch.cuda.synchronize()
    assert _counters_zero()
    assert torch.equal(eager, call())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = call()
    for _ in range(3):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager) and _counters_zero()
    ref = sparse_paged_attention_reference(q, kc, vc, bt, qsl, sl, pos, sel, bs, 128**-0.5)
    bound = paged_attention.output_error_bound(torch.bfloat16, vc.abs().max().item())
    assert (eager.float() - ref.float()).abs().max().item() <= bound
