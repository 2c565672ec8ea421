"""Per-rank ONNX export (``m3export/export/rank_export.py``) run in ONNX Runtime with the reductions done by the
runtime (``runtime/backends/rank_graphs.py``), against the single-graph artifact of the same model.

The oracle is the tiny preset's ordinary artifact (``model.onnx``) in ONNX Runtime: same weights (both are the
preset's deterministic random weights), same page size. Tolerance for logits: fp32 with some sums reordered
(each rank's partial over its heads / columns, then the sum of two): Higham's bound for a reordered sum of K <= 96
terms is ~K * 2^-24 relative, a few such sums per layer over 4 layers; 1e-4 of the largest logit covers it with
margin, and greedy tokens through the engine must be identical.
"""

from __future__ import annotations

import json

import pytest
import torch

from m3export.errors import ArtifactError
from m3export.export.rank_export import export_rank_artifact
from m3export.model.batch import Segment, build_batch
from m3export.runtime import Engine, SamplingParams
from m3export.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend
from m3export.runtime.backends.rank_graphs import RankGraphsBackend

pytestmark = pytest.mark.slow  # one per-rank export of tiny: ~20-40 s on the 2-core CI machine


@pytest.fixture(scope="module")
def rank_artifact(tmp_path_factory):
    return export_rank_artifact("tiny", tmp_path_factory.mktemp("ranks") / "tiny-tp2", 2, page_size=16)


def test_manifest_describes_ranks_slices_and_collectives(rank_artifact):
    m = json.loads((rank_artifact / "manifest.json").read_text())
    assert m["parallel"] == {"tensor_parallel_size": 2, "expert_parallel": False}
    assert [s["graph"] for s in m["segments"]] == [g for i in range(4) for g in (f"attn{i}", f"mlp{i}")] + ["head"]
    assert m["segments"][0]["then"].startswith("h = hidden")
    assert all("all_reduce_sum(partial)" in s["then"] for s in m["segments"][:-1])
    assert "all_gather" in m["segments"][-1]["then"]
    q = "model.layers.0.self_attn.q_proj.weight"  # 4 query heads of 32: rows [0, 64) on rank 0, [64, 128) on 1
    assert [r["slices"][q] for r in m["ranks"]] == [{"dim": 0, "ranges": [[0, 64]]}, {"dim": 0, "ranges": [[64, 128]]}]
    assert m["ranks"][0]["slices"]["model.norm.weight"] == {"replicated": True}
    assert m["ranks"][1]["tensors"][q]["shape"] == [64, 64]
    for r in m["ranks"]:  # every graph file and weight file is listed with its checksum
        assert {r["weights"], *r["graphs"].values()} <= set(m["files"])


def test_rank_graphs_with_runtime_reductions_equal_the_single_graph(rank_artifact, tiny_artifact):
    ranks, single = RankGraphsBackend(rank_artifact), OnnxRuntimeBackend.from_artifact(tiny_artifact)
    page = 16
    for be in (ranks, single):
        be.allocate(16, page)
    segments = [Segment([0, 1], 0, list(range(1, 21))), Segment([2], 0, [5, 6, 7])]
    ids, batch = build_batch(segments, page)
    rows = torch.tensor([19, 22])
    got, want = ranks.forward(ids, batch, rows), single.forward(ids, batch, rows)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert (g.double() - w.double()).abs().max() <= 1e-4 * w.double().abs().max()

    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[1, 2, 3], list(range(30, 70)), [200, 201, 202, 203, 204, 205]]
    tokens = [[o.token_ids for o in Engine(be, None, max_model_len=128, max_num_batched_tokens=24).generate(
        prompts, params)] for be in (RankGraphsBackend(rank_artifact), single)]
    assert tokens[0] == tokens[1]


def test_expert_parallel_per_rank_export_is_refused(tmp_path):
    with pytest.raises(ArtifactError, match="tensor parallelism only"):
        export_rank_artifact("tiny", tmp_path / "x", 2, expert_parallel=True)
