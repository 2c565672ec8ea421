"""The sparse prefill launch's plan kernel (``plugins/kernels/_tile_plan.py``) against the torch definitions it
replaced on the launch path, bit for bit, and the host work one prefill launch is left with (issue 11: at 4k new
tokens the eager launch was host-bound, ~70-110 small tensor ops dispatched from Python per call).

Under ``TRITON_INTERPRET=1`` on CPU at tiny sizes (compiled on a GPU): random selections with -1 padding, repeats,
ids past the selecting token's own block, batches whose tiles end at sequence ends and partly empty, one-token
sequences, sequences without new tokens, tiles of 1, 4 and 8 tokens, K from 1 to 6 (powers of two and not); the
tile search's sequence loop is also run in blocks of 2 sequences so that its running counts cross blocks. Tile
lists must equal ``_batch.query_tiles``', unions and counts ``tile_unions``', chooser bits ``union_choosers``'.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.test_kernels_attention import DEVICE  # sets TRITON_INTERPRET

from m3export.plugins.kernels import _batch  # noqa: E402
from m3export.plugins.kernels import _tile_plan as TP  # noqa: E402
from m3export.plugins.kernels import sparse_paged_attention as SPA  # noqa: E402

# new tokens per sequence (0: a sequence with none), selection width K, block size
BATCHES = {
    "one-prompt": ([13], 4, 4),
    "mixed": ([1, 9, 0, 4, 1, 6], 3, 4),
    "one-token-seqs": ([1, 1, 0, 1, 1], 5, 8),
    "odd-tails": ([5, 7, 3, 0, 2], 6, 2),
    "k1": ([6, 3], 1, 4),
}


def _batch_of(new, k, bs, seed, hkv=2):
    """query_start_loc, positions (each sequence's new tokens after a random prefix), selections: ids from -1 (the
    padding) to past the last token's block, so repeats and ids after the selecting token's own block occur."""
    gen = torch.Generator().manual_seed(seed)
    new_t = torch.tensor(new)
    ctx = new_t + torch.randint(0, 3 * bs, new_t.shape, generator=gen)
    qsl = torch.tensor([0, *new_t.cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(c - n, c) for c, n in zip(ctx.tolist(), new)]).long()
    top = int(ctx.max()) // bs + 2
    sel = torch.randint(-1, top, (int(qsl[-1]), hkv, k), generator=gen, dtype=torch.int32)
    sel[::3, :, -1] = sel[::3, :, 0]  # repeats within a token's selection
    return qsl, positions, sel


@pytest.mark.parametrize("tokens", [1, 4, 8])
@pytest.mark.parametrize("name", list(BATCHES))
def test_plan_equals_the_torch_definitions_bit_for_bit(name, tokens):
    new, k, bs = BATCHES[name]
    qsl, positions, sel = _batch_of(new, k, bs, seed=len(name) * 10 + tokens)
    t = sel.shape[0]
    got = TP.tile_plan(qsl.to(DEVICE), sel.to(DEVICE), positions.to(DEVICE), t, tokens, bs, union=True,
                       chosen=tokens > 1)
    seq, start, end, slots, union, count, bits = (x.cpu() if isinstance(x, torch.Tensor) else x for x in got)
    if tokens == 1:
        assert seq is None and slots == t
        start = torch.arange(t, dtype=torch.int32)
        end = start + 1
    else:
        want = _batch.query_tiles(qsl, t, tokens)
        assert slots == want[3]
        for a, b, what in zip((seq, start, end), want[:3], ("seq", "start", "end")):
            assert torch.equal(a, b), what
    want_union, want_count = TP.tile_unions(sel, positions, start, end, tokens, bs)
    assert torch.equal(union, want_union) and torch.equal(count, want_count)
    if tokens > 1:
        assert torch.equal(bits, TP.union_choosers(sel, positions, start, end, tokens, bs, want_union))
        if (end - start).max() > 1:  # some tile's tokens chose differently (a case that tells bits apart)
            assert ((bits > 0) & (bits < (1 << (end - start)[:, None, None]) - 1)).any()
    assert (count > 0).any() and (count < tokens * k).any()


def test_tile_search_runs_across_blocks_of_sequences(monkeypatch):
    """Many sequences searched 2 at a time (the launch loads up to 1024 starts at once): the running tile and
    sequence counts carried from block to block, sequences without new tokens at block edges; tile lists only (the
    non-union walks' plan: no unions made; ``tile_lists``, the dense attention's and the indexer's). The plan without
    unions is ``tile_lists``' one launch: a spy records what ``tile_lists`` returned inside ``tile_plan``, so both
    are checked on one launch per tile size (the interpreter runs every program of it)."""
    monkeypatch.setattr(TP, "_SEQ_BLOCK", 2)
    lists = []
    real = TP.tile_lists
    monkeypatch.setattr(TP, "tile_lists", lambda *a: lists.append(real(*a)) or lists[-1])
    new = [3, 0, 0, 5, 1, 0, 9, 2, 0, 4, 1]
    qsl, positions, sel = _batch_of(new, 2, 4, seed=3)
    t = sel.shape[0]
    for tokens in (2, 4, 16):
        seq, start, end, slots, union, count, bits = TP.tile_plan(qsl.to(DEVICE), sel.to(DEVICE),
                                                                  positions.to(DEVICE), t, tokens, 4, union=False,
                                                                  chosen=False)
        want = _batch.query_tiles(qsl, t, tokens)
        assert slots == want[3] and union is None and count is None and bits is None
        for a, b in zip((seq, start, end), want[:3]):
            assert torch.equal(a.cpu(), b)
        (got,) = lists  # the dense attention's and the indexer's tiles: what tile_lists gave tile_plan
        assert got[3] == want[3] and all(torch.equal(a.cpu(), b) for a, b in zip(got[:3], want[:3]))
        lists.clear()


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("setting", ["defaults", "without-bits"])
def test_a_4k_prefill_launch_dispatches_few_host_ops(monkeypatch, setting):
    """A 4096-token prompt at M3's per-layer dims (64 / 4 heads of 128, blocks and pages of 128, top-16), bf16, with
    both Triton launches replaced by recorders: the launcher dispatches at most 8 tensor ops (the output, the plan's
    buffers) and launches the plan and the attention kernel once each, with the default's chooser bits and with the
    same tile without them. The plan's torch chains were 109 ops for this launch with the bits (71 without), each a
    device kernel dispatched from Python."""
    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, grid, kwargs))

    monkeypatch.setattr(SPA, "_sparse_paged_attention", Recorder("attention"))
    monkeypatch.setattr(TP, "_tile_plan", Recorder("plan"))
    t, hq, hkv, d, bs, k = 4096, 64, 4, 128, 128, 16
    pages = t // bs
    q = torch.empty(t, hq, d, dtype=torch.bfloat16)
    kc = torch.empty(pages, bs, hkv, d, dtype=torch.bfloat16)
    bt = torch.arange(pages, dtype=torch.int32)[None]
    qsl = torch.tensor([0, t], dtype=torch.int32)
    positions = torch.arange(t)
    sel = torch.zeros(t, hkv, k, dtype=torch.int32)
    without_bits = SPA.VARIANTS["prefill"]["union_tma_lean_rescale-t4-n64-w4-s3-waves2"]
    config = None if setting == "defaults" else {"prefill": without_bits}
    with _Ops() as seen:
        SPA.forward(q, kc, kc, bt, qsl, torch.tensor([t], dtype=torch.int32), positions, sel, bs, d**-0.5,
                    config=config)
    assert [name for name, *_ in launches] == ["plan", "attention"]
    assert launches[0][1] == launches[1][1][:2] == (t // 4 + 1, hkv)  # 4-token tiles (one slot spare), KV heads
    assert launches[0][2]["CHOSEN"] == launches[1][2]["CHOSEN"] == (setting == "defaults")
    assert sum(seen.ops.values()) <= 8, dict(seen.ops)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled launches and CUDA graphs need a GPU")
def test_plan_at_m3_sizes_replays_from_a_cuda_graph():
    """M3's per-layer sizes (4 KV heads, top-16, blocks of 128), compiled: a 16k-token prompt beside a 1000-token
    one and three decode tokens, tiles of 4 and 8 tokens, bit for bit against the torch definitions; then the
    plan captured in a CUDA graph and replayed after the selections changed in place (same shapes), bit for bit
    again, so nothing of it is decided on the host from the data."""
    dev, bs, k = torch.device("cuda"), 128, 16
    new = [16384, 1000, 1, 1, 1]
    qsl, positions, sel = _batch_of(new, k, bs, seed=11, hkv=4)
    sel = torch.where(torch.rand(sel.shape) < 0.1, -1, sel).to(torch.int32)
    qsl, positions, sel = qsl.to(dev), positions.to(dev), sel.to(dev)
    t = sel.shape[0]

    def check(got, tokens):
        seq, start, end, slots, union, count, bits = got
        want = _batch.query_tiles(qsl, t, tokens)
        assert slots == want[3] and all(torch.equal(a, b) for a, b in zip((seq, start, end), want[:3]))
        want_union, want_count = TP.tile_unions(sel, positions, start, end, tokens, bs)
        assert torch.equal(union, want_union) and torch.equal(count, want_count)
        assert torch.equal(bits, TP.union_choosers(sel, positions, start, end, tokens, bs, want_union))

    for tokens in (4, 8):
        check(TP.tile_plan(qsl, sel, positions, t, tokens, bs, union=True, chosen=True), tokens)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = TP.tile_plan(qsl, sel, positions, t, 4, bs, union=True, chosen=True)
    sel.copy_(torch.roll(sel, 1, dims=2))  # other selections, the same shapes
    sel[::7] = -1
    graph.replay()
    torch.cuda.synchronize()
    check(got, 4)
