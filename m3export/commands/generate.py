"""``m3export generate``: stream a completion from an artifact, checkpoint or preset through the paged runtime."""

from __future__ import annotations

import argparse
import sys

from ..dtypes import MODEL_DTYPES
from ..plugins.onnxruntime.providers import add_argument as add_provider_argument
from ..sources import ARTIFACT, BACKENDS, PRESET, default_backend, source_kind
from .arguments import (add_kv_cache_dtype_argument, add_parallel_arguments, add_step_budget_argument, bounded_int,
                        check_device, check_parallel, check_text, parallel_engine_args, provider_engine_arg,
                        step_budget_engine_args)
from .synth import has_random_weights

NAME = "generate"
HELP = ("Generate from an exported artifact (torch / onnxruntime / tensorrt backend), or from a checkpoint "
        "directory or preset (torch backend); text streams to stdout, throughput to stderr.")
EXAMPLES = """\
  m3export generate --prompt "def parse_args(argv):" --max-tokens 48 --temperature 0   # embedded trained model
  m3export generate art/tiny --prompt "Once upon a time" --backend onnxruntime --max-tokens 32
  m3export generate art/mini --prompt "Hello" --backend onnxruntime --provider cuda:device_id=0
  m3export generate art/mini-ort --prompt "Hello" --backend onnxruntime --provider cuda:enable_cuda_graph=1
      # (exported with --flavour ort-contrib: its verified ONNX Runtime CUDA kernels run, decode steps replayed)
  m3export generate art/tiny --prompt "Hello" --speculative 2 --temperature 0.8 --top-p 0.9 --seed 0
  m3export generate tiny --prompt-ids 1,2,3 --temperature 0        # preset, random weights, token ids out
  m3export generate ckpt/m3 --prompt "Hello" --device cuda --tensor-parallel-size 2 --expert-parallel
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", metavar="ARTIFACT", nargs="?",
                   help="artifact directory (has manifest.json), checkpoint directory, or preset name (random "
                        "weights); default: the embedded trained checkpoint (m3export.embedded)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs a tokenizer: tokenizer.json or the tiny preset)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    p.add_argument("--backend", default=None, choices=BACKENDS,
                   help="runtime backend (default: onnxruntime for an exported artifact, whose ONNX graphs it runs, "
                        "torch with a --device other than cpu; torch for checkpoints and presets)")
    p.add_argument("--speculative", type=bounded_int(0), default=0, metavar="K",
                   help="draft K tokens per step with the MTP module(s) (0: no speculation)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the most likely tokens whose probabilities add up to P (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=bounded_int(0, 2**64 - 1), default=None,
                   help="random seed, 0 .. 2^64 - 1 (default: a fresh one each run)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, ...)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="torch backend on CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    add_provider_argument(p, default=None)
    add_kv_cache_dtype_argument(p)
    add_parallel_arguments(p)
    p.add_argument("--dtype", choices=MODEL_DTYPES,
                   help="model dtype for the torch backend (default: an artifact's own; a checkpoint's or preset's "
                        "float32 on the CPU, bfloat16 on a GPU)")
    p.add_argument("--num-pages", type=bounded_int(1), help="KV-cache pages to allocate (default: 4 x max-model-len)")
    p.add_argument("--max-model-len", type=bounded_int(2),
                   help="longest sequence (prompt + generated) to allow (default: min(4096, the model's limit))")
    add_step_budget_argument(p)


def _engine(args: argparse.Namespace):
    from ..dtypes import BY_NAME
    from ..errors import M3Error
    from ..runtime import Engine

    if args.artifact is None:
        from ..embedded import default_model

        args.artifact = str(default_model())
    if source_kind(args.artifact) == PRESET:
        print(f"note: preset {args.artifact!r} has random weights, so its output is meaningless by design; leave "
              "ARTIFACT out to generate with the embedded trained model", file=sys.stderr)
    elif has_random_weights(args.artifact):
        print(f"note: {args.artifact} holds random weights (m3export synth, or exported from it or a preset), so its "
              "output is meaningless by design; leave ARTIFACT out to generate with the embedded trained model",
              file=sys.stderr)

    if args.backend is None:  # what the source was built for; the onnxruntime backend runs on the CPU only
        args.backend = default_backend(args.artifact) if str(args.device) == "cpu" else "torch"
    dtype = BY_NAME[args.dtype].torch if args.dtype else None
    sizing = {"num_pages": args.num_pages, "max_model_len": args.max_model_len,
              "num_speculative_tokens": args.speculative, "enforce_eager": args.enforce_eager,
              "kv_cache_dtype": args.kv_cache_dtype, **parallel_engine_args(args), **step_budget_engine_args(args)}
    provider = provider_engine_arg(args.provider, args.backend)  # a bad name or option fails before any load
    if source_kind(args.artifact) == ARTIFACT:
        return Engine.from_artifact(args.artifact, backend=args.backend, device=args.device, dtype=dtype,
                                    provider=provider, **sizing)
    if args.backend != "torch":
        raise M3Error(f"{args.artifact} is not an exported artifact (no manifest.json): checkpoints and presets run "
                      f"on the torch backend; export it first (m3export export) to use {args.backend}")
    return Engine.from_checkpoint(args.artifact, device=args.device, dtype=dtype, **sizing)


def run(args: argparse.Namespace) -> int:
    from ..runtime import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
        prompt = args.prompt if args.prompt is not None else [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.prompt is not None:
        check_text("--prompt", args.prompt)
    check_device(args.device)
    check_parallel(args)
    try:
        engine = _engine(args)
    except ValueError as e:  # the engine's own checks of its sizes (pool, length limit, speculation)
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = weights_report(engine, args.artifact)
    if report:
        print(report, file=sys.stderr)
    try:
        return _generate(args, engine, prompt, params)
    finally:
        engine.close()  # worker processes stop, ONNX Runtime sessions close (before CUDA shuts down at exit)


def weights_report(engine, source) -> str | None:
    """What the torch backend's model holds, by dtype, against the source's safetensors bytes: an MXFP8
    checkpoint's experts stay E4M3 values + UE8M0 scales where the model runs (about the checkpoint's bytes, not
    the 2x of a bf16 copy). None for backends that hold no torch model (ONNX Runtime, TensorRT, parallel ranks)."""
    from pathlib import Path

    model = getattr(engine.backend, "model", None)
    if model is None:
        return None
    by_dtype, seen, device = {}, set(), None
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "meta" or (t.data_ptr(), t.dtype) in seen:
            continue
        seen.add((t.data_ptr(), t.dtype))
        device = device or t.device
        name = str(t.dtype).removeprefix("torch.")
        by_dtype[name] = by_dtype.get(name, 0) + t.numel() * t.element_size()
    total = sum(by_dtype.values())
    parts = ", ".join(f"{name} {_size(n)}" for name, n in sorted(by_dtype.items(), key=lambda kv: -kv[1]))
    line = f"weights: {_size(total)} resident on {device} ({parts})"
    src = Path(str(source))
    files = sorted(src.glob("*.safetensors")) if src.is_dir() else []
    if files:
        line += f"; the source's safetensors: {_size(sum(f.stat().st_size for f in files))}"
    return line


def _size(n: int) -> str:
    """Bytes in decimal units, three significant digits at least."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n} B"


def _generate(args: argparse.Namespace, engine, prompt, params) -> int:
    if isinstance(prompt, str) and engine.tokenizer is None:
        print(f"error: {args.artifact} has no tokenizer.json: pass --prompt-ids instead of --prompt", file=sys.stderr)
        return 2
    try:
        for out in engine.stream(prompt, params):
            if engine.tokenizer is not None:
                sys.stdout.write(out.new_text)
            elif out.new_token_ids:
                sys.stdout.write(" ".join(map(str, out.new_token_ids)) + " ")
            sys.stdout.flush()
    except ValueError as e:  # the prompt was rejected (empty, too long, bad ids)
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write("\n")
    graphs = getattr(engine.backend, "graphs_description", None)  # the onnxruntime backend: which graphs ran
    print(engine.stats.summary() + f" [backend {engine.backend.name}, finish: {out.finish_reason}"
          + (f", {graphs}" if graphs else "") + "]", file=sys.stderr)
    return 0
