"""The multi-process runtime (``runtime/distributed*.py``, ``DistributedBackend``): CPU, gloo, 2 processes.

The oracle is the single-process engine on the same model: greedy generation through the engine with TP=2, with
EP (``--expert-parallel``: with vLLM's semantics EP=2 and TP=2+EP=2 are the same group of 2 ranks, attention
TP, routed experts split whole) equals it token for token, on the tiny preset and on the embedded trained model.
float64 keeps argmax away from rounding ties: the shards only reorder sums (``docs/parallel.md``, Numerics), so
any differing token is a real error, not a near tie. The parallel engines run with MTP speculation and small
token budgets, so chunked prefill, mixed batches, verification steps and the MTP module's steps all cross the
broadcast; greedy speculation is token-identical to plain decoding (``tests/test_runtime_speculative.py``).

Each launch costs a few seconds of process start-up, so each engine is started once per module and shared.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from m3export.errors import M3Error
from m3export.runtime import Engine, SamplingParams
from m3export.runtime.backends.distributed_backend import DistributedBackend
from m3export.runtime.distributed import LaunchSpec, WorkerError, shard_backend

ROOT = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(20, 57)), [100, 101, 102, 103, 104, 105, 106, 107, 108]]
POISON = 311  # a token id no prompt above holds (< tiny's vocabulary of 320): rank 1's tripwire
SIZING = {"max_model_len": 96, "max_num_batched_tokens": 16, "num_pages": 64}


def shard_with_tripwire(spec: LaunchSpec, rank: int, device: torch.device):
    """The ordinary shard backend; on rank 1 its forward raises when the step holds token ``POISON``: a worker
    failing in the middle of serving (rank 0 is then waiting inside the model's first all-reduce)."""
    backend = shard_backend(spec, rank, device)
    if rank == 1:
        forward = backend.forward

        def tripped(input_ids, batch, logits_indices, **kw):
            if bool((input_ids == POISON).any()):
                raise RuntimeError(f"tripwire: token {POISON} reached rank 1")
            return forward(input_ids, batch, logits_indices, **kw)

        backend.forward = tripped
    return backend


def failing_on_rank_1(spec: LaunchSpec, rank: int, device: torch.device):
    """A worker that cannot build its backend (say, its slice of the checkpoint is unreadable)."""
    if rank == 1:
        raise ValueError("rank 1 cannot load its shard")
    return shard_backend(spec, rank, device)


def padded_shards(spec: LaunchSpec, rank: int, device: torch.device):
    """Every rank's shard behind the CUDA-graph backend with its bucket padding run eagerly (``pad_eagerly``): the
    static inputs a GPU's graphs replay, on the CPU; rank 0's takes its batches on the host (``batch_device``)."""
    from m3export.runtime.backends.cuda_graph import GraphedTorchBackend

    backend = shard_backend(spec, rank, device)
    return GraphedTorchBackend(backend.model, backend.dtype, pad_eagerly=True)


def generate(engine: Engine, prompts) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, GREEDY)]


def parallel_engine(source, expert_parallel: bool, factory: str | None = None, **sizing) -> Engine:
    spec = LaunchSpec(str(source), 2, expert_parallel, "cpu", "float64",
                      **({"backend_factory": factory} if factory else {}))
    backend = DistributedBackend.launch(spec)
    from m3export.runtime.tokenizer import find_tokenizer

    return Engine(backend, find_tokenizer(source, backend.config), num_speculative_tokens=2, **sizing)


@pytest.fixture(scope="module")
def single_tiny():
    return generate(Engine.from_checkpoint("tiny", dtype=torch.float64, **SIZING), PROMPTS)


def test_tensor_parallel_equals_one_process_then_a_worker_error_names_its_rank(single_tiny):
    """TP=2 generation == one process; then rank 1 raises mid-step: rank 0 raises WorkerError naming rank 1 and
    its error, the group is torn down (worker gone, no default group), and the engine refuses further steps."""
    engine = parallel_engine("tiny", False, "tests.test_parallel_runtime:shard_with_tripwire", **SIZING)
    backend = engine.backend
    try:
        assert backend.local.model.config.num_key_value_heads == 1  # rank 0 holds half the model, not all of it
        assert generate(engine, PROMPTS) == single_tiny
        assert engine.stats.verify_steps > 0  # the MTP module's steps and verification crossed the broadcast
        with pytest.raises(WorkerError, match=r"rank 1 failed: RuntimeError: tripwire: token 311 reached rank 1"):
            engine.generate([[1, 2, POISON]], GREEDY)
        assert backend.group.procs[1].poll() is not None
        assert not dist.is_initialized()
        with pytest.raises(M3Error, match="failed earlier"):
            engine.generate([[1, 2, 3]], GREEDY)
    finally:
        engine.close()


def test_expert_parallel_equals_one_process_and_close_stops_the_workers(single_tiny, monkeypatch):
    """EP (= TP=2 + EP=2): generation == one process; close() ends the workers with exit code 0 and leaves no
    process group, and rank 0's NCCL watch (started by hand: this group is gloo, see the NCCL watch test below)
    does not abort the group for workers that stopped; closing again is harmless."""
    aborted = _record_aborts(monkeypatch)
    engine = parallel_engine("tiny", True, **SIZING)
    procs = dict(engine.backend.group.procs)
    watcher = threading.Thread(target=engine.backend.group._watch_workers, daemon=True)
    watcher.start()
    try:
        assert generate(engine, PROMPTS) == single_tiny
    finally:
        engine.close()
    watcher.join(10)
    assert not aborted.is_set(), "the watch aborted the group of a clean close"
    assert all(p.returncode == 0 for p in procs.values()), {r: p.returncode for r, p in procs.items()}
    assert not dist.is_initialized()
    engine.close()
    with pytest.raises(M3Error, match="closed"):
        engine.generate([[1, 2, 3]], GREEDY)


def test_embedded_model_tp_ep_equals_one_process():
    """The embedded trained model (bf16 checkpoint, text prompts through its tokenizer), TP=2 with EP."""
    from m3export.embedded import default_model

    src = default_model()
    prompts = ["def read_config(path):", "import os\n\nclass Cache:\n    def __init__(self"]
    single = generate(Engine.from_checkpoint(src, dtype=torch.float64, **SIZING), prompts)
    engine = parallel_engine(src, True, **SIZING)
    try:
        assert generate(engine, prompts) == single
    finally:
        engine.close()


def test_steps_are_built_where_rank_0s_backend_takes_them(single_tiny):
    """DistributedBackend hands the engine its local backend's ``batch_device`` (the host for the CUDA-graph
    backend: one host-to-device copy into the graphs' static inputs, and a verify step's shape read without a
    device-to-host copy); the broadcast moves host batches to the collective's device itself. With every rank
    padding its decode, verify and MTP steps into bucket shapes, TP=2 generation == one process."""
    from types import SimpleNamespace

    graphed = SimpleNamespace(config=None, device=torch.device("cuda", 0), required_page_size=None,
                              dtype=torch.float32, batch_device=torch.device("cpu"))  # rank 0's backend on a GPU
    group = SimpleNamespace(spec=SimpleNamespace(world_size=2), close=lambda *args: None)
    assert DistributedBackend(group, graphed).batch_device == torch.device("cpu")

    engine = parallel_engine("tiny", False, "tests.test_parallel_runtime:padded_shards", **SIZING)
    try:
        local = engine.backend.local
        assert local.pad_eagerly and engine.backend.batch_device == local.batch_device == torch.device("cpu")
        assert generate(engine, PROMPTS) == single_tiny
        assert engine.stats.verify_steps > 0 and local.padded_mtp_steps > 0  # bucket shapes crossed the broadcast
    finally:
        engine.close()


def test_worker_failing_at_start_is_reported_with_its_rank():
    spec = LaunchSpec("tiny", 2, False, "cpu", "float64",
                      backend_factory="tests.test_parallel_runtime:failing_on_rank_1")
    with pytest.raises(WorkerError, match="rank 1 failed: ValueError: rank 1 cannot load its shard"):
        DistributedBackend.launch(spec)
    assert not dist.is_initialized()


def _gone(pid: int) -> bool:
    """The process no longer runs (exited; a zombie nobody reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


RANK0_THEN_KILLED = """
import os, signal, sys
from m3export.runtime.backends.distributed_backend import DistributedBackend
from m3export.runtime.distributed import LaunchSpec
backend = DistributedBackend.launch(LaunchSpec("tiny", 2, False, "cpu", None))
print(backend.group.procs[1].pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_workers_exit_when_rank_0_is_killed():
    """Rank 0 SIGKILLed (no clean-up code runs): its worker notices (end of file on its stdin) and exits."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    run = subprocess.run([sys.executable, "-c", RANK0_THEN_KILLED], capture_output=True, text=True, timeout=120,
                         env=env, cwd=ROOT)
    assert run.returncode == -9, run.stderr[-2000:]
    pid = int(run.stdout.split()[0])
    deadline = time.monotonic() + 20
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid), f"worker {pid} outlived rank 0"


@pytest.mark.parametrize("argv, message", [
    (["-tp", "3"], "tensor_parallel_size 3 does not divide num_attention_heads (4)"),
    (["--tensor-parallel-size", "2", "--device", "cuda"] if not torch.cuda.is_available() else
     ["--tensor-parallel-size", str(torch.cuda.device_count() + 1), "--device", "cuda"], "CUDA devic"),
])
def test_generate_refuses_a_group_that_cannot_run_in_one_line(argv, message, capsys):
    """Checked before any process starts or any weight loads: one line, exit code 2."""
    from m3export.cli import main

    assert main(["generate", "tiny", "--prompt-ids", "1,2", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1], err


def test_parallel_flags_refuse_an_artifact(tmp_path):
    """Parallel runs start from a checkpoint: an artifact's graphs are one device's (before anything loads)."""
    with pytest.raises(M3Error, match="run a checkpoint or preset on the torch backend"):
        Engine.from_artifact(tmp_path, tensor_parallel_size=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_nccl_and_graphs_equal_one_gpu():
    """NCCL, the Triton kernels and CUDA-graph decode on each rank: TP=2 and EP generation through the engine ==
    one GPU (fp32: only the order of some sums differs, ~1e-6 relative on tiny, far below its logit margins)."""
    sizing = {**SIZING, "max_num_batched_tokens": 64}
    single = generate(Engine.from_checkpoint("tiny", device="cuda", dtype=torch.float32, **sizing), PROMPTS)
    for ep in (False, True):
        with Engine.from_checkpoint("tiny", device="cuda", dtype=torch.float32, tensor_parallel_size=2,
                                    expert_parallel=ep, num_speculative_tokens=2, **sizing) as engine:
            assert generate(engine, PROMPTS) == single, f"expert_parallel={ep}"
            assert engine.backend.local.replays > 0  # rank 0 decoded from CUDA graphs (and so did rank 1)


def _record_aborts(monkeypatch) -> threading.Event:
    """``_abort_process_group`` recorded instead of performed (the NCCL watch's action, on a gloo group)."""
    import torch.distributed.distributed_c10d as c10d

    aborted = threading.Event()
    monkeypatch.setattr(c10d, "_abort_process_group", lambda group=None: aborted.set())
    return aborted


def test_nccl_watch_aborts_the_group_when_a_worker_dies_not_when_it_stops(monkeypatch):
    """NCCL never fails a collective whose peer died, so on NCCL rank 0 watches the workers' pipes and aborts the
    group (``_abort_process_group``) when one reports or exits outside ``close()``. Checked here on a gloo group
    with the abort recorded instead of performed: a SIGKILLed worker triggers it; that a clean close does not is
    checked on the EP engine's group (``test_expert_parallel_equals_one_process_and_close_stops_the_workers``:
    one launch fewer)."""
    aborted = _record_aborts(monkeypatch)
    backend = DistributedBackend.launch(LaunchSpec("tiny", 2, False, "cpu", None))
    group = backend.group
    watcher = threading.Thread(target=group._watch_workers, daemon=True)
    watcher.start()
    group.procs[1].kill()
    assert aborted.wait(10), "the watch did not abort after the worker died"
    group.close(graceful=False)
