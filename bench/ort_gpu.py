"""Decode step of an exported artifact in ONNX Runtime (an execution provider, CUDA by default) beside the torch
backend on the same artifact, in the same run, with the roofline.

For each batch x context the K/V and index-key pools are filled with random values (the same bytes on both sides:
the torch backend's pools are copied into ONNX Runtime's) and every sequence decodes one token at position
``context``. Reported per row: milliseconds of one ``forward`` step of each backend (median of ``--reps``), the
ratio ORT / torch, ORT's cost at each context over its cost at the smallest one (the issue's target: within 1.3x
from 4k to 32k, and within 2x of the torch backend with kernels), whether both pick the same greedy tokens, and
the roofline (bytes the step must read, ``bench/decode.py``'s ``step_bytes``, over the device-to-device copy
bandwidth measured in the same run).

Variants: ``plain`` is the artifact as exported (every ``m3`` node runs its ONNX function body); ``lowered`` is
its ``ort-contrib`` flavour (``export --flavour ort-contrib [--lower MoE,MXFP8Linear,PagedAttention]``:
``com.microsoft`` kernels, experimental, ``m3export/export/lowering.py``; which lowerings it holds is copied from
the manifest into the JSON), timed with its greedy agreement and largest logit difference to the torch backend
when the artifact has it. The lowered logits are held to twice the plain graph's own largest difference to the
torch backend (floor: one bf16 ulp of the logit scale): the lowering's extra error (the norm gain ``1 + w`` rounded
to the activation dtype, another rounding order inside the fused ops) is about one more 16-bit rounding of the
values two 16-bit implementations already round differently (``tests/test_ort_cuda_stream.py`` uses the same
bound). ``ort_enqueue_ms`` is how long ``forward`` takes to return before the device finishes: well under the
step on a sync-free path (ORT on torch's stream), the whole step where something waits on the host.
``torch_graphs``: whether the torch backend's timed steps replayed CUDA graphs (the reference the ratios need on
the GPU; a row timed eagerly there fails the script). Before each shape's ``allocate`` the bench releases the
graphed backend's graphs and their memory pool (``fresh_pools``): ``GraphedTorchBackend.allocate`` drops its
graphs but keeps the pool handle, and capturing into a pool whose graphs are all gone trips torch's allocator
(``beginAllocateToPool``: ``use_count > 0`` INTERNAL ASSERT), which turned graphs off for every later row of the
2026-11-30 H200 run.

``decode`` and ``decode-graph`` (``--variants``) are the artifact's decode-only graph (``model.decode.onnx``,
``m3export/export/decode_graph.py``: no control flow, no value-dependent sizes) run eagerly, and replayed as ONNX
Runtime CUDA graphs (``--provider cuda:enable_cuda_graph=1`` for its session: the step padded to a batch bucket
and a power-of-two table width, one captured graph per shape, fed a host batch as the engine hands it), each with
its greedy agreement and largest logit difference to the torch backend (``<variant>_...`` fields; the plain
graph's own difference is the yardstick: the decode graph computes the same function). ``plain`` and ``lowered``
always run the general graph (``decode_graph=False``).

``--profile`` adds, for the first shape, where one steady ORT step's time goes (``profile`` in the JSON, a table
on stdout), per variant: ONNX Runtime's own profiler over ``--profile-steps`` steps after two warm-up steps (in
sessions of their own, so the timed rows carry no profiling cost) gives each node's host time (self time:
a Scan / Loop / If node's time less its body's), ranked by op type and by node, the nodes per execution provider
(CPU-placed nodes in a CUDA run), and the Memcpy nodes (a ``MemcpyToHost`` waits for the device: the step's host
syncs). On CUDA, torch's profiler (CUPTI sees every kernel of the process, ORT's included) records the same steps'
GPU kernels: kernels and busy milliseconds per step, the top kernels by total time. Busy time well under the step
means the step is launch- or sync-bound, not bandwidth-bound.

  python bench/ort_gpu.py --artifact art/mini-bf16              # H200 + onnxruntime-gpu: table + JSON
  python bench/ort_gpu.py --smoke --artifact art/tiny           # CPU script check (CPU EP, fp32 tiny artifact)
  python bench/ort_gpu.py --artifact art/mini-bf16 --shapes 1x4096 --profile   # where an ORT-CUDA step goes
  python bench/ort_gpu.py --artifact art/mini-bf16 --variants plain,decode,decode-graph   # the decode graph rows
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import decode_batch, step_bytes  # noqa: E402  (bench/decode.py: the one decode-step roofline)
from results_file import write_results  # noqa: E402  (bench/results_file.py)

SMOKE = False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn, reps: int, device: torch.device, until_done: bool = True) -> float:
    """Median milliseconds of ``fn``, the device idle before each call; ``until_done``: until the device has
    finished it (ORT may run on a stream of its own), else until ``fn`` returns (the host's share of a step)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        if until_done:
            _sync(device)
        times.append((time.perf_counter() - t) * 1e3)
    _sync(device)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device) -> float:
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = timed_ms(lambda: b.copy_(a), 20, device)
    return 2 * a.numel() / (ms * 1e-3)


def copy_pages(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    """The torch backend's pool ``src`` into a session's pool ``dst``, page for page. The graphed torch backend
    (CUDA) allocates one scratch page past the ones asked for (its padded rows write there), so ``src`` may have
    more pages than ``dst``; the batch addresses only pages below ``dst``'s count."""
    if src.shape[0] < dst.shape[0] or src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"pool {name}: the torch backend's {tuple(src.shape)} cannot fill ORT's {tuple(dst.shape)}")
    dst.copy_(src[:dst.shape[0]])


def fresh_pools(torch_be, pages: int, page: int) -> None:
    """``torch_be.allocate``, its CUDA graphs (and their memory pool) released first: the next capture takes a new
    pool handle (module docstring: the stale handle is what failed on the H200)."""
    release = getattr(torch_be, "release_graphs", None)
    if release is not None:
        release()
    torch_be.allocate(pages, page)


def fill_ort_pools(ort_be, torch_be) -> None:
    """ORT's pools hold the torch backend's bytes (graph order: one pool list per layer)."""
    session = ort_be._main
    for name, pool in zip(session.pool_inputs, (p for layer in torch_be._caches for p in layer)):
        copy_pages(session.pool_tensors[name], pool, name)


CONTROL_FLOW = {"Scan", "Loop", "If"}  # nodes whose profiled time includes their body's nodes


def _node_self_times(nodes: list[dict]) -> list[tuple[dict, float]]:
    """Each node event with its self time in us: its duration less the events nested inside it (a Scan's body
    runs inside the Scan's event, on the same thread)."""
    out = []
    for tid in {e["tid"] for e in nodes}:
        stack: list[list] = []  # [event, self us, end]
        for e in sorted((e for e in nodes if e["tid"] == tid), key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1][2] <= e["ts"]:
                out.append(tuple(stack.pop()[:2]))
            if stack and e["ts"] + e["dur"] <= stack[-1][2]:
                stack[-1][1] -= e["dur"]
            stack.append([e, float(e["dur"]), e["ts"] + e["dur"]])
        out.extend(tuple(x[:2]) for x in stack)
    return out


def summarize_ort_profile(events: list[dict], steps: int, top: int = 15) -> dict:
    """Where the last ``steps`` runs of an ONNX Runtime profile (chrome-trace events, ``end_profiling``'s file)
    spent host time: per op type and per node (self time, ms per step), per execution provider, and the Memcpy
    nodes. Times are ORT's host-side node times: on a GPU EP a node's time is its kernel launches (and any wait),
    not the kernel's run time."""
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])[-steps:]
    if len(runs) < steps:
        raise ValueError(f"ONNX Runtime's profile holds {len(runs)} runs, {steps} asked for")
    windows = [(r["ts"], r["ts"] + r["dur"]) for r in runs]
    nodes = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")
             and any(a <= e["ts"] < b for a, b in windows)]
    timed = _node_self_times(nodes)
    by_op: dict[tuple, list] = defaultdict(lambda: [0, 0.0])
    by_node: dict[tuple, list] = defaultdict(lambda: [0, 0.0])
    by_provider: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e, self_us in timed:
        args = e.get("args", {})
        op, provider = args.get("op_name", "?"), args.get("provider", "?")
        for table, key in ((by_op, (op, provider)), (by_node, (e["name"][:-len("_kernel_time")], op, provider)),
                           (by_provider, provider)):
            table[key][0] += 1
            table[key][1] += self_us
    node_us = sum(us for _, us in timed) or 1.0

    def ranked(table: dict, fields) -> list[dict]:
        rows = sorted(table.items(), key=lambda kv: -kv[1][1])[:top]
        return [{**dict(zip(fields, key)), "count_per_step": n / steps, "host_ms_per_step": us / steps / 1e3,
                 "share": us / node_us} for key, (n, us) in rows]

    memcpy = {}
    for (op, _), (n, _) in by_op.items():
        if op.startswith("Memcpy"):
            memcpy[op] = memcpy.get(op, 0) + n / steps
    kernels = [e for e in events if e.get("cat") == "Kernel" and any(a <= e["ts"] < b for a, b in windows)]
    return {
        "steps": steps,
        "step_host_ms": statistics.median(r["dur"] for r in runs) / 1e3,
        "nodes_per_step": len(nodes) / steps,
        "node_host_ms_per_step": node_us / steps / 1e3,
        "providers": {p: {"nodes_per_step": n / steps, "host_ms_per_step": us / steps / 1e3}
                      for p, (n, us) in sorted(by_provider.items())},
        "cpu_placed_nodes_per_step": by_provider.get("CPUExecutionProvider", [0])[0] / steps,
        "memcpy_nodes_per_step": memcpy,
        "memcpy_to_host_nodes": sorted({k[0] for k in by_node if k[1] == "MemcpyToHost"})[:top],
        "top_op_types": ranked(by_op, ("op_type", "provider")),
        "top_nodes": ranked(by_node, ("node", "op_type", "provider")),
        # kernel events only in an onnxruntime built with CUDA profiling (the released wheels are not)
        "ort_kernel_events_per_step": len(kernels) / steps,
    }


def summarize_kernels(prof, steps: int, top: int = 15) -> dict:
    """GPU kernels of a ``torch.profiler`` run over ``steps`` steps: count and busy ms per step, top kernels by
    total time (a kernel's name cut at its argument list)."""
    from torch.autograd import DeviceType

    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            name = e.name.split("(")[0][:160]
            totals[name][0] += 1
            totals[name][1] += e.time_range.elapsed_us()
    busy = sum(us for _, us in totals.values()) or 1.0
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels_per_step": sum(n for n, _ in totals.values()) / steps,
            "busy_ms_per_step": busy / steps / 1e3,
            "top_kernels": [{"kernel": k, "count_per_step": n / steps, "ms_per_step": us / steps / 1e3,
                             "share": us / busy} for k, (n, us) in rows]}


@contextlib.contextmanager
def profiled_backend(art, provider, prefix: str, flavour: str | None = None, threads: int | None = None):
    """An ``OnnxRuntimeBackend`` whose main session runs with ONNX Runtime's profiler on (its files under a
    temporary folder, read with ``be._main.session.end_profiling()`` inside the block); closed on exit."""
    import onnxruntime as ort

    from m3export.plugins.onnxruntime.session import PagedSession
    from m3export.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

    kw = {} if flavour is None else {"flavour": flavour}
    with contextlib.closing(OnnxRuntimeBackend(art, provider, threads=threads, **kw)) as be, \
            tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "step")
        if threads:
            options.intra_op_num_threads = threads
        be._main.close()  # the backend's own session, replaced by the profiled one (closed with the backend)
        be._main = PagedSession.from_artifact(art, "model", providers=be.provider, options=options, **kw)
        yield be


def profile_variant(art, provider, flavour, torch_be, pages: int, page: int, step, steps: int) -> dict:
    """A fresh session of ``flavour`` with ONNX Runtime's profiler on (and torch's, for the GPU kernels, on CUDA):
    two warm-up steps, then ``steps`` profiled ones of ``step(backend)``; the summaries of both profilers."""
    with profiled_backend(art, provider, "ort_profile_", flavour=flavour) as be:
        be.allocate(pages, page)
        fill_ort_pools(be, torch_be)
        device = be.device
        for _ in range(2):
            step(be)
        _sync(device)
        gpu = {"note": "no CUDA device: host times only"}
        if device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            try:  # CUPTI taken by another profiler, or torch's event API of another version: say so, keep ORT's
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(steps):
                        step(be)
                    _sync(device)
                gpu = summarize_kernels(prof, steps)
            except Exception as e:  # noqa: BLE001
                gpu = {"error": f"{type(e).__name__}: {e}"[:500]}
                for _ in range(steps):  # ORT's summary reads the last `steps` runs: whole ones
                    step(be)
        else:
            for _ in range(steps):
                step(be)
        events = json.loads(Path(be._main.session.end_profiling()).read_text())
    return {**summarize_ort_profile(events, steps), "gpu": gpu}


def print_profile(name: str, prof: dict) -> None:
    if "error" in prof:
        print(f"\nprofile {name}: {prof['error'][:300]}")
        return
    print(f"\nprofile {name}: step {prof['step_host_ms']:.2f} ms host, {prof['nodes_per_step']:.0f} nodes "
          f"({prof['node_host_ms_per_step']:.2f} ms), CPU-placed {prof['cpu_placed_nodes_per_step']:.0f}, "
          f"memcpy {prof['memcpy_nodes_per_step'] or 0}")
    gpu = prof["gpu"]
    if "busy_ms_per_step" in gpu:
        print(f"  GPU: {gpu['kernels_per_step']:.0f} kernels, busy {gpu['busy_ms_per_step']:.2f} ms per step")
        for k in gpu["top_kernels"][:8]:
            print(f"    {k['ms_per_step']:8.3f} ms {k['share']:6.1%} x{k['count_per_step']:<6.0f} {k['kernel'][:90]}")
    else:
        print(f"  GPU: {gpu}")
    print("  host time by op type (self, per step):")
    for r in prof["top_op_types"][:10]:
        print(f"    {r['host_ms_per_step']:8.3f} ms {r['share']:6.1%} x{r['count_per_step']:<6.0f} {r['op_type']} "
              f"({r['provider']})")


def artifact_arguments(ap: argparse.ArgumentParser, what: str) -> None:
    """``--artifact`` / ``--provider``, the same in every ORT benchmark (``what``: the artifact it wants)."""
    ap.add_argument("--artifact", required=True, help=f"exported artifact ({what})")
    ap.add_argument("--provider", default="cuda", help="ONNX Runtime execution provider (default: %(default)s)")


def open_artifact(artifact: str, provider_text: str):
    """(provider, artifact): the EP parsed and required (one clear line where it is missing), the artifact loaded
    without re-hashing its shards (a benchmark reads what ``verify`` checked)."""
    from m3export.export.artifact import load_artifact
    from m3export.plugins.onnxruntime.providers import parse_provider, require

    return require(parse_provider(provider_text)), load_artifact(artifact, verify_checksums=False)


def main() -> int:
    global SMOKE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    artifact_arguments(ap, "a bf16 `mini` one on the H200")
    ap.add_argument("--shapes", default="1x4096,1x32768,8x4096,8x32768", help="batch x context pairs")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "ort_gpu_h200.json"))
    ap.add_argument("--smoke", action="store_true", help="CPU EP, short contexts: checks the script, measures nothing")
    ap.add_argument("--profile", action="store_true",
                    help="profile steady ORT steps at the first shape (ORT's profiler; torch's for the GPU kernels)")
    ap.add_argument("--profile-steps", type=int, default=5, help="steps profiled per variant (default: %(default)s)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"ORT variants to time, among {', '.join(VARIANTS)} (default: all; plain always runs)")
    args = ap.parse_args()
    wanted = set(args.variants.split(","))
    if wanted - set(VARIANTS):
        ap.error(f"--variants: unknown {sorted(wanted - set(VARIANTS))}; choose among {', '.join(VARIANTS)}")
    SMOKE = args.smoke

    from m3export.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

    provider, art = open_artifact(args.artifact, "cpu" if SMOKE else args.provider)
    ort_be = OnnxRuntimeBackend(art, provider, decode_graph=False)
    lowered_be, lowered_error = None, None
    if "ort-contrib" in art.manifest.flavours and "lowered" in wanted:
        try:  # a lowering ORT cannot load here is a result to report, not the end of the benchmark
            lowered_be = OnnxRuntimeBackend(art, provider, flavour="ort-contrib", decode_graph=False)
        except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
            lowered_error = f"{type(e).__name__}: {e}"[:2000]
    decode_bes, decode_errors = decode_backends(art, provider, wanted)
    try:
        return measure(args, art, provider, ort_be, lowered_be, lowered_error, decode_bes, decode_errors)
    finally:  # every ORT session closed while the CUDA runtime is up: one left to the exit aborted a process once
        for be in (ort_be, lowered_be, *decode_bes.values()):
            if be is not None:
                be.close()


VARIANTS = ("plain", "lowered", "decode", "decode-graph", "lowered-decode", "lowered-decode-graph")
DECODE_VARIANTS = VARIANTS[2:]


def decode_backends(art, provider, wanted: set[str]) -> tuple[dict, dict]:
    """The decode-graph variants asked for: ``decode`` (eager) and ``decode-graph`` (replayed as ORT CUDA graphs;
    on the CPU EP, ``--smoke``, the same padded inputs run without capture); ``lowered-...``: the same with the
    decode graph of the ``ort-contrib`` flavour (its MoE on ``com.microsoft.MoE``) and that flavour's general
    graph for other steps. -> (name -> backend, name -> why not): a backend ORT refuses is a result to report."""
    from m3export.plugins.onnxruntime.providers import Provider
    from m3export.runtime.backends.onnxruntime_backend import CUDA_GRAPH, OnnxRuntimeBackend

    made, errors = {}, {}
    for name in DECODE_VARIANTS:
        if name not in wanted:
            continue
        kw = {"flavour": "ort-contrib"} if name.startswith("lowered-") else {}
        if kw and "ort-contrib" not in art.manifest.flavours:
            continue  # not in this artifact (as the lowered variant: export it with --flavour ort-contrib)
        try:
            if not name.endswith("-graph"):
                made[name] = OnnxRuntimeBackend(art, provider, decode_graph=True, **kw)
            elif provider.name == "CUDAExecutionProvider":
                made[name] = OnnxRuntimeBackend(art, Provider(provider.name, {**provider.options, CUDA_GRAPH: "1"}),
                                                **kw)
            else:
                made[name] = OnnxRuntimeBackend(art, provider, pad_decode=True, **kw)
        except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
            errors[name] = f"{type(e).__name__}: {e}"[:2000]
    return made, errors


def time_decode_variant(name: str, be, ids, batch: int, context: int, page: int, device, lt, plain_diff: float,
                        reps: int, t_ms: float) -> dict:
    """One decode-graph variant's row fields (``<name>_...``), fed the batch where the backend wants it
    (``batch_device``: the host for padded / replayed steps, as the engine hands them)."""
    key = name.replace("-", "_")
    try:
        where = be.batch_device
        b, _ = decode_batch(batch, context, page, where)
        x, rows = ids.to(where), torch.arange(batch, device=where)
        lx, _ = be.forward(x, b, rows)
        ms = timed_ms(lambda: be.forward(x, b, rows), reps, device)
        return {f"ort_{key}_ms": ms, f"ort_{key}_enqueue_ms": timed_ms(lambda: be.forward(x, b, rows), reps, device,
                                                                        until_done=False),
                f"{key}_over_torch": ms / t_ms, f"{key}_greedy_same": bool((lx.argmax(-1) == lt.argmax(-1)).all()),
                f"{key}_max_abs_logit_diff": float((lx - lt).abs().max()), f"{key}_plain_diff": plain_diff,
                f"{key}_replays": be.replays, f"{key}_general_steps": be.general_steps}
    except Exception as e:  # noqa: BLE001 - e.g. ORT refusing a capture: reported, the other rows go on
        return {f"{key}_error": f"{type(e).__name__}: {e}"[:2000]}


def measure(args, art, provider, ort_be, lowered_be, lowered_error, decode_bes, decode_errors) -> int:
    """The rows (and ``--profile``) of ``main`` with the ONNX Runtime backends it opened (and closes)."""
    from m3export.runtime.backends import create_backend

    device = torch.device(provider.device)
    cfg, page = art.config, art.page_size
    torch_be = create_backend("torch", args.artifact, device=str(device))
    if SMOKE:  # the class the GPU gets (CUDA graphs off here): its pools hold a scratch page past the sessions'
        from m3export.runtime.backends.cuda_graph import GraphedTorchBackend

        torch_be = GraphedTorchBackend(torch_be.model, torch_be.dtype, use_graphs=False, pad_eagerly=True)
    elt = torch.empty((), dtype=ort_be.graph_dtype.torch).element_size()
    shapes = [(1, 40), (2, 90)] if SMOKE else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    bw = copy_bandwidth(device)
    import onnxruntime

    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)",
           "onnxruntime": onnxruntime.__version__, "provider": str(provider), "artifact": str(art.root),
           "dtype": art.manifest.dtype, "mxfp8": art.manifest.mxfp8, "page_size": page,
           "copy_bandwidth_TBps": bw / 1e12,
           "lowered": "ort-contrib flavour (experimental)" if lowered_be else lowered_error or
                      "not in this artifact (export it with --flavour ort-contrib)",
           "lowerings": {g: {k: r.get(k) for k in ("lowered", "applied", "kept", "gain_rounding")}
                         for g, r in art.manifest.flavours.get("ort-contrib", {}).items()},
           "decode_variants": sorted(decode_bes), "decode_errors": decode_errors, "rows": []}
    print(f"{'batch':>5s} {'context':>7s} {'torch ms':>9s} {'ort ms':>9s} {'enqueue':>8s} {'ort/torch':>9s} "
          f"{'vs first':>8s} {'roofline ms':>11s}  greedy")
    first: dict[int, float] = {}
    g = torch.Generator(device=device).manual_seed(0)
    for batch, context in shapes:
        b, pages = decode_batch(batch, context, page, device)
        ort_variants = [be for be in (ort_be, lowered_be, *decode_bes.values()) if be is not None]
        for be in ort_variants:
            be.allocate(pages, page)
        fresh_pools(torch_be, pages, page)
        for pool in (p for layer in torch_be._caches for p in layer):
            pool.normal_(0.0, 1.0, generator=g)
        for be in ort_variants:  # the same bytes
            fill_ort_pools(be, torch_be)
        ids = torch.randint(0, cfg.vocab_size, (batch,), generator=g, device=device)
        rows = torch.arange(batch, device=device)
        with torch.no_grad():
            lo, _ = ort_be.forward(ids, b, rows)
            lt, _ = torch_be.forward(ids, b, rows)
            same = bool((lo.argmax(-1) == lt.argmax(-1)).all())
            plain_diff = float((lo - lt).abs().max())
            replays = getattr(torch_be, "replays", 0)
            t_ms = timed_ms(lambda: torch_be.forward(ids, b, rows), args.reps, device)
            # every timed torch step (2 warm-up + reps) replayed a graph; None where graphs are off (CPU)
            graphed = getattr(torch_be, "replays", 0) - replays == args.reps + 2 if device.type == "cuda" else None
            o_ms = timed_ms(lambda: ort_be.forward(ids, b, rows), args.reps, device)
            o_enqueue = timed_ms(lambda: ort_be.forward(ids, b, rows), args.reps, device, until_done=False)
            lowered = {}
            if lowered_be is not None:
                try:
                    ll, _ = lowered_be.forward(ids, b, rows)
                    diff = float((ll - lt).abs().max())
                    bound = max(2 * plain_diff, 2.0 ** -8 * float(lt.abs().max()))
                    lowered = {"ort_lowered_ms": timed_ms(lambda: lowered_be.forward(ids, b, rows), args.reps,
                                                          device),
                               "lowered_greedy_same": bool((ll.argmax(-1) == lt.argmax(-1)).all()),
                               "lowered_max_abs_logit_diff": diff, "lowered_logit_bound": bound,
                               "lowered_within_bound": diff <= bound}
                except Exception as e:  # noqa: BLE001 - e.g. a kernel ORT lacks for these shapes
                    lowered = {"lowered_error": f"{type(e).__name__}: {e}"[:2000]}
            decoded = {}
            for name, be in decode_bes.items():
                decoded.update(time_decode_variant(name, be, ids, batch, context, page, device, lt, plain_diff,
                                                   args.reps, t_ms))
        if args.profile and "profile" not in res:  # the first shape: the headline row
            res["profile"] = {"batch": batch, "context": context}
            for name, flavour, be in (("plain", None, ort_be), ("lowered", "ort-contrib", lowered_be)):
                if be is None:
                    continue
                try:  # a profiler that fails here is a result to report, not the end of the benchmark
                    res["profile"][name] = profile_variant(art, provider, flavour, torch_be, pages, page,
                                                           lambda x: x.forward(ids, b, rows), args.profile_steps)
                except Exception as e:  # noqa: BLE001 - ORT and torch raise their own exception types
                    res["profile"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        first.setdefault(batch, o_ms)
        roof_ms = step_bytes(torch_be.model, cfg, batch, context, elt, {
            i: cfg.num_local_experts for i in range(cfg.num_hidden_layers)}) / bw * 1e3
        row = {"batch": batch, "context": context, "torch_ms": t_ms, "ort_plain_ms": o_ms,
               "ort_enqueue_ms": o_enqueue, "plain_max_abs_logit_diff": plain_diff,
               "ort_over_torch": o_ms / t_ms,
               "ort_over_first_context": o_ms / first[batch], "roofline_ms_all_experts": roof_ms,
               "greedy_same": same, "torch_graphs": graphed,
               "pool_pages": {"torch": int(torch_be._caches[0][0].shape[0]),
                              "ort": int(next(iter(ort_be._main.pool_tensors.values())).shape[0])},
               **lowered, **decoded}
        res["rows"].append(row)
        write_results(res, args.json)  # each row as it comes: a variant that breaks the device loses no row before it
        low = (f"  lowered {lowered['ort_lowered_ms']:.2f} ms "
               f"{'same' if lowered['lowered_greedy_same'] else 'DIFFERENT'} "
               f"{'within' if lowered['lowered_within_bound'] else 'OUTSIDE'} bound" if "ort_lowered_ms" in lowered
               else f"  lowered: {lowered['lowered_error'][:80]}" if lowered else "")
        for name in decode_bes:
            key = name.replace("-", "_")
            low += (f"  {name} {row[f'ort_{key}_ms']:.2f} ms ({row[f'{key}_over_torch']:.2f}x) "
                    f"{'same' if row[f'{key}_greedy_same'] else 'DIFFERENT'}" if f"ort_{key}_ms" in row
                    else f"  {name}: {row[f'{key}_error'][:80]}")
        print(f"{batch:5d} {context:7d} {t_ms:9.2f} {o_ms:9.2f} {o_enqueue:8.2f} {o_ms / t_ms:9.2f} "
              f"{o_ms / first[batch]:8.2f} "
              f"{roof_ms:11.3f}  {'same' if same else 'DIFFERENT'}{low}"
              f"{'  torch EAGER (graphs off: ratio not against the graphed backend)' if graphed is False else ''}",
              flush=True)
    for name in ("plain", "lowered"):
        if name in res.get("profile", {}):
            print_profile(f"{name} (batch {res['profile']['batch']}, context {res['profile']['context']})",
                          res["profile"][name])
    write_results(res, args.json)
    rows_ok = all(r["greedy_same"] and r.get("lowered_greedy_same", True) and r.get("lowered_within_bound", True)
                  and all(r.get(f"{n.replace('-', '_')}_greedy_same", False) for n in decode_bes)
                  and r["torch_graphs"] is not False for r in res["rows"]) and not decode_errors
    profile_ok = not any("error" in v for v in res.get("profile", {}).values() if isinstance(v, dict))
    return 0 if rows_ok and profile_ok else 1


if __name__ == "__main__":
    sys.exit(main())
