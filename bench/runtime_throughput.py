"""Runtime throughput on the tiny model (CPU): the paged engine per backend against plain PyTorch.

The baseline is what a user without a runtime does: greedy generation by recomputing the whole sequence with
``model(ids)`` for every new token (no KV cache). Both run in this process, on the same prompts, one thread,
and the table reports the engine's decode rate as a ratio to it. (A hardware roofline is not meaningful for a
model this small on a CPU: every step is dominated by per-op overhead, not by bytes or FLOPs.)

  python bench/runtime_throughput.py                      # torch and onnxruntime backends, k = 0 and 2
  python bench/runtime_throughput.py --prompts 16 --new-tokens 64
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write_results  # noqa: E402  (bench/results_file.py)


def baseline(model, prompts: list[list[int]], new: int) -> float:
    """Decode tokens per second of cache-free greedy generation (one sequence at a time)."""
    start, n = time.perf_counter(), 0
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(new):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
                n += 1
    return n / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "runtime_throughput.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)

    import m3export
    from m3export.export.exporter import export_artifact
    from m3export.runtime import Engine, SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    base = baseline(m3export.load_model("tiny"), prompts[:2], args.new_tokens)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        art = export_artifact("tiny", Path(tmp) / "art", progress=False)
        for backend in ("torch", "onnxruntime"):
            for k in (0, 2):
                eng = Engine.from_artifact(art, backend=backend, num_speculative_tokens=k)
                eng.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
                eng.stats.__init__()
                t = time.perf_counter()
                eng.generate(prompts, params)
                wall = time.perf_counter() - t
                st = eng.stats
                rows.append({
                    "backend": backend, "speculative_tokens": k, "wall_s": round(wall, 3),
                    "prefill_tok_s": round(st.prefill_tok_s, 1), "decode_tok_s": round(st.decode_tok_s, 1),
                    "end_to_end_new_tok_s": round(args.prompts * args.new_tokens / wall, 1),
                    "acceptance_length": st.mean_acceptance_length,
                    "decode_vs_baseline": round(st.decode_tok_s / base, 2),
                })
    print(f"\ntiny model, {args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new tokens, greedy, "
          f"1 thread; baseline (cache-free model(ids) per token): {base:.1f} tok/s")
    head = ("backend", "k", "prefill tok/s", "decode tok/s", "new tok/s e2e", "accept len", "decode / baseline")
    print("  ".join(f"{h:>16}" for h in head))
    for r in rows:
        acc = "n/a" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        vals = (r["backend"], r["speculative_tokens"], r["prefill_tok_s"], r["decode_tok_s"],
                r["end_to_end_new_tok_s"], acc, f"{r['decode_vs_baseline']:.2f}x")
        print("  ".join(f"{v!s:>16}" for v in vals))
    write_results({"baseline_decode_tok_s": round(base, 1), "rows": rows, "config": vars(args)}, args.json)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
