"""``m3export serve``: an OpenAI-compatible HTTP server (completions, chat with reasoning and tool calls)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..plugins.onnxruntime.providers import add_argument as add_provider_argument
from .arguments import (add_kv_cache_dtype_argument, add_parallel_arguments, add_step_budget_argument,
                        check_parallel, parallel_engine_args, provider_engine_arg, step_budget_engine_args)

NAME = "serve"
HELP = ("Serve an artifact, checkpoint or preset through an OpenAI-compatible HTTP API (/v1/models, "
        "/v1/completions, /v1/chat/completions with streaming, reasoning_content and tool_calls; /health; "
        "Prometheus /metrics).")
EXAMPLES = """\
  m3export serve --speculative 2                                # the embedded trained checkpoint (small, CPU)
  m3export serve art/m3 --backend onnxruntime                   # http://127.0.0.1:8000/v1
  m3export serve art/mini --backend onnxruntime --provider cuda:enable_cuda_graph=1   # ONNX Runtime on a GPU
  m3export serve ckpt/m3 --port 9000 --served-model-name m3 --speculative 2
  m3export serve tiny --chat-template chat_template.jinja       # random-weight preset; it ships no template
  curl 127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "m3", "messages": [{"role": "user", "content": "Hi"}], "stream": true}'
  python -c "import openai; c = openai.OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='-'); \\
             print(c.completions.create(model='m3', prompt='Hello', max_tokens=8).choices[0].text)"
"""

DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="ARTIFACT_OR_CHECKPOINT", nargs="?",
                   help="exported artifact directory, or (torch backend) a checkpoint directory or preset name; "
                        "default: the embedded trained checkpoint (m3export.embedded)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s; 0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s; 0 picks a free one)")
    p.add_argument("--backend", default="torch", choices=["torch", "onnxruntime", "tensorrt"],
                   help="runtime backend for an artifact (default: %(default)s)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model id clients send (default: the directory's name, or the preset's)")
    p.add_argument("--chat-template", metavar="FILE",
                   help="Jinja chat template (default: the model's chat_template.jinja or tokenizer_config.json)")
    p.add_argument("--reasoning-parser", default="m3", choices=["m3", "none"],
                   help="split <mm:think> reasoning into reasoning_content (default: %(default)s)")
    p.add_argument("--tool-call-parser", default="m3", choices=["m3", "none"],
                   help="parse M3 tool-call markup into tool_calls when a request has tools (default: %(default)s)")
    p.add_argument("--speculative", type=int, default=0, metavar="K",
                   help="draft K tokens per step with the MTP module(s) (default: 0, no speculation)")
    p.add_argument("--max-model-len", type=int, help="longest sequence, prompt + generated (default: what fits)")
    p.add_argument("--num-pages", type=int, help="KV-cache pages (default: 4 x max-model-len)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests in one batch at most (default: %(default)s)")
    add_step_budget_argument(p)
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="torch backend on CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    add_kv_cache_dtype_argument(p)
    add_parallel_arguments(p)
    p.add_argument("--dtype", choices=DTYPES,
                   help="model dtype for the torch backend (default: an artifact's own; a checkpoint's or preset's "
                        "float32 on the CPU, bfloat16 on a GPU)")
    add_provider_argument(p, default=None)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level (default: %(default)s)")


def _model_name(source: str) -> str:
    path = Path(source)
    return path.resolve().name if path.is_dir() else source


def build_server(args: argparse.Namespace):
    """The OpenAIServer for parsed arguments (engine loaded and warmed up); progress goes to stderr."""
    from ..serve.chat_template import ChatTemplate
    from ..serve.openai_server import OpenAIServer
    from ..serve.repo import load_engine, resolve_source
    from ..serve.triton_model import warm_up

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    for module in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            __import__(module)
        except ImportError:
            from ..errors import M3Error

            raise M3Error(f"m3export serve needs the serve extra ({module} is not installed): "
                          "pip install 'm3export[serve]'") from None

    if args.model is None:
        from ..embedded import default_model

        args.model = str(default_model())
    src = resolve_source(args.model, args.backend)
    engine_args = {"num_speculative_tokens": args.speculative, "max_num_seqs": args.max_num_seqs,
                   "device": args.device, **step_budget_engine_args(args)}
    if args.enforce_eager:
        engine_args["enforce_eager"] = True
    if args.kv_cache_dtype != "auto":
        engine_args["kv_cache_dtype"] = args.kv_cache_dtype
    provider = provider_engine_arg(getattr(args, "provider", None), args.backend)  # before the engine loads
    if provider is not None:
        engine_args["provider"] = provider
    check_parallel(args)
    engine_args.update(parallel_engine_args(args))
    for key in ("max_model_len", "num_pages", "dtype"):
        if getattr(args, key) is not None:
            engine_args[key] = getattr(args, key)
    say(f"[1/3] loading {src.kind} {src.location} ({args.backend} backend)")
    t0 = time.perf_counter()
    engine = load_engine({"source_kind": src.kind, "source": src.location, "backend": args.backend,
                          "engine_args": json.dumps(engine_args)}, Path.cwd())
    model_dir = src.location if src.kind != "preset" else None
    if args.chat_template:
        template = ChatTemplate.from_file(args.chat_template, model_dir)
    else:
        template = ChatTemplate.from_model_dir(model_dir) if model_dir else None
    say(f"[2/3] warming up (loaded in {time.perf_counter() - t0:.1f} s; max_model_len {engine.max_model_len}, "
        f"chat template: {template.where if template else 'none (chat requests will be refused)'})")
    warm_up(engine)
    return OpenAIServer(engine, args.served_model_name or _model_name(args.model), chat_template=template,
                        reasoning_parser=args.reasoning_parser == "m3",
                        tool_call_parser=args.tool_call_parser == "m3")


def run(args: argparse.Namespace) -> int:
    import socket

    import uvicorn

    server = build_server(args)
    # Bind and listen first, so the URL printed is the one listening (also with --port 0) before uvicorn takes over.
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        sock.close()
        from ..errors import M3Error

        raise M3Error(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    # Listen before printing: a client that reads the URL and connects at once is queued in the backlog until
    # uvicorn accepts, never refused (a bound socket that is not yet listening refuses connections).
    sock.listen(2048)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    print(f"[3/3] serving '{server.model_name}' at http://{shown}:{port}/v1 (Ctrl-C stops)", file=sys.stderr,
          flush=True)
    # Ctrl-C lets responses in flight finish for a few seconds, then cancels them (their requests are aborted).
    config = uvicorn.Config(server.app, log_level=args.log_level, timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        server.engine.close()  # worker processes stop, ONNX Runtime sessions close with the server
    return 0
