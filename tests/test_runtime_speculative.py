"""MTP speculative decoding: greedy outputs identical with and without speculation, MTP caches that match a
cache-free recomputation through rejections, the multi-accept + bonus path, and seeded reproducibility.

The tiny model's MTP weights are random, so its own drafts are nearly always rejected; an oracle drafter that
proposes the target's own greedy continuation (sometimes corrupted on purpose) drives acceptance up.
"""

import functools

import pytest
import torch

from m3export.model import Batch
from m3export.runtime import Engine, SamplingParams
from m3export.runtime.backends.torch_backend import TorchBackend
from m3export.runtime.drafter import Drafter, MTPDrafter

from .runtime_fixtures import model, prompts, reference, tiny_model  # noqa: F401  (fixtures)

GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)


def engine(model, k, **kw) -> Engine:
    kw.setdefault("page_size", 4)
    kw.setdefault("num_pages", 128)
    return Engine(TorchBackend(model), num_speculative_tokens=k, **kw)


@pytest.mark.parametrize("k, page_size, budget", [(1, 4, 64), (2, 8, 64), (3, 4, 6)])
def test_greedy_identical_with_and_without_mtp(model, reference, k, page_size, budget):
    ps = prompts(5, seed=k, hi=36)
    eng = engine(model, k, page_size=page_size, max_num_batched_tokens=budget)
    outs = eng.generate(ps, GREEDY)
    for p, o in zip(ps, outs, strict=True):
        assert o.token_ids == reference(tuple(p), 14)
    assert eng.stats.verify_steps > 0  # speculation ran (the equality above is the point of the test)
    assert eng.blocks.num_free == eng.blocks.num_pages


def mtp_reference_drafts(model, tokens: list[int], k: int, page: int = 4) -> list[int]:
    """Greedy MTP drafts after ``tokens`` computed from scratch: the target over x_0..x_{n-1}, every module over
    positions 0..n-1 with (x_{t+1}, h_t), then the chain, each step writing every module's cache."""
    n = len(tokens) - 1
    pages = (n + k) // page + 1
    table = torch.arange(pages, dtype=torch.int32)[None]  # identity pages: slot == position

    def batch(start, length):
        pos = torch.arange(start, start + length)
        return Batch(pos, torch.tensor([0, length], dtype=torch.int32),
                     torch.tensor([start + length], dtype=torch.int32), table, pos.clone())

    dt = model.lm_head.weight.dtype
    with torch.no_grad():
        hidden = model.step(torch.tensor(tokens[:n]), batch(0, n),
                            model.allocate_caches(pages, page, dt, "cpu")).hidden
        caches = model.allocate_caches(pages, page, dt, "cpu", layers="mtp")
        nxt = torch.tensor(tokens[1:])
        results = [model.mtp_step(m, nxt, hidden, batch(0, n), caches[m], torch.tensor([n - 1]))
                   for m in range(len(model.mtp))]
        drafts = [int(results[0][0][0].argmax())]
        h = results[0][1][n - 1:n]
        for s in range(1, k):
            b = batch(n - 1 + s, 1)
            outs = [model.mtp_step(m, torch.tensor([drafts[-1]]), h, b, caches[m], torch.tensor([0]))
                    for m in range(len(model.mtp))]
            logits, h = outs[s % len(model.mtp)][:2]
            drafts.append(int(logits[0].argmax()))
    return drafts


class RecordingMTPDrafter(MTPDrafter):
    """The real MTP drafter; records its proposals, then optionally replaces them by the target's own greedy
    continuation (``oracle``) so that drafts get accepted and the MTP caches catch up over several tokens."""

    def __init__(self, *args, oracle=None, corrupt_every=0):
        super().__init__(*args)
        self.oracle, self.corrupt_every = oracle, corrupt_every
        self.proposals = []  # (tokens known, MTP drafts)
        self.calls = 0

    def run(self, jobs):
        super().run(jobs)
        for j in jobs:
            r = j.request
            if j.num_drafts:
                self.proposals.append((list(r.tokens), list(r.drafts)))
                if self.oracle is not None:
                    r.drafts = oracle_drafts(self.oracle, r, j.num_drafts, self.corrupt_every, self.calls)
                    self.calls += 1


def oracle_drafts(oracle, req, n, corrupt_every, call):
    want = oracle(tuple(req.prompt_token_ids), len(req.output_token_ids) + n)[len(req.output_token_ids):]
    drafts = list(want)
    if corrupt_every and call % corrupt_every == 0:
        drafts[call % n] = (drafts[call % n] + 1) % 256  # reject in the middle of the chain
    return drafts


@pytest.mark.parametrize("modules, k, oracle", [(1, 2, False), (1, 3, True), (2, 3, False), (2, 3, True)])
def test_mtp_caches_match_cache_free_recomputation(reference, modules, k, oracle):
    """Every MTP proposal equals the one computed from scratch: catch-up over prompts, accepted drafts and
    rollback of rejected ones leave each module's cache exactly as a fresh computation would."""
    model = tiny_model(num_mtp_modules=modules) if modules != 1 else tiny_model()
    ref = functools.lru_cache(maxsize=None)(lambda p, n: _greedy(model, p, n))
    backend = TorchBackend(model)
    eng = Engine(backend, page_size=4, num_pages=64, num_speculative_tokens=k, max_num_batched_tokens=12,
                 drafter=None)
    rec = RecordingMTPDrafter(backend, 4, eng._ensure_pages, oracle=ref if oracle else None, corrupt_every=3)
    eng.drafter = rec
    ps = prompts(3, seed=modules * 10 + k, lo=5, hi=30)
    outs = eng.generate(ps, GREEDY)
    for p, o in zip(ps, outs, strict=True):
        assert o.token_ids == ref(tuple(p), 14)
    assert len(rec.proposals) > 10
    for tokens, drafts in rec.proposals:
        assert drafts == mtp_reference_drafts(model, tokens, len(drafts))
    if oracle:
        assert eng.stats.mean_acceptance_length > 2.0


def _greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


class OracleDrafter(Drafter):
    """Proposes the target's own greedy continuation; every ``corrupt_every``-th call one draft is wrong."""

    def __init__(self, oracle, corrupt_every=0):
        self.oracle, self.corrupt_every, self.calls = oracle, corrupt_every, 0

    def run(self, jobs):
        for j in jobs:
            if j.num_drafts:
                j.request.drafts = oracle_drafts(self.oracle, j.request, j.num_drafts, self.corrupt_every,
                                                 self.calls)
                self.calls += 1


@pytest.mark.parametrize("corrupt_every", [0, 2])
def test_multi_accept_bonus_and_rollback(model, reference, corrupt_every):
    ps = prompts(4, seed=5 + corrupt_every, hi=36)
    eng = engine(model, 4, drafter=OracleDrafter(reference, corrupt_every))
    outs = eng.generate(ps, GREEDY)
    for p, o in zip(ps, outs, strict=True):
        assert o.token_ids == reference(tuple(p), 14)
    acc = eng.stats.mean_acceptance_length
    if corrupt_every:
        assert 1.5 < acc < 5.0 and eng.stats.accepted_tokens < eng.stats.draft_tokens
    else:
        # every draft accepted plus the bonus token; only the last step drafts fewer (max_tokens is near)
        assert eng.stats.accepted_tokens == eng.stats.draft_tokens and acc == pytest.approx((5 + 5 + 3) / 3)
    assert eng.blocks.num_free == eng.blocks.num_pages


@pytest.mark.parametrize("drafter", ["mtp", "oracle"])
def test_sampling_with_speculation_is_seeded_and_batch_independent(model, reference, drafter):
    """Sampled drafts (MTP, with their distributions) and greedy ones (oracle, one-hot p_d) both go through
    rejection sampling; either way a seeded request's tokens do not depend on its batch."""
    ps = prompts(4, seed=77, hi=36)
    params = [SamplingParams(temperature=0.9, top_k=40, seed=9 + i, max_tokens=12, ignore_eos=True)
              for i in range(len(ps))]

    def run(ps, params):
        d = OracleDrafter(reference) if drafter == "oracle" else None
        return [o.token_ids for o in engine(model, 2, drafter=d).generate(ps, params)]

    batched = run(ps, params)
    assert batched == [run([p], [q])[0] for p, q in zip(ps, params, strict=True)]
    assert run(ps[:1], params[:1])[0] == batched[0]


def test_preemption_and_prefix_sharing_with_speculation(model, reference):
    base = prompts(1, seed=91, lo=17, hi=18)[0]
    ps = [base + [i, i + 1] for i in range(3)] + prompts(3, seed=92, lo=10, hi=30)
    eng = engine(model, 2, num_pages=14, max_num_batched_tokens=40)
    sched, preempted_shared, found_again = eng.scheduler, [], []
    preempt, cached_prefix = sched._preempt, sched._cached_prefix

    def recording_preempt(req):  # did the victim hold pages another request also holds?
        preempted_shared.append(any(eng.blocks.refcount(p) >= 2 for p in req.pages))
        preempt(req)

    def recording_cached_prefix(req):  # does a preempted request find its pages again when it is readmitted?
        hits, digests = cached_prefix(req)
        if req.output_token_ids:
            found_again.append(len(hits))
        return hits, digests

    sched._preempt, sched._cached_prefix = recording_preempt, recording_cached_prefix
    outs = eng.generate(ps, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for p, o in zip(ps, outs, strict=True):
        assert o.token_ids == reference(tuple(p), 16)
    assert eng.stats.preemptions == len(preempted_shared) > 0
    assert any(preempted_shared), "no preemption hit a request holding shared prefix pages"
    assert any(found_again), "no preempted request found its cached prefix again"
    assert eng.blocks.num_free == eng.blocks.num_pages
    # MTP's entry at a page's last row depends on the next token, so sharing needs it to match too:
    eng = engine(model, 2)
    eng.add_request("a", base[:16] + [1, 2, 3], GREEDY)
    eng.step()
    eng.add_request("b", base[:16] + [1, 9], GREEDY)  # equal through token 16: all four full pages shared
    eng.add_request("c", base[:16] + [7, 9], GREEDY)  # differs at token 16: the fourth page is not
    eng.step()
    ra, rb, rc = (eng._requests[x] for x in "abc")
    assert rb.pages[:4] == ra.pages[:4] and rc.pages[:3] == ra.pages[:3] and rc.pages[3] != ra.pages[3]
    finals = {}
    while eng.has_unfinished():
        for o in eng.step():
            finals[o.request_id] = o.token_ids
    assert finals["b"] == reference(tuple(base[:16] + [1, 9]), 14)
    assert finals["c"] == reference(tuple(base[:16] + [7, 9]), 14)
