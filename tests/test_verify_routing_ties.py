"""``m3export verify`` and expert-routing near ties (``m3export/export/routing_ties.py``): a token whose routing
is within the bound of the other runtime's roundings has its later rows excused and counted, the rows it cannot
reach (other sequences, earlier tokens, earlier layers) are still judged, a gap just above the bound is a failure,
and an fp32 artifact has no ties.

The near tie is constructed on the tiny fp32 artifact: the reference's correction bias of one expert at one MoE
layer is raised so that, for exactly one token of the run, that expert overtakes the reference's k-th one by a gap
``g``; ONNX Runtime routes that token as before. With ``g`` half the token's bound the two routings are a near tie;
with twice the bound they are a real difference."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from m3export.export import routing_ties, verify
from m3export.export.artifact import load_torch_model
from m3export.model.batch import Segment, build_batch

LAYER = 1  # the first MoE layer of the tiny preset: later layers' cache rows and selections are in play


def _verify(art, load):
    original = verify.load_torch_model
    verify.load_torch_model = load
    try:
        return verify.verify_artifact(art, decode_steps=2, progress=False, hash_files=False)
    finally:
        verify.load_torch_model = original


@functools.lru_cache(maxsize=None)
def _routing_inputs(art):
    """Per main-model step of the verify run: (router input x [T, D] float64 at LAYER, query_start_loc) of the
    unperturbed reference, recorded by a pre-hook of this test's own."""
    seen = []

    def load(a):
        model = load_torch_model(a)
        step = model.step

        def recording_step(ids, batch, *args, **kwargs):
            seen.append([None, batch.query_start_loc.long().tolist()])
            return step(ids, batch, *args, **kwargs)

        model.step = recording_step
        model.model.layers[LAYER].mlp.register_forward_pre_hook(
            lambda mod, args: seen[-1].__setitem__(0, args[0].detach().double()))
        return model

    assert _verify(art, load).passed
    return seen


def _scores(model, x):
    gate = model.model.layers[LAYER].mlp.gate
    w, b = gate.weight.detach().double(), gate.e_score_correction_bias.detach().double()
    return torch.sigmoid(x @ w.t()) + b, w, b


def _construct(art, gap_in_bounds: float):
    """(load function whose reference routes one token differently by ``gap_in_bounds`` times its bound, the
    (step, token, sequence start, sequence end) of that token)."""
    model = load_torch_model(art)
    k = model.config.num_experts_per_tok
    candidates = []  # (distance of expert c below the token's k-th score, step, token, c)
    for step, (x, _) in enumerate(_routing_inputs(art)):
        s, _, _ = _scores(model, x)
        top = s.sort(-1, descending=True)
        kth = top.values[:, k - 1:k]
        for c in range(s.shape[1]):
            d = (kth[:, 0] - s[:, c]).masked_fill((top.indices[:, :k] == c).any(-1), math.inf)
            candidates += [(float(d[t]), step, t, c) for t in range(s.shape[0])]
    candidates.sort()
    for i, (d, step, token, expert) in enumerate(candidates):
        x, qsl = _routing_inputs(art)[step]
        start, end = max(q for q in qsl if q <= token), min(q for q in qsl if q > token)
        if step != 0 or end - token < 4:  # in the prefill, with later tokens of its sequence in the step
            continue
        s, w, b = _scores(model, x)
        kth_expert = int(s[token].sort(descending=True).indices[k - 1])
        beta = routing_ties.score_bounds(x[token:token + 1], w, b, "float32")[0]
        bound = float(beta[expert] + beta[kth_expert])
        raise_by = d + gap_in_bounds * bound
        # only this token changes its routing: every other (token, expert) distance is farther than the raise
        if all(c[0] > raise_by + 10 * bound for c in candidates[:i] + candidates[i + 1:] if c[3] == expert):
            break
    else:
        raise AssertionError("no prefill token can be made the run's only near tie")

    def load(a):
        m = load_torch_model(a)
        with torch.no_grad():
            m.model.layers[LAYER].mlp.gate.e_score_correction_bias[expert] += raise_by
        return m

    return load, (step, token, start, end)


def test_fp32_artifact_has_no_routing_ties(tiny_artifact):
    report = _verify(tiny_artifact, load_torch_model)
    assert report.passed and report.routing.ties == []
    assert report.routing.closest > 1.0  # tokens were judged, none within its bound
    assert "routing near ties: none" in "\n".join(report.lines())


def test_a_constructed_near_tie_is_excused_and_counted(tiny_artifact):
    load, (step, token, start, end) = _construct(tiny_artifact, 0.5)
    report = _verify(tiny_artifact, load)
    assert report.passed, "\n".join(report.lines())
    [tie] = report.routing.ties
    assert (tie.graph, tie.step, tie.token, tie.layer) == ("model", step, token, LAYER)
    assert tie.gap <= tie.bound and tie.gap == pytest.approx(0.5 * tie.bound, rel=1e-3)
    # the tied token and the later ones of its sequence: logits and hidden rows excused, nothing else
    rows = report.routing.excused["model:logits"]
    assert rows[0] == end - token and rows[1] == report.tokens
    assert 1 <= rows[2] <= rows[0]  # the tied token was routed otherwise: its row really differs, and is counted
    assert any(line.startswith("routing near ties: 1 tokens") for line in report.lines())
    # cache rows: the token from layer LAYER + 1 on, the later tokens from LAYER + 2 on (4 layers)
    layers = 4
    assert report.routing.excused["model:cache rows (token, layer)"][0] == (
        (layers - LAYER - 1) + (end - token - 1) * (layers - LAYER - 2))


def test_later_steps_need_the_forced_cache_rows(tiny_artifact, monkeypatch):
    """The tie is in the prefill at the start of a sequence: without copying the runtime's excused cache rows into
    the reference (teacher forcing of the caches), that sequence's later steps read other rows on the two sides
    and fail; with it they are judged in full and pass (the test above)."""
    load, _ = _construct(tiny_artifact, 0.5)
    monkeypatch.setattr(verify, "_force_rows", lambda *args: None)
    report = _verify(tiny_artifact, load)
    assert len(report.routing.ties) == 1
    assert not report.passed and report.outputs["model:logits"].max_rel > report.tolerance


def test_a_gap_just_above_the_bound_is_a_failure(tiny_artifact):
    load, (step, token, _, _) = _construct(tiny_artifact, 2.0)
    report = _verify(tiny_artifact, load)
    # (the real difference it leaves moves the later tokens' inputs: ties among those may be found, not this one)
    assert not [t for t in report.routing.ties if (t.step, t.token, t.layer) == (step, token, LAYER)]
    assert not report.passed and report.outputs["model:logits"].max_rel > report.tolerance


def test_rows_of_other_sequences_are_still_judged(tiny_artifact, monkeypatch):
    """With the near tie excused, a wrong logits row of the other sequence in the same step still fails."""
    from m3export.plugins.onnxruntime.session import PagedSession

    load, (step, token, start, end) = _construct(tiny_artifact, 0.5)
    other = 0 if start > 0 else end  # a token of another sequence of that step
    run, calls = PagedSession.run, []

    def wrong_row(self, feeds):
        out = run(self, feeds)
        if "selection.1" in out:  # the step graph (the MTP graphs have one "selection")
            calls.append(None)
            if len(calls) - 1 == step:
                out["logits"] = out["logits"].copy()
                out["logits"][other] += 1.0
        return out

    monkeypatch.setattr(PagedSession, "run", wrong_row)
    report = _verify(tiny_artifact, load)
    assert len(report.routing.ties) == 1
    assert not report.passed and report.outputs["model:logits"].max_rel > report.tolerance


def test_excused_rows_follow_the_sequence_and_the_layers(tiny_artifact, monkeypatch):
    """The watch's row rule on a two-sequence step, with a near tie forced at one token: that token from the next
    layer on, the later tokens of its sequence one layer later (their attention reads its rows), nothing of the
    other sequence or of earlier tokens; selections of both from the next layer on; final rows of both."""
    model = load_torch_model(tiny_artifact)
    ids, batch = build_batch([Segment([0], 0, list(range(5, 11))), Segment([1], 0, list(range(20, 24)))], 16)
    tied_token = 2  # in the first sequence (tokens 0..5)

    def bounds(x, w, b, dtype):  # no token is a tie but tied_token at the first MoE layer (all 10 tokens judged)
        beta = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
        if x.shape[0] == ids.numel():
            beta[tied_token] = math.inf
        return beta

    monkeypatch.setattr(routing_ties, "score_bounds", bounds)
    record = routing_ties.RoutingTies()
    with routing_ties.RoutingWatch(model, "float32", record) as watch, torch.no_grad():
        watch.begin("model", batch, 0)
        model.step(ids, batch, model.allocate_caches(2, 16, torch.float32, "cpu"))
        assert [(t.token, t.layer) for t in record.ties] == [(tied_token, LAYER)]
        first, later = torch.arange(10) == tied_token, (torch.arange(10) > tied_token) & (torch.arange(10) < 6)
        assert torch.equal(watch.cache_excused(LAYER), torch.zeros(10, dtype=torch.bool))
        assert torch.equal(watch.cache_excused(LAYER + 1), first)
        assert torch.equal(watch.cache_excused(LAYER + 2), first | later)
        assert torch.equal(watch.selection_excused(LAYER), torch.zeros(10, dtype=torch.bool))
        assert torch.equal(watch.selection_excused(LAYER + 1), first | later)
        assert torch.equal(watch.output_excused(), first | later)
    assert not model.model.layers[LAYER].mlp._forward_pre_hooks  # close() removed the hooks


def test_bound_covers_inputs_moved_as_the_derivation_assumes():
    """Router inputs each moved by up to rho = 2 R u of themselves (independent, as the model of the bound
    assumes), routed in fp32: every biased score stays within beta of the float64 one, for bfloat16 and fp32."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=gen, dtype=torch.float64)
    w = torch.randn(16, 512, generator=gen, dtype=torch.float64) * 0.05
    b = torch.randn(16, generator=gen, dtype=torch.float64) * 0.1
    exact = torch.sigmoid(x @ w.t()) + b
    for dtype in ("float32", "bfloat16"):
        rho = 2 * routing_ties.ROUTER_ROUNDINGS * routing_ties.unit_roundoff(dtype)
        moved = x * (1 + rho * (torch.rand(x.shape, generator=gen, dtype=torch.float64) * 2 - 1))
        got = (torch.sigmoid(moved.float() @ w.float().t()) + b.float()).double()
        beta = routing_ties.score_bounds(x, w, b, dtype)
        assert bool(((got - exact).abs() <= beta).all()), dtype
    # bfloat16's bound is the input term's, within ~10x of what the moved inputs do (lam = 7 against a sum's
    # typical ~1 standard deviation); fp32's is the fp32 dot term, a bound on any summation order (not checked here)
    assert bool(((got - exact).abs() > 0.1 * beta).any())
