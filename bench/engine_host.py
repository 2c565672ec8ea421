"""The engine's own per-step host work: scheduling, batch building, sampling and output, with a backend that
computes nothing.

A decode step on the GPU costs the device time (``bench/decode.py``) plus what the engine does on the host around
``Backend.forward``. This drives ``Engine`` with a backend that returns zero logits of the real vocabulary size
instantly (greedy sampling then scans all 200,064 logits of every row, as it does in production; the device-to-host
copy of the logits that a GPU backend adds is not included), so the time per step is host work only: the number to add to a graphed device step, and the budget to keep under it.

  python bench/engine_host.py                    # batch 1 / 8 / 64, M3's vocabulary; bench/results/engine_host.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from m3export.config import preset
from m3export.runtime import Engine, SamplingParams
from m3export.runtime.backends.base import Backend


class NoComputeBackend(Backend):
    """Fixed random logits and zero hidden states of the right shapes, made once; no pools (the engine only
    addresses pages). Random, not zero, logits: the sampler's scan should see real data."""

    name = "no-compute"

    def __init__(self, cfg, max_rows: int):
        self.config = cfg
        self.forward_time = 0.0
        self._logits = torch.randn(max_rows, cfg.vocab_size, generator=torch.Generator().manual_seed(0))
        self._hidden = torch.zeros(max_rows, cfg.hidden_size)

    @property
    def num_mtp_modules(self) -> int:
        return 0

    def page_bytes(self, page_size: int) -> int:
        return 1

    def allocate(self, num_pages: int, page_size: int) -> None:
        pass

    def forward(self, input_ids, batch, logits_indices):
        t = time.perf_counter()
        out = self._logits[:logits_indices.shape[0]], self._hidden[:input_ids.shape[0]]
        self.forward_time += time.perf_counter() - t
        return out

    def mtp_forward(self, module, input_ids, hidden, batch, logits_indices):
        raise RuntimeError("no MTP modules")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "engine_host.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = preset("full")  # the release's vocabulary (200,064) and eos ids; no weights are built
    rows = []
    for b in [int(v) for v in args.batches.split(",")]:
        be = NoComputeBackend(cfg, max(b * args.prompt_len, b))
        eng = Engine(be, page_size=64, num_pages=b * (-(-(args.prompt_len + args.new_tokens) // 64) + 1),
                     max_num_seqs=b, max_num_batched_tokens=max(512, b * args.prompt_len))
        prompts = [[(7 * i + j) % 1000 + 1 for j in range(args.prompt_len)] for i in range(b)]
        params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
        eng.step()  # the prefill step (all prompts fit one step)
        be.forward_time, steps = 0.0, 0
        t = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
            steps += 1
        total = time.perf_counter() - t
        host_us = (total - be.forward_time) / steps * 1e6
        rows.append(dict(batch=b, decode_steps=steps, host_us_per_step=host_us,
                         host_us_per_token=host_us / b))
        print(json.dumps(rows[-1]), flush=True)
    res = {"vocab": cfg.vocab_size, "threads": 1, "rows": rows}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"\nengine host work per decode step (vocabulary {cfg.vocab_size}, greedy, one thread)")
    print(f"{'batch':>5} {'us/step':>9} {'us/token':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['host_us_per_step']:>9.0f} {r['host_us_per_token']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
