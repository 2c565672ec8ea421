"""Shutdown and diagnostics of multi-process runs (issue 18: the first 2-GPU run hung in the first engine's close).

CPU, gloo. gloo's teardown is local, so these tests give it NCCL's two properties that hung the H200 run: the
teardown is collective (``ncclCommFinalize`` waits for every rank: modelled by an all-reduce inside
``destroy_process_group``) and refused while a CUDA graph that captured a collective exists (modelled by a flag
that ``release_graphs`` clears). The earlier close (rank 0 waiting for the workers' exit before its own destroy)
fails the first: the worker sits in the collective teardown until rank 0 kills it 30 s later.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from m3export.parallel.spawn import run_ranks
from m3export.runtime.backends.distributed_backend import DistributedBackend
from m3export.runtime.distributed import LaunchSpec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.parallel_sanity import ProbeBackend  # noqa: E402


def nccl_like_destroy(backend: ProbeBackend, destroy):
    """``destroy_process_group`` with NCCL's two properties (module docstring)."""

    def collective_destroy(*a, **k):
        if backend.graph_held:
            raise RuntimeError(f"rank {backend.rank}: teardown while a captured graph exists (NCCL hangs here)")
        dist.all_reduce(torch.ones(1))  # every rank must be in the teardown
        return destroy(*a, **k)

    return collective_destroy


def probe_holding_a_graph(spec, rank: int, device):
    """The sanity probe, "holding a graph" until ``release_graphs``; on workers the NCCL-like teardown."""
    backend = ProbeBackend(rank, device)
    backend.graph_held = True
    release = backend.release_graphs

    def released():
        backend.graph_held = False
        release()

    backend.release_graphs = released
    if rank != 0:  # rank 0 is this test process: the test patches it (and undoes it)
        dist.destroy_process_group = nccl_like_destroy(backend, dist.destroy_process_group)
    return backend


def test_close_tears_down_together_after_releasing_graphs(monkeypatch):
    backend = DistributedBackend.launch(LaunchSpec("probe", 2, False, "cpu", None,
                                                   backend_factory="tests.test_parallel_shutdown:probe_holding_a_graph"))
    monkeypatch.setattr(dist, "destroy_process_group", nccl_like_destroy(backend.local, dist.destroy_process_group))
    backend.allocate(4, 16)
    procs = dict(backend.group.procs)
    t0 = time.monotonic()
    backend.close()
    elapsed = time.monotonic() - t0
    assert {r: p.wait(timeout=30) for r, p in procs.items()} == {1: 0}  # the worker's teardown raised nothing
    assert backend.group.teardown_ok and not dist.is_initialized()
    assert not backend.local.graph_held
    assert elapsed < 20, f"close took {elapsed:.0f} s: rank 0 did not join the collective teardown"


def test_sanity_check_runs_on_gloo_and_every_rank_writes_diagnostics(tmp_path):
    """bench/parallel_sanity.py, stage 0 of scripts/gpu_multi.sh: every check passes, the JSON has each, and with
    M3EXPORT_DIAG_DIR both ranks leave progress and stack files."""
    env = {**os.environ, "M3EXPORT_DIAG_DIR": str(tmp_path / "diag"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    run = subprocess.run([sys.executable, "bench/parallel_sanity.py", "--device", "cpu", "--steps", "20",
                          "--json", str(tmp_path / "s.json")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    checks = json.loads((tmp_path / "s.json").read_text())["checks"]
    assert len(checks) == 7 and checks["close"]["worker_exit_codes"] == {"1": 0}, checks
    diag = tmp_path / "diag"
    for rank in (0, 1):
        [prog] = diag.glob(f"progress_rank{rank}_pid*.txt")
        assert "teardown done" in prog.read_text()
        assert list(diag.glob(f"stacks_rank{rank}_pid*.txt"))


def dump_on_usr1(rank: int, world: int, out: str) -> None:
    os.kill(os.getpid(), signal.SIGUSR1)  # what `timeout -s USR1` sends the whole process group
    time.sleep(0.5)
    Path(out, f"env{rank}").write_text(os.environ["NCCL_DEBUG_FILE"])


def test_spawned_ranks_dump_their_stacks_on_sigusr1_and_log_nccl_per_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("M3EXPORT_DIAG_DIR", str(tmp_path))
    run_ranks(dump_on_usr1, 2, str(tmp_path))
    for rank in (0, 1):
        [stacks] = tmp_path.glob(f"stacks_rank{rank}_pid*.txt")
        assert "dump_on_usr1" in stacks.read_text()  # the rank's own frame, from its own handler
        pid = stacks.name.split("_pid")[1].removesuffix(".txt")
        assert Path(tmp_path, f"env{rank}").read_text() == str(tmp_path / f"nccl_rank{rank}_pid{pid}.log")
