"""NCCL sanity check of the multi-process runtime in ~20 s, with no model: the first stage of ``scripts/gpu_multi.sh``.

It drives the runtime's own pieces (``DistributedBackend.launch``: worker processes, TCP store, joining the group,
the step messages, shutdown) with a probe backend on every rank instead of a model shard, and times each check:

1. start-up: the workers start, every rank joins the group (NCCL: the communicator is created there);
2. ``allocate``: every rank all-reduces and all-gathers a known tensor and checks the sums; on CUDA it also
   captures an all-reduce in a CUDA graph (warm-up on a side stream first) and replays it three times;
3. each message kind: a FORWARD step, a FORWARD with media rows and embeddings, an MTP_FORWARD with hidden
   states; every rank digests the bytes it received (sum and position-weighted sum of each tensor's bytes) and
   the digests are all-gathered: every rank must have received exactly what rank 0 sent;
4. 200 small FORWARD steps: the per-step cost of the broadcast protocol;
5. ``close()``: graphs released on every rank, the collective teardown, the workers' exit codes.

A failing check raises (a worker's error comes back as ``WorkerError`` naming its rank); the JSON keeps every
check done so far. ``--device cpu`` runs the same on gloo (the CUDA-graph part skipped), which the CPU tests do.

  python bench/parallel_sanity.py                 # 2 GPUs (scripts/gpu_multi.sh, stage 0)
  python bench/parallel_sanity.py --device cpu    # gloo
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import RESULTS, write_results  # noqa: E402  (bench/results_file.py)

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HIDDEN = 64
PAGE = 16


def digest(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[2] float64: the sum of the tensor's bytes and their sum weighted by position (mod 65521): exact in float64
    at these sizes, and a byte changed or moved changes it."""
    b = t.detach().to(device).contiguous().view(torch.uint8).reshape(-1).to(torch.int64)
    w = torch.arange(b.numel(), device=device, dtype=torch.int64) % 65521
    return torch.stack([b.sum(), (b * w).sum()]).to(torch.float64)


class ProbeBackend:
    """What ``DistributedBackend`` and the workers' loop need of a backend, checking collectives instead of running
    a model. ``forward`` / ``mtp_forward`` return the all-gathered digests [world, k] of what each rank received."""

    name = "probe"
    required_page_size = None
    num_mtp_modules = 1
    supports_media = True
    replays_single_position_mtp_steps = False

    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device, self.world = rank, device, dist.get_world_size()
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.config = SimpleNamespace(hidden_size=HIDDEN)
        self.batch_device = device
        self.graph = None
        self.checks: dict[str, float] = {}

    def page_bytes(self, page_size: int) -> int:
        return page_size

    def allocate(self, num_pages: int, page_size: int) -> None:
        w, dev = self.world, self.device
        want = w * (w + 1) / 2
        t0 = time.perf_counter()
        x = torch.full((4096,), float(self.rank + 1), device=dev)
        dist.all_reduce(x)
        if not bool((x == want).all()):
            raise AssertionError(f"rank {self.rank}: all_reduce gave {x[:4].tolist()}, want {want}")
        parts = [torch.empty(8, device=dev) for _ in range(w)]
        dist.all_gather(parts, torch.full((8,), float(self.rank), device=dev))
        if [int(p[0]) for p in parts] != list(range(w)):
            raise AssertionError(f"rank {self.rank}: all_gather gave {[p[0].item() for p in parts]}")
        self.checks["eager_collectives_s"] = time.perf_counter() - t0
        if dev.type == "cuda":
            t0 = time.perf_counter()
            static = torch.zeros(4096, device=dev)
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up outside the graph, as GraphedTorchBackend does
                y = static.clone()
                dist.all_reduce(y)
            torch.cuda.current_stream(dev).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                y = static.clone()
                dist.all_reduce(y)
            self.checks["graph_capture_s"] = time.perf_counter() - t0
            for k in range(3):
                static.fill_(float(self.rank + 1 + k))
                self.graph.replay()
                torch.cuda.synchronize(dev)
                want_k = want + w * k
                if not bool((y == want_k).all()):
                    raise AssertionError(f"rank {self.rank}: replay {k} of the captured all_reduce gave "
                                         f"{y[:4].tolist()}, want {want_k}")
            self.checks["graph_replays_s"] = time.perf_counter() - t0 - self.checks["graph_capture_s"]

    def release_graphs(self) -> None:
        if self.graph is not None:
            torch.cuda.synchronize(self.device)
            self.graph.reset()
            self.graph = None

    def _digests(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, None]:
        mine = torch.cat([digest(t, self.device) for t in tensors])
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine)
        return torch.stack(parts).cpu(), None

    def forward(self, input_ids, batch, logits_indices, media=None):
        tensors = [input_ids, *(getattr(batch, n) for n in batch.input_names()), logits_indices]
        return self._digests(tensors + ([] if media is None else list(media)))

    def mtp_forward(self, module, input_ids, hidden, batch, logits_indices):
        return self._digests([input_ids, *(getattr(batch, n) for n in batch.input_names()), logits_indices, hidden])

    def encode_media(self, pixel_values, grid_thw):
        raise NotImplementedError("the probe has no vision tower")


def probe_backend(spec, rank: int, device: torch.device) -> ProbeBackend:
    """``LaunchSpec.backend_factory`` of this check."""
    return ProbeBackend(rank, device)


def check_digests(name: str, gathered: torch.Tensor) -> None:
    """Every rank's digests equal rank 0's: every rank received what rank 0 sent."""
    for r in range(1, gathered.shape[0]):
        if not torch.equal(gathered[r], gathered[0]):
            raise AssertionError(f"{name}: rank {r} received other bytes than rank 0 sent "
                                 f"(digests {gathered[r].tolist()} vs {gathered[0].tolist()})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (ranks on cuda:0 .. ; NCCL) or cpu (gloo)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200, help="small FORWARD steps timed")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from m3export.parallel.diagnostics import rank_diagnostics

    rank_diagnostics(0)  # with M3EXPORT_DIAG_DIR: this process's stacks on SIGUSR1 / a timer
    from m3export.model.batch import Segment, build_batch
    from m3export.runtime.backends.distributed_backend import DistributedBackend
    from m3export.runtime.distributed import LaunchSpec

    cuda = torch.device(args.device).type == "cuda"
    path = Path(args.json) if args.json else RESULTS / f"parallel_sanity_{'cuda' if cuda else 'cpu'}.json"
    res = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None, "ranks": args.ranks,
           "checks": {}}

    def done(name: str, t0: float, **extra) -> None:
        res["checks"][name] = {"seconds": time.perf_counter() - t0, **extra}
        write_results(res, path)
        print(f"[{time.strftime('%H:%M:%S')}] ok {name}: {time.perf_counter() - t0:.2f} s {extra or ''}", flush=True)

    t0 = time.perf_counter()
    spec = LaunchSpec("probe", args.ranks, False, args.device, None, backend_factory="bench.parallel_sanity:probe_backend")
    backend = DistributedBackend.launch(spec)
    done("start-up and join", t0)
    try:
        t0 = time.perf_counter()
        backend.allocate(8, PAGE)
        done("allocate: all_reduce, all_gather" + (", captured all_reduce replayed 3x" if cuda else ""), t0,
             **backend.local.checks)
        host = backend.batch_device
        ids, batch = build_batch([Segment([0, 1], 0, list(range(3, 20))), Segment([2], 0, [5, 6, 7])], PAGE, host)
        last = batch.query_start_loc[1:].long() - 1
        t0 = time.perf_counter()
        check_digests("FORWARD", backend.forward(ids, batch, last)[0])
        done("FORWARD message", t0)
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(0)
        values = torch.randn(4, HIDDEN, generator=g).to(backend.local.dtype)
        check_digests("FORWARD with media", backend.forward(ids, batch, last, media=(torch.arange(4), values))[0])
        done("FORWARD message with media", t0)
        t0 = time.perf_counter()
        hidden = torch.randn(ids.shape[0], HIDDEN, generator=g).to(backend.local.dtype)
        check_digests("MTP_FORWARD", backend.mtp_forward(0, ids, hidden, batch, last)[0])
        done("MTP_FORWARD message", t0)
        t0 = time.perf_counter()
        one, b1 = build_batch([Segment([0], 5, [9])], PAGE, host)
        for _ in range(args.steps):
            backend.forward(one, b1, torch.zeros(1, dtype=torch.int64))
        done(f"{args.steps} small FORWARD steps", t0, ms_per_step=1e3 * (time.perf_counter() - t0) / args.steps)
    finally:
        t0 = time.perf_counter()
        procs = dict(backend.group.procs)
        backend.close()
        codes = {r: p.wait(timeout=60) for r, p in procs.items()}
        done("close", t0, teardown_ok=backend.group.teardown_ok, worker_exit_codes=codes)
    if any(codes.values()) or not backend.group.teardown_ok:
        print(f"close was not clean: worker exit codes {codes}, teardown ok {backend.group.teardown_ok}",
              file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
