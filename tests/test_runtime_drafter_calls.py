"""How the MTP drafter spends module calls, and that its two call shapes draft the same tokens.

A call of an MTP module costs about the same whatever its (small) token count, so the drafter writes each
module's pending positions (its catch-up over the kept positions, then the chain positions since it last ran)
in one call: a round of k drafts is at most k calls, and a module that no chain of the engine's k uses is never
run. A backend that replays one-position steps from CUDA graphs gets one-position chain calls instead. Either way
every proposal must equal the one computed from scratch (``mtp_reference_drafts``), and greedy output must equal
the cache-free reference.
"""

import functools

import pytest

from m3export.runtime import Engine, SamplingParams
from m3export.runtime.backends.cuda_graph import GraphedTorchBackend
from m3export.runtime.backends.torch_backend import TorchBackend

from .runtime_fixtures import prompts, tiny_model
from .test_runtime_speculative import RecordingMTPDrafter, _greedy, mtp_reference_drafts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def counting(backend_cls):
    """``backend_cls`` recording every MTP call as (module, tokens, requests, logits rows), per engine step."""

    class Counting(backend_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.steps: list[list[tuple[int, int, int, int]]] = []

        def forward(self, *args, **kwargs):
            self.steps.append([])
            return super().forward(*args, **kwargs)

        def mtp_forward(self, module, input_ids, hidden, batch, logits_indices):
            self.steps[-1].append((module, len(input_ids), len(batch.seq_lens), len(logits_indices)))
            return super().mtp_forward(module, input_ids, hidden, batch, logits_indices)

    return Counting


@pytest.fixture(scope="module")
def model2():
    return tiny_model(num_mtp_modules=2)


@pytest.mark.parametrize("graphed", [False, True], ids=["torch", "graphed"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_round_of_k_drafts_is_at_most_k_module_calls(model2, k, graphed):
    # graphed: the CUDA-graph backend's bucket shapes (run eagerly here) replay merged calls too, so it gets them.
    if graphed:
        be = counting(GraphedTorchBackend)(model2, use_graphs=False, pad_eagerly=True, buckets=(1, 2, 4))
    else:
        be = counting(TorchBackend)(model2)
    eng = Engine(be, page_size=4, num_pages=96, num_speculative_tokens=k, max_num_batched_tokens=64)
    ps = prompts(2, seed=40 + k, lo=5, hi=30)
    ref = functools.lru_cache(maxsize=None)(lambda p, n: _greedy(model2, p, n))
    for p, o in zip(ps, eng.generate(ps, GREEDY), strict=True):
        assert o.token_ids == ref(tuple(p), 12)
    assert eng.stats.verify_steps > 0
    for calls in be.steps:
        assert len(calls) <= k, calls  # one call per module per position would be 2k - 1 at k = 2, 3
        assert {m for m, *_ in calls} <= set(range(min(k, 2))), calls  # k = 1: module 1 drafts nothing, never runs


@pytest.mark.parametrize("single", [False, True], ids=["merged", "one-position"])
def test_both_call_shapes_draft_what_a_fresh_computation_drafts(model2, single):
    """Merged calls (plain torch backend) and one-position chain calls (what a backend that replays only
    one-position steps asks for; here the graphed backend's padded inputs run eagerly, told to ask for them)
    leave every module's cache as a fresh computation would."""
    if single:
        class OnePosition(GraphedTorchBackend):
            replays_single_position_mtp_steps = True

        backend = counting(OnePosition)(model2, use_graphs=False, pad_eagerly=True, buckets=(1, 2, 4))
    else:
        backend = counting(TorchBackend)(model2)
    assert backend.replays_single_position_mtp_steps == single
    eng = Engine(backend, page_size=4, num_pages=64, num_speculative_tokens=3, max_num_batched_tokens=12)
    rec = RecordingMTPDrafter(backend, 4, eng._ensure_pages, 3)
    eng.drafter = rec
    ps = prompts(3, seed=23, lo=5, hi=30)
    ref = functools.lru_cache(maxsize=None)(lambda p, n: _greedy(model2, p, n))
    for p, o in zip(ps, eng.generate(ps, GREEDY), strict=True):
        assert o.token_ids == ref(tuple(p), 12)
    assert len(rec.proposals) > 10
    for tokens, drafts in rec.proposals:
        assert drafts == mtp_reference_drafts(model2, tokens, len(drafts))
    chain_calls = [c for calls in backend.steps for c in calls[1:] if c[3]]  # calls after the first that draft
    assert chain_calls
    if single:
        assert all(t == b for _, t, b, _ in chain_calls), chain_calls  # one position per request: replayable
        assert backend.padded_mtp_steps > 0
    else:
        assert any(t > b for _, t, b, _ in chain_calls), chain_calls  # catch-up merged into a chain call
