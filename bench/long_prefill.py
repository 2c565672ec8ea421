"""A long prompt prefilled in chunks on ``mini``: throughput and peak device memory at several prompt lengths.

The engine splits a prompt into steps of at most ``--chunk`` tokens (``max_num_batched_tokens``); each step
attends over the pages already written plus its own chunk, so the memory a step needs beyond the K/V pools is
set by the chunk, not by the prompt. This runs one prompt per length (16k / 32k / 64k by default) through
``Engine.generate`` (one sampled token) on a model with random weights (``bench/decode.py``'s ``build_model``:
``mini`` with ``--experts`` experts, MXFP8 or bf16 weights, bf16 activations), each with a pool sized for that
prompt, and reports per length: seconds, prefill tokens/s, the pools' bytes and the peak bytes allocated beyond
the model's weights (``torch.cuda.max_memory_allocated``), split into pools and the rest (activations and
workspace). Memory linear in prompt length means: the pools grow with the prompt and the rest stays flat, so peak
bytes per prompt token fall or stay level as the prompt grows (a quadratic step would multiply the rest by 16
from 16k to 64k). The table prints each length's growth against the shortest.

  python bench/long_prefill.py --device cuda     # H200: mini, 128 experts, MXFP8, 16k/32k/64k in chunks of 8192
  python bench/long_prefill.py --device cpu      # tiny preset, short prompts: checks the script (memory not measured)
  python bench/long_prefill.py --lengths 16384 --chunk 512,2048,8192   # one prompt length per step budget
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: m3export
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: decode, results_file
from results_file import RESULTS, write_results  # noqa: E402  (bench/results_file.py)


def prefill_once(model, n_prompt: int, chunk: int, page: int, graphs: bool) -> dict:
    """One prompt of ``n_prompt`` random tokens prefilled in steps of at most ``chunk`` tokens on a fresh engine
    whose pool holds it; the sampled token's step included. Memory figures on CUDA only."""
    from m3export.runtime import Engine, SamplingParams
    from m3export.runtime.backends.cuda_graph import GraphedTorchBackend

    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    gc.collect()  # the previous length's engine and pools (reference cycles) before the baseline
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
    max_len = n_prompt + 8
    be = GraphedTorchBackend(model, use_graphs=graphs and cuda, max_model_len=max_len)
    eng = Engine(be, page_size=page, num_pages=-(-max_len // page) + 1, max_model_len=max_len, max_num_seqs=1,
                 max_num_batched_tokens=chunk)
    row = dict(tokens=n_prompt, chunk=chunk, steps=-(-n_prompt // chunk))
    if cuda:
        torch.cuda.synchronize(device)
        row["pool_bytes"] = torch.cuda.memory_allocated(device) - base
        torch.cuda.reset_peak_memory_stats(device)
    prompt = torch.randint(0, model.config.vocab_size, (n_prompt,), generator=torch.Generator().manual_seed(3))
    t = time.perf_counter()
    eng.generate([prompt.tolist()], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    if cuda:
        torch.cuda.synchronize(device)
    row["seconds"] = time.perf_counter() - t
    row["tokens_per_s"] = n_prompt / row["seconds"]
    if cuda:
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
        row["peak_beyond_pools_bytes"] = row["peak_bytes"] - row["pool_bytes"]
        row["peak_bytes_per_token"] = row["peak_bytes"] / n_prompt
    return row


def warm_prefill(model, n_prompt: int, chunk: int, page: int, graphs: bool) -> dict:
    """``prefill_once`` twice, the second's row with the first's seconds as ``first_seconds``. A kernel compiles
    once per set of compile-time arguments, which follow a step's context in powers of two (the block top-k's
    padded block count; ``tests/test_kernels_compile_keys.py``), so the first prompt of a length pays for the
    buckets its chunks pass through (as a server's first long request does) and the second measures the steps."""
    first = prefill_once(model, n_prompt, chunk, page, graphs)
    row = prefill_once(model, n_prompt, chunk, page, graphs)
    row["first_seconds"] = first["seconds"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (mini) or cpu (tiny preset, short prompts)")
    ap.add_argument("--experts", type=int, default=128, help="routed experts of mini (the release has 128)")
    ap.add_argument("--weights", choices=["mxfp8", "bf16"], default="mxfp8")
    ap.add_argument("--lengths", default=None, help="prompt lengths (default 16384,32768,65536; cpu 96,192,384)")
    ap.add_argument("--chunk", default=None,
                    help="max_num_batched_tokens, comma-separated for several (default 8192; cpu 64)")
    ap.add_argument("--page-size", type=int, default=None,
                    help="default: the engine's (runtime.engine.default_page_size: 16 for M3; 64 until 2026-12-02; "
                         "cpu: 4, the tiny index block)")
    ap.add_argument("--no-graphs", action="store_true", help="plain TorchBackend steps (prefill is eager anyway)")
    ap.add_argument("--json", default=None, help="default bench/results/long_prefill_<device>.json")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("bench/long_prefill.py --device cuda needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2

    from decode import build_model  # bench/decode.py: random weights made on the device

    from m3export.config import preset
    from m3export.runtime.engine import default_page_size

    cfg = preset("mini" if cuda else "tiny")
    if cuda:
        cfg = dataclasses.replace(cfg, num_local_experts=args.experts).validate()
    lengths = [int(v) for v in (args.lengths or ("16384,32768,65536" if cuda else "96,192,384")).split(",")]
    chunks = [int(v) for v in (args.chunk or ("8192" if cuda else "64")).split(",")]
    page = args.page_size or (default_page_size(cfg) if cuda else 4)
    t0 = time.time()
    model = build_model(cfg, cuda and args.weights == "mxfp8", args.device, torch.bfloat16 if cuda else torch.float32)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"{'mini' if cuda else 'tiny'}: {weights / 1e9:.2f} GB of weights built in {time.time() - t0:.0f} s",
          flush=True)
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "preset": "mini" if cuda else "tiny", "experts": cfg.num_local_experts,
           "weights": args.weights if cuda else "fp32", "weight_bytes": weights, "page_size": page, "chunks": chunks,
           "rows": []}
    json_path = args.json or RESULTS / f"long_prefill_{'cuda' if cuda else 'cpu'}.json"
    for n, chunk in [(n, c) for c in chunks for n in lengths]:
        try:
            row = warm_prefill(model, n, chunk, page, graphs=not args.no_graphs)
        except Exception as exc:  # out of memory or a kernel that does not take this shape: reported, go on
            row = dict(tokens=n, chunk=chunk, error=f"{type(exc).__name__}: {exc}"[:300])
            if cuda:
                torch.cuda.empty_cache()
        res["rows"].append(row)
        print(row, flush=True)
        out = write_results(res, json_path)  # after every length: a run cut short keeps what it measured
    ok = [r for r in res["rows"] if "seconds" in r]
    print(f"\nchunked prefill, {res['preset']} ({cfg.num_local_experts} experts, {res['weights']}), pages of {page};"
          f" {out}")
    print(f"{'tokens':>7} {'chunk':>6} {'steps':>5} {'s':>7} {'tok/s':>8} {'first s':>8} {'pool GB':>8} {'peak GB':>8} "
          f"{'rest GB':>8} {'x tokens':>8} {'x rest':>7}   (first s: the same prompt the first time, kernels compiled)")
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['tokens']:>7} {r['chunk']:>6} {r['error']}")
            continue
        first = next(f for f in ok if f["chunk"] == r["chunk"])  # growth against the shortest of its chunk size
        gb = lambda k: f"{r[k] / 1e9:>8.2f}" if k in r else f"{'-':>8}"  # noqa: E731
        grow = (f"{r['peak_beyond_pools_bytes'] / first['peak_beyond_pools_bytes']:>7.2f}"
                if "peak_beyond_pools_bytes" in r and first.get("peak_beyond_pools_bytes") else f"{'-':>7}")
        print(f"{r['tokens']:>7} {r['chunk']:>6} {r['steps']:>5} {r['seconds']:>7.2f} {r['tokens_per_s']:>8.0f} "
              f"{r['first_seconds']:>8.2f} {gb('pool_bytes')} "
              f"{gb('peak_bytes')} {gb('peak_beyond_pools_bytes')} {r['tokens'] / first['tokens']:>8.1f} {grow}")
    return 0 if len(ok) == len(lengths) * len(chunks) else 1


if __name__ == "__main__":
    sys.exit(main())
