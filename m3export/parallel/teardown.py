"""Leaving a ``torch.distributed`` group without hanging: collective destroy when every rank tears down, abort
after a failure, and a bound on either.

NCCL's teardown is collective (``ncclCommFinalize`` / ``ncclCommDestroy`` wait for every rank of the
communicator) and waits until every CUDA graph that captured one of its collectives is destroyed; a rank that
died, or one still holding graphs, makes the others' ``destroy_process_group`` wait for ever. gloo's is local.
"""

from __future__ import annotations

import logging
import threading

import torch.distributed as dist

from .diagnostics import dump_stacks, progress

log = logging.getLogger("m3export.parallel")

TEARDOWN_TIMEOUT_S = 60.0  # destroying / aborting the process group (NCCL's finalize waits for every rank)


def teardown_group(graceful: bool, timeout: float = TEARDOWN_TIMEOUT_S) -> bool:
    """Leave the default process group, within ``timeout`` seconds; True when done. ``graceful`` (every rank is
    tearing down now): ``destroy_process_group``, collective on NCCL. Otherwise (a rank failed or was killed, the
    others may sit in a collective): on NCCL the communicators are aborted, since a collective teardown would
    wait for the missing rank for ever; gloo's destroy is local either way. Run on a helper thread so that a
    teardown that hangs is reported (stacks dumped) instead of hanging the caller."""
    if not dist.is_initialized():
        return True
    abort = not graceful and dist.get_backend() == "nccl"
    failed: list[BaseException] = []

    def run():
        try:
            if abort:
                dist.distributed_c10d._abort_process_group()
            else:
                dist.destroy_process_group()
        except BaseException as e:  # aborted meanwhile by the NCCL watch, or an older torch
            failed.append(e)

    progress(f"teardown ({'abort' if abort else 'destroy'}) starts")
    t = threading.Thread(target=run, name="m3export-teardown", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        dump_stacks(f"process group teardown still running after {timeout:.0f} s")
        log.error("the process group did not shut down within %.0f s (%s); giving up on it", timeout,
                  "abort" if abort else "destroy")
        return False
    if failed:
        log.warning("process group not torn down cleanly (%s)", failed[0])
    progress("teardown done")
    return True
