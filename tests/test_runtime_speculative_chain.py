"""A greedy speculative round replayed as one MTP chain (``Backend.mtp_chain``, ``drafter.chain_plan``) against the
drafter's calls one by one: the same calls, the same tokens, the same MTP caches, and the host work of a round
counted (never timed). On the H200 the embedded model's graphed round made k + 1 backend calls, each building a
batch in Python, so a round cost ~3.5 plain steps of host work and speculation ran at 0.64-0.73x of plain decode;
with the chain a round is the verify call and one chain call, one batch each.

On the CPU the graphed backend's padded shapes run eagerly (``pad_eagerly``: the inputs a graph sees, the chain's
slicing included); the GPU test replays the captured graphs."""

import collections

import pytest
import torch

from m3export.model.batch import Segment, build_batch
from m3export.runtime import Engine, SamplingParams
from m3export.runtime import device_drafts, drafter, engine as engine_module
from m3export.runtime.backends.cuda_graph import GraphedTorchBackend
from m3export.runtime.drafter import chain_plan


@pytest.fixture(scope="module")
def trained():
    """The embedded trained model in float32 (two MTP modules): its drafts are accepted, so rounds keep several
    positions and the chain's catch-up spans vary."""
    import m3export
    from m3export.embedded import default_model

    return m3export.load_model(default_model(), dtype=torch.float32, progress=False)


PROMPTS = [list(range(40 + 7 * i, 72 + 7 * i)) for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _one_by_one(backend: GraphedTorchBackend) -> GraphedTorchBackend:
    """The backend declining every chain: the drafter makes its calls one by one (the path before chains)."""
    backend.mtp_chain = lambda *args: None
    return backend


def _mtp_pools(backend: GraphedTorchBackend) -> list[torch.Tensor]:
    """Every MTP pool without the scratch page(s) past the engine's pages (padding rows write there)."""
    return [p[:backend._scratch_page] for cache in backend._mtp_caches for p in cache]


def test_chain_plan_is_the_calls_the_drafter_makes(trained, monkeypatch):
    """One request on the two-module model, the drafter calling the modules one by one: each round's calls (module,
    first and end position relative to the first kept one) are ``chain_plan`` of the round's kept positions and
    drafts, the catch-up that a module drafting nothing owes included (k = 1: module 1 never runs; a request
    near max_tokens drafts fewer than k)."""
    rounds = []
    run, mtp_forward = drafter.MTPDrafter.run, GraphedTorchBackend.mtp_forward

    def recorded_run(self, jobs):
        rounds.append(([(len(j.hidden), j.num_drafts, j.start) for j in jobs], []))
        return run(self, jobs)

    def recorded_call(self, module, input_ids, hidden, batch, logits_indices):
        rounds[-1][1].append((module, int(batch.positions[0]), int(batch.positions[-1]) + 1))
        return mtp_forward(self, module, input_ids, hidden, batch, logits_indices)

    monkeypatch.setattr(drafter.MTPDrafter, "run", recorded_run)
    monkeypatch.setattr(GraphedTorchBackend, "mtp_forward", recorded_call)
    checked = collections.Counter()
    for k in (1, 2, 3):
        eng = Engine(_one_by_one(GraphedTorchBackend(trained, use_graphs=False, pad_eagerly=True)), num_pages=64,
                     num_speculative_tokens=k)
        rounds.clear()
        eng.generate(PROMPTS[:1], GREEDY)
        for jobs, calls in rounds:
            if not jobs or jobs[0][1] == 0:  # a finished request's step, or nothing to draft
                continue
            [(q, drafts, start)] = jobs
            plan = chain_plan(q, drafts, 2, min(2, k))
            assert [(m, start + lo, start + hi) for m, lo, hi in plan.calls] == calls, (k, q, drafts)
            checked[(k, q > 1, drafts < k)] += 1
    assert all(checked[(k, True, False)] for k in (1, 2, 3)), checked  # rounds after accepted drafts
    assert any(short for (_, _, short) in checked), checked  # and a round of fewer drafts


def test_chain_plan_of_one_module_and_of_three():
    """Hand-derived: with one module every call is module 0 over what it owes (the kept positions, then the
    chain's one position each); with three modules and k = 2 the third module still writes its catch-up."""
    assert chain_plan(2, 3, 1, 1).calls == ((0, 0, 2), (0, 2, 3), (0, 3, 4))
    assert chain_plan(3, 2, 3, 3).calls == ((0, 0, 3), (1, 0, 4), (2, 0, 3))
    assert chain_plan(1, 3, 2, 2).calls == ((0, 0, 1), (1, 0, 2), (0, 1, 3))
    with pytest.raises(ValueError, match="k=0"):
        chain_plan(1, 0, 2, 2)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_replayed_chain_writes_and_drafts_what_the_calls_do(trained, k, batch):
    """Greedy tokens equal plain decode's; the acceptance (the drafts) and every MTP cache entry equal those of
    the same engine making its calls one by one; rounds did run as chains (batch 3: those whose requests kept as
    many positions; the others one by one)."""
    plain = Engine(GraphedTorchBackend(trained, use_graphs=False), num_pages=64).generate(PROMPTS[:batch], GREEDY)
    engines = {}
    for chained in (True, False):
        be = GraphedTorchBackend(trained, use_graphs=False, pad_eagerly=True)
        eng = Engine(be if chained else _one_by_one(be), num_pages=64, num_speculative_tokens=k,
                     max_num_seqs=batch)
        outs = eng.generate(PROMPTS[:batch], GREEDY)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        engines[chained] = eng
    chain, calls = engines[True], engines[False]
    assert chain.backend.chain_replays > 0 and calls.backend.chain_replays == 0
    assert (chain.stats.verify_steps, chain.stats.accepted_tokens) == \
        (calls.stats.verify_steps, calls.stats.accepted_tokens)
    assert chain.stats.accepted_tokens > 0
    for a, b in zip(_mtp_pools(chain.backend), _mtp_pools(calls.backend), strict=True):
        assert torch.equal(a, b)  # the same ops on the same values (CPU, same shapes): bit for bit


def test_sampled_rounds_keep_the_calls(trained):
    """A sampling request's drafts are drawn (and their distributions kept for rejection sampling): its rounds are
    the drafter's calls, never a chain."""
    be = GraphedTorchBackend(trained, use_graphs=False, pad_eagerly=True)
    eng = Engine(be, num_pages=64, num_speculative_tokens=2)
    eng.generate(PROMPTS[:1], SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True))
    assert be.chain_replays == 0 and eng.stats.verify_steps > 0


@pytest.mark.parametrize("k", [2, 3])
def test_a_greedy_round_is_two_backend_calls_two_batches_and_one_read(trained, monkeypatch, k):
    """Host work of one request's decode steps, counted per step: one target call and one device-to-host read (the
    decision); a drafting step one chain call and no other MTP call, two batches built (the verify step's and the
    chain's). Before the chain a round of k drafts made k MTP calls and k + 1 batches."""
    counts = collections.Counter()

    def counting(name, inner):
        def call(*args, **kwargs):
            counts[name] += 1
            return inner(*args, **kwargs)

        return call

    for module in (engine_module, drafter):
        monkeypatch.setattr(module, "build_batch", counting("build_batch", build_batch))
    be = GraphedTorchBackend(trained, use_graphs=False, pad_eagerly=True)
    for name in ("forward", "mtp_forward", "mtp_chain"):
        setattr(be, name, counting(name, getattr(be, name)))
    eng = Engine(be, num_pages=64, num_speculative_tokens=k)
    eng.add_request("r", PROMPTS[0], GREEDY)
    eng.step()  # the prompt (its catch-up spans more than a page: the calls one by one)
    per_step = []
    while eng.has_unfinished():
        counts.clear()
        reads = sum(device_drafts.HOST_READS.values())
        eng.step()
        per_step.append((dict(counts), sum(device_drafts.HOST_READS.values()) - reads))
    assert eng.stats.accepted_tokens > 0
    for c, reads in per_step:
        assert c.get("forward") == 1 and reads == 1, per_step
        if c.get("mtp_chain"):
            assert c["mtp_chain"] == 1 and c.get("mtp_forward", 0) == 0 and c["build_batch"] == 2, per_step
    # every step drafted through a chain but the last two: one token of room left (nothing to draft: the modules'
    # catch-up alone, one call each), then the finished request's
    assert sum(1 for c, _ in per_step if not c.get("mtp_chain")) <= 2, per_step


def test_a_chain_of_a_batch_past_a_page_is_declined(trained):
    """q + k - 1 positions per sequence past a page (padding sequences hold theirs in one scratch page): None, so
    the drafter makes the calls itself."""
    be = GraphedTorchBackend(trained, use_graphs=False, pad_eagerly=True)
    Engine(be, num_pages=64)
    page = be._page_size
    ids, batch = build_batch([Segment([0, 1], 3, [5] * (page + 1))], page)
    hidden = torch.zeros(page, trained.config.hidden_size)
    assert be.mtp_chain(chain_plan(page, 2, 2, 2), ids, hidden, batch) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [2, 3])
def test_gpu_replayed_chain_equals_the_calls_one_by_one(k):
    """On the GPU with the kernels and CUDA graphs (embedded model, float32): the chain graph replays, its greedy
    tokens equal plain graphed decode's, and its acceptance (its drafts) and MTP caches equal those of the same
    engine replaying the calls one by one (the same kernels on the same shapes)."""
    import m3export
    from m3export.embedded import default_model
    from m3export.plugins.kernels import register

    register()
    m = m3export.load_model(default_model(), dtype=torch.float32, device="cuda", progress=False)
    kw = dict(num_pages=64, max_num_seqs=1)
    plain = Engine(GraphedTorchBackend(m, use_graphs=True), **kw).generate(PROMPTS, GREEDY)
    engines = {}
    for chained in (True, False):
        be = GraphedTorchBackend(m, use_graphs=True)
        eng = Engine(be if chained else _one_by_one(be), num_speculative_tokens=k, **kw)
        outs = eng.generate(PROMPTS, GREEDY)
        assert be.use_graphs and be.mtp_graphs, "graphs were turned off (a capture failed: see the log)"
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        engines[chained] = eng
    chain, calls = engines[True], engines[False]
    assert chain.backend.chain_replays > 0 and calls.backend.chain_replays == 0
    assert chain.backend.eager_mtp_steps == calls.backend.eager_mtp_steps  # the prompts' catch-ups only
    assert (chain.stats.verify_steps, chain.stats.accepted_tokens) == \
        (calls.stats.verify_steps, calls.stats.accepted_tokens)
    for a, b in zip(_mtp_pools(chain.backend), _mtp_pools(calls.backend), strict=True):
        assert torch.equal(a, b)
