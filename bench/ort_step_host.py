"""Host time of a decode step of the onnxruntime backend: what a step costs besides ONNX Runtime's own run, and
how many io_binding calls a steady step makes (``PagedSession`` binds once: 0).

For each batch x context every sequence decodes one token at position ``context`` through
``OnnxRuntimeBackend.forward`` (the engine's path), the same step repeated. Reported per row (medians of
``--reps``): ``step_ms``, the whole step until the device is done; ``enqueue_ms``, until ``forward`` returns
(on a sync-free CUDA path the host's share of the step); ``host_us``, the step with ORT's
``run_with_iobinding`` replaced by a no-op (binding, copies into the bound input buffers, output buffers,
checks: the session's own overhead); ``binding_calls``, the IOBinding calls (binds, get_outputs) of one steady
step. The pools hold zeros: ORT's time does not depend on their values.

``--nodes`` adds where a step's nodes come from (``nodes`` in the JSON, a table on stdout): ONNX Runtime's profiler
over ``--profile-steps`` steady steps of the first shape, in a session of its own, each executed node attributed by
its name to the graph level (the traced model: norms, RoPE, projections, cache writes), to the ``m3`` op whose
function body ORT inlined (``_inlfunc_<Op>[_token_<i>]_...``: one instance per node of that op; nodes ORT merged
across instances, such as the step's token bookkeeping, count once, in whichever instance kept them), or to the
``Memcpy`` nodes the provider inserted (``MemcpyToHost`` waits for the device). Per origin: nodes per step, how many
ran on the CPU EP (shape arithmetic a GPU provider leaves on the host), instances and nodes per instance. On a GPU
provider ORT spends a few microseconds of host time per node, so this table is the step's host cost.

``--cuda-placement`` predicts, without a GPU, which nodes ORT's CUDA EP leaves on the CPU EP and how many Memcpy
nodes it inserts (``cuda_placement`` in the JSON; ``cuda_placement``'s docstring says what it models). On the tiny
fp16 graph of commit 6b00835 it gives 72 CPU nodes, 30 MemcpyToHost and 31 MemcpyFromHost: the H200 profile's
numbers for the `mini` bf16 graph of the same structure.

  python bench/ort_step_host.py --artifact /tmp/art/tiny --provider cpu --threads 1   # CPU: the session's overhead
  python bench/ort_step_host.py --artifact art/mini-bf16 --provider cuda              # H200 + onnxruntime-gpu
  python bench/ort_step_host.py --artifact art/mini-bf16 --provider cuda --shapes 1x4096 --reps 20 --nodes
  python bench/ort_step_host.py --artifact /tmp/art/tiny16 --provider cpu --shapes 1x4096 --reps 2 --cuda-placement
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import decode_batch  # noqa: E402  (bench/decode.py: the decode step's batch)
from ort_gpu import profiled_backend, summarize_ort_profile, timed_ms  # noqa: E402  (bench/ort_gpu.py)
from results_file import RESULTS, write_results  # noqa: E402  (bench/results_file.py)

BINDING_CALLS = ("bind_input", "bind_output", "bind_ortvalue_input", "bind_ortvalue_output", "get_outputs")


def count_binding_calls(fn) -> int:
    """IOBinding calls ``fn`` makes (the class's methods wrapped while it runs)."""
    from onnxruntime.capi.onnxruntime_inference_collection import IOBinding

    counts: Counter = Counter()
    originals = {m: getattr(IOBinding, m) for m in BINDING_CALLS}

    def counted(method):
        def call(*args, **kwargs):
            counts[method] += 1
            return originals[method](*args, **kwargs)
        return call

    try:
        for m in BINDING_CALLS:
            setattr(IOBinding, m, counted(m))
        fn()
    finally:
        for m, f in originals.items():
            setattr(IOBinding, m, f)
    return sum(counts.values())


_INLINED = re.compile(r"_inlfunc_(?P<op>[A-Za-z0-9]+?)(?:_token_(?P<instance>\d+))?_")


def node_origin(name: str, op_type: str) -> tuple[str, str | None]:
    """(origin, instance) of an executed node: the ``m3`` op whose inlined body it belongs to and which of that op's
    nodes (ORT's ``_token_<i>`` suffix; None for the first), ``Memcpy``, or ``graph`` (the traced model)."""
    if op_type.startswith("Memcpy"):
        return "Memcpy", None
    m = _INLINED.match(name)
    return (m["op"], m["instance"]) if m else ("graph", None)


def attribute_nodes(events: list[dict], steps: int) -> dict:
    """Per origin (``node_origin``), from ONNX Runtime's profile of the last ``steps`` runs (every node of
    ``bench/ort_gpu.py``'s summary): nodes per step, those on the CPU EP, instances, nodes per instance, the op
    types; and the step's totals."""
    every_node = summarize_ort_profile(events, steps, top=sys.maxsize)["top_nodes"]
    rows: dict[str, dict] = defaultdict(
        lambda: {"nodes": 0.0, "cpu_ep": 0.0, "instances": set(), "op_types": Counter()})
    for n in every_node:
        origin, instance = node_origin(n["node"], n["op_type"])
        row = rows[origin]
        row["nodes"] += n["count_per_step"]
        row["cpu_ep"] += n["count_per_step"] if n["provider"] == "CPUExecutionProvider" else 0.0
        row["instances"].add(instance)
        row["op_types"][n["op_type"]] += n["count_per_step"]
    out = []
    for origin, r in sorted(rows.items(), key=lambda kv: -kv[1]["nodes"]):
        k = len(r["instances"]) if origin not in ("graph", "Memcpy") else None
        out.append({"origin": origin, "nodes_per_step": r["nodes"], "cpu_ep_per_step": r["cpu_ep"], "instances": k,
                    "nodes_per_instance": r["nodes"] / k if k else None,
                    "op_types_per_step": dict(r["op_types"].most_common())})
    return {"steps": steps, "nodes_per_step": sum(r["nodes_per_step"] for r in out),
            "cpu_ep_per_step": sum(r["cpu_ep_per_step"] for r in out), "origins": out}


def profile_nodes(art, provider, threads, pages: int, page: int, step, steps: int) -> dict:
    """``attribute_nodes`` of ``steps`` steady steps (after two warm-up steps) in a fresh profiled session."""
    with profiled_backend(art, provider, "ort_nodes_", threads=threads) as be:
        be.allocate(pages, page)
        for _ in range(2 + steps):
            step(be)
        if be.device.type == "cuda":
            torch.cuda.synchronize(be.device)
        events = json.loads(Path(be._main.session.end_profiling()).read_text())
    return attribute_nodes(events, steps)


# Inputs that ORT's CUDA kernels read from host memory (their kernel definitions' OrtMemTypeCPUInput)
CUDA_HOST_INPUTS = {"Reshape": {1}, "Expand": {1}, "Range": {0, 1, 2}, "TopK": {1}, "Pad": {1, 2, 3},
                    "Slice": {1, 2, 3, 4}, "Tile": {1}, "ConstantOfShape": {0}, "Squeeze": {1}, "Unsqueeze": {1},
                    "ReduceMax": {1}, "ReduceSum": {1}, "ReduceMean": {1}, "CumSum": {1}, "Split": {1}, "If": {0},
                    "Clip": {1, 2}}
HOST_OUTPUT_OPS = {"Shape", "Size"}  # CUDA kernels whose output lives in host memory


def cuda_placement(model_path: Path) -> dict:
    """What ORT's CUDA EP would do with a step graph, predicted on the CPU: the graph as ORT optimises it (functions
    inlined, CSE, constant folding; ``ORT_ENABLE_EXTENDED``, no CPU-only layout passes), then ORT's rule for nodes
    it prefers on the CPU EP (``GetCpuPreferredNodes``, core/framework/fallback_cpu_capability.cc: starting from
    consumers of host-memory outputs, a node goes to the CPU EP if every input is a host value, a graph input or
    an initializer of at most 100 elements, none is 16-bit and none is one its CUDA kernel reads from host memory
    anyway), then one Memcpy per value crossing between host and device (a device value read on the host: a
    MemcpyToHost, which waits for the device). Graph inputs (the batch, the pools) are bound on the device, as
    ``PagedSession`` does. Not modelled: nodes whose types no CUDA kernel takes (the step graphs have none,
    tests/test_ort_cuda_kernel_types.py) and fusions only the CUDA EP makes."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="ort_placement_") as tmp:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        graph = onnx.load(options.optimized_model_filepath, load_external_data=False).graph
    small = {t.name for t in graph.initializer if int(np.prod(t.dims)) <= 100}
    initializers = {t.name for t in graph.initializer}
    graph_inputs = {i.name for i in graph.input}
    sixteen_bit = {v.name for v in (*graph.value_info, *graph.input, *graph.output)
                   if v.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)}
    host = {o for n in graph.node if n.op_type in HOST_OUTPUT_OPS for o in n.output}
    on_cpu: set[int] = set()
    changed = True
    while changed:  # ORT walks candidates in topological order; a fixed point over the sorted graph is the same
        changed = False
        for k, n in enumerate(graph.node):
            if k in on_cpu or n.op_type in HOST_OUTPUT_OPS or n.op_type == "If":
                continue
            ins = [(j, i) for j, i in enumerate(n.input) if i]
            if not any(i in host for _, i in ins):
                continue
            if all(i not in sixteen_bit and (i in small or i in graph_inputs or
                                              (i in host and j not in CUDA_HOST_INPUTS.get(n.op_type, ())))
                   for j, i in ins):
                on_cpu.add(k)
                host.update(n.output)
                changed = True
    device = {o for k, n in enumerate(graph.node) for o in n.output
              if k not in on_cpu and n.op_type not in HOST_OUTPUT_OPS} | graph_inputs
    to_host, from_host = set(), set()
    for k, n in enumerate(graph.node):
        if n.op_type in HOST_OUTPUT_OPS:
            continue  # reads its input's shape only
        for j, i in enumerate(n.input):
            if not i or i in initializers:
                continue
            wants_host = k in on_cpu or j in CUDA_HOST_INPUTS.get(n.op_type, ())
            if wants_host and i in device:
                to_host.add(i)
            elif not wants_host and i in host:
                from_host.add(i)
    origins = Counter(node_origin(i, "")[0] for i in to_host)
    return {"nodes": len(graph.node), "cpu_ep_nodes": len(on_cpu), "memcpy_to_host": len(to_host),
            "memcpy_from_host": len(from_host), "memcpy_to_host_by_origin": dict(origins.most_common())}


def print_nodes(nodes: dict) -> None:
    print(f"\nnodes per step: {nodes['nodes_per_step']:.0f} ({nodes['cpu_ep_per_step']:.0f} on the CPU EP)")
    print(f"{'origin':<22s} {'nodes':>6s} {'CPU EP':>6s} {'inst':>4s} {'per inst':>8s}  top op types")
    for r in nodes["origins"]:
        inst = f"{r['instances']:4d} {r['nodes_per_instance']:8.1f}" if r["instances"] else f"{'':4s} {'':8s}"
        ops = ", ".join(f"{k} {v:.0f}" for k, v in list(r["op_types_per_step"].items())[:6])
        print(f"{r['origin']:<22s} {r['nodes_per_step']:6.0f} {r['cpu_ep_per_step']:6.0f} {inst}  {ops}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--provider", default="cuda", help="ONNX Runtime execution provider (default: %(default)s)")
    ap.add_argument("--shapes", default=None, help="batch x context pairs (default: 1x4096,8x4096,1x32768,8x32768 "
                                                   "on a GPU EP, 1x64,8x256 on the CPU EP)")
    ap.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None, help="default: bench/results/ort_step_host_<device>.json")
    ap.add_argument("--nodes", action="store_true", help="attribute the first shape's step nodes to their origin")
    ap.add_argument("--profile-steps", type=int, default=3, help="steps profiled for --nodes (default: %(default)s)")
    ap.add_argument("--cuda-placement", action="store_true",
                    help="predict the CUDA EP's CPU-placed nodes and Memcpy nodes of model.onnx (no GPU needed)")
    args = ap.parse_args()

    from m3export.export.artifact import load_artifact
    from m3export.plugins.onnxruntime.providers import parse_provider, require
    from m3export.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

    provider = require(parse_provider(args.provider))
    art = load_artifact(args.artifact, verify_checksums=False)
    backend = OnnxRuntimeBackend(art, provider, threads=args.threads)
    try:
        return measure(args, art, provider, backend)
    finally:  # every ORT session closed while the CUDA runtime is up: one left to the exit aborted a process once
        backend.close()


def measure(args, art, provider, backend) -> int:
    """The rows (and ``--nodes``, ``--cuda-placement``) of ``main`` with the backend it opened (and closes)."""
    device = torch.device(provider.device)
    session = backend._main
    default = "1x64,8x256" if device.type == "cpu" else "1x4096,8x4096,1x32768,8x32768"
    shapes = [tuple(int(v) for v in s.split("x")) for s in (args.shapes or default).split(",")]
    import onnxruntime

    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "onnxruntime": onnxruntime.__version__, "provider": str(provider), "artifact": str(art.root),
           "dtype": art.manifest.dtype, "pools": len(session.pool_inputs), "threads": args.threads, "rows": []}
    print(f"{'batch':>5s} {'context':>7s} {'step ms':>8s} {'enqueue ms':>10s} {'host us':>8s} {'binding calls':>13s}")
    for batch, context in shapes:
        where = backend.batch_device  # the host for padded / replayed decode steps, as the engine builds them
        b, pages = decode_batch(batch, context, art.page_size, where)
        backend.allocate(pages, art.page_size)
        ids = torch.zeros(batch, dtype=torch.int64, device=where)
        rows = torch.arange(batch, device=where)
        step = lambda: backend.forward(ids, b, rows)  # noqa: E731 - its outputs dropped, as the engine does
        step_ms = timed_ms(step, args.reps, device, until_done=True)
        enqueue_ms = timed_ms(step, args.reps, device, until_done=False)
        calls = count_binding_calls(step)
        # the session's own work only: ORT's run of every session a decode step may take (the general graph's, the
        # decode graphs' of --provider cuda:enable_cuda_graph=1 or a device EP) a no-op
        sessions = [backend._main, *backend._decodes.values()]
        runs = [s.session.run_with_iobinding for s in sessions]
        for s in sessions:
            s.session.run_with_iobinding = lambda *a: None
        try:
            host_us = timed_ms(step, args.reps, device, until_done=False) * 1e3
        finally:
            for s in sessions:
                del s.session.run_with_iobinding  # the class's method again
        assert all(s.session.run_with_iobinding.__func__ is r.__func__ for s, r in zip(sessions, runs))
        row = {"batch": batch, "context": context, "step_ms": step_ms, "enqueue_ms": enqueue_ms, "host_us": host_us,
               "binding_calls": calls}
        res["rows"].append(row)
        print(f"{batch:5d} {context:7d} {step_ms:8.3f} {enqueue_ms:10.3f} {host_us:8.1f} {calls:13d}", flush=True)
        if args.nodes and "nodes" not in res:
            res["nodes"] = {"batch": batch, "context": context,
                            **profile_nodes(art, provider, args.threads, pages, art.page_size,
                                            lambda be: be.forward(ids, b, rows), args.profile_steps)}
    if "nodes" in res:
        print_nodes(res["nodes"])
    if args.cuda_placement:  # model.onnx, and its decode-only form (export/decode_graph.py) where the artifact has it
        decode = art.manifest.flavours.get("decode", {}).get("model")
        for key, path in (("cuda_placement", art.path("model")),
                          ("cuda_placement_decode", decode and art.root / decode["file"])):
            if path is None:
                continue
            res[key] = p = cuda_placement(path)
            print(f"\nCUDA EP placement of {path.name} (predicted): {p['nodes']} nodes, {p['cpu_ep_nodes']} on the "
                  f"CPU EP, {p['memcpy_to_host']} MemcpyToHost {p['memcpy_to_host_by_origin']}, "
                  f"{p['memcpy_from_host']} MemcpyFromHost")
    name = "h200" if "H200" in res["device"] else device.type
    write_results(res, args.json or RESULTS / f"ort_step_host_{name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
