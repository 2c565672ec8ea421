"""bench/ort_gpu.py: the --smoke mode runs the script end to end on the CPU EP (it measures nothing here), with
--profile; the profile summary against hand-built traces; on a GPU, the graphed torch backend keeps its graphs
across the bench's per-shape allocations."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "ort_gpu.py"
sys.path.insert(0, str(BENCH.parent))
import ort_gpu  # noqa: E402  (bench/ort_gpu.py)
from tests.session_census import run_with_census  # noqa: E402

PAGE = 16  # the tiny_artifact fixture's page size


def test_smoke_run_writes_rows_with_both_backends_and_a_profile(tiny_artifact, tmp_path):  # noqa: F811
    out = tmp_path / "ort.json"
    run, opened, unclosed = run_with_census(BENCH, ["--smoke", "--artifact", str(tiny_artifact), "--json", str(out),
                                                    "--reps", "2", "--profile", "--profile-steps", "2"], timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    # the backend's sessions and the profiled variant's (its backend's own one replaced): all closed before exit
    assert opened >= 3 and unclosed == 0, (opened, unclosed)
    res = json.loads(out.read_text())
    assert res["provider"] == "CPUExecutionProvider" and len(res["rows"]) == 2
    for row in res["rows"]:
        assert row["greedy_same"] and row["torch_ms"] > 0 and row["ort_plain_ms"] > 0
        assert row["torch_graphs"] is None  # no CUDA graphs on the CPU: neither graphed nor fallen back
        # the torch backend of the GPU run (graphed: one scratch page more than asked for) fills ORT's pools
        assert row["pool_pages"]["torch"] == row["pool_pages"]["ort"] + 1
    prof = res["profile"]["plain"]
    assert (res["profile"]["batch"], res["profile"]["context"]) == (1, 40) and prof["steps"] == 2
    # the CPU EP places every node on the CPU; ORT's profile names each node's op, so the table has op types
    assert prof["nodes_per_step"] > 100 and prof["cpu_placed_nodes_per_step"] == prof["nodes_per_step"]
    assert prof["memcpy_nodes_per_step"] == {} and prof["gpu"] == {"note": "no CUDA device: host times only"}
    # the matmuls (ORT fuses a MatMul with its Transpose into FusedMatMul) or the MoE body's Scan / If rank high
    assert {"MatMul", "FusedMatMul", "Scan", "If"} & {r["op_type"] for r in prof["top_op_types"]}
    # self times partition the nodes' time: no Scan body counted twice, nothing past the runs' own time
    assert 0 < prof["node_host_ms_per_step"] <= prof["step_host_ms"]
    assert sum(r["share"] for r in prof["top_op_types"]) <= 1 + 1e-9


def _event(cat, name, ts, dur, op=None, provider="CUDAExecutionProvider", tid=1):
    args = {} if op is None else {"op_name": op, "provider": provider}
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "ph": "X", "args": args}


def test_profile_summary_counts_self_time_of_the_last_runs():
    """Two runs; only the last is summarised. In it a Scan (100 us) holds two body nodes (20 + 20 us), so its self
    time is 60 us; a CPU-placed Shape and a MemcpyToHost follow."""
    events = [_event("Session", "model_run", 0, 1000), _event("Node", "old_kernel_time", 10, 500, "MatMul"),
              _event("Session", "model_run", 2000, 300),
              _event("Node", "scan_kernel_time", 2000, 100, "Scan"),
              _event("Node", "mul_a_kernel_time", 2010, 20, "Mul"),
              _event("Node", "mul_b_kernel_time", 2040, 20, "Mul"),
              _event("Node", "shape_kernel_time", 2100, 10, "Shape", "CPUExecutionProvider"),
              _event("Node", "copy_kernel_time", 2120, 50, "MemcpyToHost"),
              _event("Node", "copy_fence_before", 2120, 1, "MemcpyToHost")]  # not a node's time
    s = ort_gpu.summarize_ort_profile(events, steps=1)
    assert s["step_host_ms"] == 0.3 and s["nodes_per_step"] == 5
    assert s["node_host_ms_per_step"] == pytest.approx(0.16)  # 60 + 20 + 20 + 10 + 50 us
    ops = {r["op_type"]: r for r in s["top_op_types"]}
    assert ops["Scan"]["host_ms_per_step"] == pytest.approx(0.06) and ops["Mul"]["count_per_step"] == 2
    assert [r["op_type"] for r in s["top_op_types"]] == ["Scan", "MemcpyToHost", "Mul", "Shape"]
    assert s["cpu_placed_nodes_per_step"] == 1 and s["memcpy_nodes_per_step"] == {"MemcpyToHost": 1}
    assert s["memcpy_to_host_nodes"] == ["copy"]
    assert s["providers"]["CUDAExecutionProvider"] == {"nodes_per_step": 4, "host_ms_per_step": pytest.approx(0.15)}
    with pytest.raises(ValueError, match="2 runs, 3 asked for"):
        ort_gpu.summarize_ort_profile(events, steps=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_torch_backend_replays_graphs_after_each_shape_allocation(tiny_artifact):  # noqa: F811
    """The bench allocates the graphed torch backend once per shape; every shape's steps must replay graphs (the
    2026-11-30 H200 run fell back to eager after the second allocation: a capture into the stale pool handle)."""
    from decode import decode_batch  # bench/decode.py (bench/ is on sys.path: see above)

    from m3export.runtime.backends import create_backend

    device = torch.device("cuda")
    be = create_backend("torch", str(tiny_artifact), device="cuda")
    if not getattr(be, "use_graphs", False):
        pytest.skip(f"{type(be).__name__} does not capture CUDA graphs here")
    for i, (batch, context) in enumerate(((1, 40), (2, 90), (1, 40))):
        b, pages = decode_batch(batch, context, PAGE, device)
        ort_gpu.fresh_pools(be, pages, PAGE)
        ids = torch.zeros(batch, dtype=torch.int64, device=device)
        before = be.replays
        with torch.no_grad():
            for _ in range(3):
                be.forward(ids, b, torch.arange(batch, device=device))
        assert be.use_graphs and be.replays - before == 3, (
            f"shape {i} ({batch}x{context}) did not replay graphs: " + ("the capture itself fails here" if i == 0
                                                                         else "lost at a later allocation"))


def test_kernel_summary_reads_device_events_of_torch_profiler():
    """summarize_kernels keeps only device events (CUDA kernels, ORT's among them on the GPU): on a CPU-only
    profile it finds none; on events shaped like torch's FunctionEvent it adds up count and time per kernel name."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    cpu_events = prof.events()
    assert cpu_events and all(e.time_range.elapsed_us() >= 0 for e in cpu_events)  # the fields it reads exist
    assert ort_gpu.summarize_kernels(prof, steps=1)["kernels_per_step"] == 0

    def kernel(name, us):
        return SimpleNamespace(name=name, device_type=DeviceType.CUDA,
                               time_range=SimpleNamespace(elapsed_us=lambda: us))

    fake = SimpleNamespace(events=lambda: [kernel("gemv(float*)", 30), kernel("gemv(float*)", 10),
                                           kernel("topk(int)", 20), *cpu_events])
    s = ort_gpu.summarize_kernels(fake, steps=2)
    assert s["kernels_per_step"] == 1.5 and s["busy_ms_per_step"] == pytest.approx(0.03)
    assert [(k["kernel"], k["count_per_step"], k["share"]) for k in s["top_kernels"]] == [
        ("gemv", 1.0, pytest.approx(40 / 60)), ("topk", 0.5, pytest.approx(20 / 60))]
