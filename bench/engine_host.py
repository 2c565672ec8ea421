"""The engine's own per-step work around the model, split by phase, with a backend that computes nothing.

A decode step costs the device time of the model (``bench/decode.py``) plus what the engine does around
``Backend.forward``. This drives ``Engine`` with a backend that returns fixed random logits of the real vocabulary
(200,064) instantly, on ``--device`` (on a GPU the logits stay there, as a GPU backend leaves them, so sampling
runs on the device and its one device-to-host copy is included), and times each phase of every decode step:

* ``schedule``: ``Scheduler.schedule`` (which requests, how many tokens, pages);
* ``build_batch``: the flattened paged batch from the scheduled work (``m3export.model.batch.build_batch``);
* ``backend``: ``Backend.forward`` (here: returning the fixed tensors; on a real model, the device step);
* ``sample``: every sampled row decided (``acceptance.decide``: penalties, filters, draws, logprobs where the
  logits are, then the copy of the chosen ids to the host);
* ``detokenize``: incremental detokenization and stop strings (only with ``--tokenizer``: without one the
  engine works on ids and this is ~0);
* ``draft``: with ``--speculative K``, the MTP drafter's work around its module calls (catch-up and chain
  batches, proposals; the module calls themselves return fixed logits instantly, so every draft equals the
  verify row's argmax only by chance: most rounds end at their first draft);
* ``other``: the rest of ``Engine.step`` (bookkeeping, outputs).

``host_reads_per_step``: the engine's device-to-host reads per step (``runtime/device_drafts.HOST_READS``; each
waits for the device on a GPU): 1 (the step's decision) with or without speculation.

Per batch size and sampling mode (greedy; sampled with temperature / top-k / top-p and a seed; greedy with 5
logprobs) it reports microseconds per step per phase. On a GPU every phase ends with a synchronisation so device
work is charged to the phase that launched it (this adds a few microseconds per phase).

  python bench/engine_host.py                          # CPU: batch 1 / 8 / 64; bench/results/engine_host_cpu.json
  python bench/engine_host.py --device cuda            # on the H200: bench/results/engine_host_cuda.json
  python bench/engine_host.py --speculative 0,2        # + speculative rounds of 2 drafts (one MTP module)
  python bench/engine_host.py --device cuda --device-step-us 1340   # a model step's device time, overlapped
  python bench/engine_host.py --batches 32 --modes greedy,logprobs --new-tokens 8192 --windows 1024 \
      --tokenizer m3export/embedded/code-tiny/tokenizer.json     # engine us a step as the outputs grow

``--windows W``: the engine's whole host time a decode step (phases not split, nothing synchronised) averaged over
each W steps of one long generation per batch and mode, to show whether a step's cost grows with what the requests
already generated (it should not: ``runtime.outputs.Deferred``). With ``--tokenizer`` the vocabulary is the
tokenizer's, and fixed logits rows whose token decodes to a split character (which never completes, so its decode
window would grow without end: not what a model emits) take a clean row's.

``--device-step-us N`` (GPU): each forward also keeps the device busy for N microseconds (``torch.cuda._sleep``, the
time of the model's replayed step, e.g. ``bench/decode.py``'s 1.34 ms for ``mini`` at one row and 4k context), and
the phases are not synchronised: a step's wall time then shows what the engine adds over the model's device time
once its host work overlaps the device's (``step_us``; ``over_device_us`` = ``step_us`` - N), as in a real step.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: m3export
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: results_file
from results_file import RESULTS, write_results  # noqa: E402

from m3export.config import preset  # noqa: E402
from m3export.runtime import Engine, SamplingParams  # noqa: E402
from m3export.runtime.backends.base import Backend  # noqa: E402

PHASES = ("schedule", "build_batch", "backend", "sample", "detokenize", "draft")
MODES = {
    "greedy": lambda i: SamplingParams(temperature=0),
    "sampled": lambda i: SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=i),
    "logprobs": lambda i: SamplingParams(temperature=0, logprobs=5),
}


class NoComputeBackend(Backend):
    """Fixed random logits and zero hidden states of the right shapes on ``device``, made once; no pools (the
    engine only addresses pages). Random, not zero, logits: the sampler should see real data. Like the CUDA
    default (``GraphedTorchBackend``) it takes host batches and copies them to the device itself, and token ids
    already there. ``mtp``: one MTP module, which returns the same fixed rows."""

    name = "no-compute"

    def __init__(self, cfg, max_rows: int, device: torch.device, mtp: bool = False, busy_cycles: int = 0):
        self.config = cfg
        self.device = device
        self.mtp = mtp
        self.busy_cycles = busy_cycles  # device clock cycles each forward keeps the GPU busy (a model step's time)
        g = torch.Generator().manual_seed(0)
        self._logits = torch.randn(max_rows, cfg.vocab_size, generator=g).to(device)
        self._hidden = torch.zeros(1, cfg.hidden_size, device=device)  # one row, expanded to the step's tokens

    @property
    def num_mtp_modules(self) -> int:
        return 1 if self.mtp else 0

    @property
    def takes_device_token_ids(self) -> bool:
        return True

    def page_bytes(self, page_size: int) -> int:
        return 1

    def allocate(self, num_pages: int, page_size: int) -> None:
        pass

    @property
    def batch_device(self) -> torch.device:
        return torch.device("cpu")

    def forward(self, input_ids, batch, logits_indices):
        if self.device.type != "cpu":  # what a graphed step copies into its static inputs
            input_ids, batch, logits_indices = (input_ids.to(self.device), batch.to(self.device),
                                                logits_indices.to(self.device))
        if self.busy_cycles:
            torch.cuda._sleep(self.busy_cycles)
        return self._logits[:logits_indices.shape[0]], self._hidden.expand(input_ids.shape[0], -1)

    def mtp_forward(self, module, input_ids, hidden, batch, logits_indices):
        if not self.mtp:
            raise RuntimeError("no MTP modules")
        return self.forward(input_ids, batch, logits_indices)


class PhaseTimers:
    """Seconds spent in each phase: the functions of a phase are wrapped (on the objects the engine calls them
    through) for as long as ``timing()`` is active."""

    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def _wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.seconds[phase] += time.perf_counter() - t
        return timed

    @contextmanager
    def timing(self, eng: Engine):
        import m3export.runtime.engine as engine_module
        from m3export.runtime.detokenizer import IncrementalDetokenizer

        patches = [(eng.scheduler, "schedule", "schedule"), (engine_module, "build_batch", "build_batch"),
                   (eng.backend, "forward", "backend"), (engine_module, "decide", "sample"),
                   (IncrementalDetokenizer, "append", "detokenize"), (IncrementalDetokenizer, "release", "detokenize")]
        if eng.drafter is not None:
            patches.append((eng.drafter, "run", "draft"))
        saved = [(obj, name, obj.__dict__.get(name) if isinstance(obj, type) else getattr(obj, name))
                 for obj, name, _ in patches]
        for obj, name, phase in patches:
            setattr(obj, name, self._wrap(phase, getattr(obj, name)))
        try:
            yield self
        finally:
            for obj, name, original in saved:
                if isinstance(obj, type) or name in ("build_batch", "decide"):
                    setattr(obj, name, original)
                else:
                    delattr(obj, name)  # the instance attribute goes; the method shows through again


def cycles_per_us(device: torch.device) -> float:
    """The device clock as ``torch.cuda._sleep`` counts it, measured (a 2M-cycle sleep timed with events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(100_000)  # the clock up
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    torch.cuda.synchronize(device)
    return 2_000_000 / (start.elapsed_time(end) * 1e3)


def prefilled_engine(cfg, be: Backend, tokenizer, batch: int, mode: str, prompt_len: int, new_tokens: int,
                     **engine_kwargs) -> Engine:
    """An engine on ``be`` holding ``batch`` random prompts of ``prompt_len`` tokens (``mode``'s parameters, each to
    ``new_tokens`` tokens, EOS ignored), after its prefill step (all prompts fit one step; every kernel and
    allocation warmed up)."""
    page = 64
    eng = Engine(be, tokenizer, page_size=page, num_pages=batch * (-(-(prompt_len + new_tokens) // page) + 2),
                 max_num_seqs=batch, max_num_batched_tokens=max(512, batch * prompt_len), **engine_kwargs)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=g).tolist()
        eng.add_request(f"r{i}", prompt, dataclasses.replace(MODES[mode](i), max_tokens=new_tokens, ignore_eos=True))
    eng.step()
    return eng


def run(cfg, device: torch.device, batch: int, mode: str, prompt_len: int, new_tokens: int, tokenizer,
        speculative: int = 0, device_step_us: float = 0.0, clock: float = 0.0) -> dict:
    """One table row. ``clock``: ``cycles_per_us(device)``, measured once by the caller (with ``device_step_us``)."""
    from m3export.runtime.device_drafts import HOST_READS

    busy = int(device_step_us * clock) if device_step_us else 0
    be = NoComputeBackend(cfg, batch * (1 + speculative), device, mtp=speculative > 0,  # sampled rows per step
                          busy_cycles=busy)
    eng = prefilled_engine(cfg, be, tokenizer, batch, mode, prompt_len, new_tokens, num_speculative_tokens=speculative)
    if device_step_us:  # no phase timers (their synchronisations would end the overlap): the steps' wall time
        torch.cuda.synchronize(device)
        steps, t = 0, time.perf_counter()
        while eng.has_unfinished():
            eng.step()
            steps += 1
        step_us = (time.perf_counter() - t) / steps * 1e6
        return dict(batch=batch, mode=mode, speculative=speculative, decode_steps=steps,
                    device_step_us=device_step_us, step_us=step_us, over_device_us=step_us - device_step_us)
    timers = PhaseTimers(device)
    steps = 0
    reads = HOST_READS.copy()
    with timers.timing(eng):
        t = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
            steps += 1
        total = time.perf_counter() - t
    reads = sum((HOST_READS - reads).values())
    per = {k: v / steps * 1e6 for k, v in timers.seconds.items()}
    per["other"] = total / steps * 1e6 - sum(per.values())
    host = total / steps * 1e6 - per["backend"]
    tokens = batch * (new_tokens - 1)  # every token after the prefill step's first
    return dict(batch=batch, mode=mode, speculative=speculative, decode_steps=steps, us_per_step=per,
                engine_us_per_step=host, engine_us_per_token=host * steps / tokens,
                host_reads_per_step=reads / steps)


def growth(cfg, batch: int, mode: str, prompt_len: int, new_tokens: int, tokenizer, window: int) -> dict:
    """One long generation: engine us a step (everything ``Engine.step`` does around an instant backend) averaged
    over each ``window`` decode steps, in order."""
    be = NoComputeBackend(cfg, batch, torch.device("cpu"))
    if tokenizer is not None:
        ids = be._logits.argmax(-1).tolist()
        split = [i for i, t in enumerate(ids) if "\ufffd" in tokenizer.decode([t])]
        clean = [i for i in range(len(ids)) if i not in set(split)]
        for i in split:
            be._logits[i] = be._logits[clean[i % len(clean)]]
    eng = prefilled_engine(cfg, be, tokenizer, batch, mode, prompt_len, new_tokens,
                           max_model_len=prompt_len + new_tokens + 1)
    us, steps, t = [], 0, time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps % window == 0:
            now = time.perf_counter()
            us.append((now - t) / window * 1e6)
            t = now
    return dict(batch=batch, mode=mode, new_tokens=new_tokens, window=window, engine_us_per_step=us)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--modes", default=",".join(MODES), help=f"any of {', '.join(MODES)}")
    ap.add_argument("--prompt-len", type=int, default=32, help="context before decoding (block tables grow with it)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--tokenizer", default=None, help="a tokenizer.json of M3's vocabulary, to time detokenizing")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--speculative", default="0", help="drafts per round, comma-separated (0: no speculation)")
    ap.add_argument("--device-step-us", type=float, default=0.0,
                    help="GPU: keep the device busy this long each forward, phases unsynchronised (see above)")
    ap.add_argument("--windows", type=int, default=0,
                    help="CPU: engine us a step over each this many steps of one long generation (see above)")
    ap.add_argument("--json", default=None, help="default bench/results/engine_host_<device type>.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench/engine_host.py --device cuda needs a CUDA device", file=sys.stderr)
        return 2
    if args.device_step_us and device.type != "cuda":
        raise SystemExit("--device-step-us needs --device cuda (it keeps the GPU busy)")
    torch.set_num_threads(args.threads)
    cfg = preset("full")  # the release's vocabulary (200,064) and eos ids; no weights are built
    tokenizer = None
    if args.tokenizer:
        from m3export.runtime.tokenizer import TextTokenizer

        tokenizer = TextTokenizer.from_file(args.tokenizer)
    if args.windows:
        if device.type != "cpu":
            raise SystemExit("--windows times the engine's host work alone: run it with --device cpu")
        if tokenizer is not None:
            cfg = dataclasses.replace(cfg, vocab_size=min(cfg.vocab_size, tokenizer.vocab_size))
        rows = [growth(cfg, b, mode, args.prompt_len, args.new_tokens, tokenizer, args.windows)
                for mode in args.modes.split(",") for b in [int(v) for v in args.batches.split(",")]]
        out = write_results({"device": "cpu", "torch": torch.__version__, "vocab": cfg.vocab_size,
                             "threads": args.threads, "tokenizer": args.tokenizer, "rows": rows},
                            args.json or RESULTS / "engine_host_growth_cpu.json")
        print(f"engine us a decode step, averaged over each {args.windows} steps (vocabulary {cfg.vocab_size}); {out}")
        print(f"{'mode':>8} {'batch':>5} " + " ".join(f"{(i + 1) * args.windows:>7}" for i in
                                                    range(len(rows[0]['engine_us_per_step']))))
        for r in rows:
            print(f"{r['mode']:>8} {r['batch']:>5} " + " ".join(f"{v:>7.0f}" for v in r["engine_us_per_step"]))
        return 0
    rows = []
    clock = cycles_per_us(device) if args.device_step_us else 0.0
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"--modes: unknown mode {mode!r} (expected {', '.join(MODES)})")
        for k in [int(v) for v in args.speculative.split(",")]:
            for b in [int(v) for v in args.batches.split(",")]:
                rows.append(run(cfg, device, b, mode, args.prompt_len, args.new_tokens, tokenizer, k,
                                args.device_step_us, clock))
                print(rows[-1], flush=True)
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "vocab": cfg.vocab_size, "threads": args.threads,
           "tokenizer": args.tokenizer, "rows": rows}
    out = write_results(res, args.json or RESULTS / f"engine_host_{device.type}.json")
    if args.device_step_us:
        print(f"\ndecode steps over a device step of {args.device_step_us:.0f} us ({res['device']}); {out}")
        print(f"{'mode':>8} {'k':>2} {'batch':>5} {'step us':>9} {'over device':>11}")
        for r in rows:
            print(f"{r['mode']:>8} {r['speculative']:>2} {r['batch']:>5} {r['step_us']:>9.0f} "
                  f"{r['over_device_us']:>11.0f}")
        return 0
    print(f"\nengine work per decode step, microseconds (vocabulary {cfg.vocab_size}, {res['device']}, "
          f"{args.threads} thread(s)); {out}")
    cols = PHASES + ("other",)
    print(f"{'mode':>8} {'k':>2} {'batch':>5} " + " ".join(f"{c:>11}" for c in cols)
          + f" {'engine':>8} {'per tok':>8} {'reads':>5}")
    for r in rows:
        print(f"{r['mode']:>8} {r['speculative']:>2} {r['batch']:>5} "
              + " ".join(f"{r['us_per_step'][c]:>11.0f}" for c in cols)
              + f" {r['engine_us_per_step']:>8.0f} {r['engine_us_per_token']:>8.1f} {r['host_reads_per_step']:>5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
