"""The lightning indexer's TMA and folded-top-k variants compiled on a CUDA device at M3's dimensions (4 index heads
of 128, blocks of 128, top-16, one local block), against the reference. Skipped without a GPU (CI); on the H200:
``python3 -m pytest -q -m gpu tests/test_indexer_tma_gpu.py`` in a process of its own (the CPU test files switch
Triton to its interpreter).

One scan variant per TMA load form and key tile runs on a mixed batch (prefill chunk, decodes, a verify, a sequence
without new tokens) on pages of 128 and 64 (a block then spans two key tiles), bf16 and FP8 pools; every variant
that loads by TMA or folds the top-k runs at batch 1 / 128k; selections equal the reference's up to fp32 near-ties (the conformance suite's rule). The fold is
also captured in a CUDA graph: replays give the eager launch's bits, the ticket counters are back at 0 after
each, and no launcher syncs the host.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HI, DI, BS, TOPK, LOCAL, INIT = 4, 128, 128, 16, 1, 0
ATTRS = (BS, TOPK, LOCAL, INIT)


def _new_variants():
    from m3export.plugins.kernels import lightning_indexer as LI

    return {n: s for n, s in LI.VARIANTS["scan"].items() if s["loads"] != "gather" or s["fold_topk"]}


def _one_per_load_form():
    """A variant per (loads, key tile) among the TMA ones: the mixed batch's query tiles never fold, and stages /
    waves change no result, so these cover what the mixed batch can tell apart (compiles cost seconds each)."""
    seen = {}
    for name, s in _new_variants().items():
        if s["loads"] != "gather":
            seen.setdefault((s["loads"], s["block_n"]), (name, s))
    return dict(seen.values())


def _check(sel, iq, ikc, args, iks=None):
    from m3export.ops.conformance import Verdict, _compare_selection, upcast
    from m3export.ops.indexer import lightning_indexer_reference

    ref = lightning_indexer_reference(iq, ikc, *args, *ATTRS, index_k_scale=iks)
    if torch.equal(sel, ref):
        return
    if iks is not None:  # the near-tie rule on the keys as read
        from m3export.ops.kv_fp8 import dequantize_rows

        ikc = dequantize_rows(ikc, iks, torch.float64)
    verdict = Verdict()
    _compare_selection(sel, ref, upcast([iq, ikc, *args]),
                       dict(block_size=BS, topk_blocks=TOPK, local_blocks=LOCAL, init_blocks=INIT), verdict)
    assert verdict.ok, verdict.failures[:5]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("page", [128, 64])
def test_variants_on_a_mixed_batch_without_host_sync(page, fp8):
    from m3export.plugins.kernels import lightning_indexer as LI
    from tests.test_kernels_attention_gpu import MIXED, _batch

    gen = torch.Generator().manual_seed(page + fp8)
    pages, args = _batch(*MIXED, page, gen)
    t = args[3].numel()
    iq = torch.randn(t, HI, DI, device="cuda", dtype=torch.bfloat16)
    ikc, iks = torch.randn(pages, page, DI, device="cuda", dtype=torch.bfloat16), None
    if fp8:
        from m3export.ops.kv_fp8 import quantize_rows

        ikc, iks = quantize_rows(ikc)
    for name, settings in _one_per_load_form().items():
        LI.forward(iq, ikc, *args, *ATTRS, iks, config={"scan": settings})  # compile, counters allocated
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any device-to-host sync inside the launcher raises
        try:
            sel = LI.forward(iq, ikc, *args, *ATTRS, iks, config={"scan": settings})
        finally:
            torch.cuda.set_sync_debug_mode("default")
        _check(sel, iq, ikc, args, iks)


def test_variants_at_batch_1_and_128k():
    from m3export.plugins.kernels import lightning_indexer as LI
    from tests.test_kernels_attention_gpu import _batch

    pages, args = _batch([131072], [1], 128, torch.Generator().manual_seed(3))
    iq = torch.randn(1, HI, DI, device="cuda", dtype=torch.bfloat16)
    ikc = torch.randn(pages, 128, DI, device="cuda", dtype=torch.bfloat16)
    for name, settings in _new_variants().items():
        _check(LI.forward(iq, ikc, *args, *ATTRS, config={"scan": settings}), iq, ikc, args)


def test_fold_replayed_from_a_cuda_graph():
    from m3export.plugins.kernels import _batch as batch_helpers
    from m3export.plugins.kernels import lightning_indexer as LI
    from tests.test_kernels_attention_gpu import _batch

    pages, args = _batch([32768] * 8, [1] * 8, 128, torch.Generator().manual_seed(5))
    iq = torch.randn(8, HI, DI, device="cuda", dtype=torch.bfloat16)
    ikc = torch.randn(pages, 128, DI, device="cuda", dtype=torch.bfloat16)
    for name, settings in _new_variants().items():
        if not settings["fold_topk"]:
            continue
        cfg = {"scan": settings}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eager = LI.forward(iq, ikc, *args, *ATTRS, config=cfg)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = LI.forward(iq, ikc, *args, *ATTRS, config=cfg)
        counters = batch_helpers.ticket_counters(iq.device, 1)
        for _ in range(3):
            out.fill_(-7)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), name
            assert int(counters.count_nonzero()) == 0, name
        _check(eager, iq, ikc, args)


@pytest.mark.parametrize("table_tokens", [131072, 1 << 20])
def test_tiered_topk_on_rows_of_every_length_in_a_wide_table(table_tokens):
    """The block top-k compiled at M3's dims, block maxima as wide as a decode graph's block table (max_model_len
    of 128k or 1M tokens) for rows from one token to the whole table, on both sides of every tier boundary
    (``topk_tiers``), scores with ties everywhere: the ids of the reference's ``select_blocks``, with the tiers and
    without (the whole padded row)."""
    from m3export.ops.indexer import select_blocks
    from m3export.plugins.kernels import lightning_indexer as LI

    gen = torch.Generator().manual_seed(table_tokens % 1000)
    nb = table_tokens // BS + 1
    own = sorted({0, 1, 15, 16, 17, 32, 63, 64, 65, 66, 255, 256, 257, 1023, 1024, 1025, 4095, 4096, 4097, nb - 1}
                 - {b for b in range(nb, 1 << 20)})
    pos = torch.tensor(own) * BS + torch.randint(0, BS, (len(own),), generator=gen)
    pos = torch.minimum(pos, torch.tensor(table_tokens))
    scores = torch.randint(-20, 20, (len(own), HI, nb), generator=gen).float() / 4
    want = select_blocks(scores, pos, BS, TOPK, LOCAL, INIT)
    for tiers in (1, 0):
        got = LI.block_topk(scores.cuda(), pos.cuda(), BS, TOPK, LOCAL, INIT, config={"topk": {"tiers": tiers}})
        assert torch.equal(got.cpu(), want), f"tiers={tiers}"
