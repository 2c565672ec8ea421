"""``m3export triton-repo``: write a Triton Inference Server model repository that serves M3 with our runtime."""

from __future__ import annotations

import argparse

from ..plugins.onnxruntime.providers import add_argument as add_provider_argument
from ..sources import BACKENDS, default_backend
from .arguments import add_kv_cache_dtype_argument, provider_engine_arg

NAME = "triton-repo"
HELP = ("Write a Triton model repository (Python backend, decoupled/streaming, vLLM-style inputs) that runs "
        "an artifact, a checkpoint or a preset with the m3export runtime.")
EXAMPLES = """\
  m3export triton-repo --out repo                               # the embedded trained checkpoint, torch backend
  m3export triton-repo tiny --out repo                          # random-weight preset, torch backend
  m3export triton-repo out/m3-artifact --out repo --backend onnxruntime --instances 2
  m3export triton-repo out/m3-artifact --out repo --backend onnxruntime --provider cuda
  m3export triton-repo ckpt/tiny --out repo --name m3-tiny --copy --engine-arg max_model_len=2048
  python -m m3export.serve.server repo                          # then serve it (HTTP 8000, gRPC 8001)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", metavar="ARTIFACT", nargs="?",
                   help="exported artifact directory, or (torch backend) a checkpoint directory or preset name; "
                        "default: the embedded trained checkpoint (m3export.embedded)")
    p.add_argument("--out", required=True, metavar="REPO", help="model repository directory (created if missing)")
    p.add_argument("--backend", default=None, choices=BACKENDS,
                   help="runtime backend the engine uses (default: onnxruntime for an exported artifact, whose ONNX "
                        "graphs it runs, unless --engine-arg device names a GPU; torch for checkpoints and presets)")
    p.add_argument("--instances", type=int, default=1, metavar="N",
                   help="model instances, each with its own engine (default: %(default)s)")
    p.add_argument("--name", default="m3", help="model name in Triton (default: %(default)s)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--link", dest="copy", action="store_false",
                       help="reference ARTIFACT by its absolute path in config.pbtxt (default)")
    where.add_argument("--copy", dest="copy", action="store_true",
                       help="copy ARTIFACT into the repository (REPO/NAME/1/...), so the repository stands alone")
    p.set_defaults(copy=False)
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="engine keyword argument, VALUE as JSON (e.g. max_model_len=8192, device=\"cuda\"); repeatable")
    add_kv_cache_dtype_argument(p, default=None)
    p.add_argument("--force", action="store_true", help="replace REPO/NAME if it exists")
    add_provider_argument(p, default=None)


def run(args: argparse.Namespace) -> int:
    from ..serve.repo import parse_engine_args, write_repository

    if args.artifact is None:
        from ..embedded import default_model

        args.artifact = str(default_model())

    engine_args = parse_engine_args(args.engine_arg)
    if args.kv_cache_dtype is not None:
        engine_args["kv_cache_dtype"] = args.kv_cache_dtype
    if args.backend is None:  # what the source was built for; the onnxruntime backend runs on the CPU only
        cpu = str(engine_args.get("device", "cpu")) == "cpu"
        args.backend = default_backend(args.artifact) if cpu or args.provider is not None else "torch"
    provider = provider_engine_arg(args.provider, args.backend)  # checked here, not in Triton's log
    if provider is not None:
        engine_args["provider"] = provider
    model_dir = write_repository(
        args.artifact, args.out, backend=args.backend, instances=args.instances, name=args.name, copy=args.copy,
        engine_args=engine_args, force=args.force,
    )
    print(f"wrote Triton model '{args.name}' ({args.backend} backend, {args.instances} instance(s)) to {model_dir}")
    print(f"serve it: python -m m3export.serve.server {model_dir.parent}")
    return 0
