"""Per-rank diagnostics for multi-process runs: where every rank is stuck when a run hangs, and what NCCL did.

A 2-GPU run that hangs gives nothing to read unless each rank says where it is. ``rank_diagnostics(rank)``,
called by every rank as it starts (``spawn.run_ranks``, the runtime's rank 0 and workers), does nothing unless
``M3EXPORT_DIAG_DIR`` names a directory; then, for this process:

* ``stacks_rank{r}_pid{p}.txt``: Python stacks of all threads (``faulthandler``) every
  ``M3EXPORT_STACKS_EVERY_S`` seconds (default 60), and at once on SIGUSR1 (``timeout -s USR1`` sends it to the
  whole process group: every rank dumps before the run is killed);
* ``nccl_rank{r}_pid{p}.log``: NCCL's own log (``NCCL_DEBUG=INFO`` unless set; ``NCCL_DEBUG_FILE`` always set
  per rank, since workers inherit rank 0's environment). NCCL reads both at its first use, after this;
* ``progress_rank{r}_pid{p}.txt``: ``progress(msg)`` lines with the time since the rank started.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

DIAG_DIR_ENV = "M3EXPORT_DIAG_DIR"
STACKS_EVERY_ENV = "M3EXPORT_STACKS_EVERY_S"

_state: dict = {}  # the open files (faulthandler writes to their descriptors until the process ends)


def diag_dir() -> Path | None:
    d = os.environ.get(DIAG_DIR_ENV)
    return Path(d) if d else None


def rank_diagnostics(rank: int) -> Path | None:
    """Set up this process's stack dumps, NCCL log and progress file as rank ``rank`` (see the module docstring);
    the directory, or None when ``M3EXPORT_DIAG_DIR`` is not set. Idempotent per process."""
    d = diag_dir()
    if d is None:
        return None
    if _state.get("pid") == os.getpid():
        return d
    d.mkdir(parents=True, exist_ok=True)
    tag = f"rank{rank}_pid{os.getpid()}"
    os.environ.setdefault("NCCL_DEBUG", "INFO")
    os.environ["NCCL_DEBUG_FILE"] = str(d / f"nccl_{tag}.log")
    stacks = open(d / f"stacks_{tag}.txt", "a", buffering=1)  # noqa: SIM115  (kept open: faulthandler's file)
    every = float(os.environ.get(STACKS_EVERY_ENV, "60"))
    faulthandler.enable(file=stacks, all_threads=True)
    if every > 0:
        faulthandler.dump_traceback_later(every, repeat=True, file=stacks)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)
    _state.update(pid=os.getpid(), rank=rank, stacks=stacks, start=time.monotonic(),
                  progress=open(d / f"progress_{tag}.txt", "a", buffering=1))  # noqa: SIM115
    progress(f"rank {rank} pid {os.getpid()} started: {' '.join(sys.argv)[:200]}")
    return d


def progress(msg: str) -> None:
    """One time-stamped line in this rank's progress file (nothing without ``M3EXPORT_DIAG_DIR``)."""
    f = _state.get("progress") if _state.get("pid") == os.getpid() else None
    if f is not None:
        f.write(f"{time.strftime('%H:%M:%S')} +{time.monotonic() - _state['start']:7.1f}s rank {_state['rank']}: "
                f"{msg}\n")


def dump_stacks(reason: str) -> None:
    """All threads' stacks into this rank's stack file now (before giving up on something that hangs)."""
    f = _state.get("stacks") if _state.get("pid") == os.getpid() else None
    if f is not None:
        f.write(f"--- {reason}\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
