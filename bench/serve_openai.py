"""What the OpenAI-compatible HTTP layer costs: the same requests through ``m3export serve`` (real HTTP on
127.0.0.1, streamed with the official client) and straight into the engine, tiny model, CPU, one thread.

Both runs generate the same number of tokens (greedy, EOS ignored) from the same prompts with all requests in
flight at once, so the engine batches them the same way; the table reports decode throughput of each and the
server's time to first token and time per output token as clients see them. The clients run in a process of
their own, so their parsing does not compete with the server for the interpreter.

  python bench/serve_openai.py                         # 16 concurrent streams of 48 tokens
  python bench/serve_openai.py --clients 32 --new-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import write_results  # noqa: E402  (bench/results_file.py)


async def _clients(url: str, model: str, prompts: list[str], new: int) -> list[tuple[float, float, int]]:
    """Per client: (time to first token, mean time per later token, tokens), all streamed at once."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)

    async def one(prompt: str):
        start = time.perf_counter()
        first = last = None
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=new, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        tokens = 0
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            elif chunk.choices:  # text, or the final chunk (tokens that are no text alone are not sent)
                first = first or now
                last = now
        return first - start, (last - first) / max(1, tokens - 1), tokens

    return await asyncio.gather(*(one(p) for p in prompts))


def _client_process(url: str, model: str, prompts: list[str], new: int, results) -> None:
    import openai  # noqa: F401 - imported before the clock starts

    start = time.perf_counter()
    per_client = asyncio.run(_clients(url, model, prompts, new))
    results.put((time.perf_counter() - start, per_client))


def _run_clients(url: str, model: str, prompts: list[str], new: int) -> tuple[float, list]:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_client_process, args=(url, model, prompts, new, results))
    proc.start()
    out = results.get(timeout=600)
    proc.join(60)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "serve_openai.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)

    import uvicorn

    from m3export.runtime import Engine, SamplingParams
    from m3export.serve.openai_server import OpenAIServer

    prompts = [f"Request number {i}: tell me a story about the number {i * 7}." for i in range(args.clients)]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)

    engine = Engine.from_checkpoint("tiny")
    engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    direct_s = time.perf_counter() - start
    total = sum(len(o.token_ids) for o in outs)

    server = OpenAIServer(engine, "tiny")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    http = uvicorn.Server(uvicorn.Config(server.app, log_level="warning"))
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not http.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    _run_clients(url, "tiny", prompts[:1], 2)  # warm-up of the HTTP path
    served_s, results = _run_clients(url, "tiny", prompts, args.new_tokens)
    http.should_exit = True
    thread.join(30)
    served_tokens = sum(r[2] for r in results)
    assert served_tokens == total, (served_tokens, total)

    row = {
        "clients": args.clients, "new_tokens": args.new_tokens, "tokens": total,
        "engine_tok_s": total / direct_s, "server_tok_s": served_tokens / served_s,
        "server_over_engine": (served_tokens / served_s) / (total / direct_s),
        "ttft_median_s": statistics.median(r[0] for r in results),
        "ttft_max_s": max(r[0] for r in results),
        "tpot_median_s": statistics.median(r[1] for r in results),
    }
    print(f"{'clients':>8} {'tokens':>7} {'engine tok/s':>13} {'server tok/s':>13} {'ratio':>6} "
          f"{'TTFT med/max s':>15} {'TPOT med ms':>12}")
    print(f"{row['clients']:>8} {row['tokens']:>7} {row['engine_tok_s']:>13.1f} {row['server_tok_s']:>13.1f} "
          f"{row['server_over_engine']:>6.2f} {row['ttft_median_s']:>7.2f}/{row['ttft_max_s']:<7.2f} "
          f"{row['tpot_median_s'] * 1e3:>12.1f}")
    out = write_results({"device": "cpu, 1 thread", "model": "tiny (random weights)", "rows": [row]}, args.json)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
