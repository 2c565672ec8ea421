"""Tensor parallelism on 2 GPUs against 1, in one run: equality first, then decode / prefill throughput.

1. **Equality** (``mini``: real per-layer dims, 4 layers, ``--eq-experts`` experts, fp32): the same prefill batch
   through one GPU's torch backend and through the 2-rank ``DistributedBackend`` (max relative logit
   difference), then greedy generation through the engine (4 prompts): the tokens must be identical.
2. **Throughput** (``mini`` with ``--layers`` layers and ``--experts`` experts, bf16, CUDA graphs): the same engine
   workload on 1 GPU (in this process) and on 2 (TP=2, and TP=2 with ``--expert-parallel``): decode tokens/s at
   batch 1 / 8 / 64 (``--batches``) and prefill tokens/s, from the engine's own counters. On rank 0 a few decode
   steps (batch 8) and one prefill step run under ``torch.profiler``: the **NCCL share** is the time of NCCL
   kernels over all GPU kernel time, and over the wall time of the profiled steps (NCCL kernel time includes
   waiting for the other rank, so it bounds the communication cost from above).
3. **Beyond one GPU** (``--big-layers`` / ``--big-experts``, optional): a configuration whose weights exceed one
   GPU's memory, decoded on 2 GPUs only (its size per rank is printed).

Weights are random, made on each device by a generator seeded per parameter name (seconds for tens of GB):
every rank draws the whole parameter and keeps its slice (``m3export.parallel.shard_of``), so one GPU and two
hold the same model. The table goes to stdout, the JSON to ``bench/results/parallel_<device>.json`` (and $OUT).

  python bench/parallel.py                          # 2 GPUs (scripts/gpu_multi.sh)
  python bench/parallel.py --device cpu --smoke     # the same logic on CPU, gloo, the tiny preset
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import RESULTS, write_results  # noqa: E402  (bench/results_file.py)

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------------------------------------- the model
def sized_config(source: str):
    """``preset[:num_hidden_layers=N,num_local_experts=E]`` -> M3Config (layer 0 dense, the rest sparse MoE)."""
    from m3export.config import _layers, preset

    name, _, sizes = source.partition(":")
    cfg = preset(name)
    changes = {k: int(v) for k, v in (kv.split("=") for kv in sizes.split(",") if kv)}
    if "num_hidden_layers" in changes:
        n = changes["num_hidden_layers"]
        changes["layer_types"], changes["mlp_layer_types"] = _layers(n, 1)
    return dataclasses.replace(cfg, **changes).validate() if changes else cfg


def fill_random(model, cfg, parallel, rank: int) -> None:
    """Each parameter drawn whole on the model's device from a generator seeded by its name, then cut to the
    rank's slice (``parallel`` None: the whole model): every rank, and one device alone, hold the same model."""
    from m3export.checkpoint.loader import build_empty
    from m3export.parallel import shard_of

    device = next(model.parameters()).device
    whole = {n: tuple(q.shape) for n, q in build_empty(cfg, torch.float32, "meta",
                                                        num_mtp_modules=len(model.mtp)).named_parameters()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = whole[name]
            g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
            std = 0.2 if "norm" in name else 0.05 if "correction_bias" in name else (
                1.0 if "embed" in name else 1.0 / math.sqrt(shape[-1]))
            full = torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(std)  # one temporary
            p.copy_(full if parallel is None else shard_of(name, cfg, parallel, rank).take(full))
            del full


def random_shard_backend(spec, rank: int, device: torch.device):
    """``LaunchSpec.backend_factory`` of this benchmark: rank ``rank``'s shard of ``sized_config(spec.source)``
    with ``fill_random`` weights, behind the ordinary torch backend (CUDA graphs unless ``enforce_eager``)."""
    from m3export.parallel import ParallelConfig, build_shard
    from m3export.runtime.backends import make_torch_backend
    from m3export.runtime.distributed import model_dtype

    cfg = sized_config(spec.source)
    parallel = ParallelConfig(spec.tensor_parallel_size, spec.expert_parallel)
    model = build_shard(cfg, parallel, rank, model_dtype(spec), device).eval()
    fill_random(model, cfg, parallel, rank)
    if device.type == "cuda":
        from m3export.plugins.kernels import use_on

        use_on(device)
    return make_torch_backend(model, spec.enforce_eager)


def single_backend(source: str, device: str, dtype: torch.dtype, enforce_eager: bool = False):
    """The same model on one device in this process (the baseline)."""
    from m3export.checkpoint.loader import build_empty
    from m3export.runtime.backends import make_torch_backend

    cfg = sized_config(source)
    model = build_empty(cfg, dtype, device, num_mtp_modules=cfg.num_mtp_modules).eval()
    fill_random(model, cfg, None, 0)
    if str(device).startswith("cuda"):
        from m3export.plugins.kernels import use_on

        use_on(device)
    return make_torch_backend(model, enforce_eager)


def parallel_backend(source: str, device: str, dtype: torch.dtype, expert_parallel: bool = False,
                     enforce_eager: bool = False, tp: int = 2):
    from m3export.dtypes import of_torch
    from m3export.runtime.backends.distributed_backend import DistributedBackend
    from m3export.runtime.distributed import LaunchSpec

    spec = LaunchSpec(source, tp, expert_parallel, device, of_torch(dtype).name, enforce_eager,
                      backend_factory="bench.parallel:random_shard_backend")
    return DistributedBackend.launch(spec)


def say(msg: str) -> None:
    """A time-stamped progress line, flushed at once (the log shows where a run that hangs stopped)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def release(backend) -> None:
    t0 = time.perf_counter()
    say(f"closing {type(backend).__name__}")
    backend.close()
    say(f"closed in {time.perf_counter() - t0:.1f} s")
    del backend
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- 1. equality
def prefill_logits(backend, prompts, page: int) -> torch.Tensor:
    """The last-token logits of ``prompts`` prefilled together on fresh pools."""
    from m3export.model.batch import Segment, build_batch

    pages_each = -(-max(map(len, prompts)) // page)
    backend.allocate(pages_each * len(prompts) + 1, page)
    segments = [Segment(list(range(i * pages_each, (i + 1) * pages_each)), 0, p) for i, p in enumerate(prompts)]
    ids, batch = build_batch(segments, page, backend.batch_device)
    last = torch.tensor([sum(map(len, prompts[:i + 1])) - 1 for i in range(len(prompts))], device=ids.device)
    logits, _ = backend.forward(ids, batch, last)
    return logits.float().cpu()


def greedy(backend, prompts, new_tokens: int) -> list[list[int]]:
    from m3export.runtime import Engine, SamplingParams

    engine = Engine(backend, None, max_model_len=256, num_pages=64 * len(prompts))
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


def equality(args, device: str, save=lambda partial: None) -> dict:
    from m3export.runtime.engine import default_page_size

    source, dtype = args.eq_source, args.eq_dtype
    cfg = sized_config(source)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (7, 33, 64, 100)]
    page = default_page_size(cfg)
    out = {"source": source, "dtype": str(dtype).removeprefix("torch."), "prompts": [len(p) for p in prompts],
           "rows": []}
    ref_logits = ref_tokens = None
    for name, make in (("1 device", lambda: single_backend(source, device, dtype)),
                       ("TP=2", lambda: parallel_backend(source, device, dtype)),
                       ("TP=2 EP", lambda: parallel_backend(source, device, dtype, expert_parallel=True))):
        t0 = time.perf_counter()
        say(f"equality: starting {name}")
        be = make()
        say(f"equality: {name} ready in {time.perf_counter() - t0:.1f} s; prefill")
        logits = prefill_logits(be, prompts, page)
        say(f"equality: {name} greedy")
        tokens = greedy(be, prompts, args.eq_tokens)
        if ref_logits is None:
            ref_logits, ref_tokens = logits, tokens
        else:  # recorded before the close, so a close that hangs keeps the comparison
            rel = ((logits.double() - ref_logits.double()).abs().max() / ref_logits.double().abs().max()).item()
            same = sum(a == b for t, r in zip(tokens, ref_tokens) for a, b in zip(t, r))
            total = sum(len(r) for r in ref_tokens)
            out["rows"].append({"parallel": name, "logits_max_rel_diff": rel, "greedy_tokens_equal": same,
                                "greedy_tokens": total, "identical": tokens == ref_tokens,
                                "seconds": time.perf_counter() - t0})
            say(f"equality: {name}: max rel logit diff {rel:.2e}, greedy tokens equal {same}/{total}")
            save(out)
        release(be)
    return out


# ---------------------------------------------------------------------------------------------- 2. throughput
def nccl_share(device: str, run) -> dict:
    """Profile ``run()`` on rank 0: collective time over all GPU kernel time and over the wall time. On CPU the
    gloo collectives' host time over the wall time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        run()
        synchronize(device)
        wall = time.perf_counter() - t0
    events = prof.events()
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.device_time for e in kernels) / 1e6
        comm = sum(e.device_time for e in kernels if "nccl" in e.name.lower()) / 1e6
    else:
        total = wall
        comm = sum(e.cpu_time_total for e in events
                   if e.name.startswith("gloo:") or e.name.startswith("c10d::")) / 1e6
    return {"collective_s": comm, "kernel_s": total, "wall_s": wall,
            "share_of_kernel_time": comm / total if total else None, "share_of_wall": comm / wall if wall else None}


def throughput(backend, device: str, batches, prompt_len: int, decode_tokens: int, prefill_prompts: int,
               prefill_len: int, vocab: int) -> dict:
    from m3export.runtime import Engine, SamplingParams
    from m3export.runtime.stats import EngineStats

    g = torch.Generator().manual_seed(1)
    max_len = max(prompt_len + decode_tokens + 8, prefill_len + 8)
    from m3export.runtime.engine import default_page_size

    page = default_page_size(backend.config)
    engine = Engine(backend, None, max_model_len=max_len, max_num_seqs=max(batches),
                    max_num_batched_tokens=max(prefill_len * prefill_prompts, max(batches) * prompt_len),
                    num_pages=(max(max(batches), prefill_prompts) + 1) * -(-max_len // page) * 2)
    out = {"decode": {}, "prefill": None}
    for b in batches:
        prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(b)]
        params = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # capture, warm up
        engine.stats = EngineStats()
        engine.generate(prompts, params)
        st = engine.stats
        out["decode"][b] = {"tok_s": st.decode_tokens / st.decode_time, "step_ms": 1e3 * st.decode_time / max(
            1, st.decode_tokens // b)}
    prompts = [torch.randint(0, vocab, (prefill_len,), generator=g).tolist() for _ in range(prefill_prompts)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.generate(prompts, one)  # warm-up
    engine.stats = EngineStats()
    engine.generate(prompts, one)
    out["prefill"] = {"tok_s": engine.stats.prefill_tokens / engine.stats.prefill_time,
                      "tokens": engine.stats.prefill_tokens}
    # NCCL share: decode steps at batch 8 (or the largest below), then one prefill step
    b = max(x for x in batches if x <= 8)
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(b)]
    for rid, p in enumerate(prompts):
        engine.add_request(f"nccl-{rid}", p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    engine.step()  # their prefill
    engine.step()

    def decode_steps():
        for _ in range(16):
            engine.step()

    out["nccl_decode"] = nccl_share(device, decode_steps)
    while engine.has_unfinished():
        engine.step()
    for rid, p in enumerate(prompts[:prefill_prompts]):
        engine.add_request(f"nccl-p{rid}", p * max(1, prefill_len // prompt_len), one)
    out["nccl_prefill"] = nccl_share(device, lambda: engine.step())
    while engine.has_unfinished():
        engine.step()
    return out


def model_bytes(source: str, dtype: torch.dtype) -> int:
    from m3export.checkpoint.loader import build_empty

    cfg = sized_config(source)
    meta = build_empty(cfg, dtype, "meta", num_mtp_modules=cfg.num_mtp_modules)
    return sum(p.numel() * p.element_size() for p in meta.parameters())


# ---------------------------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (ranks on cuda:0, cuda:1; NCCL) or cpu (gloo)")
    ap.add_argument("--smoke", action="store_true", help="CPU logic check: the tiny preset, small batches")
    ap.add_argument("--eq-experts", type=int, default=16)
    ap.add_argument("--eq-tokens", type=int, default=24, help="greedy tokens per prompt compared")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--prefill-prompts", type=int, default=4)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--big-layers", type=int, default=0, help="stage 3 (0: skipped)")
    ap.add_argument("--big-experts", type=int, default=128)
    ap.add_argument("--skip", default="", help="comma-separated stages to skip: equality, throughput")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from m3export.parallel.diagnostics import rank_diagnostics

    rank_diagnostics(0)  # with M3EXPORT_DIAG_DIR: this process's stacks on SIGUSR1 / a timer
    skip = set(filter(None, args.skip.split(",")))
    device = args.device
    if args.smoke:
        base, args.eq_dtype = "tiny", torch.float64
        args.eq_source = "tiny"
        args.batches, args.prompt_len, args.decode_tokens = "1,2,4", 16, 8
        args.prefill_prompts, args.prefill_len = 2, 64
        tput_source, tput_dtype = f"tiny:num_hidden_layers={args.layers},num_local_experts={args.experts}", torch.float32
    else:
        base = "mini"
        args.eq_dtype = torch.float32
        args.eq_source = f"mini:num_local_experts={args.eq_experts}"
        tput_source = f"mini:num_hidden_layers={args.layers},num_local_experts={args.experts}"
        tput_dtype = torch.bfloat16
    if torch.device(device).type == "cuda" and torch.cuda.device_count() < 2:
        print(f"needs 2 GPUs, this machine shows {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    res = {"device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    name = "parallel_" + ("h200x2" if device.startswith("cuda") else "cpu") + ("_smoke" if args.smoke else "")
    path = Path(args.json) if args.json else RESULTS / f"{name}.json"

    def save():  # after every stage: a stage cut short by a time limit keeps the earlier ones
        write_results(res, path)

    if "equality" not in skip:
        t0 = time.perf_counter()
        res["equality"] = eq = equality(args, device, lambda partial: (res.update(equality=partial), save()))
        print(f"\n== equality: {eq['source']} {eq['dtype']}, prompts {eq['prompts']} ({time.perf_counter() - t0:.0f} s)")
        print("| parallel | max rel logit diff | greedy tokens equal |")
        print("|---|---|---|")
        for r in eq["rows"]:
            print(f"| {r['parallel']} | {r['logits_max_rel_diff']:.2e} | {r['greedy_tokens_equal']}/{r['greedy_tokens']}"
                  f"{'' if r['identical'] else ' DIFFER'} |")
        save()

    if "throughput" not in skip:
        cfg = sized_config(tput_source)
        res["throughput"] = {"source": tput_source, "dtype": str(tput_dtype).removeprefix("torch."),
                             "weights_bytes": model_bytes(tput_source, tput_dtype), "runs": {}}
        for name, make in (("1 GPU" if device.startswith("cuda") else "1 process",
                            lambda: single_backend(tput_source, device, tput_dtype)),
                           ("TP=2", lambda: parallel_backend(tput_source, device, tput_dtype)),
                           ("TP=2 EP", lambda: parallel_backend(tput_source, device, tput_dtype, expert_parallel=True))):
            t0 = time.perf_counter()
            say(f"throughput: starting {name}")
            be = make()
            loaded = time.perf_counter() - t0
            say(f"throughput: {name} ready in {loaded:.1f} s; measuring")
            run = throughput(be, device, batches, args.prompt_len, args.decode_tokens, args.prefill_prompts,
                             args.prefill_len, cfg.vocab_size)
            run["load_s"] = loaded
            res["throughput"]["runs"][name] = run
            save()  # before the close: a close that hangs keeps the run
            say(f"throughput: {name} measured: " + ", ".join(
                f"b={b} {run['decode'][b]['tok_s']:.0f} tok/s" for b in batches)
                + f", prefill {run['prefill']['tok_s']:.0f} tok/s")
            release(be)
        tp = res["throughput"]
        print(f"\n== throughput: {tput_source} {tp['dtype']}, {tp['weights_bytes'] / 2**30:.1f} GiB of weights")
        print("| run | " + " | ".join(f"decode b={b} tok/s" for b in batches)
              + " | prefill tok/s | NCCL share decode (kernel / wall) | NCCL share prefill |")
        print("|---|" + "---|" * (len(batches) + 3))
        for name, r in tp["runs"].items():
            def share(s):
                k, w = s["share_of_kernel_time"], s["share_of_wall"]
                return f"{'n/a' if k is None else f'{100 * k:.1f} %'} / {'n/a' if w is None else f'{100 * w:.1f} %'}"

            cells = [f"{r['decode'][b]['tok_s']:.0f}" for b in batches]
            print(f"| {name} | " + " | ".join(cells) + f" | {r['prefill']['tok_s']:.0f} | {share(r['nccl_decode'])} | "
                  f"{share(r['nccl_prefill'])} |")
        save()

    if args.big_layers:
        big = f"{base}:num_hidden_layers={args.big_layers},num_local_experts={args.big_experts}"
        need = model_bytes(big, tput_dtype)
        cap = torch.cuda.get_device_properties(0).total_memory if device.startswith("cuda") else None
        t0 = time.perf_counter()
        say(f"beyond one GPU: starting {big} on 2 ranks")
        be = parallel_backend(big, device, tput_dtype)
        loaded = time.perf_counter() - t0
        say(f"beyond one GPU: ready in {loaded:.1f} s; measuring")
        run = throughput(be, device, batches, args.prompt_len, args.decode_tokens, args.prefill_prompts,
                         args.prefill_len, sized_config(big).vocab_size)
        run.update(load_s=loaded, weights_bytes=need, one_gpu_bytes=cap)
        res["beyond_one_gpu"] = {"source": big, **run}
        save()  # before the close
        release(be)
        print(f"\n== beyond one GPU: {big}, {need / 2**30:.1f} GiB of weights"
              + (f" (one GPU holds {cap / 2**30:.1f} GiB)" if cap else ""))
        print(" | ".join(f"decode b={b}: {run['decode'][b]['tok_s']:.0f} tok/s" for b in batches)
              + f" | prefill {run['prefill']['tok_s']:.0f} tok/s")

    save()
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
