"""The engine on the torch backend against the cache-free model: paging, chunking, batching, preemption,
prefix sharing, cancellation, stop conditions, streaming, seeds and logprobs.

The tiny preset (index blocks of 4 tokens, top-3 blocks) exercises block selection from 13 tokens on; the model
runs in float64 so that comparisons of argmax decisions are not at the mercy of fp32 rounding.
"""

import logging

import pytest
import torch

from m3export.runtime import Engine, SamplingParams
from m3export.runtime.backends.torch_backend import TorchBackend

from .runtime_fixtures import model, prompts, reference, tiny_model  # noqa: F401  (fixtures)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def engine(model, **kw) -> Engine:
    kw.setdefault("page_size", 4)
    kw.setdefault("num_pages", 128)
    return Engine(TorchBackend(model), **kw)


def test_selection_is_exercised(model):
    """The sequences below are long enough that the indexer drops blocks (sparse != dense)."""
    ids = torch.tensor([prompts(1, 3, 30, 31)[0]])
    _, selections = model(ids, return_selections=True)
    sel = selections[0][0, -1]  # last token, each KV head: 3 of its 8 visible blocks
    assert (sel >= 0).sum(-1).tolist() == [3, 3]


@pytest.mark.parametrize("page_size", [4, 8])
def test_paged_generation_equals_full_recompute(model, reference, page_size):
    ps = prompts(10, seed=page_size)
    eng = engine(model, page_size=page_size, max_num_batched_tokens=64)
    outs = eng.generate(ps, GREEDY)
    for p, o in zip(ps, outs, strict=True):
        assert o.token_ids == reference(tuple(p), 12)
        assert o.finished and o.finish_reason == "length" and o.prompt_token_ids == p
    assert eng.blocks.num_free == eng.blocks.num_pages


def test_chunked_prefill_equals_unchunked(model, reference):
    ps = prompts(4, seed=11, lo=20, hi=40)
    chunked = engine(model, max_num_batched_tokens=5).generate(ps, GREEDY)
    whole = engine(model, max_num_batched_tokens=512).generate(ps, GREEDY)
    for p, a, b in zip(ps, chunked, whole, strict=True):
        assert a.token_ids == b.token_ids == reference(tuple(p), 12)


def test_batched_equals_sequential_greedy_and_seeded(model):
    ps = prompts(5, seed=21)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=100 + i, max_tokens=10, ignore_eos=True)
              for i in range(len(ps))]
    params[0] = GREEDY
    batched = engine(model).generate(ps, params)
    one = engine(model)
    sequential = [one.generate([p], q)[0] for p, q in zip(ps, params, strict=True)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in sequential]


def test_seed_reproducible_and_unseeded_varies(model):
    p = prompts(1, seed=5)[0]
    eng = engine(model)
    a = eng.generate([p], SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True))[0]
    others = [prompts(1, seed=s)[0] for s in range(3)]  # different company this time
    b = eng.generate([p] + others, SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True))[0]
    assert a.token_ids == b.token_ids
    c = eng.generate([p] * 3, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True))
    assert len({tuple(o.token_ids) for o in c}) > 1


def test_pool_too_small_preempts_and_recomputes(model, reference):
    ps = prompts(6, seed=31, lo=10, hi=30)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    eng = engine(model, num_pages=12, max_num_batched_tokens=64)  # 48 slots; one request needs up to 12 pages
    outs = eng.generate(ps, params)
    assert eng.stats.preemptions > 0
    for p, o in zip(ps, outs, strict=True):
        assert o.token_ids == reference(tuple(p), 16)
    assert eng.blocks.num_free == eng.blocks.num_pages


def test_prefix_pages_are_shared_and_outputs_identical(model, reference):
    base = prompts(1, seed=41, lo=14, hi=15)[0]  # 14 tokens: 3 full pages of 4 to share
    a, b = base + [7, 8, 9], base + [200, 201]
    eng = engine(model)
    eng.add_request("a", a, GREEDY)
    eng.step()  # a's prompt is computed and its full pages published
    eng.add_request("b", b, GREEDY)
    eng.step()
    ra, rb = eng._requests["a"], eng._requests["b"]
    assert rb.pages[:3] == ra.pages[:3] and rb.pages[3] != ra.pages[3]
    assert all(eng.blocks.refcount(p) == 2 for p in ra.pages[:3])
    assert eng.stats.prefill_tokens == len(a) + len(b) - 12  # b computed only its tail
    finals = {}
    while eng.has_unfinished():
        for o in eng.step():
            finals[o.request_id] = o.token_ids
    assert finals["a"] == reference(tuple(a), 12) and finals["b"] == reference(tuple(b), 12)
    # cached after finishing: a third request with the same prefix computes only its tail again
    before = eng.stats.prefill_tokens
    out = eng.generate([base + [1]], GREEDY)[0]
    assert eng.stats.prefill_tokens - before == len(base) + 1 - 12
    assert out.token_ids == reference(tuple(base + [1]), 12)
    assert eng.blocks.num_free == eng.blocks.num_pages


def test_abort_frees_pages_without_leaks(model):
    eng = engine(model, num_pages=64)
    ps = prompts(12, seed=51)
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.7, seed=i, max_tokens=30, ignore_eos=True))
    eng.step()
    eng.abort("r0")  # running
    eng.abort("r11")  # maybe still waiting
    eng.abort("nope")  # unknown ids are ignored
    aborted = {}
    steps = 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.finish_reason == "abort":
                aborted[o.request_id] = o
        steps += 1
        if steps == 3:
            for i in range(1, 6):
                eng.abort(f"r{i}")
    assert set(aborted) == {"r0", "r11", "r1", "r2", "r3", "r4", "r5"}
    assert all(o.finished for o in aborted.values())
    assert eng.blocks.num_free == eng.blocks.num_pages
    assert not eng.has_unfinished()


def test_stop_conditions(model, reference, monkeypatch):
    p = prompts(1, seed=61)[0]
    ref = reference(tuple(p), 12)
    eng = engine(model)
    o = eng.generate([p], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ref[3]]))[0]
    assert o.token_ids == ref[:ref.index(ref[3]) + 1] and o.finish_reason == "stop"
    monkeypatch.setattr(model.config, "eos_token_id", [ref[2]])
    o = eng.generate([p], SamplingParams(temperature=0, max_tokens=12))[0]
    assert o.token_ids == ref[:ref.index(ref[2]) + 1] and o.finish_reason == "stop"
    o = eng.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert o.token_ids == ref and o.finish_reason == "length"
    short = engine(model, max_model_len=len(p) + 5)
    o = short.generate([p], GREEDY)[0]
    assert o.token_ids == ref[:5] and o.finish_reason == "length"


class CharTokenizer:
    """Token id i <-> one printable character: text and stop strings without a trained tokenizer (the random
    model emits arbitrary bytes, so a byte tokenizer would mostly produce invalid UTF-8 here)."""

    def encode(self, text):
        return [ord(c) - 33 for c in text]

    def decode(self, ids):
        return "".join(chr(33 + i % 94) for i in ids)


def test_text_streaming_and_stop_strings(model, reference):
    tok = CharTokenizer()
    eng = Engine(TorchBackend(model), tok, page_size=4, num_pages=64)
    prompt = "abcdefgh"
    ref = reference(tuple(tok.encode(prompt)), 12)
    text = tok.decode(ref)
    outs = list(eng.stream(prompt, GREEDY))
    assert [len(o.new_token_ids) for o in outs] == [1] * 12  # the prefill step already reports its token
    assert [t for o in outs for t in o.new_token_ids] == outs[-1].token_ids == ref
    assert "".join(o.new_text for o in outs) == outs[-1].text == text
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    j = next(j for j in range(2, 10) if text.find(text[j:j + 2]) == j)  # first occurrence at j
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["never", text[j:j + 2]])
    outs = list(eng.stream(prompt, params))
    assert outs[-1].finish_reason == "stop" and outs[-1].text == text[:j]
    assert outs[-1].token_ids == ref[:j + 2]  # generation ends with the token that completed the match
    assert "".join(o.new_text for o in outs) == text[:j]


def test_outputs_are_snapshots_made_when_read(model):
    """Each output's cumulative ids, text and logprobs are what the request had at that step, whenever they are
    read (the engine defers the copies, ``runtime.outputs.Deferred``: copying them at every step made a step's
    host work grow with the output's length); until read they are not made; the deltas add up to them, and the
    running ``cumulative_logprob`` equals the sum over the logprobs, in the same order."""
    from m3export.runtime.outputs import Deferred

    tok = CharTokenizer()
    eng = Engine(TorchBackend(model), tok, page_size=4, num_pages=64)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2, stop=["never!"])
    outs = list(eng.stream("abcdefgh", params))
    assert len(outs) == 10
    assert all(isinstance(o._token_ids, Deferred) and isinstance(o._text, Deferred) for o in outs)
    ids, text, lps = [], "", []
    for o in outs:  # read only now, after the request finished
        ids, text, lps = ids + o.new_token_ids, text + o.new_text, lps + o.new_logprobs
        assert o.token_ids == ids and o.text == text and o.logprobs == lps
        assert o.cumulative_logprob == sum(next(iter(lp.values())) for lp in o.logprobs)
    assert text == tok.decode(ids) and outs[-1].finished


def test_stream_closed_early_aborts(model):
    eng = engine(model, num_pages=32)
    it = eng.stream([1, 2, 3], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(it)
    it.close()
    eng.step()
    assert not eng.has_unfinished() and eng.blocks.num_free == 32


def test_logprobs(model):
    p = prompts(1, seed=71)[0]
    eng = engine(model)
    o = eng.generate([p], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2))[0]
    assert len(o.logprobs) == 3
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([p]))[0, -1].float(), -1)
    first = o.logprobs[0]
    assert next(iter(first)) == o.token_ids[0] and len(first) <= 3
    assert first[o.token_ids[0]] == pytest.approx(float(lp.max()), abs=1e-5)
    assert eng.generate([p], GREEDY)[0].logprobs is None


def test_add_request_validation(model):
    eng = engine(model, max_model_len=32)
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.add_request("x", [], GREEDY)
    with pytest.raises(ValueError, match="at most 31"):
        eng.add_request("x", list(range(32)), GREEDY)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        eng.add_request("x", "hello", GREEDY)
    with pytest.raises(ValueError, match=r"\[0, 320\)"):
        eng.add_request("x", [1, 999], GREEDY)
    with pytest.raises(ValueError, match="SamplingParams.stop needs a tokenizer"):
        eng.add_request("x", [1], SamplingParams(stop=["a"]))
    eng.add_request("x", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("x", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        engine(model, num_pages=4, max_model_len=64)


def test_pool_sized_by_bytes(model):
    per_page = TorchBackend(model).page_bytes(4)
    # 4 layers x (K + V: 4 rows x 2 heads x 32) + 3 sparse layers' index keys (4 x 32) + 1 MTP module (K, V, index)
    assert per_page == 8 * ((4 + 1) * 2 * 4 * 2 * 32 + (3 + 1) * 4 * 32)
    eng = Engine(TorchBackend(model), page_size=4, kv_cache_bytes=20 * per_page + 7)
    assert eng.blocks.num_pages == 20 and eng.max_model_len == 80
    with pytest.raises(ValueError, match="holds no page"):
        Engine(TorchBackend(model), page_size=4, kv_cache_bytes=per_page - 1)


def test_speculation_without_mtp_weights_is_off_and_says_so(caplog):
    m = tiny_model(num_mtp_modules=0)
    with caplog.at_level(logging.WARNING, logger="m3export.runtime"):
        eng = engine(m, num_speculative_tokens=3)
    assert eng.num_speculative_tokens == 0 and "no MTP weights" in caplog.text
    assert len(eng.generate([[5, 6, 7]], GREEDY)[0].token_ids) == 12


def test_checkpoints_load_in_bf16_on_a_gpu_unless_asked(monkeypatch):
    """``Engine.from_checkpoint`` without a dtype loads float32 on the CPU (the loader's default, as the reference
    ops run) and bfloat16 on any other device (vLLM's ``auto`` for M3's bf16 weights: float32 copies doubled the
    non-expert bytes on the H200); a given dtype is kept. The load is stood in for (no GPU here)."""
    import m3export
    from m3export.runtime.engine import checkpoint_dtype

    assert checkpoint_dtype("cpu", None) is None and checkpoint_dtype("cuda", None) == torch.bfloat16
    assert checkpoint_dtype("cuda:1", torch.float32) == torch.float32 and checkpoint_dtype("cpu", torch.float16) == \
        torch.float16
    seen = []

    def load(source, device="cpu", dtype=None, **kw):
        seen.append((device, dtype))
        raise RuntimeError("stand-in")

    monkeypatch.setattr(m3export, "load_model", load)
    for device, dtype in (("cpu", None), ("cuda", None), ("cuda", torch.float32)):
        with pytest.raises(RuntimeError, match="stand-in"):
            Engine.from_checkpoint("tiny", device=device, dtype=dtype)
    assert seen == [("cpu", None), ("cuda", torch.bfloat16), ("cuda", torch.float32)]
