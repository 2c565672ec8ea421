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
