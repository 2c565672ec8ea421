"""The batched sampler the engine runs (``acceptance.decide``) against the one-row definition (``accept``).

Same uniforms, same device: the batched rows must give exactly the tokens of the one-row functions, for every
mix of greedy / sampled rows, filters, penalties, drafts (one-hot and with a draft distribution) and logprobs.
Random logits make ties (where the two could legitimately differ) have probability zero.
"""

import dataclasses
import math

import pytest
import torch

from m3export.runtime import SamplingParams
from m3export.runtime.acceptance import Row, accept, decide, emitted
from m3export.runtime.sampling import (PositionalRandom, Purpose, RowParams, apply_penalties, draw, filtered_probs,
                                       filtered_probs_rows, penalise_rows, propose_rows, sample, token_logprobs)
from m3export.runtime.drafter import Drafter
from tests.runtime_fixtures import model, prompts  # noqa: F401  (fixtures)

V = 97

PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.2),
    SamplingParams(),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05),
    SamplingParams(min_p=0.2),
    SamplingParams(temperature=0.8, repetition_penalty=0.7, presence_penalty=1.5, top_k=V + 3),
    SamplingParams(temperature=1.1, frequency_penalty=-1.0, top_p=0.5, logprobs=3),
    SamplingParams(temperature=0, logprobs=0),
]


def _logits(seed, rows, scale=3.0):
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * scale


def _history(seed, n):
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, V, (n,), generator=g).tolist()


def test_batched_filters_and_penalties_equal_the_one_row_definition():
    logits = _logits(0, len(PARAMS))
    prompts = [_history(i, 7) for i in range(len(PARAMS))]
    outputs = [_history(50 + i, 5 + i) for i in range(len(PARAMS))]
    rp = RowParams(PARAMS, logits.device)
    pen = penalise_rows(logits, rp, prompts, outputs)
    for i, p in enumerate(PARAMS):
        assert torch.equal(pen[i], apply_penalties(logits[i], p, prompts[i], outputs[i])), p
    rand = [i for i, p in enumerate(PARAMS) if not p.greedy]
    probs = filtered_probs_rows(pen[rand], RowParams([PARAMS[i] for i in rand], logits.device))
    for j, i in enumerate(rand):
        assert torch.equal(probs[j], filtered_probs(pen[i], PARAMS[i])), PARAMS[i]


def test_penalties_follow_their_definition():
    """vLLM's rules, on hand-picked numbers: repetition divides positive / multiplies negative logits of seen
    tokens (prompt or output), frequency subtracts per occurrence in the output, presence once."""
    logits = torch.tensor([2.0, -2.0, 2.0, 1.0, 0.5])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)
    got = apply_penalties(logits, p, prompt=[0, 1], output=[2, 2, 2, 4])
    want = torch.tensor([2.0 / 2, -2.0 * 2, 2.0 / 2 - 3 * 0.25 - 0.5, 1.0, 0.5 / 2 - 0.25 - 0.5])
    assert torch.allclose(got, want, atol=0, rtol=1e-6)  # float32 rounding of a few operations


def test_min_p_keeps_tokens_at_least_that_fraction_of_the_best():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])
    p = filtered_probs(probs.log(), SamplingParams(min_p=0.2))  # 0.2 * 0.5 = 0.1: the 0.08 token goes
    assert p[3] == 0 and (p[:3] > 0).all() and math.isclose(float(p.sum()), 1.0)


@pytest.mark.parametrize("seed", range(4))
def test_decide_equals_accept_with_and_without_drafts(seed):
    """Per request: 1 + k rows verifying k drafts (k = 0 .. 3), greedy and sampled, one-hot drafts and drafts
    with a distribution; the tokens emitted and their logprobs must be accept()'s and token_logprobs()'."""
    g = torch.Generator().manual_seed(seed)
    rows, requests, all_logits = [], [], []
    for i, p in enumerate(PARAMS):
        k = (i + seed) % 4
        logits = _logits(100 * seed + i, k + 1)
        if p.greedy:  # drafts that the argmax accepts for a while, then one it rejects
            best = logits.argmax(-1).tolist()
            drafts = best[:k]
            if k > 1 and (i + seed) % 2:
                drafts[k - 1] = (drafts[k - 1] + 1) % V
            draft_probs = None
        else:  # drafts from a distribution near the target's, so that both acceptances and rejections occur
            near = torch.stack([filtered_probs(logits[j] + 0.5 * torch.randn(V, generator=g), p)
                                for j in range(k)]) if k else torch.zeros(0, V, dtype=torch.float64)
            draft_probs = near if (i + seed) % 2 else None
            drafts = [int(torch.multinomial(near[j], 1, generator=g)) for j in range(k)]
        rng, pos = PositionalRandom(7 * seed + i), 11 + i
        prompt, output = _history(i, 6), _history(60 + i, 3)
        requests.append((p, rng, pos, drafts, draft_probs, logits, prompt, output, len(rows)))
        for j in range(k + 1):
            rows.append(Row(p, rng, pos + j, drafts[j] if j < k else None,
                            None if draft_probs is None or j >= k else draft_probs[j], prompt,
                            output + drafts[:j]))
        all_logits.append(logits)
    results = decide(torch.cat(all_logits), rows)
    outcomes = {(w.draft is not None, r.accepted) for w, r in zip(rows, results) if not w.params.greedy}
    assert outcomes == {(True, True), (True, False), (False, False)}  # accepted, rejected and plain rows seen
    for p, rng, pos, drafts, draft_probs, logits, prompt, output, first in requests:
        n = len(drafts) + 1
        want = accept(logits, drafts, draft_probs, p, rng, pos, prompt, output)
        got = emitted(rows[first:first + n], results[first:first + n])
        assert got == want, (p, drafts)
        if p.logprobs is not None:
            for j, tok in enumerate(got):
                ref = token_logprobs(logits[j], tok, p.logprobs)
                lp = results[first + j].logprobs(tok, p.logprobs)
                assert lp.keys() == ref.keys()
                # log_softmax of the same float32 row, batched or not: equal up to float32 rounding.
                assert all(math.isclose(lp[t], ref[t], rel_tol=1e-6, abs_tol=1e-6) for t in ref)


def test_decide_plain_rows_equal_sample_over_many_positions():
    """One row per position (no drafts): the batched draw is sample()'s for every position's uniform."""
    p = SamplingParams(temperature=0.9, top_k=30, top_p=0.95)
    logits = _logits(5, 64, scale=1.0)
    rng = PositionalRandom(123)
    results = decide(logits, [Row(p, rng, pos) for pos in range(64)])
    assert [r.token for r in results] == [sample(logits[pos], p, rng, pos) for pos in range(64)]
    assert len({r.token for r in results}) > 10  # really random: flat logits, many distinct tokens


def test_decide_greedy_rows_are_argmax_and_rng_free():
    logits = _logits(9, 8)
    p = SamplingParams(temperature=0)
    a = decide(logits, [Row(p, PositionalRandom(1), 0) for _ in range(8)])
    b = decide(logits, [Row(p, PositionalRandom(2), 5) for _ in range(8)])
    assert [r.token for r in a] == [r.token for r in b] == logits.argmax(-1).tolist()


def test_decide_refuses_a_row_count_mismatch():
    with pytest.raises(ValueError, match="2 logits rows for 1 rows"):
        decide(_logits(0, 2), [Row(SamplingParams(), PositionalRandom(0), 0)])


def test_decide_sampled_frequencies_follow_the_distribution():
    """Statistical check of the batched path alone: 4000 rows of one distribution, each with its own uniform,
    land on the tokens with the filtered probabilities (tolerance: 5 binomial standard deviations)."""
    p = SamplingParams(temperature=1.0, top_k=4)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(4000, 1)
    rng = PositionalRandom(99)
    toks = torch.tensor([r.token for r in decide(logits, [Row(p, rng, i) for i in range(4000)])])
    want = filtered_probs(logits[0], p)
    freq = torch.bincount(toks, minlength=6).double() / 4000
    sd = (want * (1 - want) / 4000).sqrt()
    assert ((freq - want).abs() <= 5 * sd + 1e-12).all(), (freq, want)
    assert (freq[4:] == 0).all()


def test_uniform_purposes_are_the_ones_accept_uses():
    """decide() must read SAMPLE / ACCEPT / RESIDUAL uniforms at the row's own position (a shifted position or a
    swapped purpose would still be 'random' but break seed determinism across schedules)."""
    p = SamplingParams()
    logits = _logits(3, 1)
    rng = PositionalRandom(5)
    want = sample(logits[0], p, rng, 42)
    assert decide(logits, [Row(p, rng, 42)])[0].token == want
    assert rng.uniform(42, Purpose.SAMPLE) != rng.uniform(43, Purpose.SAMPLE)


@pytest.mark.parametrize("field, value", [
    ("min_p", -0.1), ("min_p", 1.5), ("repetition_penalty", 0.0), ("repetition_penalty", float("inf")),
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("frequency_penalty", "1"),
])
def test_new_params_are_validated_by_name(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_propose_rows_equals_the_one_row_draft_rule():
    """Greedy rows draft the argmax; sampled rows draw from filtered_probs with the DRAFT uniform of the position,
    and their returned distribution is that filtered row (what rejection sampling takes as p_d)."""
    logits = _logits(11, len(PARAMS))
    rngs = [PositionalRandom(40 + i) for i in range(len(PARAMS))]
    positions = [3 * i + 1 for i in range(len(PARAMS))]
    tokens, probs = propose_rows(logits, PARAMS, rngs, positions)
    for i, p in enumerate(PARAMS):
        if p.greedy:
            assert tokens[i] == int(logits[i].argmax())
            continue
        want = filtered_probs(logits[i], p)
        assert torch.equal(probs[i], want)
        assert tokens[i] == draw(want, rngs[i].uniform(positions[i], Purpose.DRAFT))
    greedy = [p for p in PARAMS if p.greedy]
    assert propose_rows(logits[:len(greedy)], greedy, rngs[:len(greedy)], positions[:len(greedy)])[1] is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", range(2))
def test_gpu_decide_equals_the_host_definition(seed):
    """The batched pass on the GPU against the one-row definition on the CPU, same uniforms. Greedy is exact by
    construction; a sampled token can differ only if a uniform lands within float64 rounding (~1e-16) of a CDF
    step or a top-p boundary moves by rounding, which for these random logits has probability ~1e-12: any
    mismatch is a bug."""
    g = torch.Generator().manual_seed(seed)
    rows, logits, reqs = [], [], []
    for i, p in enumerate(PARAMS):
        k = (i + seed) % 3
        lg = _logits(200 + 10 * seed + i, k + 1)
        drafts = lg.argmax(-1).tolist()[:k] if p.greedy else torch.randint(0, V, (k,), generator=g).tolist()
        rng, pos, prompt, output = PositionalRandom(i + seed), 5 + i, _history(i, 4), _history(70 + i, 4)
        reqs.append((p, rng, pos, drafts, lg, prompt, output, len(rows)))
        rows += [Row(p, rng, pos + j, drafts[j] if j < k else None, None, prompt, output + drafts[:j])
                 for j in range(k + 1)]
        logits.append(lg)
    results = decide(torch.cat(logits).cuda(), rows)
    for p, rng, pos, drafts, lg, prompt, output, first in reqs:
        n = len(drafts) + 1
        assert emitted(rows[first:first + n], results[first:first + n]) == \
            accept(lg, drafts, None, p, rng, pos, prompt, output), p


def test_logprobs_of_a_token_that_is_no_candidate():
    """An engine that forces its tokens (tests' ScriptedEngine) asks for the logprobs of any token: read from the
    row's log-probabilities, equal to token_logprobs."""
    logits = _logits(21, 1)
    p = SamplingParams(temperature=0, logprobs=2)
    res = decide(logits, [Row(p, PositionalRandom(0), 0)])[0]
    forced = int(logits[0].argmin())
    got, want = res.logprobs(forced, 2), token_logprobs(logits[0], forced, 2)
    assert got.keys() == want.keys() and all(math.isclose(got[t], want[t], rel_tol=1e-6) for t in want)


def _cache_free(model, prompt, params, n):
    """The request's tokens by recomputing the whole sequence and applying the one-row sample() (penalties with
    the history so far) at every position."""
    ids, rng = list(prompt), PositionalRandom(params.seed or 0)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]))[0, -1]
            ids.append(sample(logits, params, rng, len(ids), prompt, ids[len(prompt):]))
    return ids[len(prompt):]


class _KnownContinuation(Drafter):
    """Drafts the request's true (penalised greedy) continuation, so every draft is accepted and each verify row
    after the first must count the drafts before it in its penalty history."""

    def __init__(self, continuations):
        self.continuations = continuations

    def run(self, jobs):
        for j in jobs:
            if j.num_drafts:
                r = j.request
                want = self.continuations[tuple(r.prompt_token_ids)]
                done = len(r.output_token_ids)
                r.drafts = want[done:done + j.num_drafts]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, repetition_penalty=1.8, presence_penalty=1.0, frequency_penalty=0.5),
    SamplingParams(temperature=0.9, min_p=0.05, top_k=40, repetition_penalty=1.3, frequency_penalty=0.7, seed=4),
], ids=["greedy", "sampled"])
def test_engine_penalties_equal_a_cache_free_loop(model, params):
    """The engine (paged, batched, device sampler) against the cache-free loop; penalties must change the
    tokens (else the test could not tell)."""
    from m3export.runtime import Engine
    from m3export.runtime.backends.torch_backend import TorchBackend

    ps, n = prompts(2, seed=9), 10
    params = dataclasses.replace(params, max_tokens=n, ignore_eos=True)
    got = [o.token_ids for o in Engine(TorchBackend(model), page_size=4, num_pages=64).generate(ps, params)]
    assert got == [_cache_free(model, p, params, n) for p in ps]
    plain = dataclasses.replace(params, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    assert got != [o.token_ids for o in Engine(TorchBackend(model), page_size=4, num_pages=64).generate(ps, plain)]


def test_engine_penalties_count_the_drafts_a_verify_row_follows(model):
    """Greedy with penalties and 3 drafts per step that are all right: each verify row's penalties include the
    drafts before it; the tokens must be the cache-free loop's and every draft accepted."""
    from m3export.runtime import Engine
    from m3export.runtime.backends.torch_backend import TorchBackend

    ps, n = prompts(2, seed=9), 12
    params = SamplingParams(temperature=0, repetition_penalty=1.8, presence_penalty=1.0, frequency_penalty=0.5,
                            max_tokens=n, ignore_eos=True)
    want = {tuple(p): _cache_free(model, p, params, n) for p in ps}
    eng = Engine(TorchBackend(model), page_size=4, num_pages=64, num_speculative_tokens=3,
                 drafter=_KnownContinuation(want))
    assert [o.token_ids for o in eng.generate(ps, params)] == [want[tuple(p)] for p in ps]
    assert eng.stats.draft_tokens > 0 and eng.stats.accepted_tokens == eng.stats.draft_tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_plain_rows_at_the_vocabulary_size_equal_the_host_definition():
    """A step whose rows verify no draft (the plain pass: no residuals, no acceptance tests) at M3's vocabulary,
    on the GPU, against sample() on the CPU; the one-row draw also on a GPU row. As above, a mismatch needs a
    uniform within float64 rounding of a CDF step: any is a bug."""
    vocab = 200064
    params = [p for p in PARAMS if not p.penalised] * 3
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(77)) * 2.0
    rngs = [PositionalRandom(300 + i) for i in range(len(params))]
    got = decide(logits.cuda(), [Row(p, rng, 40 + i) for i, (p, rng) in enumerate(zip(params, rngs))])
    assert [r.token for r in got] == [sample(logits[i], p, rngs[i], 40 + i) for i, p in enumerate(params)]
    i = next(i for i, p in enumerate(params) if p.top_p < 1)
    assert sample(logits[i].cuda(), params[i], rngs[i], 40 + i) == got[i].token
