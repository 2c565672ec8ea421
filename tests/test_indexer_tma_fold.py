"""The lightning indexer's TMA key loads and its folded top-k (``plugins/kernels/lightning_indexer.py``, issue 11)
against the reference, under Triton's interpreter at tiny sizes (on a GPU machine the same cases run compiled).

TMA reads one page-sized key tile per bulk copy and cuts the context into runs of whole tiles / blocks, so the
cases cover a tile holding several blocks, a block spanning several tiles (running max), tiles of part of a page,
pages a descriptor cannot address (gathered instead), FP8 pools, decode, verify and mixed batches. The fold runs the top-k in the scan's
last program per query tile: its ticket counters must be back at 0 after every launch (the next launch, or a
CUDA graph replay, starts from them), and the selections must be the reference's exactly: ties, forced blocks, -1.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.test_kernels_attention import CASES, DEVICE, Paged, spy_launches  # sets TRITON_INTERPRET without a GPU

from m3export.ops.indexer import lightning_indexer_reference  # noqa: E402
from m3export.plugins.kernels import _batch  # noqa: E402
from m3export.plugins.kernels import lightning_indexer as LI  # noqa: E402

TMA = {"scan": dict(loads="tma", block_n=16, num_stages=3)}
FOLD = {"scan": dict(loads="tma", block_n=16, fold_topk=1)}
HOST = {"scan": dict(loads="tma-host", block_n=16, num_stages=4)}  # the descriptor made at launch

# (context lengths, new tokens, page, block, top-k, local, init), pages of >= 16 keys (``MIN_TMA_TILE``: the
# dot's smallest N) so that TMA really reads them, with 16-key tiles:
TMA_CASES = {
    "decode-blocks-span-tiles": ([70, 45, 1, 33], [1, 1, 1, 1], 16, 32, 3, 1, 0),  # 2 tiles per block: running max
    "decode-tiles-hold-blocks": ([70, 45, 1, 33], [1, 1, 1, 1], 32, 8, 4, 1, 1),  # 2 blocks per 16-key tile
    "verify-and-prefill": ([40, 29, 21, 17], [17, 4, 3, 0], 16, 16, 3, 1, 0),  # query tiles of several tokens
    "many-blocks-top16": CASES["many-blocks-top16"],
}


@pytest.fixture(autouse=True)
def _sixteen_sms(monkeypatch):
    """16 multiprocessors: every query tile's context is cut into several splits (tickets > 1 per counter)."""
    monkeypatch.setattr(_batch, "num_sms", lambda device: 16)


def _case(name):
    ctx, new, page, *attrs = TMA_CASES.get(name) or CASES[name]
    return Paged(ctx, new, page, zlib.crc32(name.encode())), tuple(attrs)


def _run(paged, attrs, config, dtype=torch.float32, d=32, scale=False):
    q, pool = paged.randn(paged.tokens, 2, d, dtype=dtype), paged.pool(d, dtype=dtype)
    ks = None
    if scale:  # E4M3 pool with per-row fp32 scales, read by kernel and reference alike
        from m3export.ops.kv_fp8 import quantize_rows

        pool, ks = quantize_rows(paged.pool(d))
    ref = lightning_indexer_reference(q, pool, *paged.args("cpu"), *attrs, index_k_scale=ks)
    got = LI.forward(q.to(DEVICE), pool.to(DEVICE), *paged.args(), *attrs,
                     None if ks is None else ks.to(DEVICE), config=config)
    return got.cpu(), ref


# TMA_CASES, and two whose pages (5 and 3 keys) no descriptor tile can follow (the same launch, gathered)
@pytest.mark.parametrize("name", [*TMA_CASES, "mixed-with-empty-seq", "page-smaller-than-block"])
@pytest.mark.parametrize("config", [TMA, FOLD, HOST], ids=["tma", "tma-fold", "tma-host"])
def test_tma_and_fold_select_exactly_as_reference(name, config):
    paged, attrs = _case(name)
    assert (LI.tma_usable(paged.pool(32)) is None) == (name in TMA_CASES)  # TMA where the case says so
    got, ref = _run(paged, attrs, config, dtype=torch.bfloat16)
    assert torch.equal(got, ref)


def test_tma_tiles_of_part_of_a_page():
    """16-key tiles on pages of 32 with blocks of 32: two tiles per page and per block."""
    paged = Paged([70, 45, 1, 33], [1, 1, 1, 1], 32, seed=4)
    got, ref = _run(paged, (32, 2, 1, 0), {"scan": dict(loads="tma", block_n=16, num_stages=2)})
    assert torch.equal(got, ref)


@pytest.mark.parametrize("config", [TMA, FOLD, HOST], ids=["tma", "tma-fold", "tma-host"])
def test_fp8_pool_through_tma(config):
    paged, attrs = _case("many-blocks-top16")
    got, ref = _run(paged, attrs, config, scale=True)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("method", ["rounds", "bitonic"])
@pytest.mark.parametrize("loads", ["gather", "tma"])
def test_fold_ties_go_to_forced_then_lower_id(loads, method, monkeypatch):
    """A decode batch (so the top-k is folded) full of exact ties: keys and queries in {-1, 0, 1} (integer scores,
    many equal block maxima), a sequence of all-zero keys (every block ties), forced local / init blocks, and -1
    padding (sequences of one and of two blocks); pages of 16, blocks of 4 (four blocks per TMA tile)."""
    paged = Paged([47, 6, 40, 1, 30], [1, 1, 1, 1, 1], 16, seed=1)
    attrs = (4, 4, 2, 1)
    q = torch.randint(-1, 2, (paged.tokens, 2, 16), generator=paged.gen).float()
    keys = torch.randint(-1, 2, (paged.num_pages * 16, 16), generator=paged.gen).float()
    keys[paged.block_tables[2, :3].long().repeat_interleave(16) * 16 + torch.arange(16).repeat(3)] = 0.0
    pool = paged.pool(16, values=lambda *shape: keys)
    ref = lightning_indexer_reference(q, pool, *paged.args("cpu"), *attrs)
    assert (ref == -1).any() and (ref[2] >= 0).all()
    monkeypatch.setattr(LI, "block_topk", None)  # folded: the top-k launch is never called
    config = {"scan": dict(fold_topk=1, loads=loads, block_n=16), "topk": dict(method=method)}
    got = LI.forward(q.to(DEVICE), pool.to(DEVICE), *paged.args(), *attrs, config=config)
    assert torch.equal(got.cpu(), ref)


def test_fold_puts_every_ticket_counter_back_to_zero():
    """Launches in a row (different batches, so different query tiles and splits) leave the shared counters at 0,
    and each later launch is right: it started from zeros the one before restored."""
    counters = _batch.ticket_counters(torch.device(DEVICE), 1)
    for name in ("decode-blocks-span-tiles", "decode-between-empty-seqs", "decode-tiles-hold-blocks"):
        paged, attrs = _case(name)
        got, ref = _run(paged, attrs, FOLD)
        assert torch.equal(got, ref)
        assert int(counters.count_nonzero()) == 0


def test_fold_serves_decode_batches_and_leaves_prefill_tiles_to_the_topk_launch(monkeypatch):
    """Decode-like batches (one token per program) take no top-k launch; a verify batch (query tiles of several
    tokens) and a decode batch past ``FOLD_MOST_KEYS`` do, with the same result as without the fold."""
    launches = []
    plain = LI.block_topk
    monkeypatch.setattr(LI, "block_topk", lambda *a, **k: launches.append(1) or plain(*a, **k))
    paged, attrs = _case("decode-tiles-hold-blocks")
    got, ref = _run(paged, attrs, FOLD)
    assert torch.equal(got, ref) and launches == []
    paged, attrs = _case("verify-and-prefill")
    got, ref = _run(paged, attrs, FOLD)
    assert torch.equal(got, ref) and launches == [1]
    monkeypatch.setattr(LI, "FOLD_MOST_KEYS", 8)  # 2 heads x 32 blocks (20 blocks of 8 padded) are more
    paged, attrs = _case("decode-tiles-hold-blocks")
    got, ref = _run(paged, attrs, FOLD)
    assert torch.equal(got, ref) and launches == [1, 1]


def test_fold_of_an_empty_batch_and_scan_alone():
    """No query token: every id -1 and no launch. ``scan`` alone never folds (it returns block maxima)."""
    paged, attrs = _case("decode-one-token-seqs")
    q, pool = paged.randn(0, 2, 32), paged.pool(32)
    bt, _, sl, pos = paged.args()
    qsl = torch.zeros(sl.numel() + 1, dtype=torch.int32, device=DEVICE)
    got = LI.forward(q.to(DEVICE), pool.to(DEVICE), bt, qsl, sl, pos[:0], *attrs, config=FOLD)
    assert got.shape == (0, 2, attrs[1])
    q = paged.randn(paged.tokens, 2, 32)
    folded = LI.scan(q.to(DEVICE), pool.to(DEVICE), *paged.args(), attrs[0], config=FOLD)
    # the same tile without the fold (not DEFAULTS: another key tile is another interpreter dot shape, whose numpy
    # summation order may differ in the last bit)
    plain = LI.scan(q.to(DEVICE), pool.to(DEVICE), *paged.args(), attrs[0],
                    config={"scan": dict(FOLD["scan"], fold_topk=0)})
    own = paged.positions // attrs[0]
    for t in range(paged.tokens):  # entries past a token's own block are never written
        assert torch.equal(folded[t, :, :own[t] + 1].cpu(), plain[t, :, :own[t] + 1].cpu())


def test_tma_usable_names_what_a_descriptor_cannot_read():
    assert LI.tma_usable(torch.zeros(6, 16, 32)) is None
    assert "power of two >= 16" in LI.tma_usable(torch.zeros(6, 3, 32))
    assert "power of two >= 16" in LI.tma_usable(torch.zeros(6, 8, 32))
    assert "16-byte aligned" in LI.tma_usable(torch.zeros(6, 16, 33))  # rows of 132 bytes
    assert "16-byte aligned" in LI.tma_usable(torch.zeros(6, 32, 32)[:, :16])  # pages not one run of rows
    assert "wider than a bulk copy's box" in LI.tma_usable(torch.zeros(1, 16, 264))


@pytest.mark.parametrize("loads", ["gather", "tma-host"])
@pytest.mark.parametrize("dot, flag", [("tf32", "FP8_TF32"), ("bits", "FP8_BITS")])
def test_fp8_pool_with_another_dot(loads, dot, flag, monkeypatch):
    """bf16 queries over an E4M3 pool with ``fp8_dot="tf32"`` (queries and keys widened to fp32, exact, the dot in
    TF32) or ``"bits"`` (keys widened to bf16 by bit placement, the dot in bf16): the interpreter multiplies in
    fp32 and widens with ``widen``; the compiled lowering is ``tests/test_indexer_sm90_compile.py``'s and the bit
    placement's every byte ``tests/test_fp8_widen_gpu.py``'s."""
    seen = spy_launches(monkeypatch, LI, "_index_scan")
    paged, attrs = _case("many-blocks-top16")
    config = {"scan": dict(loads=loads, block_n=16, fp8_dot=dot)}
    got, ref = _run(paged, attrs, config, dtype=torch.bfloat16, scale=True)
    assert torch.equal(got, ref)
    assert [kw[flag] for kw in seen] == [True]
    _run(paged, attrs, config, dtype=torch.float32, scale=True)  # fp32 queries keep their IEEE dot
    _run(paged, attrs, config, dtype=torch.bfloat16)  # 16-bit keys: no FP8 dot to change
    assert [kw[flag] for kw in seen] == [True, False, False]
    assert not any(kw["FP8_TF32"] and kw["FP8_BITS"] for kw in seen)


def test_unknown_loads_are_refused():
    paged, attrs = _case("decode-one-token-seqs")
    with pytest.raises(ValueError, match="scan loads 'bulk'"):
        _run(paged, attrs, {"scan": dict(loads="bulk")})
    assert LI.LOADS == ("gather", "tma", "tma-host", "auto")
    with pytest.raises(ValueError, match="scan fp8_dot 'fp16' is not one of"):
        _run(paged, attrs, {"scan": dict(fp8_dot="fp16")})


def test_ticket_counters_grow_but_never_inside_a_capture(monkeypatch):
    """More counters than the buffer has: a new, larger zeroed buffer (the old one kept referenced); inside a CUDA
    graph capture the same request is refused by name instead (it would come from the graph's pool)."""
    dev = torch.device("cpu")
    monkeypatch.setattr(_batch, "_TICKETS", {})
    monkeypatch.setattr(_batch, "_OUTGROWN", [])
    small = _batch.ticket_counters(dev, 3)
    assert small.numel() == _batch._MIN_TICKETS and int(small.count_nonzero()) == 0
    assert _batch.ticket_counters(dev, 5) is small
    big = _batch.ticket_counters(dev, _batch._MIN_TICKETS + 1)
    assert big.numel() == 2 * _batch._MIN_TICKETS and _batch._OUTGROWN == [small]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    cuda = torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="not allocated before CUDA graph capture"):
        _batch.ticket_counters(cuda, 1)


class _Captured(Exception):
    pass


@pytest.mark.parametrize("page, config, tma", [
    (16, None, False),  # the engine's default page: gathered 128-key tiles, not TMA tiles of 16 keys
    (64, {"scan": {"fp8_dot": "tf32"}}, False),  # settings that keep the default loads, "auto"
    (128, None, True),  # a page holds the default's whole key tile: TMA
    (16, {"scan": {"loads": "tma-host"}}, True),  # loads asked for are kept (the sweep's variants)
])
def test_auto_loads_gather_pages_below_the_key_tile(page, config, tma, monkeypatch):
    """Loads "auto" (the default): a bulk copy never crosses a page, so TMA tiles would shrink to the page; such
    pools gather whole-block tiles instead (``SMALL_PAGE_SCAN``; H200: 2x faster at pages of 16), others run
    "tma-host". The launch is captured, not run: its kwargs say which walk and tile it compiled."""
    seen = {}

    class Capture:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.update(kwargs)
                raise _Captured

            return launch

    monkeypatch.setattr(LI, "_index_scan", Capture())
    q = torch.zeros(1, 4, 128, dtype=torch.bfloat16)
    pool = torch.zeros(2 * 4096 // page, page, 128, dtype=torch.bfloat16)
    table = torch.arange(4096 // page, dtype=torch.int32).view(1, -1)
    with pytest.raises(_Captured):
        LI.scan(q, pool, table, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([4096], dtype=torch.int32),
                torch.tensor([4095]), 128, config=config)
    assert bool(seen["TMA"]) == tma and seen["HOST_DESC"] == tma
    assert seen["BLOCK_N"] == (min(page, LI.DEFAULTS["scan"]["block_n"]) if tma else 128)
    if not tma:
        assert seen["num_stages"] == LI.SMALL_PAGE_SCAN["num_stages"]
