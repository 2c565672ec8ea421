"""``m3export verify`` and expert routing (``m3export/export/routing_ties.py``, ``router_taps.py``): ONNX Runtime's
routing is read (its MoE bodies' chosen ids) and recomputed from its own router inputs (graph outputs of a
verify-only copy of each graph), the two checked against each other, compared per token with the reference's
routing, and the reference is forced to ONNX Runtime's experts where they differ.

The difference is constructed on ONNX Runtime's side: a copy of the tiny fp32 artifact whose correction bias of one
expert at one MoE layer is raised so that, for exactly one token of the run, that expert overtakes the token's
k-th one in ONNX Runtime (the bias only ranks: the routing weights do not change). The reference is the model of
the original artifact, so it routes that token as before."""

from __future__ import annotations

import functools
import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from m3export.export import routing_ties, verify
from m3export.export.artifact import load_artifact, load_torch_model
from m3export.export.router_taps import tap_router_inputs
from m3export.ops import routing_bound

LAYER = 1  # the first MoE layer of the tiny preset: later layers' cache rows and selections are in play
SEPARATION = 1e-3  # the raised expert's margin to every other token's routing: far above fp32's (~1e-6 here)


def _verify(art, reference=None):
    """verify ``art`` against the model of ``reference`` (default: ``art`` itself)."""
    original = verify.load_torch_model
    verify.load_torch_model = lambda a: load_torch_model(a if reference is None else reference)
    try:
        return verify.verify_artifact(art, decode_steps=2, progress=False, hash_files=False)
    finally:
        verify.load_torch_model = original


@functools.lru_cache(maxsize=None)
def _router_inputs(art):
    """The reference's router inputs x [T, D] (float64) at LAYER, per main-model step of the verify run."""
    seen = []
    original = verify.load_torch_model

    def load(a):
        model = original(a)
        model.model.layers[LAYER].mlp.register_forward_pre_hook(lambda mod, args: seen.append(args[0].double()))
        return model

    verify.load_torch_model = load
    try:
        assert verify.verify_artifact(art, decode_steps=2, progress=False, hash_files=False).passed
    finally:
        verify.load_torch_model = original
    return seen


def _flipped(art, tmp):
    """(a copy of ``art`` in ``tmp`` whose ONNX Runtime routes one token of the run otherwise at LAYER, that
    token's (step, token, expert raised))."""
    model = load_torch_model(art)
    gate = model.model.layers[LAYER].mlp.gate
    w, b = gate.weight.detach().double(), gate.e_score_correction_bias.detach().double()
    k = model.config.num_experts_per_tok
    best = None
    for expert in range(w.shape[0]):  # distances of the expert below each (step, token)'s k-th biased score
        dist = []
        for step, x in enumerate(_router_inputs(art)):
            s = torch.sigmoid(x @ w.t()) + b
            top = s.sort(-1, descending=True)
            kept = (top.indices[:, :k] == expert).any(-1)
            d = (top.values[:, k - 1] - s[:, expert]).masked_fill(kept, float("inf"))
            dist += [(float(d[t]), step, t) for t in range(s.shape[0])]
        dist.sort()
        sep = dist[1][0] - dist[0][0]
        if best is None or sep > best[0]:
            best = (sep, expert, dist[0], dist[1][0])
    sep, expert, (d0, step, token), d1 = best
    assert sep > 2 * SEPARATION, "no token's routing can be flipped alone"
    root = tmp / "flipped"
    shutil.copytree(art, root)
    entry = json.loads((root / "manifest.json").read_text())["tensors"][
        f"model.layers.{LAYER}.mlp.gate.e_score_correction_bias"]
    with open(root / entry["file"], "r+b") as f:  # the bias ONNX Runtime reads (the reference keeps its own)
        f.seek(entry["offset"] + 4 * expert)
        value = np.frombuffer(f.read(4), np.float32)[0]
        f.seek(entry["offset"] + 4 * expert)
        f.write(np.float32(value + (d0 + d1) / 2).tobytes())
    return root, (step, token, expert)


@pytest.fixture(scope="module")
def flipped(tiny_artifact, tmp_path_factory):
    return _flipped(tiny_artifact, tmp_path_factory.mktemp("flipped"))


def test_fp32_artifact_routes_alike(tiny_artifact):
    report = _verify(tiny_artifact)
    assert report.passed, "\n".join(report.lines())
    assert report.routing.differences == [] and report.routing.fp32_ties == []
    assert report.routing.routings == report.tokens * 4  # 3 MoE layers of the model, 1 of the MTP module
    assert report.routing.read_ids == report.routing.routings and report.routing.inconsistent == 0
    assert 1.0 < report.routing.closest < float("inf")  # tokens were judged, none within its fp32 bound
    assert report.outputs["model:router inputs (MoE layers)"].max_rel <= report.tolerance
    assert "0 of" in "\n".join(report.lines())


def test_a_routing_difference_is_found_forced_and_counted(tiny_artifact, flipped):
    root, (step, token, expert) = flipped
    report = _verify(root, reference=tiny_artifact)
    assert report.passed, "\n".join(report.lines())
    [diff] = report.routing.differences
    assert (diff.graph, diff.step, diff.token, diff.layer) == ("model", step, token, LAYER)
    assert expert in diff.runtime and expert not in diff.reference
    assert len(set(diff.runtime) ^ set(diff.reference)) == 2  # one expert swapped for another
    assert report.routing.fp32_ties == []  # the flip is far beyond fp32's bound
    assert any(line.startswith("expert routing from each side's router inputs: 1 of") for line in report.lines())


def test_without_forcing_the_difference_fails(tiny_artifact, flipped, monkeypatch):
    root, _ = flipped
    monkeypatch.setattr(routing_ties, "_forced", lambda module, x, experts: module.forward(x))
    report = _verify(root, reference=tiny_artifact)
    assert len(report.routing.differences) >= 1
    assert not report.passed and report.outputs["model:logits"].max_rel > report.tolerance


def test_a_wrong_logits_row_elsewhere_still_fails(tiny_artifact, flipped, monkeypatch):
    from m3export.plugins.onnxruntime.session import PagedSession

    root, (step, token, _) = flipped
    run, calls = PagedSession.run, []

    def wrong_row(self, feeds):
        out = run(self, feeds)
        if "selection.1" in out:  # the step graph (the MTP graphs have one "selection")
            calls.append(None)
            if len(calls) - 1 == step:
                out["logits"] = out["logits"].copy()
                out["logits"][0 if token else 1] += 1.0
        return out

    monkeypatch.setattr(PagedSession, "run", wrong_row)
    report = _verify(root, reference=tiny_artifact)
    assert len(report.routing.differences) == 1
    assert not report.passed and report.outputs["model:logits"].max_rel > report.tolerance


def test_forced_routing_is_the_moe_of_the_given_experts(tiny_artifact):
    """``_forced`` against the MoE computed by hand in float64 from the module's weights for a chosen expert set
    (weights: the unbiased scores renormalised over the set); the bias is left as it was."""
    model = load_torch_model(tiny_artifact)
    moe = model.model.layers[LAYER].mlp
    cfg = moe.cfg
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, cfg.hidden_size, generator=gen)
    bias = moe.gate.e_score_correction_bias.detach().clone()
    experts = [0, 3, 5, 6][:cfg.num_experts_per_tok]
    got = routing_ties._forced(moe, x, experts)
    assert torch.equal(moe.gate.e_score_correction_bias, bias)

    def swiglu(gu):
        gate, up = gu.chunk(2, -1)
        gate, up = gate.clamp(max=cfg.swiglu_limit), up.clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
        return (up + 1) * gate * torch.sigmoid(gate * cfg.swiglu_alpha)

    x64 = x.double()
    s = torch.sigmoid(x64 @ moe.gate.weight.double().t())[:, experts]
    wts = s / s.sum(-1, keepdim=True)
    routed = sum(wts[:, j:j + 1] * (swiglu(x64 @ moe.experts.w13[e].double().t()) @ moe.experts.w2[e].double().t())
                 for j, e in enumerate(experts))
    sh = moe.shared_experts
    want = routed * cfg.routed_scaling_factor + swiglu(x64 @ sh.gate_up_proj.weight.double().t()) @ \
        sh.down_proj.weight.double().t()
    # fp32 matmuls of width <= 64 and a few elementwise ops: ~1e-6 relative; 1e-5 leaves room, an other expert O(1)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_router_taps_add_outputs_only(tiny_artifact):
    """The verify-only copy: the artifact graph's nodes, outputs and functions, plus one Identity per MoE node."""
    art = load_artifact(tiny_artifact, verify_checksums=False)
    tapped = tap_router_inputs(art, "model")
    copy = onnx.load_from_string(tapped.model)
    orig = onnx.load(str(art.path("model")), load_external_data=False)
    assert [o.name for o in copy.graph.output][:len(orig.graph.output)] == [o.name for o in orig.graph.output]
    assert [t.module for t in tapped.taps] == [f"model.layers.{i}.mlp" for i in (1, 2, 3)]
    assert len(copy.graph.node) == len(orig.graph.node) + 3 and len(copy.functions) == len(orig.functions)
    assert tapped.graph.output_names[-6:] == [name for t in tapped.taps for name in (t.output, t.experts)]
    [body] = [f for f in copy.functions if f.name == "MoE"]
    [orig_body] = [f for f in orig.functions if f.name == "MoE"]
    assert len(body.output) == 2 and len(body.node) == len(orig_body.node) + 1  # the ids, through one Identity
    assert np.array_equal(tapped.taps[0].bias, load_torch_model(art).model.layers[1].mlp.gate
                          .e_score_correction_bias.detach().double().numpy())


def test_ort_fp32_router_is_within_the_bound():
    """ONNX Runtime's fp32 router arithmetic (the MoE body's Cast / MatMul / Sigmoid / Add) on random inputs at
    D = 2048 stays within ``routing_bound.fp32_score_bounds`` of float64; its Sigmoid alone within ``SIGMOID_ERROR``."""
    d, e = 2048, 16
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "wt"], ["z"]), helper.make_node("Sigmoid", ["z"], ["s"]),
         helper.make_node("Add", ["s", "b"], ["out"])], "router",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("x", "wt", "b")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("s", "out", "z")])
    sess = ort.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
                                .SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, d)).astype(np.float32)
    w = (rng.standard_normal((e, d)) * 0.05).astype(np.float32)
    b = (rng.standard_normal(e) * 0.1).astype(np.float32)
    s32, out, _ = sess.run(None, {"x": x, "wt": np.ascontiguousarray(w.T), "b": b})
    x64, w64, b64 = (torch.from_numpy(a.astype(np.float64)) for a in (x, w, b))
    exact = torch.sigmoid(x64 @ w64.t()) + b64
    beta = routing_bound.fp32_score_bounds(x64, w64, b64)
    assert bool(((torch.from_numpy(out.astype(np.float64)) - exact).abs() <= beta).all())
    # the Sigmoid kernel alone, over a dense sweep of fp32 inputs (its error does not depend on the MatMul's)
    z = np.linspace(-30, 30, 1 << 20, dtype=np.float32)[None, :]
    sig, _, _ = sess.run(None, {"x": z.reshape(-1, 1), "wt": np.ones((1, 1), np.float32),
                               "b": np.zeros(1, np.float32)})
    err = np.abs(sig.astype(np.float64)[:, 0] - 1 / (1 + np.exp(-z[0].astype(np.float64)))).max()
    assert err <= routing_bound.SIGMOID_ERROR, err


def test_without_graphsurgeon_verify_says_what_to_install(tiny_artifact, monkeypatch):
    import sys

    from m3export.errors import BackendUnavailable

    monkeypatch.setitem(sys.modules, "onnx_graphsurgeon", None)  # import raises ImportError
    with pytest.raises(BackendUnavailable, match="pip install onnx-graphsurgeon"):
        tap_router_inputs(load_artifact(tiny_artifact, verify_checksums=False), "model")


def test_ort_ids_against_its_own_router_scores(tiny_artifact, monkeypatch):
    """ONNX Runtime's expert ids are read and checked: an id swapped for an expert its router scores far lower
    (every margin of this run is >20x its fp32 bound: the fp32 test above) is a MISMATCH, not a routing
    difference the reference follows silently."""
    from m3export.plugins.onnxruntime.session import PagedSession

    run, calls = PagedSession.run, []
    name = f"router_experts.model.layers.{LAYER}.mlp"
    experts = load_artifact(tiny_artifact, verify_checksums=False).config.num_local_experts

    def wrong_id(self, feeds):
        out = run(self, feeds)
        if name in out:
            calls.append(None)
            if len(calls) == 1:
                ids = out[name] = out[name].copy()
                ids[3, 0] = min(set(range(experts)) - set(ids[3].tolist()))  # an expert it did not keep
        return out

    monkeypatch.setattr(PagedSession, "run", wrong_id)
    report = _verify(tiny_artifact)
    assert report.routing.inconsistent == 1 and not report.passed
    assert any("not an fp32 tie: model step 0, token 3, layer 1" in line for line in report.lines())
