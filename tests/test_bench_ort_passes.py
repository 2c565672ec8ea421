"""bench/ort_passes.py on the CPU EP (tiny fp32 artifact): each pass rewrites the artifact's own decode graph (23
norms, 14 rotations), the RoPE variant is bit-equal to the no-pass graph, the RMSNorm variant within its bound
(``tests/test_ort_fused_norms_decode.py``'s), the torch backend agrees with all of them, and the router taps report
each MoE layer's routing, unchanged by either pass here, and the block selections equal the torch backend's; the
DecodeAttention lowering keeps the fp32 dense node there (reported "kept") and, on the float16 tiny artifact,
lowers it: its attention output within the lowering's bound, the no-pass graph's greedy tokens and experts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "ort_passes.py"


def test_cpu_run_rewrites_and_compares_each_pass(tiny_artifact, tmp_path):  # noqa: F811
    out = tmp_path / "p.json"
    run = subprocess.run([sys.executable, str(BENCH), "--artifact", str(tiny_artifact), "--provider", "cpu",
                          "--context", "60", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [8, 1] and len(set(rows[0]["contexts"])) == 8  # 8 different positions
    for r in rows:
        assert r["rewritten"] == {"none": {}, "rms_norm": {"rms_norm": 23}, "rope": {"rope": 14},
                                  "both": {"rms_norm": 23, "rope": 14},
                                  "decode_attention": {"decode_attention": 0, "decode_attention_kept": {
                                      "node_paged_attention": r["decode_attention"]["kept"][
                                          "node_paged_attention"]}}}, r["rewritten"]
        # fp32 pools: the DecodeAttention lowering keeps the dense node, and the variant is reported, not run
        assert "FLOAT pools" in r["decode_attention"]["kept"]["node_paged_attention"], r["decode_attention"]
        assert r["rope"]["bit_equal_to_none"] and r["none"]["bit_equal_to_none"]
        # fp32: the fused norm moves a few fp32 ulps (fused_norms.py), ~1e-6 of the logits' scale through 4 layers
        for name in ("rms_norm", "both"):
            assert 0 < r[name]["max_abs_diff_vs_none"] <= 1e-5 * r["logit_scale"], (name, r[name])
        # the same greedy tokens everywhere; the torch backend within the fp32 distance of two implementations
        assert all(r[n]["greedy_same_as_none"] and r[n]["greedy_same_as_torch"] for n in ("none", "rms_norm", "rope",
                                                                                       "both"))
        assert r["none"]["max_abs_diff_vs_torch"] <= 1e-5 * r["logit_scale"]
        general = r["general_graph"]  # the general step graph on the same step: the same logits, within fp32 rounding
        assert general["greedy_same_as_torch"] and max(general["row_diffs_vs_torch"]) <= 1e-5 * r["logit_scale"]
        assert max(r["unpadded_decode"]["row_diffs_vs_padded"]) <= 1e-5 * r["logit_scale"]  # padding changes nothing
        # the decode graph's block selections (tapped) against the torch backend's (hooks): three sparse layers,
        # the same blocks for every token and KV head here
        assert [(x["layer"], x["differ"]) for x in r["selections_vs_torch"]] == [(0, []), (1, []), (2, [])]
        # the router taps of the decode graph: one per MoE layer (the tiny model's 3), no token rerouted in fp32
        assert len(r["routing"]) == 3, r["routing"]
        for layer in r["routing"].values():
            assert layer["min_margin"] > 0 and all(layer[n]["tokens_rerouted"] == [] for n in ("rms_norm", "rope",
                                                                                                 "both"))
            assert layer["rope"]["max_abs_router_input_diff"] == 0  # the RoPE pass is exact
            # the torch backend's router inputs (hooks) within fp32 rounding of ORT's, the same experts chosen
            t = layer["torch"]
            assert t["tokens_rerouted"] == [] and t["max_abs_router_input_diff"] <= 1e-5 * t["router_input_scale"], t


def test_cpu_run_reports_the_decode_attention_lowering_in_float16(fp16_trt_artifact, tmp_path):  # noqa: F811
    """The DecodeAttention variant on the float16 tiny artifact (the CPU EP has float16 Attention-24 kernels, no
    bfloat16 ones): one dense node lowered, its attention output within the lowering's bound where that applies
    (the first dense layer: everything upstream the same nodes), the same greedy tokens and experts as the no-pass
    graph."""
    out = tmp_path / "p.json"
    run = subprocess.run([sys.executable, str(BENCH), "--artifact", str(fp16_trt_artifact), "--provider", "cpu",
                          "--context", "40", "--variants", "none,decode_attention", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "decode_attention" in run.stdout and "dense attention 0" in run.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [8, 1]
    for r in rows:
        assert r["rewritten"] == {"none": {}, "decode_attention": {"decode_attention": 1}}, r["rewritten"]
        v = r["decode_attention"]
        # the tiny model's one dense layer (layer 0, first in the graph): q and the pools are the no-pass graph's,
        # so the difference is the op's own and the lowering's CPU test's bound applies, output_error_bound
        # (fp16: (3u + u^2 + 2^-12) max|V|, u = 2^-11, on the tapped max|V| of the pool after this step's write)
        (dense,) = v["dense_attention"]
        assert dense["bound_applies"] and dense["within_bound"], dense
        assert dense["max_abs_diff_vs_none"] <= dense["bound"] and dense["output_scale"] > 0.05, dense
        # the logits carry that difference through three more layers, their norms and MoE routing (a near-tie
        # margin flips an expert: a difference of the logits' own size), so no attention bound reaches them and
        # none is asserted. On this seeded step (smallest routing margin ~7e-4, batch 8's layer 1) no expert
        # changes and the greedy tokens are the no-pass graph's; were a near-tie flipped, the routing row names
        # the token and its margin
        assert v["greedy_same_as_none"] and not v["bit_equal_to_none"], v
        assert len(r["routing"]) == 3
        for layer in r["routing"].values():
            assert layer["decode_attention"]["tokens_rerouted"] == [], layer


def test_selections_name_the_blocks_only_one_side_chose():
    import torch

    sys.path.insert(0, str(BENCH.parent))
    import ort_passes

    mine = torch.tensor([[[3, 1, -1], [0, 2, 5]], [[7, 8, 9], [1, 2, 3]]], dtype=torch.int32)  # [T, Hkv, K]
    theirs = torch.tensor([[[1, 3, -1], [0, 2, 6]], [[9, 8, 7], [1, 2, 3]]], dtype=torch.int32)
    got = ort_passes.selections({f"{ort_passes.SELECTION}0": mine}, [theirs], batch=2)
    # order within a list and the unused slot (-1) do not count; token 0 head 1 chose 5 where torch chose 6
    assert got == [{"layer": 0, "differ": [{"token": 0, "head": 1, "ort_only": [5], "torch_only": [6]}]}]
    assert ort_passes.selections({f"{ort_passes.SELECTION}0": mine}, [theirs], batch=0) == [{"layer": 0,
                                                                                             "differ": []}]
