"""CUDA-graph decode (``runtime/backends/cuda_graph.py``): bucket choice, and the padded decode shapes a graph
replays, run eagerly on the CPU against the unpadded step and the cache-free greedy reference. Capture and replay
themselves need CUDA (``gpu`` test)."""

import pytest
import torch

from m3export.model.batch import Batch
from m3export.runtime import Engine, SamplingParams
from m3export.runtime.backends.cuda_graph import GraphedTorchBackend, collector_paused, mtp_step_shape, step_shape
from tests.runtime_fixtures import model, prompts, reference, tiny_model  # noqa: F401  (fixtures)

PAGE = 4


def test_step_shape():
    buckets = (1, 2, 4, 8)

    def shape(counts, sampled=None):
        ids = torch.zeros(sum(counts), dtype=torch.int64)
        batch = _batch([[2 * i, 2 * i + 1] for i in range(len(counts))], [0] * len(counts), counts)
        rows = torch.arange(sum(counts)) if sampled is None else torch.tensor(sampled)
        return step_shape(ids, batch, rows, buckets, page_size=PAGE)

    assert shape([1]) == (1, 1)
    assert shape([1, 1, 1]) == (4, 1)
    assert shape([1] * 8) == (8, 1)
    assert shape([1] * 9) is None  # past the largest bucket: eager
    assert shape([3, 3]) == (2, 3)  # MTP verification of 2 drafts per sequence
    assert shape([2, 4]) is None  # uneven: prefill, mixed or uneven drafts
    assert shape([5, 5]) is None  # more tokens per sequence than a page holds (padding lives in one page)
    assert shape([3, 2]) is None
    assert shape([4, 1]) is None  # 5 tokens over 2 sequences
    assert shape([2, 2], sampled=[1, 3]) is None  # a prefill chunk pair: only the last tokens sampled


def test_mtp_step_shape():
    buckets = (1, 2, 4)

    def shape(counts, rows):
        ids = torch.zeros(sum(counts), dtype=torch.int64)
        batch = _batch([[2 * i, 2 * i + 1] for i in range(len(counts))], [0] * len(counts), counts)
        return mtp_step_shape(ids, batch, torch.arange(rows), buckets, page_size=PAGE)

    assert shape([1, 1, 1], 3) == (4, 1, True)  # a chain step: one draft position per request, logits for each
    assert shape([1, 1], 0) == (2, 1, False)  # a module only writing its cache
    assert shape([1, 1], 1) == (2, 1, True)  # logits for the drafting request only
    assert shape([3], 1) == (1, 3, True)  # one request's catch-up over 3 kept positions, logits at the last
    assert shape([2, 2], 2) == (2, 2, True)  # two requests that kept 2 positions each
    assert shape([2, 2], 0) == (2, 2, False)
    assert shape([2, 2], 3) is None  # more logits rows than sequences: not a drafter's call
    assert shape([2, 1, 1], 3) is None  # uneven catch-up: eager
    assert shape([5], 1) is None  # more positions than a page holds (padding lives in one page)
    assert shape([1] * 5, 5) is None  # past the largest bucket


def _batch(tables, starts, counts):
    """A flattened batch of len(tables) sequences, each with counts[i] new tokens from position starts[i]."""
    pos, slots, qsl, lens = [], [], [0], []
    for pages, s, n in zip(tables, starts, counts):
        for p in range(s, s + n):
            pos.append(p)
            slots.append(pages[p // PAGE] * PAGE + p % PAGE)
        qsl.append(qsl[-1] + n)
        lens.append(s + n)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return Batch(torch.tensor(pos), torch.tensor(qsl, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), bt,
                 torch.tensor(slots))


def test_padded_decode_equals_unpadded_and_leaves_real_pages_alone(model):
    be = GraphedTorchBackend(model, use_graphs=False, pad_eagerly=True, buckets=(4,))
    be.allocate(num_pages=6, page_size=PAGE)
    tables = [[0, 1], [2]]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (8,), generator=g)
    be.forward(ids, _batch(tables, [0, 0], [5, 3]), torch.tensor([4, 7]))  # prefill: eager, unpadded
    saved = [[c.clone() for c in layer] for layer in be._caches]
    step_ids = torch.tensor([11, 12])
    step = _batch(tables, [5, 3], [1, 1])
    logits, hidden = be.forward(step_ids, step, torch.tensor([0, 1]))  # bucket 4: two padding rows
    padded_caches = [[c.clone() for c in layer] for layer in be._caches]
    for layer, keep in zip(be._caches, saved):
        for c, k in zip(layer, keep):
            c.copy_(k)
    be.pad_eagerly = False
    want_logits, want_hidden = be.forward(step_ids, step, torch.tensor([0, 1]))
    assert logits.shape == want_logits.shape and hidden.shape == want_hidden.shape
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-10)  # float64 model: same sums, any blocking
    torch.testing.assert_close(hidden, want_hidden, rtol=0, atol=1e-10)
    written = step.slot_mapping
    for layer_p, layer_u in zip(padded_caches, be._caches):
        for p, u in zip(layer_p, layer_u):
            # Pages 0-5 are the engine's (page 6 is the scratch page): only this step's two slots changed, to the
            # same values up to float64 rounding (a batch of 4 rows may block its products differently).
            p, u = p[:6].flatten(0, 1), u[:6].flatten(0, 1)
            others = torch.ones(p.shape[0], dtype=torch.bool)
            others[written] = False
            assert torch.equal(p[others], u[others])
            torch.testing.assert_close(p[written], u[written], rtol=0, atol=1e-12)


def test_padded_verify_step_equals_unpadded(model):
    # An MTP verification shape: 2 sequences x 3 tokens, padded to a bucket of 4 sequences on the scratch page.
    be = GraphedTorchBackend(model, use_graphs=False, pad_eagerly=True, buckets=(4,))
    be.allocate(num_pages=6, page_size=PAGE)
    tables = [[0, 1, 2], [3, 4]]
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1))
    be.forward(ids[:8], _batch(tables, [0, 0], [5, 3]), torch.tensor([4, 7]))
    saved = [[c.clone() for c in layer] for layer in be._caches]
    step = _batch(tables, [5, 3], [3, 3])
    rows = torch.arange(6)
    logits, hidden = be.forward(ids[:6], step, rows)
    for layer, keep in zip(be._caches, saved):
        for c, k in zip(layer, keep):
            c.copy_(k)
    be.pad_eagerly = False
    want_logits, want_hidden = be.forward(ids[:6], step, rows)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-10)  # float64 model
    torch.testing.assert_close(hidden, want_hidden, rtol=0, atol=1e-10)


@pytest.mark.parametrize("counts,rows", [
    ([1, 1, 1], [0, 1, 2]), ([1, 1, 1], []), ([1, 1, 1], [1]), ([3, 3, 2], [2, 5, 7]), ([3, 3, 2], [5]),
    ([2, 2, 2], []), ([3, 1, 2], [2, 3, 5]), ([3, 1, 2], [5, 2]), ([2, 1, 2], []), ([1, 3, 1], [3])],
    ids=["chain", "chain-cache-only", "chain-one-drafting", "catch-up-uniform-q", "catch-up-one-drafting",
         "catch-up-cache-only", "catch-up-uneven", "catch-up-uneven-rows-reordered", "catch-up-uneven-cache-only",
         "catch-up-uneven-one-drafting"])
def test_padded_mtp_step_equals_unpadded(model, counts, rows):
    """An MTP step of 3 sequences of counts[i] tokens each (1: a chain step; more: the catch-up over the positions
    each request kept after a verify step) padded to a bucket of 4 on the scratch page, logits at the last entry of
    the drafting requests (in the order asked) or none: same logits and output hidden as the unpadded step, and the
    same entries in the module's cache (the scratch page aside). Uneven counts run as one bucket call per count."""
    be = GraphedTorchBackend(model, use_graphs=False, pad_eagerly=True, buckets=(4,))
    be.allocate(num_pages=6, page_size=PAGE)
    g = torch.Generator().manual_seed(2)
    tables = [[0, 1, 2], [3, 4], [5]]
    hidden = torch.randn(10, model.config.hidden_size, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 256, (10,), generator=g)
    be.mtp_forward(0, ids, hidden, _batch(tables, [0, 0, 0], [5, 3, 2]), torch.tensor([4, 7, 9]))  # prompt: eager
    assert be.padded_mtp_steps == 0 and be.eager_mtp_steps == 1
    saved = [c.clone() for c in be._mtp_caches[0]]
    step = _batch(tables, [5, 3, 2], counts)
    rows = torch.tensor(rows, dtype=torch.int64)
    t = sum(counts)
    step_ids, step_hidden = torch.arange(21, 21 + t), hidden[:t] * 0.5
    logits, out = be.mtp_forward(0, step_ids, step_hidden, step, rows)
    assert be.padded_mtp_steps == len(set(counts)) and be.eager_mtp_steps == 1
    padded_cache = [c[:6].clone() for c in be._mtp_caches[0]]
    for c, k in zip(be._mtp_caches[0], saved):
        c.copy_(k)
    be.pad_eagerly = False
    want_logits_, want_out = be.mtp_forward(0, step_ids, step_hidden, step, rows)
    assert be.eager_mtp_steps == 2
    assert logits.shape == want_logits_.shape == (len(rows), model.config.vocab_size)
    torch.testing.assert_close(logits, want_logits_, rtol=0, atol=1e-10)  # float64 model: rounding of blocking
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-10)
    for p, u in zip(padded_cache, be._mtp_caches[0]):
        torch.testing.assert_close(p, u[:6], rtol=0, atol=1e-12)


def test_failed_captures_fall_back_to_eager_steps(model, monkeypatch):
    """A capture that fails (an op synchronising with the host) gives the eager result of that very step; an MTP
    shape failing turns off only the MTP graphs, a target shape all graphs (and batches go back to the device)."""
    be = GraphedTorchBackend(model, use_graphs=True, buckets=(4,))
    be.allocate(num_pages=6, page_size=PAGE)

    def refuse(step):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(be, "_capture", refuse)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # no CUDA here
    tables = [[0, 1], [2]]
    hidden = torch.randn(2, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    step, ids = _batch(tables, [5, 3], [1, 1]), torch.tensor([21, 22])
    saved = [c.clone() for c in be._mtp_caches[0]]
    logits, out = be.mtp_forward(0, ids, hidden, step, torch.arange(2))
    assert not be.mtp_graphs and be.use_graphs and be.batch_device == torch.device("cpu")
    for c, k in zip(be._mtp_caches[0], saved):
        c.copy_(k)
    want_logits, want_out = be.mtp_forward(0, ids, hidden, step, torch.arange(2))  # plainly eager now
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=0)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    logits, _ = be.forward(ids, step, torch.arange(2))
    assert not be.use_graphs and be.batch_device == be.device and be.replays == 0
    assert logits.shape == (2, model.config.vocab_size)


def test_capture_runs_with_the_garbage_collector_off(model, monkeypatch):
    """The capture itself (not the warm-up before it) runs with Python's cyclic collector off, and the collector is
    back on after it, whether the capture ends or raises: a collection inside a capture can run a finalizer whose
    CUDA call is illegal while a stream captures, which aborts the process (``collector_paused``). The CUDA
    calls are stood in for (no CUDA here); the step reports the collector's state in each of its two runs."""
    import contextlib
    import gc

    class Fake:
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Fake)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Fake())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None: contextlib.nullcontext())
    be = GraphedTorchBackend(model, use_graphs=True, buckets=(4,))
    seen = []

    def step():
        seen.append(gc.isenabled())
        return "outs"

    assert gc.isenabled()
    graph, outs = be._capture(step)
    assert seen == [True, False] and outs == "outs" and gc.isenabled()

    def failing():
        seen.append(gc.isenabled())
        if len(seen) > 3:
            raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="capturing"):
        be._capture(failing)
    assert seen[2:] == [True, False] and gc.isenabled()


def test_collector_paused_leaves_a_disabled_collector_disabled():
    """A caller that turned the collector off keeps it off after the block."""
    import gc

    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_capture_shapes_captures_every_decode_shape_on_padding_alone(model, monkeypatch):
    """``capture_shapes`` (what a benchmark calls before measuring): one graph per (bucket, q) target shape and per
    (module, bucket, q, logits wanted) MTP shape up to the bucket that holds ``max_batch``, each captured from a
    step of padding only, which writes nothing of the engine's pages. The capture itself is CUDA's: here a fake
    one runs the step once, as the real one's warm-up does."""

    class Replayed:
        def replay(self):
            pass

    def capture(step):
        with torch.inference_mode():
            return Replayed(), step()

    be = GraphedTorchBackend(model, use_graphs=True, buckets=(1, 2, 4, 8))
    be.allocate(num_pages=6, page_size=PAGE)
    monkeypatch.setattr(be, "_capture", capture)
    g = torch.Generator().manual_seed(5)
    for layer in be._caches + be._mtp_caches:
        for c in layer:
            c.copy_(torch.randn(c.shape, generator=g, dtype=torch.float64).to(c.dtype))
    saved = [[c.clone() for c in layer] for layer in be._caches + be._mtp_caches]
    modules = model.config.num_mtp_modules
    assert be.capture_shapes(max_batch=3, max_tokens_per_sequence=3, mtp_modules=modules) == 3 * 3 * (1 + 2 * modules)
    assert set(be._graphs) == {(b, q) for b in (1, 2, 4) for q in (1, 2, 3)} | {
        ("mtp", m, b, q, w) for m in range(modules) for b in (1, 2, 4) for q in (1, 2, 3) for w in (True, False)}
    assert be.capture_shapes(max_batch=3, max_tokens_per_sequence=3, mtp_modules=modules) == 0  # all there
    assert be.capture_shapes(max_batch=1, max_tokens_per_sequence=PAGE + 2) == PAGE - 3  # q stops at a page
    pools = [(c, k) for layer, keep in zip(be._caches + be._mtp_caches, saved) for c, k in zip(layer, keep)]
    assert all(torch.equal(c[:6], k[:6]) for c, k in pools)  # pages 0-5 are the engine's ...
    assert all(not torch.equal(c[6], k[6]) for c, k in pools)  # ... the steps wrote the scratch page, every pool


def test_engine_on_padded_speculative_decode_matches_reference(model, reference):
    # k = 2 drafts: verification steps are (bucket, 3) shapes whenever every sequence drafts 2; the last steps
    # (fewer drafts near max_tokens) and the prefills run eagerly. Greedy output must equal full recomputation.
    be = GraphedTorchBackend(model, use_graphs=False, pad_eagerly=True, buckets=(1, 2, 4))
    eng = Engine(be, page_size=PAGE, num_pages=64, max_num_seqs=3, num_speculative_tokens=2)
    ps = prompts(3, seed=5)
    outs = eng.generate(ps, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outs] == [reference(tuple(p), 8) for p in ps]
    assert eng.stats.verify_steps > 0
    assert be.padded_mtp_steps > 0  # the drafter's chain steps ran in bucket shapes too
    assert be.batch_device == torch.device("cpu")  # the engine hands this backend host batches


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_rounds_run_no_eager_step(k):
    """The graphed backend's speculative decode: after the prompt's step (target prefill, and each used module's
    catch-up over the prompt), every target call (verify) and every MTP call (catch-up over the kept positions,
    chain steps) is a bucket shape, i.e. a graph replay on a GPU; none falls back to an eager step, which on the
    H200 cost about an eager decode step each and made speculation 4x slower than plain graphed decode. Run on
    the embedded trained model (drafts are accepted, so catch-ups cover several positions), in float32 on the
    CPU with the padded shapes run eagerly (``pad_eagerly``: the inputs a graph sees); greedy output must equal
    the plain engine's."""
    import m3export
    from m3export.embedded import default_model

    ckpt = default_model()
    m = m3export.load_model(ckpt, dtype=torch.float32, progress=False)
    prompt = list(range(40, 72))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = Engine(GraphedTorchBackend(m, use_graphs=False), num_pages=64).generate([prompt], params)
    be = GraphedTorchBackend(m, use_graphs=False, pad_eagerly=True)
    eng = Engine(be, num_pages=64, num_speculative_tokens=k)
    out = eng.generate([prompt], params)
    assert out[0].token_ids == plain[0].token_ids
    assert eng.stats.accepted_tokens > 0, "no draft accepted: the catch-up over several positions went untested"
    assert be.eager_steps == 1, "a verify step ran eagerly"
    assert be.eager_mtp_steps == eng.drafter.modules_used, "an MTP step of a speculative round ran eagerly"
    assert be.padded_mtp_steps > 0


def test_speculative_batch_runs_no_eager_mtp_step():
    """Three requests at once with k = 2: after a verify step they keep different numbers of positions, and the
    catch-up runs as one bucket call per count (a graph replay each on a GPU), never eagerly after the prompts';
    greedy output equals the plain engine's."""
    import m3export
    from m3export.embedded import default_model

    m = m3export.load_model(default_model(), dtype=torch.float32, progress=False)
    ps = [list(range(40 + 7 * i, 72 + 7 * i)) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = Engine(GraphedTorchBackend(m, use_graphs=False), num_pages=64).generate(ps, params)
    be = GraphedTorchBackend(m, use_graphs=False, pad_eagerly=True)
    eng = Engine(be, num_pages=64, num_speculative_tokens=2)
    outs = eng.generate(ps, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert eng.stats.accepted_tokens > 0
    assert be.eager_mtp_steps == eng.drafter.modules_used, "an MTP step of a speculative round ran eagerly"


def test_engine_on_padded_decode_matches_reference(model, reference):
    be = GraphedTorchBackend(model, use_graphs=False, pad_eagerly=True, buckets=(2, 4))
    eng = Engine(be, page_size=PAGE, num_pages=64, max_num_seqs=3)
    ps = prompts(3, seed=3)
    outs = eng.generate(ps, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == [reference(tuple(p), 6) for p in ps]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [0, 2], ids=["no-spec", "mtp-k2"])
def test_gpu_graphs_replay_the_same_tokens(k):
    """Decode steps, and with speculation (k = 2) the verify steps and the MTP chain steps, replayed from graphs
    give the eager tokens, greedy and seeded sampling alike (fp32 tiny model: graph and eager run the same
    kernels; sampling draws on the device from the same positional uniforms)."""
    from m3export.plugins.kernels import kernels, register

    missing = {"m3::paged_attention", "m3::sparse_paged_attention", "m3::lightning_indexer", "m3::moe"} - set(kernels())
    if missing:
        pytest.skip(f"no Triton kernel yet for {sorted(missing)}: the reference ops cannot be captured")
    register()
    m = tiny_model().float().cuda()
    ps = prompts(3, seed=4)
    kw = dict(page_size=PAGE, num_pages=64, num_speculative_tokens=k)
    for params in (SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True)):
        eager = Engine(GraphedTorchBackend(m, use_graphs=False), **kw).generate(ps, params)
        be = GraphedTorchBackend(m, use_graphs=True)
        graphed = Engine(be, **kw).generate(ps, params)
        assert be.use_graphs and be.replays > 0, "decode steps did not run from graphs"
        assert k == 0 or be.mtp_replays > 0, "MTP chain steps did not run from graphs"
        # One prefill step for the three prompts, whose catch-up (up to 40 positions, past a page) is the only MTP
        # step that may run eagerly: the catch-ups after verify steps (1-3 positions) replay.
        assert k == 0 or be.eager_mtp_steps == 1, f"{be.eager_mtp_steps} MTP steps ran eagerly"
        assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [0, 2], ids=["no-spec", "mtp-k2"])
def test_gpu_mini_kernels_and_graphs_generate_the_reference_tokens(k):
    # The end-to-end criterion: the `mini` model (real per-layer dims) with every kernel and CUDA graphs
    # generates the same 64 greedy tokens as the reference ops, with and without MTP speculation. fp32 activations
    # keep the two within ~1e-6 of each other, far below the logit gaps greedy decoding has to resolve on random
    # weights; random weights are drawn on the GPU (the preset's own initialiser works on the CPU, minutes here).
    import math

    from m3export.checkpoint.loader import build_empty
    from m3export.config import preset
    from m3export.plugins.kernels import kernels, references, register

    missing = {"m3::paged_attention", "m3::sparse_paged_attention", "m3::lightning_indexer", "m3::moe"} - set(kernels())
    if missing:
        pytest.skip(f"no Triton kernel yet for {sorted(missing)}: the reference ops cannot be captured")
    register()
    model = build_empty(preset("mini"), torch.float32, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.01 if "correction_bias" in name or p.dim() < 2 else 1 / math.sqrt(p.shape[-1]),
                      generator=g)
    ps = [list(range(1, 300)), list(range(1000, 1037))]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    kw = dict(page_size=64, num_pages=64, num_speculative_tokens=k)
    with references():
        want = [o.token_ids for o in Engine(GraphedTorchBackend(model, use_graphs=False), **kw).generate(ps, params)]
    be = GraphedTorchBackend(model, use_graphs=True)
    got = [o.token_ids for o in Engine(be, **kw).generate(ps, params)]
    assert be.use_graphs and be.replays > 0, "decode steps did not run from graphs"
    assert k == 0 or be.mtp_replays > 0, "MTP chain steps did not run from graphs"
    assert got == want


@pytest.mark.parametrize("counts", [[3, 1, 2], [1, 3], [2, 1, 1, 1]], ids=["3-1-2", "1-3", "2-1-1-1"])
def test_padded_ragged_verify_step_equals_unpadded(model, counts):
    """A verify step whose requests verify different numbers of drafts (counts[i] tokens, all sampled) padded to
    the bucket's tokens per sequence, the short sequences' extra rows masked (scratch-page slots, positions after
    their own): the same logits and hidden at the real rows as the unpadded step, and the same writes into the
    engine's pages (only the step's own slots change)."""
    be = GraphedTorchBackend(model, use_graphs=False, pad_eagerly=True, buckets=(4,))
    be.allocate(num_pages=8, page_size=PAGE)
    tables = [[0, 1, 2], [3, 4], [5, 6], [7]][:len(counts)]
    starts = [5, 3, 4, 1][:len(counts)]
    g = torch.Generator().manual_seed(6)
    for layer in be._caches:  # a context already in the pages
        for c in layer:
            c.copy_(torch.randn(c.shape, generator=g, dtype=torch.float64).to(c.dtype))
    saved = [[c.clone() for c in layer] for layer in be._caches]
    step = _batch(tables, starts, counts)
    ids = torch.randint(0, 256, (sum(counts),), generator=g)
    rows = torch.arange(sum(counts))
    logits, hidden = be.forward(ids, step, rows)
    assert be.ragged_verify_steps == 1 and be.eager_steps == 0
    padded = [[c[:8].clone() for c in layer] for layer in be._caches]
    for layer, keep in zip(be._caches, saved):
        for c, k in zip(layer, keep):
            c.copy_(k)
    be.pad_eagerly = False
    want_logits, want_hidden = be.forward(ids, step, rows)
    assert be.eager_steps == 1
    assert logits.shape == want_logits.shape and hidden.shape == want_hidden.shape
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-10)  # float64 model: rounding of blocking
    torch.testing.assert_close(hidden, want_hidden, rtol=0, atol=1e-10)
    written = step.slot_mapping
    for layer_p, layer_u in zip(padded, be._caches):
        for p, u in zip(layer_p, layer_u):
            p, u = p.flatten(0, 1), u[:8].flatten(0, 1)
            others = torch.ones(p.shape[0], dtype=torch.bool)
            others[written] = False
            assert torch.equal(p[others], u[others])  # the masked rows wrote nothing of the engine's pages
            torch.testing.assert_close(p[written], u[written], rtol=0, atol=1e-12)


def test_ragged_verify_steps_of_a_batch_run_padded():
    """Requests that draft different numbers of tokens in the same step (one nearing its max_tokens drafts
    fewer) verify in one padded bucket step, not an eager one; greedy output equals the plain engine's. Embedded
    trained model (drafts are accepted), float32, padded shapes run eagerly (``pad_eagerly``)."""
    import m3export
    from m3export.embedded import default_model

    m = m3export.load_model(default_model(), dtype=torch.float32, progress=False)
    ps = [list(range(40 + 7 * i, 72 + 7 * i)) for i in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, 12, 16)]
    plain = Engine(GraphedTorchBackend(m, use_graphs=False), num_pages=64).generate(ps, params)
    be = GraphedTorchBackend(m, use_graphs=False, pad_eagerly=True)
    eng = Engine(be, num_pages=64, num_speculative_tokens=3)
    outs = eng.generate(ps, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert be.ragged_verify_steps > 0, "no verify step had unequal draft counts: the test lost its point"
    assert be.eager_steps == 1, f"{be.eager_steps - 1} verify steps ran eagerly"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_ragged_verify_steps_replay_the_eager_tokens():
    """Verify steps of unequal draft counts (requests with different max_tokens draft fewer near their end)
    replay the (bucket, most drafts + 1) graph with masked rows; greedy tokens equal the eager engine's (fp32 tiny
    model, same kernels)."""
    from m3export.plugins.kernels import kernels, register

    missing = {"m3::paged_attention", "m3::sparse_paged_attention", "m3::lightning_indexer", "m3::moe"} - set(kernels())
    if missing:
        pytest.skip(f"no Triton kernel yet for {sorted(missing)}: the reference ops cannot be captured")
    register()
    m = tiny_model(num_mtp_modules=2).float().cuda()
    ps = prompts(3, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, 12, 16)]
    kw = dict(page_size=PAGE, num_pages=64, num_speculative_tokens=3)
    eager = Engine(GraphedTorchBackend(m, use_graphs=False), **kw).generate(ps, params)
    be = GraphedTorchBackend(m, use_graphs=True)
    graphed = Engine(be, **kw).generate(ps, params)
    assert be.use_graphs and be.ragged_verify_steps > 0, "no ragged verify step replayed"
    assert be.eager_steps == 1, f"{be.eager_steps - 1} verify steps ran eagerly"
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
