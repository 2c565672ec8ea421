"""MoE prefill tiles timed in interleaved rounds: A / B comparisons that the GPU's power state cannot bias.

``bench/moe.py`` times each prefill variant for ~200 ms after the one before it; at 16k tokens the MXFP8 layer runs
at the H200's software power cap, and the SM clock falls over seconds of back-to-back calls (``docs/performance.md``,
eleventh session: 20.0 ms on the cool GPU, 21.9 once warm). A variant timed later runs on a warmer GPU. Here every
round runs each setting ``--calls`` times back to back (the launcher's default first, then the named ones, in
turn), so each setting sees every power state; the table gives each setting's median call over all rounds and its
median in the first and the last round. Each setting's output is compared with the default's: the same bits
(``same_bits``), or the relative difference.

  python3 bench/moe_prefill_ab.py --variants prefill_ws_bm256_down128_s4c2     # HALF_TAIL off against the default
  python3 bench/moe_prefill_ab.py --tokens 4096,8192,16384 --rounds 8 --calls 6 --variants A,B --json x.json
  python3 bench/moe_prefill_ab.py --smoke      # tiny dims on the CPU under the interpreter: checks the script only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: m3export
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: moe, results_file
import moe as bench_moe  # noqa: E402  (bench/moe.py: the layer, the named tiles, the dims)
from results_file import RESULTS, write_results  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="prefill_ws_bm256_down128_s4c2",
                    help="comma list of bench/moe.py NAMES timed against the launcher's default (default: %(default)s)")
    ap.add_argument("--tokens", default="16384", help="comma list of prefill token counts, each timed in its own "
                    "rounds (default: %(default)s)")
    ap.add_argument("--experts", type=int, default=128, help="routed experts (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds over the settings (default: %(default)s)")
    ap.add_argument("--calls", type=int, default=6, help="back-to-back calls per setting and round (default: "
                    "%(default)s)")
    ap.add_argument("--json", default=str(RESULTS / "moe_prefill_ab_h200.json"), help="(default: %(default)s)")
    ap.add_argument("--smoke", action="store_true", help="tiny dims on the CPU under the Triton interpreter")
    args = ap.parse_args()
    names = [n for n in args.variants.split(",") if n]
    unknown = sorted(set(names) - set(bench_moe.NAMES))
    if unknown:
        ap.error(f"--variants: unknown name(s) {unknown}")
    if args.smoke:
        import os

        os.environ["TRITON_INTERPRET"] = "1"
        bench_moe.H, bench_moe.I, bench_moe.I_SHARED, bench_moe.TOP_K, bench_moe.DEV = 64, 32, 32, 2, "cpu"
        args.tokens, args.experts, args.rounds, args.calls, names = "48", 4, 1, 1, []
    elif not torch.cuda.is_available():
        print("bench/moe_prefill_ab.py needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    from m3export.plugins.kernels import moe as kmoe

    H, I, I_SHARED, TOP_K, dev = bench_moe.H, bench_moe.I, bench_moe.I_SHARED, bench_moe.TOP_K, bench_moe.DEV
    layer = bench_moe.Layer(args.experts, ["mxfp8"])
    attrs = (TOP_K, bench_moe.SCALING, bench_moe.ALPHA, bench_moe.LIMIT)
    settings = {"default": None, **{n: bench_moe.NAMES[n] for n in names}}
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke)", "torch": torch.__version__,
           "experts": args.experts, "rounds": args.rounds, "calls": args.calls, "rows": []}
    for tokens in [int(t) for t in args.tokens.split(",") if t]:
        res["rows"].append(time_settings(kmoe, layer, attrs, settings, tokens, args, dev, (H, I, I_SHARED, TOP_K)))
        write_results(res, args.json)  # after every row: a run cut by its time limit keeps what it measured
    print(write_results(res, args.json))
    return 0


def time_settings(kmoe, layer, attrs, settings: dict, tokens: int, args, dev: str, dims: tuple) -> dict:
    """One token count: each setting's output against the default's, then the interleaved rounds; the row."""
    H, I, I_SHARED, TOP_K = dims
    x = torch.randn(tokens, H, device=dev, generator=torch.Generator(device=dev).manual_seed(1)).bfloat16()
    a = layer.args("mxfp8", x)

    def run(config):
        return kmoe.run_moe(a[0], a[1], a[2], a[3], a[5], a[7], a[9], *attrs, scales=(a[4], a[6], a[8], a[10]),
                            config=config)

    flops = 2 * tokens * (TOP_K * 3 * H * I + 3 * H * I_SHARED + H * args.experts)
    base = run(None)
    row = {"tokens": tokens, "flops": flops,
           "default_config": kmoe.default_config(tokens, tokens * TOP_K, args.experts, True), "settings": {}}
    for name, cfg in settings.items():
        out = run(cfg)  # compiles; its output against the default's
        diff = float((out.float() - base.float()).norm() / base.float().norm().clamp_min(1e-30))
        row["settings"][name] = dict(config=cfg, same_bits=bool(torch.equal(out, base)), rel_diff=diff, rounds=[])
    t0 = time.time()
    for r in range(args.rounds):
        for name, cfg in settings.items():
            times = []
            for _ in range(args.calls):
                if dev == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    run(cfg)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                else:
                    t = time.perf_counter()
                    run(cfg)
                    times.append((time.perf_counter() - t) * 1e3)
            row["settings"][name]["rounds"].append(times)
        print(f"{tokens} tokens: round {r + 1}/{args.rounds} done ({time.time() - t0:.0f} s)", flush=True)
    print(f"\nMoE prefill, {tokens} tokens, {args.experts} experts, MXFP8; {args.rounds} rounds x {args.calls} "
          f"calls per setting, interleaved")
    print(f"{'setting':48} {'median ms':>9} {'TFLOP/s':>8} {'first rnd':>9} {'last rnd':>9} {'same bits':>9} "
          f"{'rel diff':>8}")
    for name, s in row["settings"].items():
        every = [t for rnd in s["rounds"] for t in rnd]
        s["median_ms"] = statistics.median(every)
        s["tflops"] = flops / (s["median_ms"] * 1e-3) / 1e12
        s["first_round_ms"] = statistics.median(s["rounds"][0])
        s["last_round_ms"] = statistics.median(s["rounds"][-1])
        print(f"{name:48} {s['median_ms']:>9.2f} {s['tflops']:>8.0f} {s['first_round_ms']:>9.2f} "
              f"{s['last_round_ms']:>9.2f} {str(s['same_bits']):>9} {s['rel_diff']:>8.1e}")
    return row


if __name__ == "__main__":
    sys.exit(main())
