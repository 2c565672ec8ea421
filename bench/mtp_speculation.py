"""MTP speculation on the embedded trained model: acceptance length and decode speed-up, per backend.

Prompts are held-out Python files (``m3export.corpus``: never seen in training), each cut to its first
``--prompt-len`` tokens; every configuration generates ``--new-tokens`` tokens from each, one request at a time
(single-stream decode, where speculation is meant to help). For each backend the non-speculative run (k = 0) is
the baseline of the same process, same prompts, same thread count. Greedy runs check that speculation leaves the
output unchanged; sampled runs (temperature 0.8, rejection sampling) report acceptance only, since their tokens
are random.

  python bench/mtp_speculation.py                                  # embedded model, torch + onnxruntime, CPU
  python bench/mtp_speculation.py --backends torch --device cuda   # on a GPU (torch backend)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(engine_factory, prompts, k: int, temperature: float, new: int):
    from m3export.runtime import SamplingParams
    from m3export.runtime.stats import EngineStats

    eng = engine_factory(k)
    eng.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    eng.stats = EngineStats()  # count the measured requests only
    outs, start = [], time.perf_counter()
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=temperature, max_tokens=new, ignore_eos=True, seed=i)
        outs.append(eng.generate([p], params)[0].token_ids)
    wall = time.perf_counter() - start
    s = eng.stats
    return {"k": k, "temperature": temperature, "acceptance_length": s.mean_acceptance_length,
            "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
            "decode_tok_s": s.decode_tok_s, "wall_s": wall, "tokens": sum(len(o) for o in outs)}, outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="checkpoint directory (default: the embedded trained model)")
    ap.add_argument("--backends", default="torch,onnxruntime")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "mtp_speculation.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from tokenizers import Tokenizer

    from m3export.corpus import encode_files, heldout_windows, stdlib_files
    from m3export.embedded import default_model
    from m3export.export.exporter import export_artifact
    from m3export.runtime import Engine

    ckpt = Path(args.checkpoint) if args.checkpoint else default_model()
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    held = encode_files(tok, [text for _, text in stdlib_files("heldout")])
    prompts = heldout_windows(held, args.prompt_len, args.prompts)

    rows, table = [], []
    with tempfile.TemporaryDirectory() as tmp:
        art = None
        for backend in args.backends.split(","):
            if backend == "torch":
                def factory(k):
                    return Engine.from_checkpoint(ckpt, device=args.device, num_speculative_tokens=k, max_num_seqs=1)
            else:
                if art is None:
                    art = export_artifact(str(ckpt), Path(tmp) / "art", progress=False)

                def factory(k, backend=backend):
                    return Engine.from_artifact(art, backend=backend, device=args.device, num_speculative_tokens=k,
                                                max_num_seqs=1)
            base, base_out = run(factory, prompts, 0, 0.0, args.new_tokens)
            for temperature in (0.0, 0.8):
                for k in (0, 1, 2, 3):
                    if k == 0 and temperature == 0.0:
                        r, out = base, base_out
                    else:
                        r, out = run(factory, prompts, k, temperature, args.new_tokens)
                    r["backend"] = backend
                    r["speedup_vs_k0_greedy"] = r["decode_tok_s"] / base["decode_tok_s"]
                    if temperature == 0.0:
                        r["same_output_as_k0"] = out == base_out
                    rows.append(r)
                    acc = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
                    table.append(f"{backend:12s} {temperature:4.1f} {k:2d} {acc:>6s} {r['decode_tok_s']:9.1f} "
                                 f"{r['speedup_vs_k0_greedy']:7.2f}x {str(r.get('same_output_as_k0', '')):>6s}")
                    print(table[-1], flush=True)
    print(f"\n{'backend':12s} {'temp':>4s} {'k':>2s} {'accept':>6s} {'decode/s':>9s} {'speedup':>8s} {'same':>6s}")
    print("\n".join(table))
    out = {"checkpoint": str(ckpt), "device": args.device, "threads": args.threads, "prompts": len(prompts),
           "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "torch": torch.__version__,
           "python": platform.python_version(), "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
