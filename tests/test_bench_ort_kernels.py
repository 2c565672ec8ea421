"""bench/ort_kernels.py: the kernel-to-node attribution against hand-built traces (a known clock shift between the
two profilers is recovered, each kernel lands on the node that launched it, correlation and order linking, the
replayed graph's gaps), and the script end to end on the CPU EP (ORT's nodes only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "ort_kernels.py"
sys.path.insert(0, str(BENCH.parent))
import ort_kernels  # noqa: E402  (bench/ort_kernels.py)

START = 1_796_000_000_000_000_000  # ORT's profiling start, Unix ns
SHIFT = 37_250  # ns the torch profiler's clock runs behind ORT's in the synthetic trace


def _trace(steps: int = 2):
    """ORT events of ``steps`` runs of three nodes (a graph-level Cast, two nodes of an inlined MoE body), each
    launching kernels; the torch profiler's launches (SHIFT ns earlier on its clock) and GPU activities."""
    events, launches, gpu = [], [], []
    corr = 100
    nodes = [("node_Cast_3", "Cast", ["cast_kernel"]),
             ("_inlfunc_MoE_token_1_n7", "MatMul", ["sm90_xmma_gemm_bf16", "splitk_reduce"]),
             ("_inlfunc_MoE_n9", "Add", ["_BinaryElementWiseSimple<OP_Add>"])]
    t = 1000  # us from ORT's start
    for _ in range(steps):
        run0 = t
        for name, op, kernels in nodes:
            events.append({"cat": "Node", "name": f"{name}_kernel_time", "ts": t, "dur": 10,
                           "args": {"op_name": op, "provider": "CUDAExecutionProvider"}})
            for j, k in enumerate(kernels):
                host = START + (t + 2 + 3 * j) * 1000 - SHIFT
                launches.append({"ts": host, "corr": corr, "name": "cudaLaunchKernel"})
                gpu.append({"start": host + 50_000, "dur": 4000 + 1000 * j, "corr": corr,
                            "name": f"void onnxruntime::cuda::{k}<float, 4>(float*, int)"})
                corr += 1
            t += 12
        events.append({"cat": "Session", "name": "model_run", "ts": run0 - 1, "dur": t - run0 + 1})
        # a torch copy between runs (the input upload), outside every ORT run
        launches.append({"ts": START + (t + 20) * 1000 - SHIFT, "corr": corr, "name": "cudaMemcpyAsync"})
        gpu.append({"start": START + (t + 25) * 1000, "dur": 1000, "corr": corr,
                    "name": "Memcpy HtoD (Pinned -> Device)"})
        corr += 1
        t += 100
    return events, launches, gpu


def test_kernels_land_on_the_nodes_that_launched_them():
    events, launches, gpu = _trace()
    nodes, windows = ort_kernels.node_windows(events, START, 2)
    linked, how = ort_kernels.link(launches, gpu)
    assert how == "correlation" and all(x is not None for x in linked)
    ts = np.array([x["ts"] for x in launches], dtype=np.int64)
    shift, inside = ort_kernels.fit_offset(ts, [g["name"] for g in gpu], nodes)
    # every kernel launch is inside its node once shifted (the uploads are not: 8 of 10 launches); the shifts that
    # keep every launch in its own node are SHIFT - 2 us .. SHIFT + 5 us (launches 2 and 5 us into 10 us nodes)
    assert abs(inside - 0.8) < 1e-9 and SHIFT - 2000 <= shift < SHIFT + 5000, (shift, inside)
    got = ort_kernels.attribute(launches, gpu, linked, nodes, windows, shift)
    assert len(got) == 8  # the uploads are outside ORT's runs
    assert [(k["step"], k["origin"], k["op"], k["family"]) for k in got[:4]] == [
        (0, "graph", "Cast", "cast_kernel"), (0, "MoE", "MatMul", "gemm (sm90_xmma_gemm_bf16)"),
        (0, "MoE", "MatMul", "splitk_reduce"), (0, "MoE", "Add", "_BinaryElementWiseSimple")]
    t = ort_kernels.tables(got, 2)
    assert t["kernels_per_step"] == 4 and abs(t["busy_ms_per_step"] - 0.017) < 1e-12  # 4 + 4 + 5 + 4 us
    by_origin = {r["key"]: r["us_per_step"] for r in t["by_origin"]}
    assert by_origin == {"MoE": 13.0, "graph": 4.0}


def test_an_unfitted_clock_attributes_kernels_to_the_wrong_nodes():
    """Without the fitted shift (the launches 37 us off) the attribution is wrong: the kernels fall outside ORT's
    runs and each step's input upload lands on a MoE MatMul (so a fit returning shift 0 fails the test above)."""
    events, launches, gpu = _trace()
    nodes, windows = ort_kernels.node_windows(events, START, 2)
    linked, _ = ort_kernels.link(launches, gpu)
    got = ort_kernels.attribute(launches, gpu, linked, nodes, windows, 0)
    assert [(k["family"], k["op"]) for k in got] == [("Memcpy HtoD", "MatMul")] * 2  # one upload a step


def test_link_by_order_where_correlation_ids_do_not_match():
    _, launches, gpu = _trace(1)
    for g in gpu:
        g["corr"] += 10_000
    linked, how = ort_kernels.link(launches, gpu)
    assert how == "order" and [x["ts"] for x in linked] == [x["ts"] for x in launches]
    linked, how = ort_kernels.link(launches[:-1], gpu)  # one launch missing: no guess
    assert how.startswith("none") and linked == [None] * len(gpu)


def test_replay_gaps_and_its_kernels_mapped_to_the_eager_nodes():
    events, launches, gpu = _trace(1)
    nodes, windows = ort_kernels.node_windows(events, START, 1)
    linked, _ = ort_kernels.link(launches, gpu)
    eager = ort_kernels.attribute(launches, gpu, linked, nodes, windows, SHIFT)
    # two replays: one graph launch each, the eager step's 4 kernels back to back with 2 us between them
    glaunch, ggpu = [], []
    for r, corr in enumerate((7, 8)):
        glaunch.append({"ts": r * 10**6, "corr": corr, "name": "cudaGraphLaunch"})
        t = r * 10**6 + 5000
        for k in eager:
            ggpu.append({"start": t, "dur": 3000, "corr": corr, "name": f"void {k['kernel']}(x)"})
            t += 3000 + 2000
    linked, _ = ort_kernels.link(glaunch, ggpu)
    graphs = ort_kernels.replays(glaunch, ggpu, linked)
    s = ort_kernels.replay_summary(graphs, step_ms=0.030, eager=eager)
    assert s["replays"] == 2 and s["kernels"] == 4
    assert abs(s["busy_ms"] - 0.012) < 1e-12 and abs(s["span_ms"] - 0.018) < 1e-12
    assert abs(s["gap_us_per_kernel"] - 1.5) < 1e-9 and abs(s["outside_graph_ms"] - 0.012) < 1e-12
    assert s["replays_matching_eager_order"] == 2
    assert sum(r["count_per_step"] for r in s["by_kernel"]) == 4 and s["by_kernel"][0]["us_per_step"] == 3.0
    assert {r["key"]: r["us_per_step"] for r in s["replay_by_origin"]} == {"MoE": 9.0, "graph": 3.0}
    ggpu[0]["name"] = "void other_kernel(x)"  # the first replay's order differs from the eager step's
    s = ort_kernels.replay_summary(ort_kernels.replays(glaunch, ggpu, linked), 0.030, eager)
    assert s["replays_matching_eager_order"] == 1


def test_cpu_run_reports_the_decode_graph_nodes(tiny_artifact, tmp_path):  # noqa: F811
    out = tmp_path / "k.json"
    run = subprocess.run([sys.executable, str(BENCH), "--artifact", str(tiny_artifact), "--provider", "cpu",
                          "--shapes", "1x40,2x30", "--all-experts-shapes", "1x40", "--steps", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["context"], r["moe_form_asked"]) for r in rows] == [
        (1, 40, "by batch"), (2, 30, "by batch"), (1, 40, "all-experts")]
    # the tiny model takes the all-experts graph at every batch (decode_graph.GATHER_COST), and where forced
    assert [r["eager"]["flavour"] for r in rows] == ["decode-all-experts"] * 3
    for r in rows:
        # the tiny decode graph inlines its m3 bodies: hundreds of nodes a step, all on the CPU EP here
        eager = r["eager"]
        assert eager["nodes_per_step"] > 300 and eager["cpu_ep_nodes_per_step"] == eager["nodes_per_step"]


def test_every_launch_call_is_a_launch():
    """The calls that put work on a stream, by the names CUPTI gives them (cuBLAS's sm90 GEMMs go through the
    driver's cuLaunchKernelEx), and not the calls that only wait or record."""
    for name in ("cudaLaunchKernel", "cudaLaunchKernelExC_v11060", "cuLaunchKernel", "cuLaunchKernelEx",
                 "cudaMemcpyAsync", "cuMemcpyHtoDAsync_v2", "cudaMemsetAsync", "cudaGraphLaunch_v10000"):
        assert ort_kernels.LAUNCHES.match(name), name
    for name in ("cudaStreamSynchronize", "cudaEventRecord", "cudaStreamWaitEvent", "cudaGetDevice"):
        assert not ort_kernels.LAUNCHES.match(name), name


def test_a_flavour_the_artifact_lacks_is_one_line(tiny_artifact, monkeypatch, capsys):  # noqa: F811
    """In this process (the script's own process start-up is run by the CPU test above): the parser's exit 2 and
    its one line."""
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--artifact", str(tiny_artifact), "--provider", "cpu",
                                      "--flavour", "ort-contrib"])
    with pytest.raises(SystemExit) as exit_:
        ort_kernels.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--flavour ort-contrib: not in" in err, err[-2000:]
