"""Run a function on N local ranks of ``torch.distributed`` (one process each): tests, benchmarks, the runtime.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes (``torch.multiprocessing``, spawn start
method), joins them into one process group through a rendezvous file (no port to pick, so no race for one), and
calls ``fn(rank, world_size, *args)`` in each; an exception in any rank is raised in the caller with its
traceback. On GPUs (``backend="nccl"``) rank r uses ``cuda:r``. NVLink multicast stays off (the machines' rule):
``NVLINK_MULTICAST_OFF`` is set in the caller's environment before the ranks start and again in each rank.
With ``M3EXPORT_DIAG_DIR`` set, every rank writes its stacks, NCCL log and progress there (``diagnostics``). A
rank whose ``fn`` raises aborts the group instead of destroying it (NCCL's destroy is collective and would wait
for the ranks still inside a collective).
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .diagnostics import progress, rank_diagnostics
from .teardown import teardown_group

NVLINK_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def multicast_off() -> None:
    """Set the variables that keep NCCL, symmetric memory and NVSHMEM off NVLink multicast (NVLS)."""
    os.environ.update(NVLINK_MULTICAST_OFF)


def _rank_main(rank: int, fn, world_size: int, backend: str, rendezvous: str, timeout_s: float, args: tuple) -> None:
    multicast_off()
    rank_diagnostics(rank)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    extra = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        extra["device_id"] = torch.device("cuda", rank)  # the communicator is created here, not in fn's first op
    progress(f"joining the {backend} group")
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), **extra)
    progress("joined")
    try:
        fn(rank, world_size, *args)
    except BaseException:
        # the other ranks may sit in a collective: NCCL's collective destroy would wait for them for ever
        progress("fn raised; aborting the group")
        teardown_group(graceful=False, timeout=10.0)
        raise
    progress("fn done")
    teardown_group(graceful=True)


def run_ranks(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 120.0) -> None:
    """``fn(rank, world_size, *args)`` on ``world_size`` ranks (``fn`` must be importable: a module-level
    function). ``timeout_s`` bounds each collective, so a rank that dies does not leave the others waiting."""
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"{world_size} ranks on NCCL need {world_size} GPUs; {torch.cuda.device_count()} visible")
    multicast_off()
    with tempfile.TemporaryDirectory(prefix="m3-rendezvous-") as tmp:
        rendezvous = str(Path(tmp) / "store")
        mp.spawn(_rank_main, args=(fn, world_size, backend, rendezvous, timeout_s, args), nprocs=world_size,
                 join=True)
