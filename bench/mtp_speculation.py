"""MTP speculation on the embedded trained model: acceptance length and decode speed-up, per backend, one run.

Prompts are held-out Python files (``m3export.corpus``: never seen in training), each cut to its first
``--prompt-len`` tokens; every configuration generates ``--new-tokens`` tokens from each, ``--batch`` requests at a
time (1: single-stream decode, where speculation is meant to help). For each backend, engines with k = 0 (the
baseline), 1, 2 and 3 drafts are built once and then run **interleaved**: every group of prompts goes through all
four engines back to back (the order rotating from group to group), ``--repeats`` times, so a load change on a
shared machine hits baseline and speculation alike; each speed-up is the ratio of decode rates taken in this run,
at the same temperature. Decode rate = tokens of decode steps / time of those steps (``EngineStats``: steps that
computed prompt tokens, and the drafter's catch-up over the prompt in them, count as prefill).

Greedy runs check that speculation leaves every output unchanged, token for token. Sampled runs (temperature 0.8,
seeded, rejection sampling) keep the target distribution but not the tokens of a plain run (the uniforms decide
different things), so they report acceptance and speed only.

  python bench/mtp_speculation.py                                          # CPU: torch + onnxruntime, 1 thread
  python bench/mtp_speculation.py --device cuda --backends torch,torch-eager   # a GPU: CUDA graphs and eager
  python bench/mtp_speculation.py --breakdown --batch 8 --prompts 16          # + ms per target / MTP call

``mtp/step``: MTP-module calls per target call (prefill steps included), what a round of drafts costs in calls;
a greedy round the graphed backend replays as one chain (``Backend.mtp_chain``) makes none and counts as one
``chain`` call (JSON ``chain_calls``).

Backends: ``torch`` (the checkpoint in PyTorch; on CUDA the decode, verify and MTP steps replay from CUDA graphs,
all captured in the warm-up), ``torch-eager`` (the same without graphs; on the CPU identical to ``torch``),
``torch-padded`` (the graphed backend's padded bucket shapes run eagerly, ``pad_eagerly``: the graphed path's
host work on a CPU), ``torch-replayed`` (``--profile`` only: ``torch-padded`` whose graph runs answer with the outputs
a first pass over the same requests recorded, ``GraphTape``: the host work alone, as an instant model would leave
it), ``onnxruntime`` (an artifact exported in this run, ``--threads`` intra-op threads).

``--profile`` replaces the comparison with where a decode step's time goes, per backend and k (greedy, one
request at a time): host microseconds per phase (engine step, target call, static-input fill, graph run, decision,
drafting, MTP calls, proposals), then the same steps under ``torch.profiler``: each phase's device time and the
CUDA runtime calls per step (kernel and graph launches, copies, waits); ``--trace-dir`` adds Chrome traces.

  python bench/mtp_speculation.py --device cuda --profile --backends torch --prompts 4   # the graphed rounds
  python bench/mtp_speculation.py --profile --backends torch-padded --prompts 2           # CPU stand-in
  python bench/mtp_speculation.py --profile --backends torch-replayed --prompts 4         # host work alone
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write_results  # noqa: E402  (bench/results_file.py)

KS = (0, 1, 2, 3)
TEMPERATURES = (0.0, 0.8)
BACKENDS = ("torch", "torch-eager", "torch-padded", "torch-replayed", "onnxruntime")


@dataclass
class Tally:
    """What one engine did over the measured requests of one temperature; ``stats`` are the engine's own counters
    (decode tokens and time, drafts verified and accepted) over exactly those requests."""

    stats: object = None  # m3export.runtime.stats.EngineStats
    wall_time: float = 0.0
    tokens: int = 0
    outputs: list = field(default_factory=list)  # token ids per (repeat, prompt), in run order
    per_repeat: list = field(default_factory=list)  # (decode tokens, decode time) per repeat


class CallClock:
    """Counts an engine's target and MTP-module calls (what a round of drafts costs in calls) and, when ``timed``,
    the time inside them; on a GPU ``sync`` closes each call, which costs the overlap of host and device work, so
    timing is opt-in (``--breakdown``)."""

    def __init__(self, backend, timed: bool, sync):
        self.calls = {"target": [0, 0.0], "mtp": [0, 0.0], "chain": [0, 0.0]}  # [calls, seconds]
        for method, kind in (("forward", "target"), ("mtp_forward", "mtp"), ("mtp_chain", "chain")):
            setattr(backend, method, self._wrap(getattr(backend, method), self.calls[kind], timed, sync))

    @staticmethod
    def _wrap(inner, slot, timed, sync):
        def call(*args, **kwargs):
            if timed:
                sync()
                start = time.perf_counter()
            out = inner(*args, **kwargs)
            if timed:
                sync()
                slot[1] += time.perf_counter() - start
            slot[0] += 1
            return out

        return call

    def reset(self) -> None:
        for slot in self.calls.values():
            slot[:] = [0, 0.0]


def build_engines(backend: str, ckpt: Path, art: Path | None, device: str, threads: int, batch: int) -> dict:
    """One engine per k, each with its own pools (and, for onnxruntime, sessions)."""
    from m3export.runtime import Engine

    engines = {}
    for k in KS:
        common = dict(num_speculative_tokens=k, max_num_seqs=batch)
        if backend in ("torch", "torch-eager"):
            engines[k] = Engine.from_checkpoint(ckpt, device=device, enforce_eager=backend == "torch-eager",
                                                **common)
        elif backend in ("torch-padded", "torch-replayed"):
            from m3export import load_model
            from m3export.runtime.backends.cuda_graph import GraphedTorchBackend
            from m3export.runtime.engine import checkpoint_dtype
            from m3export.runtime.tokenizer import find_tokenizer

            # one copy, in the dtype the torch rows' Engine.from_checkpoint loads (bf16 on a GPU)
            model = (engines[KS[0]].backend.model if engines
                     else load_model(ckpt, device=device, dtype=checkpoint_dtype(device, None)))
            be = GraphedTorchBackend(model, use_graphs=False, pad_eagerly=True)
            if backend == "torch-replayed":  # every pass over the prompts must make the same calls: no prefix cache
                GraphTape(be)
                common["enable_prefix_caching"] = False
            engines[k] = Engine(be,
                                find_tokenizer(ckpt, model.config), **common)
        else:
            from m3export.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend
            from m3export.runtime.tokenizer import find_tokenizer

            be = OnnxRuntimeBackend.from_artifact(art, device=device, threads=threads)
            engines[k] = Engine(be, find_tokenizer(art, be.config), **common)
    return engines


def measure(engines: dict, clocks: dict, groups: list[list[list[int]]], temperature: float, new: int,
            repeats: int) -> dict:
    """Every group through every engine, interleaved; a Tally per k (and each engine's calls in ``clocks``)."""
    from m3export.runtime import SamplingParams
    from m3export.runtime.stats import EngineStats

    tallies = {k: Tally() for k in engines}
    for k, eng in engines.items():
        eng.stats = tallies[k].stats = EngineStats()  # counts the measured requests only
        clocks[k].reset()
    for rep in range(repeats):
        before = {k: (t.stats.decode_tokens, t.stats.decode_time) for k, t in tallies.items()}
        for g, prompts in enumerate(groups):
            order = list(engines)[g % len(engines):] + list(engines)[:g % len(engines)]
            for k in order:
                t = tallies[k]
                params = [SamplingParams(temperature=temperature, max_tokens=new, ignore_eos=True,
                                         seed=1000 * g + i) for i in range(len(prompts))]
                start = time.perf_counter()
                outs = engines[k].generate(prompts, params)
                t.wall_time += time.perf_counter() - start
                t.outputs.extend(o.token_ids for o in outs)
                t.tokens += sum(len(o.token_ids) for o in outs)
        for k, t in tallies.items():
            t.per_repeat.append((t.stats.decode_tokens - before[k][0], t.stats.decode_time - before[k][1]))
    return tallies


# ---------------------------------------------------------------------------------------------- --profile
class GraphTape:
    """``--backends torch-replayed``: the graphed backend's graph runs (``_run``: one replay each on a GPU) recorded
    over one pass of the requests, then answered from the recording in the same order (cyclically: with prefix
    caching off every pass over the same greedy requests makes the same calls). The model then costs nothing, and
    what ``--profile`` times is the engine's and the backend's own host work, with the interpreter's caches as
    warm as on a GPU host (an eager CPU model run between the host phases evicts them and inflates those)."""

    def __init__(self, backend):
        self.outputs: list[tuple] = []
        self.at, self.recording = 0, True
        inner = backend._run

        def run(key, step):
            if self.recording:
                out = inner(key, step)
                self.outputs.append(tuple(None if t is None else t.clone() for t in out))
                return out
            out = self.outputs[self.at % len(self.outputs)]
            self.at += 1
            return out

        backend._run = run
        backend.tape = self

    def record(self, engine, prompts: list[list[int]], new_tokens: int) -> None:
        """One pass of ``profile_engine``'s requests (one at a time, greedy), recorded; replayed from then on."""
        from m3export.runtime import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        self.outputs, self.recording = [], True  # not the warm-up's runs
        for i, prompt in enumerate(prompts):
            engine.add_request(f"tape-{i}", prompt, params)
            while engine.has_unfinished():
                engine.step()
        self.recording, self.at = False, 0


#: What ``--profile`` times, as (label, owner, attribute): the owner is resolved per engine ("engine", "scheduler",
#: "backend", "drafter", "inputs" = the graphed backend's static-input class, or a module of the runtime for a
#: function it imports by name). Phases nest (``engine.step`` holds all the others; ``target.forward`` holds its
#: ``inputs.fill`` and ``graph.run``): each phase's time includes its children's.
PHASES = (
    ("engine.step", "engine", "step"),
    ("schedule", "scheduler", "schedule"),
    ("build_batch", "m3export.runtime.engine", "build_batch"),
    ("build_batch", "m3export.runtime.drafter", "build_batch"),
    ("fill_tokens", "m3export.runtime.engine", "fill_tokens"),
    ("fill_tokens", "m3export.runtime.drafter", "fill_tokens"),
    ("target.forward", "backend", "forward"),
    ("decide", "engine", "_decide"),
    ("settle", "engine", "_settle"),
    ("draft", "drafter", "run"),
    ("mtp.forward", "backend", "mtp_forward"),
    ("mtp.chain", "backend", "mtp_chain"),
    ("propose", "drafter", "_propose"),
    ("inputs.fill", "inputs", "fill"),
    ("graph.run", "backend", "_run"),
    ("output", "engine", "_output"),
)
#: CUDA runtime / driver calls counted per step in the profile: launches (kernels, graphs), copies, waits.
RUNTIME_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cudaGraphLaunch",
                 "cudaMemcpyAsync", "cudaMemsetAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize",
                 "cudaEventSynchronize", "cudaStreamWaitEvent", "cudaHostAlloc")


class PhaseTimer:
    """Wraps the ``PHASES`` of one engine: host microseconds per phase (``time.perf_counter`` around the call, no
    synchronisation: on a GPU this is the host's own work plus any wait inside the phase) and calls, plus a
    ``torch.profiler.record_function`` range of the phase's name, so a profile attributes device time to the
    phase that launched it. ``close()`` undoes every wrap."""

    def __init__(self, engine):
        import importlib

        from m3export.runtime.backends import cuda_graph

        owners = {"engine": engine, "scheduler": engine.scheduler, "backend": engine.backend,
                  "drafter": engine.drafter, "inputs": cuda_graph.DecodeInputs}
        self.host_s: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo = []
        for label, owner, attr in PHASES:
            obj = owners[owner] if owner in owners else importlib.import_module(owner)
            if obj is None or not hasattr(obj, attr):
                continue
            inner = getattr(obj, attr)
            had_own = attr in vars(obj)
            setattr(obj, attr, self._wrap(label, inner, bound=owner != "inputs"))
            self._undo.append((obj, attr, inner if had_own else None))
        self.reset()

    def _wrap(self, label, inner, bound: bool):
        from torch.profiler import record_function

        def timed(*args, **kwargs):
            start = time.perf_counter()
            with record_function(label):
                out = inner(*args, **kwargs)
            self.host_s[label] += time.perf_counter() - start
            self.calls[label] += 1
            return out

        return timed if bound else (lambda self_, *a, **k: timed(self_, *a, **k))

    def reset(self) -> None:
        self.host_s = {label: 0.0 for label, _, _ in PHASES}
        self.calls = {label: 0 for label, _, _ in PHASES}

    def close(self) -> None:
        for obj, attr, inner in reversed(self._undo):
            if inner is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, inner)


def profile_engine(engine, prompts: list[list[int]], new_tokens: int, device: torch.device, trace: Path | None
                   ) -> dict:
    """One request at a time through ``engine`` (greedy), each request's prompt step left out of every number,
    twice: first with ``PhaseTimer`` alone (host microseconds per phase and per decode step, wall time per decode
    step), then under ``torch.profiler`` (CPU and, on a GPU, CUDA activity), which adds its own host overhead but
    gives each phase's device time (kernels launched inside the phase's range, graph replays included) and the
    CUDA runtime calls (launches, copies, waits) per step. ``trace``: a Chrome trace of the last request's
    profiled decode steps."""
    from torch.profiler import ProfilerActivity, profile

    from m3export.runtime import SamplingParams

    be = engine.backend
    counters = ("replays", "mtp_replays", "eager_steps", "eager_mtp_steps", "padded_mtp_steps", "chain_replays")
    counters = [c for c in counters if hasattr(be, c)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    timer = PhaseTimer(engine)
    host_s = {label: 0.0 for label, _, _ in PHASES}
    calls = {label: 0 for label, _, _ in PHASES}
    events: dict[str, list[float]] = {}  # key -> [count, cpu us, device us], summed over the requests
    steps = tokens = profiled_steps = 0
    wall = 0.0
    verify = 0
    counted = {c: 0 for c in counters}  # the backend's counters over the timed decode steps
    try:
        for profiled in (False, True):
            for i, prompt in enumerate(prompts):
                engine.add_request(f"profile-{int(profiled)}-{i}", prompt, params)
                engine.step()  # the prompt (and the drafter's catch-up over it): not a decode step
                sync()
                if not profiled:
                    timer.reset()
                    before = {c: getattr(be, c) for c in counters}
                    verify -= engine.stats.verify_steps
                    start = time.perf_counter()
                    while engine.has_unfinished():
                        tokens += sum(len(o.new_token_ids) for o in engine.step())
                        steps += 1
                    sync()
                    wall += time.perf_counter() - start
                    verify += engine.stats.verify_steps
                    for c in counters:
                        counted[c] += getattr(be, c) - before[c]
                    for label in host_s:
                        host_s[label] += timer.host_s[label]
                        calls[label] += timer.calls[label]
                    continue
                with profile(activities=activities) as prof:
                    while engine.has_unfinished():
                        engine.step()
                        profiled_steps += 1
                    sync()
                for e in prof.key_averages():
                    acc = events.setdefault(e.key, [0, 0.0, 0.0])
                    acc[0] += e.count
                    acc[1] += e.cpu_time_total
                    acc[2] += getattr(e, "device_time_total", 0.0)
                if trace is not None and i == len(prompts) - 1:
                    prof.export_chrome_trace(str(trace))
    finally:
        timer.close()
    phases = {}
    for label in dict.fromkeys(label for label, _, _ in PHASES):
        n, cpu, dev = events.get(label, (0, 0.0, 0.0))
        phases[label] = {"calls_per_step": calls[label] / steps, "host_us_per_step": 1e6 * host_s[label] / steps,
                         "profiled_host_us_per_step": cpu / profiled_steps,
                         "device_us_per_step": dev / profiled_steps}
    return {"decode_steps": steps, "tokens": tokens, "tokens_per_step": tokens / steps,
            "wall_us_per_step": 1e6 * wall / steps, "wall_us_per_token": 1e6 * wall / tokens, "verify_steps": verify,
            "phases": phases,
            "runtime_calls_per_step": {name: events[name][0] / profiled_steps for name in RUNTIME_CALLS
                                       if name in events},
            "counters_per_step": {c: n / steps for c, n in counted.items()}}


def run_profile(args, backends: list[str], ckpt: Path, prompts: list[list[int]], device: torch.device,
                json_path: Path) -> int:
    """``--profile``: ``profile_engine`` per backend and k (engines warmed up and every graph captured first, as
    in the comparison), a table of the main phases, and the JSON."""
    from m3export.runtime import SamplingParams

    rows, t0 = [], time.perf_counter()

    def write(complete: bool) -> None:
        """The JSON so far: rewritten after every row, so a run cut short keeps its rows."""
        out = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "command": " ".join(sys.argv), "complete": complete,
               "checkpoint": str(ckpt), "device": args.device,
               "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
               "threads": args.threads, "prompts": len(prompts), "prompt_len": args.prompt_len,
               "new_tokens": args.new_tokens, "torch": torch.__version__, "elapsed_s": time.perf_counter() - t0,
               "phases_note": "host_us_per_step: perf_counter around each phase, no synchronisation, phases nest "
                              "(engine.step holds the others); profiled_host_us_per_step / device_us_per_step: the "
                              "same ranges under torch.profiler (its overhead included) and the device time of "
                              "what they launched; host_us_per_step_without_graph: engine.step less graph.run (the "
                              "graph runs: replays on a GPU, the eager padded model on a CPU; on a GPU the decision's "
                              "wait for the device stays in), host_cost_in_plain_steps: that over k = 0's",
               "rows": rows}
        write_results(out, json_path)

    cols = ("engine.step", "schedule", "build_batch", "fill_tokens", "target.forward", "inputs.fill", "graph.run",
            "decide", "settle", "draft", "mtp.forward", "mtp.chain", "propose", "output")
    print(f"{'backend':14s} {'k':>2s} {'tok/step':>8s} {'wall us/step':>12s} {'us/token':>8s} {'x plain':>7s} "
          f"{'speedup':>7s} {'host-graph':>10s} {'x plain':>7s}  host us per step: "
          + " ".join(f"{c:>14s}" for c in cols) + f"  {'device us/step':>14s} {'launches':>8s} {'copies':>6s}",
          flush=True)
    for backend in backends:
        engines = build_engines(backend, ckpt, None, args.device, args.threads, 1)
        for k, eng in engines.items():
            eng.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            if hasattr(eng.backend, "capture_shapes"):
                eng.backend.capture_shapes(1, k + 2 if k else 1, eng.drafter.modules_used if eng.drafter else 0,
                                           chain_drafts=k)
            if backend == "torch-replayed":
                eng.backend.tape.record(eng, prompts, args.new_tokens)
            trace = Path(args.trace_dir) / f"mtp_profile_{backend}_k{k}.json" if args.trace_dir else None
            if trace is not None:
                trace.parent.mkdir(parents=True, exist_ok=True)
            res = profile_engine(eng, prompts, args.new_tokens, device, trace)
            res.update(backend=backend, k=k)
            base = next((r for r in rows if r["backend"] == backend and r["k"] == 0), res)
            # A step of k > 0 is a round: its cost in plain steps, and the speed-up its tokens per round give.
            # Host work without the graph runs (a replay each on a GPU; the padded model on a CPU): what a round
            # costs the host, in plain steps' host work.
            ph = res["phases"]
            res["host_us_per_step_without_graph"] = (ph["engine.step"]["host_us_per_step"]
                                                     - ph["graph.run"]["host_us_per_step"])
            res.update(step_cost_in_plain_steps=res["wall_us_per_step"] / base["wall_us_per_step"],
                       host_cost_in_plain_steps=res["host_us_per_step_without_graph"]
                       / base["host_us_per_step_without_graph"],
                       speedup_vs_k0=base["wall_us_per_token"] / res["wall_us_per_token"])
            rows.append(res)
            ph, rt = res["phases"], res["runtime_calls_per_step"]
            launches = sum(v for n, v in rt.items() if "Launch" in n)
            copies = sum(v for n, v in rt.items() if "Memcpy" in n)
            print(f"{backend:14s} {k:2d} {res['tokens_per_step']:8.2f} {res['wall_us_per_step']:12.1f} "
                  f"{res['wall_us_per_token']:8.1f} {res['step_cost_in_plain_steps']:7.2f} {res['speedup_vs_k0']:6.2f}x"
                  f" {res['host_us_per_step_without_graph']:10.1f} {res['host_cost_in_plain_steps']:7.2f}"
                  "                   "
                  + " ".join(f"{ph[c]['host_us_per_step']:14.1f}" for c in cols)
                  + f"  {ph['engine.step']['device_us_per_step']:14.1f} {launches:8.1f} {copies:6.1f}", flush=True)
            write(complete=False)
        del engines
    write(complete=True)
    print(f"wrote {json_path}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="checkpoint directory (default: the embedded trained model)")
    ap.add_argument("--backends", default=None,
                    help=f"comma-separated, of {', '.join(BACKENDS)} (default: torch,onnxruntime on cpu, "
                         "torch,torch-eager on cuda)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1, help="requests generated together (max_num_seqs)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved passes over the prompts per temperature")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (torch and ONNX Runtime intra-op)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the target and MTP calls (ms per call; on a GPU each call then synchronises)")
    ap.add_argument("--profile", action="store_true",
                    help="instead of the comparison: per decode step, host us per phase, device us per phase "
                         "(torch.profiler) and CUDA runtime calls, per backend and k, greedy, one request at a time "
                         "over --prompts prompts (default json: bench/results/mtp_speculation_profile_<device>.json)")
    ap.add_argument("--trace-dir", default=None, help="with --profile: a Chrome trace per backend and k here")
    ap.add_argument("--json", default=None, help="default: bench/results/mtp_speculation_<device>.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    default = "torch,torch-eager" if device.type == "cuda" else "torch,onnxruntime"
    backends = (args.backends or default).split(",")
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        ap.error(f"unknown backends {unknown}: expected some of {', '.join(BACKENDS)}")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: this torch build sees no CUDA device")
    if "torch-replayed" in backends and not args.profile:
        ap.error("--backends torch-replayed: --profile only (its graph runs replay a recorded pass of the same "
                 "greedy requests, one at a time)")
    if min(args.prompts, args.prompt_len, args.new_tokens, args.batch, args.repeats, args.threads) < 1:
        ap.error("--prompts, --prompt-len, --new-tokens, --batch, --repeats and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    name = f"mtp_speculation_profile_{device.type}.json" if args.profile else f"mtp_speculation_{device.type}.json"
    json_path = Path(args.json or Path(__file__).parent / "results" / name)

    from tokenizers import Tokenizer

    from m3export.corpus import encode_files, heldout_windows, stdlib_files
    from m3export.embedded import default_model
    from m3export.export.exporter import export_artifact
    from m3export.runtime import SamplingParams

    ckpt = Path(args.checkpoint) if args.checkpoint else default_model()
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    held = encode_files(tok, [text for _, text in stdlib_files("heldout")])
    prompts = heldout_windows(held, args.prompt_len, args.prompts)
    if len(prompts) < args.prompts:
        print(f"note: the held-out files give only {len(prompts)} windows of {args.prompt_len} tokens")
    groups = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if args.profile:
        return run_profile(args, backends, ckpt, prompts, device, json_path)

    rows, table, t0 = [], [], time.perf_counter()

    def write(complete: bool) -> None:
        """The JSON so far: rewritten after every (backend, temperature), so a run cut short keeps its rows."""
        out = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "command": " ".join(sys.argv),
               "complete": complete, "checkpoint": str(ckpt), "device": args.device,
               "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
               "threads": args.threads, "batch": args.batch, "prompts": len(prompts),
               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
               "torch": torch.__version__, "python": platform.python_version(), "load_average_start": load_start,
               "load_average_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
               "elapsed_s": time.perf_counter() - t0, "rows": rows}
        write_results(out, json_path)

    header = (f"{'backend':12s} {'temp':>4s} {'k':>2s} {'accept':>6s} {'decode/s':>9s} {'speedup':>8s} "
              f"{'min..max':>11s} {'same':>5s} {'mtp/step':>8s}" + ("  target ms  mtp ms" if args.breakdown else ""))
    print(header, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        art = None
        if "onnxruntime" in backends:
            art = export_artifact(str(ckpt), Path(tmp) / "art", progress=False)
        for backend in backends:
            engines = build_engines(backend, ckpt, art, args.device, args.threads, args.batch)
            sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
            clocks = {k: CallClock(eng.backend, args.breakdown, sync) for k, eng in engines.items()}
            for k, eng in engines.items():  # warm-up: kernels, graphs of the batch's shapes, allocator
                eng.generate(groups[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
                if hasattr(eng.backend, "capture_shapes"):  # CUDA graphs of every decode / verify / MTP shape:
                    # verify steps of k + 1 tokens, MTP calls of up to k + 1 kept positions plus a chain position
                    eng.backend.capture_shapes(args.batch, k + 2 if k else 1,
                                               eng.drafter.modules_used if eng.drafter else 0, chain_drafts=k)
            for temperature in TEMPERATURES:
                graphs = {k: getattr(eng.backend, "num_graphs", 0) for k, eng in engines.items()}
                tallies = measure(engines, clocks, groups, temperature, args.new_tokens, args.repeats)
                base = tallies[0]
                for k, t in tallies.items():
                    ratios = [(n / s) / (bn / bs) if s and bs else 0.0
                              for (n, s), (bn, bs) in zip(t.per_repeat, base.per_repeat)]
                    st = t.stats
                    row = {"backend": backend, "temperature": temperature, "k": k,
                           "acceptance_length": st.mean_acceptance_length, "verify_steps": st.verify_steps,
                           "draft_tokens": st.draft_tokens, "accepted_tokens": st.accepted_tokens,
                           "decode_tokens": st.decode_tokens, "decode_time_s": st.decode_time,
                           "decode_tok_s": st.decode_tok_s,
                           "speedup_vs_k0": st.decode_tok_s / base.stats.decode_tok_s,
                           "speedup_per_repeat": ratios, "tokens": t.tokens, "wall_s": t.wall_time,
                           "wall_tok_s": t.tokens / t.wall_time}
                    (nt, tt), (nm, tm) = clocks[k].calls["target"], clocks[k].calls["mtp"]
                    row.update(target_calls=nt, mtp_calls=nm, mtp_calls_per_target_call=nm / nt,
                               chain_calls=clocks[k].calls["chain"][0],
                               graphs_captured_while_measuring=getattr(engines[k].backend, "num_graphs", 0) - graphs[k])
                    if args.breakdown:
                        row.update(target_ms_per_call=1e3 * tt / nt, mtp_ms_per_call=1e3 * tm / nm if nm else None)
                    if temperature == 0.0:
                        row["same_output_as_k0"] = t.outputs == base.outputs
                    rows.append(row)
                    acc = "-" if row["acceptance_length"] is None else f"{row['acceptance_length']:.2f}"
                    spread = f"{min(ratios):.2f}..{max(ratios):.2f}"
                    times = ""
                    if args.breakdown:
                        mtp_ms = "-" if row["mtp_ms_per_call"] is None else f"{row['mtp_ms_per_call']:.2f}"
                        times = f" {row['target_ms_per_call']:10.2f} {mtp_ms:>7s}"
                    table.append(f"{backend:12s} {temperature:4.1f} {k:2d} {acc:>6s} {row['decode_tok_s']:9.1f} "
                                 f"{row['speedup_vs_k0']:7.2f}x {spread:>11s} "
                                 f"{str(row.get('same_output_as_k0', '')):>5s} "
                                 f"{row['mtp_calls_per_target_call']:8.2f}{times}")
                    print(table[-1], flush=True)
                write(complete=False)
            del engines
    elapsed = time.perf_counter() - t0
    print(f"\n{header}\n" + "\n".join(table))
    same = [r["same_output_as_k0"] for r in rows if "same_output_as_k0" in r]
    print(f"\ngreedy speculation == plain greedy on every prompt: {all(same)}; {elapsed:.0f} s")
    write(complete=True)
    print(f"wrote {json_path}")
    return 0 if all(same) else 1


if __name__ == "__main__":
    sys.exit(main())
