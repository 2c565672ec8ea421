"""What the engine does on the host around each step, counted (never timed): on the H200 a graphed decode step of
``mini`` takes ~2.3 ms, so work that the engine repeats per step, or a wait for the device inside a speculative
round, is a visible share of it. Each test counts the thing that used to happen per step (a set rebuilt, a layer's
cache checked, a device-to-host read, a draft distribution copied) and checks the tokens still equal the plain
engine's or the reference's."""

import pytest
import torch

from m3export.model.attention import Attention
from m3export.runtime import Engine, SamplingParams
from m3export.runtime.backends.torch_backend import TorchBackend
from tests.runtime_fixtures import model, prompts, reference, tiny_model  # noqa: F401  (fixtures)

PAGE = 4


class CountingConfig:
    """The model's config with reads of ``eos_token_id`` counted (what the stop check of every token used)."""

    def __init__(self, cfg):
        self._cfg, self.eos_reads = cfg, 0

    def __getattr__(self, name):
        if name == "eos_token_id":
            self.eos_reads += 1
        return getattr(self._cfg, name)


def test_stop_ids_are_made_once_per_request_not_per_token(model, reference):
    eng = Engine(TorchBackend(model), page_size=PAGE, num_pages=64)
    counting = eng.config = CountingConfig(model.config)
    ps = prompts(2, seed=11)
    eos = model.config.eos_token_id[0]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[eos])]
    for i, (p, sp) in enumerate(zip(ps, params)):
        eng.add_request(f"r{i}", p, sp)
    added = counting.eos_reads
    assert added <= len(ps)
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert counting.eos_reads == added, "the stop ids were rebuilt during the steps"
    assert outs["r0"].token_ids == reference(tuple(ps[0]), 8)
    want = reference(tuple(ps[1]), 8)
    assert outs["r1"].token_ids == (want[:want.index(eos) + 1] if eos in want else want)


def test_layer_caches_are_checked_when_allocated_not_per_step(model, reference, monkeypatch):
    calls = []
    check = Attention.check_cache
    monkeypatch.setattr(Attention, "check_cache", lambda self, *a: calls.append(self) or check(self, *a))
    be = TorchBackend(model)
    eng = Engine(be, page_size=PAGE, num_pages=64)
    layers = model.config.num_hidden_layers + len(model.mtp)
    assert len(calls) == layers  # every layer's pools, main and MTP, once at allocate
    p = prompts(1, seed=12)[0]
    assert eng.generate([p], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].token_ids == \
        reference(tuple(p), 6)
    assert len(calls) == layers, "layer caches were checked again during the steps"


def test_a_malformed_cache_is_refused_at_allocate_naming_the_layer(monkeypatch):
    m = tiny_model(num_mtp_modules=1)
    allocate = m.allocate_caches

    def dense_pools_everywhere(*args, **kwargs):  # a sparse layer without its index-key pool
        return [c[:2] for c in allocate(*args, **kwargs)]

    monkeypatch.setattr(m, "allocate_caches", dense_pools_everywhere)
    sparse = next(i for i in range(m.config.num_hidden_layers) if m.config.is_sparse_layer(i))
    with pytest.raises(ValueError, match=f"layer {sparse} cache: expected 3 pools"):
        TorchBackend(m).allocate(8, PAGE)


class HostDraftsBackend(TorchBackend):
    """A backend that takes host token ids only (as ONNX Runtime's and TensorRT's do): the drafter reads every
    chain step's drafts back."""

    @property
    def takes_device_token_ids(self) -> bool:
        return False


@pytest.fixture(scope="module")
def model2():
    return tiny_model(num_mtp_modules=2)


def _reads_per_step(eng, ps, params):
    """Run the prompts to the end; the device-to-host reads (``device_drafts.HOST_READS``) of each step."""
    from m3export.runtime.device_drafts import HOST_READS

    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, params)
    per_step, outs = [], {}
    while eng.has_unfinished():
        before = HOST_READS.copy()
        for o in eng.step():
            outs[o.request_id] = o.token_ids
        per_step.append(HOST_READS - before)
    return per_step, [outs[f"r{i}"] for i in range(len(ps))]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [2, 3])
def test_a_speculative_round_reads_the_device_once(model2, k, temperature):
    """Drafts stay where the logits are between the MTP calls of a round and into the verify step, whose decision
    is the step's one read; before, each proposal was read back (1 + k reads a round), which is what a backend
    that takes host ids still gets. Both give the same tokens, greedy and seeded."""
    params = SamplingParams(temperature=temperature, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    ps = prompts(3, seed=30 + k, lo=5, hi=20)
    kw = dict(page_size=PAGE, num_pages=96, num_speculative_tokens=k, max_num_batched_tokens=64)
    dev = Engine(TorchBackend(model2), **kw)
    reads, outs = _reads_per_step(dev, ps, params)
    assert dev.stats.verify_steps > 0
    assert all(set(r) <= {"decide"} and r["decide"] <= 1 for r in reads), reads
    host = Engine(HostDraftsBackend(model2), **kw)
    host_reads, host_outs = _reads_per_step(host, ps, params)
    assert host_outs == outs
    assert max(r["propose"] for r in host_reads) == k  # the read-back path: one read per chain step


def test_penalised_requests_read_their_drafts_for_the_counts(model2):
    """A penalised request's verify rows count the drafts before them, so its drafts are read (once per round,
    with every other request of the round); the tokens equal the read-back path's."""
    params = SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=10, ignore_eos=True)
    ps = prompts(2, seed=41, lo=5, hi=20)
    kw = dict(page_size=PAGE, num_pages=96, num_speculative_tokens=2)
    reads, outs = _reads_per_step(Engine(TorchBackend(model2), **kw), ps, params)
    assert all(r["drafts"] <= 1 and r["decide"] <= 1 for r in reads) and any(r["drafts"] for r in reads)
    assert _reads_per_step(Engine(HostDraftsBackend(model2), **kw), ps, params)[1] == outs


class CountVocabCopies(torch.overrides.TorchFunctionMode):
    """Counts cat / stack calls that produce rows of the full vocabulary in float64 (draft distributions)."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.copies = vocab, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.cat, torch.stack) and out.dtype == torch.float64 and out.shape[-1] == self.vocab:
            self.copies += 1
        return out


def test_draft_distributions_are_stacked_once_per_verify_step(model2):
    """A sampled request's draft distributions are kept as rows of each chain step's probabilities and stacked
    once, by the verify step (``acceptance.decide``); appending each new row with ``torch.cat`` copied k^2 / 2 rows
    per round before that stack."""
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
    eng = Engine(TorchBackend(model2), page_size=PAGE, num_pages=96, num_speculative_tokens=3)
    eng.add_request("r", prompts(1, seed=42, lo=5, hi=20)[0], params)
    eng.step()  # the prefill step and the first round of drafts
    with CountVocabCopies(model2.config.vocab_size) as mode:
        while eng.has_unfinished():
            eng.step()
    assert eng.stats.verify_steps > 0
    assert mode.copies <= eng.stats.verify_steps, (mode.copies, eng.stats.verify_steps)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [1, 2, 3])
def test_gpu_a_graphed_speculative_step_synchronises_once(k):
    """On the GPU with every decode, verify and MTP step replayed from CUDA graphs: a step after the prompts'
    synchronises the host with the device once (the verify decision's read), counted by torch's sync debug mode
    (which flags every synchronising call: reads, pageable copies); greedy tokens equal the eager engine's."""
    import warnings

    from m3export.plugins.kernels import kernels, register
    from m3export.runtime.backends.cuda_graph import GraphedTorchBackend

    missing = {"m3::paged_attention", "m3::sparse_paged_attention", "m3::lightning_indexer", "m3::moe"} - set(kernels())
    if missing:
        pytest.skip(f"no Triton kernel yet for {sorted(missing)}: the reference ops cannot be captured")
    register()
    m = tiny_model(num_mtp_modules=2).float().cuda()
    ps = prompts(2, seed=9, lo=8, hi=30)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(page_size=PAGE, num_pages=64, num_speculative_tokens=k)
    want = [o.token_ids for o in Engine(GraphedTorchBackend(m, use_graphs=False), **kw).generate(ps, params)]
    be = GraphedTorchBackend(m)
    eng = Engine(be, **kw)
    be.capture_shapes(len(ps), k + 2, eng.drafter.modules_used)  # captures synchronise: not in the counted steps
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, params)
    eng.step()  # the prompts: eager steps
    syncs, outs = [], {}
    torch.cuda.set_sync_debug_mode("warn")
    try:
        while eng.has_unfinished():
            eager = (be.eager_steps, be.eager_mtp_steps, be.num_graphs)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for o in eng.step():
                    outs[o.request_id] = o.token_ids
            if (be.eager_steps, be.eager_mtp_steps, be.num_graphs) == eager:  # a step of replays only
                syncs.append(sum("synchroniz" in str(w.message) for w in caught))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [outs[f"r{i}"] for i in range(len(ps))] == want
    assert syncs and max(syncs) <= 1, syncs


def test_fill_tokens_takes_drafts_of_several_rounds_and_leaves_the_ids_alone():
    from m3export.runtime.device_drafts import RoundDrafts, fill_tokens

    a, b = RoundDrafts(2, 3, torch.device("cpu")), RoundDrafts(1, 2, torch.device("cpu"))
    a.put(0, [0, 1], torch.tensor([10, 20]))
    a.put(1, [1], torch.tensor([21]))
    b.put(0, [0], torch.tensor([30]))
    b.put(1, [0], torch.tensor([31]))
    ids = torch.tensor([1, 0, 0, 2, 0, 3, 0, 0])
    got = fill_tokens(ids, [(1, a, a.flat(1, 0)), (2, a, a.flat(1, 1)), (4, a, a.flat(0, 0)),
                            (6, b, b.flat(0, 0)), (7, b, b.flat(0, 1))])
    assert got.tolist() == [1, 20, 21, 2, 10, 3, 30, 31]
    assert ids.tolist() == [1, 0, 0, 2, 0, 3, 0, 0]
    assert fill_tokens(ids, []) is ids
    assert a.host() == [[10, -1, -1], [20, 21, -1]]
