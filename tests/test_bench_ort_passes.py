"""bench/ort_passes.py on the CPU EP (tiny fp32 artifact): each pass rewrites the artifact's own decode graph (23
norms, 14 rotations), the RoPE variant is bit-equal to the no-pass graph, the RMSNorm variant within its bound
(``tests/test_ort_fused_norms_decode.py``'s), the torch backend agrees with all of them, and the router taps report
each MoE layer's routing, unchanged by either pass here, and the block selections equal the torch backend's."""

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
                                  "both": {"rms_norm": 23, "rope": 14}}, r["rewritten"]
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
