"""One process per device for tensor / expert parallel inference: start-up, the workers' loop, errors, shutdown.

Rank 0 is the process that builds the engine; it starts ranks 1 .. N-1 as fresh interpreters (``python -m
m3export.runtime.distributed``, torchrun's RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT in their
environment; nothing of rank 0 is re-imported or pickled), and all N join one ``torch.distributed`` group through
a TCP store rank 0 opens: gloo on CPU, NCCL on CUDA with rank r on device ``first + r``. Each
rank builds a backend over its own shard (``shard_backend``: the model slices of ``m3export.parallel``, then the
ordinary torch backend, CUDA graphs included on a GPU). The scheduler, sampling and everything else of the engine
live on rank 0; the workers only loop over the messages of ``distributed_messages`` and run the same step on
their shard, so the collectives inside the model meet.

Failure and shutdown, the cases a multi-process runtime must not get wrong:
- a worker that raises sends its traceback (text, over a one-way pipe) to rank 0 and exits at once; its sockets
  close, so rank 0's pending collective fails (gloo does so within a second) and rank 0 raises ``WorkerError``
  naming the rank and its error; a worker that dies without a word is reported with its exit code;
- after any failure inside a step the group is torn down (its ranks may be at different collectives) and the
  backend refuses further steps;
- ``close()`` (the engine's, or at interpreter exit) tells the workers to stop, waits for them and terminates any
  that do not; a worker whose parent dies (killed, crashed) exits by itself (its stdin, whose write end only rank
  0 holds, reaches end-of-file), so no worker outlives rank 0;
- NCCL never fails a collective whose peer died, so on NCCL rank 0 also watches the workers' pipes and aborts
  the communicators when one reports or exits outside ``close()``;
- tearing an NCCL group down is itself collective (``ncclCommFinalize`` / ``ncclCommDestroy`` wait for every
  rank) and waits until every CUDA graph that captured one of its collectives is destroyed: so on shutdown every
  rank first releases its graphs (``release_graphs``), rank 0 enters the teardown right after telling the workers
  to stop (not after waiting for them, which deadlocked: the first 2-GPU run hung there), and after a failure the
  communicators are aborted, not destroyed. Each teardown is bounded (``TEARDOWN_TIMEOUT_S``): past it the stacks
  are dumped and the process goes on (rank 0) or exits (a worker).

NVLink multicast (NVLS) stays off in every rank: ``NO_MULTICAST_ENV`` is set in rank 0's environment before the
group exists, and the spawned workers inherit it.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch
import torch.distributed as dist

import m3export
from m3export.errors import M3Error
from m3export.parallel.diagnostics import progress, rank_diagnostics
from m3export.parallel.teardown import TEARDOWN_TIMEOUT_S, teardown_group  # noqa: F401  (TEARDOWN_TIMEOUT_S: docs)

from . import distributed_messages as messages

log = logging.getLogger("m3export.runtime")

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Workers wait for the next step inside a broadcast for as long as the engine idles (a server between requests),
# so the group's collective timeout must be far longer than any idle spell; a dead rank is detected by its closed
# sockets and exit, not by this timeout.
COLLECTIVE_TIMEOUT = timedelta(days=30)
STARTUP_TIMEOUT_S = 600.0  # spawning and joining; loading the shards has no limit (a full checkpoint takes long)
SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_BACKEND_FACTORY = "m3export.runtime.distributed:shard_backend"


class WorkerError(M3Error):
    """A rank other than 0 failed (its error, or its exit); the message names the rank."""


@dataclass(frozen=True)
class LaunchSpec:
    """What every rank needs to build its backend: plain values only (it crosses into the spawned processes)."""

    source: str  # checkpoint directory or preset name
    tensor_parallel_size: int
    expert_parallel: bool
    device: str  # "cpu", or the CUDA device of rank 0 ("cuda", "cuda:2"); rank r takes the index + r
    dtype: str | None  # model dtype name (m3export.dtypes), None: the source's
    enforce_eager: bool = False
    kv_cache_dtype: str | None = None  # vLLM's --kv-cache-dtype (auto / bf16 / fp8), per rank's pools
    # "module:function" called as function(spec, rank, device) -> Backend on every rank (tests swap it)
    backend_factory: str = DEFAULT_BACKEND_FACTORY

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    def rank_device(self, rank: int) -> torch.device:
        dev = torch.device(self.device)
        if dev.type == "cpu":
            return dev
        return torch.device(dev.type, (dev.index or 0) + rank)


def check_world(tensor_parallel_size: int, device: str) -> None:
    """One clear line for a group this machine cannot hold (before any process starts)."""
    if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) or tensor_parallel_size < 1:
        raise M3Error(f"--tensor-parallel-size must be a positive integer, got {tensor_parallel_size!r}")
    dev = torch.device(device)
    if dev.type == "cuda":
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        first = dev.index or 0
        if first + tensor_parallel_size > visible:
            raise M3Error(f"--tensor-parallel-size {tensor_parallel_size} on {device}: needs CUDA devices {first} .. "
                          f"{first + tensor_parallel_size - 1}, this machine shows {visible} "
                          "(CUDA_VISIBLE_DEVICES decides which)")
    elif dev.type != "cpu":
        raise M3Error(f"--tensor-parallel-size runs on cpu (gloo) or cuda (NCCL) devices, not {dev.type}")


def resolve(name: str):
    """``"module:function"`` -> the function (the backend factory of a ``LaunchSpec``)."""
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise ValueError(f"backend factory {name!r} is not 'module:function'")
    return getattr(importlib.import_module(module), attr)


def model_dtype(spec: LaunchSpec) -> torch.dtype | None:
    from m3export.dtypes import BY_NAME

    return BY_NAME[spec.dtype].torch if spec.dtype else None


def shard_backend(spec: LaunchSpec, rank: int, device: torch.device):
    """This rank's slices of the model (``m3export.parallel.load_model_shard``) behind the ordinary torch backend:
    eager on CPU; on a GPU the Triton kernels and CUDA-graph decode, per rank, unless ``enforce_eager``."""
    from m3export.parallel import ParallelConfig, load_model_shard

    from .backends import make_torch_backend

    parallel = ParallelConfig(tensor_parallel_size=spec.tensor_parallel_size, expert_parallel=spec.expert_parallel)
    # On CUDA the kernels serve the ops: fusion.serve_on, in load_model_shard and in the backend.
    model = load_model_shard(spec.source, parallel, rank, device=device, dtype=model_dtype(spec) or torch.float32,
                             progress=False)
    return make_torch_backend(model, spec.enforce_eager, spec.kv_cache_dtype)


def _collective_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _init_group(device: torch.device, store, rank: int, world_size: int) -> None:
    """Join the default group. On NCCL the device is bound (``device_id``): the communicator is created here, at
    start-up where a failure is watched for, not inside the first step's first collective."""
    extra = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)  # per thread: rank 0 joins from a helper thread
        extra["device_id"] = device
    dist.init_process_group(_collective_backend(device), store=store, rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT, **extra)


def release_graphs(backend) -> None:
    """Drop the backend's captured CUDA graphs (``GraphedTorchBackend.release_graphs``), if it has any: NCCL's
    teardown waits for every graph that captured one of its collectives."""
    release = getattr(backend, "release_graphs", None)
    if release is not None:
        release()


# ---------------------------------------------------------------------------------------------- worker side
def _watch_parent() -> None:
    """Exit this worker when rank 0's process ends, whatever the reason (no orphans holding devices): rank 0 holds
    the write end of this process's stdin and never writes, so end-of-file means it is gone."""

    def watch():
        while os.read(0, 1 << 12):
            pass
        os._exit(0)

    threading.Thread(target=watch, name="m3export-parent-watch", daemon=True).start()


def worker_main(argv: list[str]) -> None:
    """Entry point of ranks 1 .. N-1 (``python -m m3export.runtime.distributed SPEC_JSON FD``, with torchrun's
    RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT in the environment): join, build the shard's
    backend, then run every step rank 0 sends."""
    spec = LaunchSpec(**json.loads(argv[0]))
    conn = Connection(int(argv[1]), readable=False)
    rank = int(os.environ["RANK"])
    rank_diagnostics(rank)
    _watch_parent()
    try:
        device = spec.rank_device(rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), spec.world_size,
                              is_master=False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
        conn.send_bytes(b"joining")
        progress(f"joining the {_collective_backend(device)} group on {device}")
        _init_group(device, store, rank, spec.world_size)
        progress("joined; building the backend")
        backend = resolve(spec.backend_factory)(spec, rank, device)
        conn.send_bytes(b"ready")
        progress("ready")
        hidden_size = backend.config.hidden_size
        steps = 0
        while True:
            msg = messages.receive(device, messages.wire_dtype(backend), hidden_size)
            steps += 1
            if steps <= 3 or steps % 500 == 0 or msg.op in (messages.SHUTDOWN, messages.ALLOCATE):
                progress(f"message {steps}: {messages.OPERATIONS[msg.op]}")
            if msg.op == messages.SHUTDOWN:
                release_graphs(backend)
                break
            if msg.op == messages.ALLOCATE:
                backend.allocate(msg.num_pages, msg.page_size)
            elif msg.op == messages.FORWARD:
                extra = {} if msg.media is None else {"media": msg.media}
                backend.forward(msg.input_ids, msg.batch, msg.logits_indices, **extra)
            else:
                backend.mtp_forward(msg.module, msg.input_ids, msg.hidden, msg.batch, msg.logits_indices)
    except BaseException:
        text = traceback.format_exc()
        print(f"[m3export rank {rank}] {text}", file=sys.stderr, flush=True)
        try:
            conn.send_bytes(("error:" + text).encode())
        finally:
            os._exit(1)  # at once: closing the sockets is what releases rank 0 from a pending collective
    # rank 0 enters the same (collective on NCCL) teardown now; past the bound this worker exits anyway
    code = 0 if teardown_group(graceful=True) else 3
    conn.send_bytes(b"done")
    os._exit(code)  # nothing left to flush; the interpreter's own teardown (torch's) only costs seconds


class ParallelGroup:
    """Rank 0's handle on the group: starts the workers, joins the process group, reports their failures."""

    def __init__(self, spec: LaunchSpec):
        if dist.is_initialized():
            raise M3Error("this process already has a torch.distributed default group: one parallel engine per "
                          "process (close the other engine first)")
        check_world(spec.world_size, spec.device)
        self.spec = spec
        self.device = spec.rank_device(0)
        self.closed = False
        self.teardown_ok: bool | None = None  # close(): whether the process group was left within its bound
        os.environ.update(NO_MULTICAST_ENV)
        rank_diagnostics(0)
        progress(f"starting {spec.world_size - 1} worker(s): {spec.source} on {spec.device}")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        store = dist.TCPStore("127.0.0.1", 0, spec.world_size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
        self.procs: dict[int, subprocess.Popen] = {}
        self.conns: dict[int, Connection] = {}
        try:
            for rank in range(1, spec.world_size):
                self._start(rank, store.port)
            self._expect(b"joining", STARTUP_TIMEOUT_S)  # a worker failing to start is reported, not waited for
            self._join(store)
        except BaseException:
            self.close(graceful=False)
            raise

    def _join(self, store) -> None:
        """Join the process group while watching the workers: the join waits for every rank, and a worker that
        dies meanwhile must be reported now, not after the store's time-out (the joining thread is then left to
        that time-out; the process stays usable)."""
        done, failed = threading.Event(), []

        def join():
            try:
                _init_group(self.device, store, 0, self.spec.world_size)
            except BaseException as e:
                failed.append(e)
            finally:
                done.set()

        threading.Thread(target=join, name="m3export-join", daemon=True).start()
        while not done.wait(0.2):
            self.check()
        if failed:
            raise failed[0]
        progress("joined the group")

    def _start(self, rank: int, port: int) -> None:
        """Rank ``rank`` as a fresh interpreter (nothing of this process is re-imported or pickled), torchrun's
        variables in its environment, a one-way pipe for its reports and its stdin as the parent-death signal."""
        read_fd, write_fd = os.pipe()
        env = {**os.environ, **NO_MULTICAST_ENV, "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(self.spec.world_size), "LOCAL_WORLD_SIZE": str(self.spec.world_size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        tree = str(Path(m3export.__file__).resolve().parent.parent)  # where `import m3export` finds this package
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
        try:
            self.procs[rank] = subprocess.Popen(
                [sys.executable, "-m", "m3export.runtime.distributed", json.dumps(asdict(self.spec)), str(write_fd)],
                stdin=subprocess.PIPE, pass_fds=(write_fd,), env=env)
        finally:
            os.close(write_fd)
        self.conns[rank] = Connection(read_fd, writable=False)

    def wait_ready(self) -> None:
        """Block until every worker has built its backend (raises ``WorkerError`` for one that failed); then, on
        NCCL, start watching the workers (``_watch_workers``)."""
        self._expect(b"ready", None)
        if _collective_backend(self.device) == "nccl":
            threading.Thread(target=self._watch_workers, name="m3export-worker-watch", daemon=True).start()

    def _watch_workers(self) -> None:
        """NCCL does not notice a peer that died: rank 0 would wait inside its collective for ever. After start-up
        a worker writes to its pipe only to report an error or when it stopped (shutdown), and its pipe reaches
        end-of-file when it dies; so the first readable pipe outside ``close()`` aborts the NCCL communicators,
        which fails rank 0's pending collective, and the step's error handling reads the worker's report. (gloo
        fails the collective by itself when the peer's sockets close.) The pipe is only watched, never read."""
        try:
            wait(list(self.conns.values()))
        except (OSError, ValueError):  # close() closed the pipes meanwhile
            return
        if not self.closed:
            log.error("a worker reported an error or exited: aborting the NCCL process group")
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception as e:  # an older torch, or the group is gone already
                log.warning("could not abort the process group (%s)", e)

    def _expect(self, word: bytes, timeout: float | None) -> None:
        """Read one report from every worker, which must be ``word``. A worker that dies closes its pipe, so
        waiting on the pipes alone also sees every death."""
        pending = set(self.procs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise WorkerError(f"rank(s) {sorted(pending)} did not start within {timeout:.0f} s")
            wait([self.conns[r] for r in pending], left)
            for rank in sorted(pending):
                if self.conns[rank].poll():
                    got = self._read(rank)
                    if got != word:
                        raise self._error(rank, got)
                    pending.discard(rank)

    def _read(self, rank: int) -> bytes | None:
        """The worker's next report, or None once its pipe is closed (the process ended)."""
        try:
            return self.conns[rank].recv_bytes()
        except (EOFError, OSError):
            return None

    def _error(self, rank: int, got: bytes | None) -> WorkerError:
        if got is not None and got.startswith(b"error:"):
            text = got[len(b"error:"):].decode(errors="replace").rstrip()
            last = text.splitlines()[-1] if text else "unknown error"
            return WorkerError(f"rank {rank} failed: {last}\n--- rank {rank} traceback ---\n{text}")
        if got is not None:
            return WorkerError(f"rank {rank} sent an unexpected report {got[:80]!r}")
        try:
            code = self.procs[rank].wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            code = "none yet"
        return WorkerError(f"rank {rank} exited unexpectedly (exit code {code})")

    def check(self) -> None:
        """Between steps: raise ``WorkerError`` if a worker reported an error or is gone (its pipe is readable:
        a report, or end-of-file)."""
        for rank, conn in self.conns.items():
            if conn.poll():
                raise self._error(rank, self._read(rank))

    def failure(self, wait_s: float = 5.0) -> WorkerError | None:
        """After a step failed on rank 0: the worker error behind it, if a worker reports one (or dies) within
        ``wait_s`` (a worker's exception, and its exit, is what makes rank 0's collective fail)."""
        wait(list(self.conns.values()), wait_s)
        for rank, conn in self.conns.items():
            if conn.poll():
                return self._error(rank, self._read(rank))
        return None

    def close(self, graceful: bool = True, local=None) -> None:
        """Stop the workers and leave the process group; idempotent. ``graceful``: tell them to stop, then tear
        the group down together with them (collective on NCCL: rank 0 must not wait for the workers first), then
        wait for their exit. Otherwise (after a failure) abort it (``teardown_group``). ``local``: rank 0's own
        backend, whose CUDA graphs are released before the teardown (NCCL's waits for them)."""
        if self.closed:
            return
        self.closed = True
        progress(f"closing ({'graceful' if graceful else 'after a failure'})")
        alive = all(p.poll() is None for p in self.procs.values())
        told = False
        if graceful and alive and dist.is_initialized():
            try:
                messages.send(messages.StepMessage(messages.SHUTDOWN), self.device, torch.float32)
                told = True
            except Exception as e:  # a worker vanished meanwhile: stopped below
                log.warning("could not tell the workers to stop (%s); terminating them", e)
        releasing = None
        if local is not None:
            def release():
                try:
                    release_graphs(local)
                except Exception as e:  # a failed device: the teardown still runs
                    log.warning("could not release rank 0's CUDA graphs (%s)", e)

            if told:  # every rank's work completes: release (it synchronises the device), then destroy
                release()
            else:  # a collective may be stuck waiting for a dead rank, and the device with it until the abort
                releasing = threading.Thread(target=release, name="m3export-release-graphs", daemon=True)
                releasing.start()  # (the abort unblocks the device; its own end waits for the graphs' release)
        self.teardown_ok = teardown_group(graceful=told)  # told: destroy with the workers; else abort
        if releasing is not None:
            releasing.join(SHUTDOWN_TIMEOUT_S)
        deadline = time.monotonic() + (SHUTDOWN_TIMEOUT_S if graceful and alive else 0.0)
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs.values():
            if p.stdin is not None:
                p.stdin.close()  # end-of-file on the worker's stdin: its parent watch exits it
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for conn in self.conns.values():
            conn.close()
        progress("closed")


if __name__ == "__main__":
    worker_main(sys.argv[1:])
