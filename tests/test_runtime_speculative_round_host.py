"""The host bookkeeping of a speculative round that the graphed torch backend replays as one chain call, counted
(never timed). Per round the drafter used to lay out every module's pending catch-up runs (``drafter._Run``: one
per MTP module, each with a copy of the kept tokens) and to re-derive the round's call plan (``chain_plan``)
before it even tried the replayed chain, which needs neither: a greedy round at batch 1 always replays. Each test
counts one of those per round on the CPU, with the padded shapes run eagerly (``pad_eagerly``: what a graph
replays), and checks the greedy tokens still equal plain decoding's."""

import pytest
import torch

from m3export.runtime import Engine, SamplingParams, drafter
from m3export.runtime.backends.cuda_graph import GraphedTorchBackend


@pytest.fixture(scope="module")
def trained():
    """The embedded trained model in float32: its drafts are accepted, so rounds keep 1 .. k + 1 positions."""
    import m3export
    from m3export.embedded import default_model

    return m3export.load_model(default_model(), dtype=torch.float32, progress=False)


PROMPTS = [list(range(40 + 7 * i, 72 + 7 * i)) for i in range(2)]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


class Counted:
    """A stand-in for a drafter-module class or function that counts its calls and forwards them."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("k", [2, 3])
def test_a_replayed_round_builds_no_per_module_runs_and_plans_each_shape_once(trained, monkeypatch, k):
    """Decode rounds that replay their chain make no ``_Run`` (the old drafter made one per module used per round,
    2 here, before trying the chain), and the round's plan is built once per (kept positions, drafts) shape, not
    once per round (the old drafter rebuilt it every round: as many plans as chain calls). Same tokens as plain."""
    plain = Engine(GraphedTorchBackend(trained, use_graphs=False), num_pages=64).generate(PROMPTS, PARAMS)
    runs, plans = Counted(drafter._Run), Counted(drafter.ChainPlan)
    monkeypatch.setattr(drafter, "_Run", runs)
    monkeypatch.setattr(drafter, "ChainPlan", plans)
    # shapes other tests planned must be planned again here, and counted
    getattr(drafter.chain_plan, "cache_clear", lambda: None)()
    be = GraphedTorchBackend(trained, use_graphs=False, pad_eagerly=True)
    eng = Engine(be, num_pages=64, num_speculative_tokens=k)
    outs = []
    for i, prompt in enumerate(PROMPTS):  # one request at a time: every round is uniform, so every round replays
        eng.add_request(f"r{i}", prompt, PARAMS)
        eng.step()  # the prompt: its catch-up over 32 positions runs module by module (past a page), runs counted
        per_step = []  # (runs built, chains replayed) per decode step
        while eng.has_unfinished():
            runs.calls, chains = 0, be.chain_replays
            for o in eng.step():
                if o.finished:
                    outs.append(o.token_ids)
            per_step.append((runs.calls, be.chain_replays - chains))
        # (a request one token from max_tokens drafts nothing: its catch-up alone still goes module by module)
        replayed = [n for n, chained in per_step if chained]
        assert len(replayed) > 5, per_step
        assert sum(replayed) == 0, f"per-module runs built in replayed rounds: {per_step}"
    assert outs == [o.token_ids for o in plain]
    assert eng.stats.accepted_tokens > 0
    # shapes: q = 1 .. k + 1 kept positions by k' = 1 .. k drafts (fewer near max_tokens), each planned once
    assert plans.calls <= (k + 1) * k < be.chain_replays, (plans.calls, be.chain_replays)


def test_a_replayed_chain_computes_no_index_per_call(trained, monkeypatch):
    """Inside the replayed round (run eagerly here: ``pad_eagerly`` runs the captured step itself each round) each
    call's ``query_start_loc`` and last-position rows are read from tensors made once per shape, not computed
    (two ``arange`` kernels and two more per call per replay before). Same tokens as plain."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Aranges(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.overloadpacket.__name__ == "arange"
            return func(*args, **(kwargs or {}))

    be = GraphedTorchBackend(trained, use_graphs=False, pad_eagerly=True)
    per_round = []
    chain = be.mtp_chain

    def counted(plan, *args):
        with Aranges() as mode:
            out = chain(plan, *args)
        per_round.append((plan, mode.n))
        return out

    monkeypatch.setattr(be, "mtp_chain", counted)
    plain = Engine(GraphedTorchBackend(trained, use_graphs=False), num_pages=64).generate(PROMPTS[:1], PARAMS)
    outs = Engine(be, num_pages=64, num_speculative_tokens=2).generate(PROMPTS[:1], PARAMS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert be.chain_replays > 5
    # the first round of a plan makes its static inputs and any index of a new call size; a plan seen before none
    seen, again = set(), []
    for plan, n in per_round:
        if plan in seen:
            again.append(n)
        seen.add(plan)
    assert len(again) > 5 and sum(again) == 0, per_round
