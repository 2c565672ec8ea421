"""bench/ort_step_host.py on the CPU EP: it runs end to end, its count of a steady step's IOBinding calls is 0
(PagedSession binds once; tests/test_paged_session_binding.py counts them in detail), and ``--nodes`` attributes
every node of a step to the graph level or an ``m3`` op's inlined body, ``--cuda-placement`` predicts the CUDA EP's
host nodes and copies."""

from __future__ import annotations

import json
from pathlib import Path

from tests.session_census import run_with_census

BENCH = Path(__file__).resolve().parents[1] / "bench" / "ort_step_host.py"


def test_cpu_run_writes_rows_and_a_steady_step_binds_nothing(tiny_artifact, tmp_path):
    out = tmp_path / "host.json"
    run, opened, unclosed = run_with_census(BENCH, ["--artifact", str(tiny_artifact), "--provider", "cpu", "--threads",
                                                    "1", "--reps", "2", "--shapes", "1x20,2x40", "--nodes",
                                                    "--profile-steps", "2", "--cuda-placement", "--json", str(out)],
                                            timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    # the backend's sessions and --nodes' profiled one (its backend's own one replaced): all closed before exit
    assert opened >= 3 and unclosed == 0, (opened, unclosed)
    res = json.loads(out.read_text())
    assert res["provider"] == "CPUExecutionProvider" and res["pools"] > 0
    assert [(r["batch"], r["context"]) for r in res["rows"]] == [(1, 20), (2, 40)]
    for row in res["rows"]:
        assert row["binding_calls"] == 0 and row["step_ms"] > 0 and row["host_us"] > 0
    # --nodes: the first shape's step, every executed node attributed (the tiny model: 1 dense + 3 sparse layers)
    nodes = res["nodes"]
    origins = {r["origin"]: r for r in nodes["origins"]}
    assert (nodes["batch"], nodes["context"]) == (1, 20)
    assert sum(r["nodes_per_step"] for r in origins.values()) == nodes["nodes_per_step"] > 0
    assert {"graph", "PagedAttention", "SparsePagedAttention", "LightningIndexer", "MoE"} <= set(origins)
    assert origins["PagedAttention"]["instances"] == 1 and origins["SparsePagedAttention"]["instances"] == 3
    assert nodes["cpu_ep_per_step"] == nodes["nodes_per_step"]  # the CPU EP runs every node here
    # --cuda-placement: the CUDA EP's placement predicted from ORT's optimised graph (no GPU needed)
    placed = res["cuda_placement"]
    assert placed["nodes"] > placed["cpu_ep_nodes"] > 0 and placed["memcpy_from_host"] >= 0
    assert sum(placed["memcpy_to_host_by_origin"].values()) == placed["memcpy_to_host"]
