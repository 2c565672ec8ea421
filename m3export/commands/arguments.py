"""Checks of command-line values that every command shares: bounded integers, devices and prompt text.

Why here and not in each command: a bad value must be one line naming the option before anything is loaded or
allocated (argparse prints ``error: argument --x: ...`` and exits 2), and the bounds are the same wherever an
option appears.
"""

from __future__ import annotations

import argparse

from ..errors import M3Error

#: Largest KV-cache page (tokens): pages are a unit of allocation, far below any sequence length; M3's index
#: blocks are 128 tokens and pages should divide them.
MAX_PAGE_SIZE = 1024


def bounded_int(lo: int | None = None, hi: int | None = None):
    """An argparse ``type`` accepting integers in [lo, hi] (either end open when None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            if hi is None:
                raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
            if lo is None:
                raise argparse.ArgumentTypeError(f"must be <= {hi}, got {value}")
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {value}")
        return value

    parse.__name__ = "integer"  # what argparse names in its own messages
    return parse


def check_device(device: str) -> None:
    """Refuse a torch device string that does not parse, or a CUDA device on a machine without one."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise M3Error(f"--device {device!r} is not a torch device ({e}); use cpu or cuda[:N]") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise M3Error(f"--device {device}: no CUDA device is available here (torch.cuda.is_available() is "
                          "False); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise M3Error(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def check_text(option: str, text: str) -> str:
    """Command-line text must be valid UTF-8 (Python keeps undecodable argv bytes as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start:e.end].encode("utf-8", "surrogateescape")
        raise M3Error(f"{option} is not valid UTF-8 text: byte(s) {bad.hex(' ')} at character {e.start}") from None
    return text


def add_kv_cache_dtype_argument(p: argparse.ArgumentParser, default: str | None = "auto") -> None:
    """``--kv-cache-dtype`` (vLLM's flag), the same on every command that creates an engine."""
    from ..dtypes import KV_CACHE_DTYPES

    p.add_argument("--kv-cache-dtype", default=default, choices=KV_CACHE_DTYPES,
                   help="cache dtype of K/V and index keys: auto = the model dtype (an exported artifact's: the "
                        "cache dtype it was exported with), bf16, or fp8 (E4M3 with one fp32 scale per token and "
                        "head, about 1.9x the tokens per byte). 'export --kv-cache-dtype fp8' writes graphs whose "
                        "pools are uint8 E4M3 codes with fp32 scale pools; the onnxruntime / tensorrt backends run "
                        "an artifact's graphs with the cache dtype they were exported with, the torch backend takes "
                        "any")


def add_step_budget_argument(p: argparse.ArgumentParser) -> None:
    """``--max-num-batched-tokens`` (vLLM's flag), the same on every command that creates an engine; None leaves
    the engine's default, its backend's (``Backend.default_max_num_batched_tokens``)."""
    p.add_argument("--max-num-batched-tokens", type=bounded_int(1), default=None, metavar="N",
                   help="tokens per engine step at most; a longer prompt is prefilled in chunks of N (default: 512; "
                        "the torch backend on a GPU with the Triton kernels takes vLLM's serving defaults: 8192 on "
                        "GPUs of 70 GiB or more other than the A100, 2048 on other GPUs)")


def step_budget_engine_args(args: argparse.Namespace) -> dict:
    """The engine keyword for ``add_step_budget_argument``'s value: none when it was not given."""
    n = args.max_num_batched_tokens
    return {} if n is None else {"max_num_batched_tokens": n}


def add_parallel_arguments(p: argparse.ArgumentParser) -> None:
    """``--tensor-parallel-size`` / ``--expert-parallel`` (vLLM's names and meaning), on every command that creates
    an engine from a checkpoint (``docs/parallel.md``)."""
    p.add_argument("--tensor-parallel-size", "-tp", type=bounded_int(1), default=1, metavar="N",
                   help="run the model split across N processes, one per device (cuda: devices --device's index .. "
                        "+ N - 1, NCCL; cpu: gloo), from a checkpoint or preset on the torch backend (default 1)")
    p.add_argument("--expert-parallel", action="store_true",
                   help="with --tensor-parallel-size N: split the routed experts whole across the N ranks instead "
                        "of splitting every expert's columns (attention stays tensor parallel)")


def check_parallel(args: argparse.Namespace) -> None:
    """The group fits this machine (one clear line before anything loads); a note when --expert-parallel has a
    single rank to split over."""
    import sys

    if args.tensor_parallel_size > 1:
        from ..runtime.distributed import check_world

        check_world(args.tensor_parallel_size, args.device)
    elif args.expert_parallel:
        print("note: --expert-parallel with --tensor-parallel-size 1 changes nothing (one rank holds every expert)",
              file=sys.stderr)


def parallel_engine_args(args: argparse.Namespace) -> dict:
    """The engine keywords of the parallel flags (none for one rank, so every backend accepts the rest)."""
    if args.tensor_parallel_size == 1:
        return {}
    return {"tensor_parallel_size": args.tensor_parallel_size, "expert_parallel": args.expert_parallel}


def check_provider_backend(provider: str | None, backend: str | None) -> None:
    """``--provider`` names an ONNX Runtime execution provider: refused (before anything loads) with another
    backend."""
    if provider is not None and backend != "onnxruntime":
        raise M3Error(f"--provider {provider} is an ONNX Runtime execution provider: add --backend onnxruntime")


def provider_engine_arg(provider: str | None, backend: str | None) -> str | None:
    """``--provider`` checked (``check_provider_backend``, then parsed: a bad name or option fails here, not in a
    server's log) and spelled as the engine's ``provider`` argument takes it; None without the option."""
    check_provider_backend(provider, backend)
    if provider is None:
        return None
    from ..plugins.onnxruntime.providers import parse_provider

    return str(parse_provider(provider))
