"""Speculative decoding end to end: the distribution of what the engine emits, and what happens to stops, EOS,
stop strings and logprobs that fall inside one multi-token (accepted drafts + bonus) emission.

The rejection-sampling rule is tested in isolation in ``test_runtime_sampling.py``; here the engine runs it with
a drafter whose proposal distribution we set, so its output distribution and acceptance rate have exact values
to meet.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from m3export.runtime import Engine, SamplingParams
from m3export.runtime.backends.torch_backend import TorchBackend
from m3export.runtime.drafter import Drafter

from .runtime_fixtures import model, prompts, reference  # noqa: F401  (fixtures)
from .test_runtime_speculative import OracleDrafter

TOP_K = 3
Q_BY_RANK = torch.tensor([0.1, 0.3, 0.6], dtype=torch.float64)  # drafter mass on the target's 1st, 2nd, 3rd choice


class CharTokenizer:
    """Token id i <-> one printable character, so any random-model output is text with findable stop strings."""

    def encode(self, text):
        return [ord(c) - 33 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(33 + i % 94) for i in ids)


def target_distribution(model, tokens: tuple) -> torch.Tensor:
    """The target's sampling distribution after ``tokens`` at temperature 1 and top-k 3, from a full recompute
    (its own softmax over the three best logits; independent of the runtime's sampling code)."""
    with torch.no_grad():
        logits = model(torch.tensor([list(tokens)]))[0, -1].double()
    top = torch.topk(logits, TOP_K)
    p = torch.zeros_like(logits)
    p[top.indices] = torch.softmax(top.values, 0)
    return p


def drafter_distribution(p: torch.Tensor) -> torch.Tensor:
    q = torch.zeros_like(p)
    q[torch.argsort(p, descending=True, stable=True)[:TOP_K]] = Q_BY_RANK
    return q


class FixedDistributionDrafter(Drafter):
    """One draft per step, drawn from ``drafter_distribution`` of the target's own distribution: a proposal that
    differs from the target's (it favours the target's third choice) and is reported as ``draft_probs``."""

    def __init__(self, target):
        self.target = target
        self.gen = torch.Generator().manual_seed(1234)

    def run(self, jobs):
        for j in jobs:
            if j.num_drafts:
                q = drafter_distribution(self.target(tuple(j.request.tokens)))
                j.request.drafts = [int(torch.multinomial(q, 1, generator=self.gen))]
                j.request.draft_probs = q[None]


def chi2_quantile(dof: int, z: float) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at standard-normal quantile ``z`` (accurate to
    ~1% at these degrees of freedom)."""
    a = 2.0 / (9 * dof)
    return dof * (1 - a + z * math.sqrt(a)) ** 3


@pytest.mark.slow  # ~10-20 s: 1500 requests through the engine
def test_speculative_sampling_emits_the_target_distribution(model):  # noqa: F811
    """1500 seeded requests of 3 tokens: token 1 is sampled after prefill, token 2 is the verify step's (the draft
    accepted, or a draw from the residual), token 3 the bonus or a plain sample. The joint distribution of
    (t1, t2, t3) must be the target's (chi-square over the 27 outcomes), and the acceptance rate must be the
    theoretical sum_d min(p(d), q(d)), which a verifier ignoring q (accepting with p(d) alone, still unbiased)
    misses by far."""
    prompt = prompts(1, seed=5, lo=6, hi=7)[0]
    target = functools.cache(lambda toks: target_distribution(model, toks))
    n = 1500
    eng = Engine(TorchBackend(model), page_size=4, num_pages=1024, num_speculative_tokens=1,
                 drafter=FixedDistributionDrafter(target))
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, seed=i, max_tokens=3, ignore_eos=True) for i in range(n)]
    outs = eng.generate([prompt] * n, params)
    assert eng.stats.draft_tokens == n and eng.stats.verify_steps == n  # one verify step per request

    expected, accept = {}, 0.0
    p1 = target(tuple(prompt))
    for t1 in p1.nonzero().flatten().tolist():
        p2 = target(tuple(prompt + [t1]))
        accept += float(p1[t1] * torch.minimum(p2, drafter_distribution(p2)).sum())
        for t2 in p2.nonzero().flatten().tolist():
            p3 = target(tuple(prompt + [t1, t2]))
            for t3 in p3.nonzero().flatten().tolist():
                expected[t1, t2, t3] = float(p1[t1] * p2[t2] * p3[t3]) * n
    counts = {}
    for o in outs:
        key = tuple(o.token_ids)
        assert key in expected, f"emitted {key}, which the target cannot produce"
        counts[key] = counts.get(key, 0) + 1
    assert min(expected.values()) > 5  # chi-square's validity condition
    chi2 = sum((counts.get(k, 0) - e) ** 2 / e for k, e in expected.items())
    # z = 3.72: a correct engine fails with probability 1e-4 (one fixed seed set here, so it either passes always)
    assert chi2 < chi2_quantile(len(expected) - 1, 3.72), f"chi-square {chi2:.1f} over {len(expected)} outcomes"

    rate = eng.stats.accepted_tokens / eng.stats.draft_tokens
    sigma = math.sqrt(accept * (1 - accept) / n)
    assert abs(rate - accept) < 5 * sigma, f"acceptance {rate:.3f}, theory {accept:.3f} +- {sigma:.3f}"


def _oracle_engine(model, reference, **kw):  # noqa: F811
    """Drafts are the target's own greedy continuation, so all 4 are accepted and each verify step emits 5."""
    return Engine(TorchBackend(model), kw.pop("tokenizer", None), page_size=4, num_pages=64,
                  num_speculative_tokens=4, drafter=OracleDrafter(reference), **kw)


@pytest.mark.parametrize("how", ["stop_token_ids", "eos", "stop_string"])
def test_stop_inside_a_multi_token_emission(model, reference, how, monkeypatch):  # noqa: F811
    """Output token 0 comes from the prefill, tokens 1-5 from the first verify step; a stop at token 2, 3 or 4
    must end the request there even though the tokens after it were accepted in the same step."""
    tok = CharTokenizer()
    prompt = prompts(1, seed=61)[0]
    ref = reference(tuple(prompt), 12)
    text = tok.decode(ref)
    # the first output index in 2..4 where both the token and the 2-character string ending there occur first
    stop_at = next(i for i in range(2, 5) if ref[i] not in ref[:i] and text.find(text[i - 1:i + 1]) == i - 1)
    kw = dict(temperature=0, max_tokens=12)
    if how == "stop_token_ids":
        params = SamplingParams(stop_token_ids=[ref[stop_at]], ignore_eos=True, **kw)
    elif how == "eos":
        monkeypatch.setattr(model.config, "eos_token_id", [ref[stop_at]])
        params = SamplingParams(**kw)
    else:
        params = SamplingParams(stop=[text[stop_at - 1:stop_at + 1]], ignore_eos=True, **kw)
    eng = _oracle_engine(model, reference, tokenizer=tok)
    outs = list(eng.stream(prompt, params))
    assert [len(o.new_token_ids) for o in outs] == [1, stop_at]  # the stop fell inside the 5-token emission
    final = outs[-1]
    assert final.token_ids == ref[:stop_at + 1] and final.finish_reason == "stop" and final.finished
    if how == "stop_string":
        assert final.text == text[:stop_at - 1]
    assert eng.stats.accepted_tokens == 4  # all drafts were accepted: the tokens after the stop were real
    assert eng.blocks.num_free == eng.blocks.num_pages


def test_logprobs_inside_multi_token_emissions(model, reference):  # noqa: F811
    """Every token of every accepted emission carries its own position's log-probabilities (the sampled token and
    the top 2), equal to a full recompute's."""
    prompt = prompts(1, seed=71)[0]
    ref = reference(tuple(prompt), 11)
    eng = _oracle_engine(model, reference)
    o = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=11, ignore_eos=True, logprobs=2))[0]
    assert o.token_ids == ref and eng.stats.verify_steps == 2 and eng.stats.accepted_tokens == 8
    assert len(o.logprobs) == 11
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref]))[0]
    for i, (token, entry) in enumerate(zip(ref, o.logprobs, strict=True)):
        lp = torch.log_softmax(logits[len(prompt) - 1 + i].float(), -1)
        top = torch.topk(lp, 2)
        want = {token: float(lp[token]), **{int(t): float(v) for v, t in zip(top.values, top.indices)}}
        assert next(iter(entry)) == token and set(entry) == set(want)
        # the engine's logits and the recompute differ by float64 rounding; log_softmax in fp32: 1e-5 is ~100 ulp
        assert all(abs(entry[t] - want[t]) < 1e-5 for t in want), i
