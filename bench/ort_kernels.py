"""Where the GPU time of one decode-graph step on ONNX Runtime's CUDA EP goes, kernel by kernel, and what the
replayed CUDA graph adds between kernels.

For each batch x context the artifact's decode-only graph (``model.decode*.onnx``, the MoE form the backend picks
for the batch) runs two ways through ``OnnxRuntimeBackend``:

* **eager** (``pad_decode``: the replay's padded inputs, no capture), its decode session opened with ONNX Runtime's
  profiler on, and ``torch.profiler`` with CUDA activity around ``--steps`` steady steps (CUPTI records every
  kernel of the process, ORT's too). Each GPU activity (kernel, memcpy, memset) is linked to the host call that
  launched it (CUPTI's correlation id; by launch order where the ids do not match) and the launch to the ORT node
  whose host window holds it (``attribute``: both profilers stamp host time in Unix nanoseconds; the offset between
  the two clocks is fitted, ``fit_offset``, by kernels whose names say their node's op type; the share of launches
  inside a node window is reported as ``launches_in_nodes``). A node is the graph level (the traced model: norms,
  RoPE, projections, casts, cache writes) or the body of the ``m3`` op ORT inlined it from
  (``ort_step_host.node_origin``). Tables: GPU time per kernel name, per (origin, op type), per origin, per step.
* **replayed** (``enable_cuda_graph=1``): ``--steps`` replays under ``torch.profiler``, the kernels of each
  ``cudaGraphLaunch``: their count, their summed time (``busy``), the first start to the last end (``span``) and
  the step's wall time timed without a profiler (``step``). ``span - busy`` is what the graph spends between its
  kernels (launch gaps: ~1-2 us per kernel node on Hopper), ``step - span`` what the step adds around the graph
  (the input copy, the output copies). Where a replay runs the eager step's kernels in the same order (the graph is
  the captured eager step), each replayed kernel takes the eager kernel's node: the per-origin table of the
  replayed step (``replay_by_origin``).

Kernel names are cut at their argument list; ``family`` also cuts the template arguments (``_UnaryElementWise``,
``_BinaryElementWiseSimple``, a cuBLAS / CUTLASS GEMM, ...). The profiled eager step is slower than an unprofiled
one (ORT's profiler per node, CUPTI per launch): read kernel times and shares, not the eager step's wall time.

  python bench/ort_kernels.py --artifact art/mini-bf16 --shapes 1x4096,8x4096 --json $OUT/ort_kernels_h200.json
  python bench/ort_kernels.py --artifact /tmp/art/tiny --provider cpu --shapes 1x40   # CPU: ORT's nodes only
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import decode_batch, fill_pool  # noqa: E402  (bench/decode.py: the decode step's batch, pools)
from ort_gpu import artifact_arguments, open_artifact, timed_ms  # noqa: E402  (bench/ort_gpu.py)
from ort_step_host import node_origin  # noqa: E402  (bench/ort_step_host.py: graph level or an m3 op's body)
from results_file import RESULTS, write_results  # noqa: E402  (bench/results_file.py)

# host calls that put work on a stream (CUDA runtime and driver API names as CUPTI reports them)
# (cuBLAS's sm90 GEMMs launch through the driver's cuLaunchKernelEx, cluster launches: missing it once left the
# step's large GEMMs unattributed)
LAUNCHES = re.compile(r"^(cuda|cu)(LaunchKernel(Ex|ExC)?|LaunchCooperativeKernel(Multi\w*)?|Memcpy\w*Async|"
                      r"Memset\w*Async|Memcpy|Memset|GraphLaunch)(_v\d+|_ptsz)*$")
GRAPH_LAUNCH = re.compile(r"^(cuda|cu)GraphLaunch")


def kernel_name(name: str) -> str:
    """A kernel's name without its argument list and return type (``void f<...>(args)`` -> ``f<...>``)."""
    name = name.split("(")[0].strip()
    return (name[5:] if name.startswith("void ") else name)[:200]


def family(name: str) -> str:
    """A kernel's name without template arguments or namespaces (``onnxruntime::cuda::_UnaryElementWise<...>`` ->
    ``_UnaryElementWise``); GEMMs of cuBLAS / CUTLASS as ``gemm``; memcpy / memset activities as they are."""
    base = kernel_name(name).split("<")[0].split("::")[-1]
    if re.search(r"gemm|gemv|cutlass|xmma|cublas", name, re.IGNORECASE):
        return f"gemm ({base[:60]})"
    return base or name[:60]


def cuda_activity(prof) -> tuple[list[dict], list[dict]]:
    """(host launch calls, GPU activities) of a ``torch.profiler`` run, in Unix nanoseconds: each launch
    ``{ts, corr, name}``; each activity ``{start, dur, corr, name}`` (kernels, memcpy, memset; start order)."""
    from torch.autograd import DeviceType

    launches, gpu = [], []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == DeviceType.CUDA:
            gpu.append({"start": e.start_ns(), "dur": e.duration_ns(), "corr": e.correlation_id(), "name": e.name()})
        elif LAUNCHES.match(e.name()):
            launches.append({"ts": e.start_ns(), "corr": e.correlation_id(), "name": e.name()})
    return sorted(launches, key=lambda x: x["ts"]), sorted(gpu, key=lambda x: x["start"])


def link(launches: list[dict], gpu: list[dict]) -> tuple[list[dict | None], str]:
    """Each GPU activity's launch: by CUPTI correlation id, or, where fewer than 90 % of the activities find theirs
    that way, by order (one stream: the i-th non-graph launch started the i-th activity; graph launches excluded).
    -> (launch or None per activity, how)."""
    by_corr = {x["corr"]: x for x in launches if x["corr"]}
    linked = [by_corr.get(g["corr"]) if g["corr"] else None for g in gpu]
    if gpu and sum(x is not None for x in linked) >= 0.9 * len(gpu):
        return linked, "correlation"
    plain = [x for x in launches if not GRAPH_LAUNCH.match(x["name"])]
    if len(plain) != len(gpu):
        return [None] * len(gpu), f"none ({len(plain)} launches, {len(gpu)} activities, correlation ids unmatched)"
    return list(plain), "order"


def node_windows(events: list[dict], start_ns: int, steps: int) -> tuple[dict, list[tuple[int, int]]]:
    """The node events of the last ``steps`` runs of an ONNX Runtime profile (``end_profiling``'s file, its
    timestamps microseconds from ``start_ns``), start-sorted: ``{start, end}`` (Unix ns arrays) and ``name``,
    ``op``, ``provider`` lists; and the runs' windows."""
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])[-steps:]
    if len(runs) < steps:
        raise ValueError(f"ONNX Runtime's profile holds {len(runs)} runs, {steps} asked for")
    windows = [(start_ns + r["ts"] * 1000, start_ns + (r["ts"] + r["dur"]) * 1000) for r in runs]
    lo, hi = runs[0]["ts"], runs[-1]["ts"] + runs[-1]["dur"]
    nodes = sorted((e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")
                    and lo <= e["ts"] < hi), key=lambda e: e["ts"])
    return {"start": np.array([start_ns + e["ts"] * 1000 for e in nodes], dtype=np.int64),
            "end": np.array([start_ns + (e["ts"] + e["dur"]) * 1000 for e in nodes], dtype=np.int64),
            "name": [e["name"][:-len("_kernel_time")] for e in nodes],
            "op": [e.get("args", {}).get("op_name", "?") for e in nodes],
            "provider": [e.get("args", {}).get("provider", "?") for e in nodes]}, windows


def _inside(ts: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Index of the node window holding each time (-1: none); windows do not overlap (one executing thread)."""
    i = np.searchsorted(start, ts, side="right") - 1
    ok = (i >= 0) & (ts < end[np.maximum(i, 0)])
    return np.where(ok, i, -1)


# kernel-name fragments that say which ONNX op launched a kernel, besides the op type's own name (``OP_Cast``,
# ``_GatherKernel``, ...): what ``fit_offset`` scores a clock shift by
OP_KERNEL_WORDS = {"MatMul": ("gemm", "gemv", "matmul"), "Gemm": ("gemm", "gemv"), "ReduceMean": ("reduce",),
                   "ReduceSum": ("reduce",), "ReduceMax": ("reduce",), "ScatterND": ("scatter",),
                   "SimplifiedLayerNormalization": ("layernorm", "layer_norm")}


def names_op(kernel: str, op: str) -> bool:
    """Whether a kernel's name names ONNX op ``op`` (its type, or a word of ``OP_KERNEL_WORDS``)."""
    k = kernel.lower()
    return op.lower() in k or any(w in k for w in OP_KERNEL_WORDS.get(op, ()))


def fit_offset(ts: np.ndarray, kernels: list[str], nodes: dict, reach_ns: int = 2_000_000) -> tuple[int, float]:
    """The shift (ns, added to the launch times ``ts`` of ``kernels``) within +-``reach_ns`` that best places the
    launches in ``nodes``' windows, and the share of launches inside a window there. Both profilers stamp Unix
    time, so the shift is the two clocks' disagreement (a few us); but ORT's nodes run back to back, so nearly any
    shift puts a launch inside some node: a shift is scored first by how many kernels land on a node whose op type
    their name says (``names_op``: ``OP_Cast`` on a ``Cast``, a GEMM on a ``MatMul``), then by how many land inside
    any node. Coarse (1 us) then fine (50 ns); the middle of the best shifts."""
    start, end = nodes["start"], nodes["end"]
    if not len(ts) or not len(start):
        return 0, 0.0
    ops = sorted(set(nodes["op"]))
    op_id = np.array([ops.index(o) for o in nodes["op"]], dtype=np.int64)
    says = np.array([[names_op(k, o) for o in ops] for k in kernels], dtype=bool)  # [launch, op]
    rows = np.arange(len(ts))

    def middle(shifts) -> tuple[int, int]:
        scores = []
        for s in shifts:
            i = _inside(ts + s, start, end)
            inside = i >= 0
            named = int((says[rows, op_id[np.maximum(i, 0)]] & inside).sum())
            scores.append((named, int(inside.sum())))
        top = max(scores)
        hits = shifts[[k for k, c in enumerate(scores) if c == top]]
        return int(hits[len(hits) // 2]), top[1]

    best, _ = middle(np.arange(-reach_ns, reach_ns + 1, 1000))
    shift, inside = middle(np.arange(best - 1000, best + 1001, 50))
    return shift, inside / len(ts)


def attribute(launches: list[dict], gpu: list[dict], linked: list[dict | None], nodes: dict,
              windows: list[tuple[int, int]], shift: int) -> list[dict]:
    """The GPU activities launched inside one of ``windows`` (ORT's runs), each with its step, its node (name, op
    type, origin; None outside any node window) and its duration."""
    out = []
    for g, x in zip(gpu, linked):
        if x is None:
            continue
        t = x["ts"] + shift
        step = next((k for k, (a, b) in enumerate(windows) if a <= t < b), None)
        if step is None:
            continue
        i = int(_inside(np.array([t], dtype=np.int64), nodes["start"], nodes["end"])[0])
        name, op = (nodes["name"][i], nodes["op"][i]) if i >= 0 else (None, None)
        origin = node_origin(name, op)[0] if name is not None else "outside nodes"
        out.append({"step": step, "kernel": kernel_name(g["name"]), "family": family(g["name"]), "node": name,
                    "op": op, "origin": origin, "dur": g["dur"], "start": g["start"]})
    return out


def tables(kernels: list[dict], steps: int, top: int = 25) -> dict:
    """GPU time per step of ``kernels`` (``attribute``'s), ranked per kernel family, kernel name, (origin, op
    type) and origin: count and microseconds per step, share of the busy time."""
    busy = sum(k["dur"] for k in kernels) or 1

    def ranked(key, n=top) -> list[dict]:
        acc: dict = defaultdict(lambda: [0, 0])
        for k in kernels:
            acc[key(k)][0] += 1
            acc[key(k)][1] += k["dur"]
        rows = sorted(acc.items(), key=lambda kv: -kv[1][1])[:n]
        return [{"key": list(kk) if isinstance(kk, tuple) else kk, "count_per_step": c / steps,
                 "us_per_step": ns / steps / 1e3, "share": ns / busy} for kk, (c, ns) in rows]

    return {"kernels_per_step": len(kernels) / steps, "busy_ms_per_step": busy / steps / 1e6,
            "by_origin": ranked(lambda k: k["origin"], 1000),
            "by_origin_op": ranked(lambda k: (k["origin"], k["op"] or "-")),
            "by_family": ranked(lambda k: k["family"]),
            "by_kernel": ranked(lambda k: k["kernel"]),
            "by_node": ranked(lambda k: (k["node"] or "-", k["op"] or "-"))}


def replays(launches: list[dict], gpu: list[dict], linked: list[dict | None]) -> list[list[dict]]:
    """The GPU activities of each CUDA-graph launch (by correlation: a graph's kernels carry its launch's id), start
    order; one list per ``cudaGraphLaunch``."""
    per: dict[int, list] = {x["corr"]: [] for x in launches if GRAPH_LAUNCH.match(x["name"])}
    for g, x in zip(gpu, linked):
        if x is not None and x["corr"] in per:
            per[x["corr"]].append(g)
    return [sorted(v, key=lambda g: g["start"]) for _, v in sorted(per.items()) if v]


def replay_summary(graphs: list[list[dict]], step_ms: float, eager: list[dict] | None) -> dict:
    """Per replay (medians): kernels, busy (summed kernel time), span (first start to last end), gaps (span -
    busy), and the unprofiled step's wall time against them; where a replay's kernels are the eager step's (same
    names, same order), its time per origin (the eager kernels' nodes)."""
    if not graphs:
        return {"error": "no kernels linked to a cudaGraphLaunch (CUPTI did not report the graph's kernels)"}
    med = lambda xs: float(np.median(xs))  # noqa: E731
    busy = med([sum(g["dur"] for g in r) / 1e6 for r in graphs])
    span = med([(max(g["start"] + g["dur"] for g in r) - r[0]["start"]) / 1e6 for r in graphs])
    out = {"replays": len(graphs), "kernels": med([len(r) for r in graphs]), "busy_ms": busy, "span_ms": span,
           "gaps_ms": span - busy, "gap_us_per_kernel": (span - busy) * 1e3 / max(med([len(r) for r in graphs]), 1),
           "step_ms": step_ms, "outside_graph_ms": step_ms - span}
    # the replayed kernels by name, without nodes (what the graph runs, whether or not it is the eager order)
    own = tables([{"kernel": kernel_name(g["name"]), "family": family(g["name"]), "node": None, "op": None,
                   "origin": "replay", "dur": g["dur"], "start": g["start"]} for r in graphs for g in r], len(graphs))
    out["by_family"], out["by_kernel"] = own["by_family"], own["by_kernel"]
    if eager:
        first_step = [k for k in eager if k["step"] == 0]
        same = [r for r in graphs if [kernel_name(g["name"]) for g in r] == [k["kernel"] for k in first_step]]
        out["replays_matching_eager_order"] = len(same)
        if same:
            mapped = [{**k, "dur": g["dur"]} for r in same for k, g in zip(first_step, r)]
            out["replay_by_origin"] = tables(mapped, len(same))["by_origin"]
            out["replay_by_origin_op"] = tables(mapped, len(same))["by_origin_op"]
    return out


def _fill_pools(be, seed: int = 0) -> None:
    """The pools hold seeded normal values (16-bit and fp32 pools, ``decode.fill_pool``; the time does not depend
    on them)."""
    g = torch.Generator(device=be.device).manual_seed(seed)
    for t in be._main.pool_tensors.values():
        if t.is_floating_point():
            fill_pool(t, g)


def swap_decode(be, form: str, options=None, model: bytes | None = None, graph=None) -> None:
    """Replace ``be``'s decode session of ``form`` by one opened with ``options`` (e.g. ORT's profiler on) and / or
    running ``model`` (a variant of the same graph, its weights from the artifact's folder; ``graph``: its
    signature where it has more outputs), on the same pools and the backend's shared weights (the old one closed
    first)."""
    from m3export.plugins.onnxruntime.session import PagedSession

    pages = next(iter(be._main.pool_tensors.values())).shape[0]
    be._decodes.pop(form).close()
    record = be.artifact.manifest.flavours[be._decode_flavours[form]]["model"]
    new = PagedSession(be.artifact.root / record["file"], graph or be.artifact.graphs["model"],
                       providers=be._decode_provider, options=options, model=model, weights=be._weights)
    new.allocate(pages, pools_of=be._main)
    be._decodes[form] = new


def _step_inputs(art, batch: int, context: int):
    """(ids, batch, logits rows, pages) of a decode step at ``context`` on the host (as the engine hands a padded
    decode step to the backend)."""
    b, pages = decode_batch(batch, context, art.page_size, "cpu")
    ids = torch.randint(0, art.config.vocab_size, (batch,), generator=torch.Generator().manual_seed(1))
    return ids, b, torch.arange(batch), pages


def eager_profile(be, batch: int, context: int, steps: int, tmp: Path) -> tuple[dict, list[dict]]:
    """The eager padded decode step of backend ``be`` (``pad_decode``), profiled (module docstring) -> (summary,
    attributed kernels)."""
    import onnxruntime as ort

    from m3export.export.decode_graph import moe_form

    art = be.artifact
    ids, b, rows, pages = _step_inputs(art, batch, context)
    be.allocate(pages, art.page_size)
    _fill_pools(be)
    be.forward(ids, b, rows)  # opens the decode session of this batch's MoE form
    form = moe_form(batch, art.config.num_experts_per_tok, art.config.num_local_experts)
    form = form if form in be._decodes else "per-assignment"
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp / f"decode_{batch}x{context}")
    swap_decode(be, form, options)
    for _ in range(2):
        be.forward(ids, b, rows)
    session = be._decodes[form].session
    start_ns = session.get_profiling_start_time_ns()
    res = {"batch": batch, "context": context, "moe_form": form, "steps": steps,
           "flavour": be._decode_flavours[form],
           "shared_weights_GB": be._weights.nbytes / 1e9 if be._weights is not None else None,
           "shared_weights_refused": list(be._weights.refused.values())[:5] if be._weights is not None else None}
    prof = None
    if be.device.type != "cuda":
        for _ in range(steps):
            be.forward(ids, b, rows)
    else:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize(be.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                be.forward(ids, b, rows)
            torch.cuda.synchronize(be.device)
    events = json.loads(Path(session.end_profiling()).read_text())
    nodes, windows = node_windows(events, start_ns, steps)
    res["nodes_per_step"] = len(nodes["name"]) / steps
    res["cpu_ep_nodes_per_step"] = sum(p == "CPUExecutionProvider" for p in nodes["provider"]) / steps
    res["run_host_ms"] = float(np.median([(b_ - a) / 1e6 for a, b_ in windows]))
    if prof is None:
        res["gpu"] = {"note": "no CUDA device: ORT's nodes only"}
        return res, []
    launches, gpu = cuda_activity(prof)
    linked, how = link(launches, gpu)
    near = [(x["ts"], g["name"]) for g, x in zip(gpu, linked)
            if x is not None and windows[0][0] - 2_000_000 <= x["ts"] < windows[-1][1] + 2_000_000]
    shift, inside = fit_offset(np.array([t for t, _ in near], dtype=np.int64), [k for _, k in near], nodes)
    kernels = attribute(launches, gpu, linked, nodes, windows, shift)
    spans = [(max(k["start"] + k["dur"] for k in kernels if k["step"] == s) -
              min(k["start"] for k in kernels if k["step"] == s)) / 1e6 for s in range(steps)
             if any(k["step"] == s for k in kernels)]
    res["gpu"] = {"linked_by": how, "clock_shift_us": shift / 1e3, "launches_in_nodes": inside,
                  "activities": len(gpu), "attributed": len(kernels),
                  # GPU activities whose launch was not found (a launch call LAUNCHES does not name): per step
                  "unlinked": tables([{"kernel": kernel_name(g["name"]), "family": family(g["name"]), "node": None,
                                       "op": None, "origin": "unlinked", "dur": g["dur"], "start": g["start"]}
                                      for g, x in zip(gpu, linked) if x is None], steps, top=10)["by_kernel"],
                  "eager_span_ms": float(np.median(spans)) if spans else None, **tables(kernels, steps)}
    return res, kernels


def replay_profile(be, batch: int, context: int, steps: int, reps: int, eager: list[dict] | None) -> dict:
    """The replayed decode step of backend ``be`` (``enable_cuda_graph=1``): timed, then profiled (module
    docstring)."""
    from torch.profiler import ProfilerActivity, profile

    art = be.artifact
    ids, b, rows, pages = _step_inputs(art, batch, context)
    be.allocate(pages, art.page_size)
    _fill_pools(be)
    step_ms = timed_ms(lambda: be.forward(ids, b, rows), reps, be.device)
    torch.cuda.synchronize(be.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            be.forward(ids, b, rows)
        torch.cuda.synchronize(be.device)
    launches, gpu = cuda_activity(prof)
    linked, how = link(launches, gpu)
    return {"linked_by": how, "replays_total": be.replays,
            **replay_summary(replays(launches, gpu, linked), step_ms, eager)}


def print_row(r: dict) -> None:
    g = r["eager"]["gpu"]
    print(f"\nbatch {r['batch']} context {r['context']} ({r['eager']['moe_form']}, {r['eager']['flavour']}): "
          f"{r['eager']['nodes_per_step']:.0f} ORT nodes per step ({r['eager']['cpu_ep_nodes_per_step']:.0f} on the "
          f"CPU EP)")
    if "busy_ms_per_step" not in g:
        print(f"  {g}")
        return
    print(f"  eager: {g['kernels_per_step']:.0f} GPU activities per step, busy {g['busy_ms_per_step']:.3f} ms, "
          f"span {g['eager_span_ms']:.3f} ms; linked by {g['linked_by']}, {g['launches_in_nodes']:.1%} of launches "
          f"inside ORT nodes (clock shift {g['clock_shift_us']:.1f} us)")
    rp = r.get("replay", {})
    if "busy_ms" in rp:
        print(f"  replayed: step {rp['step_ms']:.3f} ms, graph span {rp['span_ms']:.3f} ms, kernels "
              f"{rp['kernels']:.0f} busy {rp['busy_ms']:.3f} ms, gaps {rp['gaps_ms']:.3f} ms "
              f"({rp['gap_us_per_kernel']:.2f} us per kernel), outside the graph {rp['outside_graph_ms']:.3f} ms")
    elif rp:
        print(f"  replayed: {rp}")
    origin_rows = rp.get("replay_by_origin") or g["by_origin"]
    print(f"  per origin ({'replayed' if 'replay_by_origin' in rp else 'eager'} kernel times):")
    for x in origin_rows:
        print(f"    {x['us_per_step']:9.1f} us {x['share']:6.1%} x{x['count_per_step']:<6.0f} {x['key']}")
    for title, key in (("per (origin, op type)", "by_origin_op"), ("per kernel family", "by_family"),
                       ("per kernel", "by_kernel")):
        print(f"  {title} (eager kernel times):")
        for x in g[key][:15]:
            k = " / ".join(x["key"]) if isinstance(x["key"], list) else x["key"]
            print(f"    {x['us_per_step']:9.1f} us {x['share']:6.1%} x{x['count_per_step']:<6.0f} {k[:110]}")
    for title, key in (("per kernel family", "by_family"), ("per kernel", "by_kernel")):
        if key in rp:
            print(f"  {title} (replayed kernel times):")
            for x in rp[key][:15]:
                print(f"    {x['us_per_step']:9.1f} us {x['share']:6.1%} x{x['count_per_step']:<6.0f} {x['key'][:110]}")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in shape.split("x")) for shape in text.split(",") if shape]


def force_moe_form(be, form: str | None):
    """``be`` (no pools yet) running every decode step through MoE form ``form``'s decode graph (None: as it
    picks, ``decode_graph.moe_form``): each form's flavour mapped to ``form``'s, open decode sessions reopened."""
    if form is None:
        return be
    flavour = be._decode_flavours[form]
    for f in be._decode_flavours:
        be._decode_flavours[f] = flavour
    for f in list(be._decodes):
        be._decodes[f].close()
        be._decodes[f] = be._open_decode(f)
    return be


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    artifact_arguments(ap, "with decode graphs, `mini` bf16 on the H200")
    ap.add_argument("--shapes", default="1x4096,8x4096", help="batch x context pairs (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=5, help="profiled steps per shape and way (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=20, help="timed replays per shape (default: %(default)s)")
    ap.add_argument("--all-experts-shapes", default="",
                    help="shapes profiled again with every decode step through the all-experts MoE form (the "
                         "backend picks per-assignment for small batches, decode_graph.moe_form)")
    ap.add_argument("--flavour", default=None,
                    help="the artifact flavour whose graphs run, e.g. ort-contrib (its decode graph's MoE on "
                         "com.microsoft.MoE); default: the plain graphs")
    ap.add_argument("--json", default=str(RESULTS / "ort_kernels_h200.json"))
    args = ap.parse_args()

    from m3export.plugins.onnxruntime.providers import Provider
    from m3export.runtime.backends.onnxruntime_backend import CUDA_GRAPH, OnnxRuntimeBackend

    provider, art = open_artifact(args.artifact, args.provider)
    if provider.name not in ("CUDAExecutionProvider", "CPUExecutionProvider"):
        ap.error(f"--provider {args.provider}: the kernel profile reads CUDA activity (cuda) or ORT's nodes (cpu)")
    import onnxruntime

    if args.flavour is not None and args.flavour not in art.manifest.flavours:
        ap.error(f"--flavour {args.flavour}: not in {art.root} (it has {sorted(art.manifest.flavours)})")
    flavour = {} if args.flavour is None else {"flavour": args.flavour}
    res = {"artifact": str(art.root), "dtype": art.manifest.dtype, "flavour": args.flavour, "onnxruntime": onnxruntime.__version__,
           "provider": str(provider), "device": torch.cuda.get_device_name() if provider.device != "cpu" else "cpu",
           "rows": []}
    rows, kernels, status = {}, {}, 0
    cuda = provider.name == "CUDAExecutionProvider"

    def device_free() -> int:
        if not cuda:
            return 0
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info(torch.device(provider.device))[0]

    def phases(shapes: list[tuple[int, int]], form: str | None) -> None:
        """The eager then the replayed profiles of ``shapes``, one backend each (both at once would hold two sets
        of sessions); ``form``: every decode step through that MoE form's decode graph (``force_moe_form``)."""
        nonlocal status
        label = form or "by batch"
        free = device_free()
        be = force_moe_form(OnnxRuntimeBackend(art, provider, decode_graph=True, pad_decode=True, **flavour), form)
        try:
            with tempfile.TemporaryDirectory(prefix="ort_kernels_") as tmp:
                for batch, context in shapes:
                    row = rows[batch, context, label] = {"batch": batch, "context": context, "moe_form_asked": label}
                    try:
                        row["eager"], kernels[batch, context, label] = eager_profile(be, batch, context, args.steps,
                                                                                     Path(tmp))
                    except Exception as e:  # noqa: BLE001 - ORT and torch raise their own types: a row to report
                        row["eager"], status = {"error": f"{type(e).__name__}: {e}"[:2000]}, 1
                    res.setdefault("eager_backend_device_GB", (free - device_free()) / 1e9)
                    res["rows"] = list(rows.values())
                    write_results(res, args.json)
        finally:
            be.close()
        if not cuda:
            return
        free = device_free()
        be = force_moe_form(OnnxRuntimeBackend(art, Provider(provider.name, {**provider.options, CUDA_GRAPH: "1"}),
                                               **flavour), form)
        try:
            for batch, context in shapes:
                try:
                    rows[batch, context, label]["replay"] = replay_profile(
                        be, batch, context, args.steps, args.reps, kernels.get((batch, context, label)))
                except Exception as e:  # noqa: BLE001
                    rows[batch, context, label]["replay"], status = {"error": f"{type(e).__name__}: {e}"[:2000]}, 1
                res.setdefault("replay_backend_device_GB", (free - device_free()) / 1e9)
                write_results(res, args.json)
        finally:
            be.close()

    # the device memory each backend took after its first shape (sessions, shared weights, pools, workspaces)
    phases(parse_shapes(args.shapes), None)
    if args.all_experts_shapes:
        phases(parse_shapes(args.all_experts_shapes), "all-experts")
    for key in ("eager_backend_device_GB", "replay_backend_device_GB"):
        if key in res:
            print(f"{key}: {res[key]:.2f}")
    for row in rows.values():
        if "error" in row["eager"]:
            print(f"\nbatch {row['batch']} context {row['context']}: {row['eager']['error'][:300]}")
        else:
            print_row(row)
    return status


if __name__ == "__main__":
    sys.exit(main())
