"""Vision encoder throughput (patches/s): the release's tower (32 layers, 1280 wide, 16 heads) + projector into the
6144-wide text embedding, random weights, one image per call (as the runtime and ``vision.onnx`` run it).

For each image grid it times ``VisionEncoder(pixel_values, position_ids)`` (median of ``--reps`` after one warm-up)
and reports patches/s, text tokens/s (patches / 4) and the achieved GFLOP/s (matmul FLOPs of the tower, attention
and projector; LayerNorm, GELU and softmax are not counted).

  python bench/vision_encoder.py                                      # CPU, fp32: table + bench/results/vision_encoder_cpu.json
  python bench/vision_encoder.py --device cuda --dtype bfloat16       # the H200: bench/results/vision_encoder_cuda.json
  python bench/vision_encoder.py --layers 2 --grids 8x8,2x8x8 --dtype bfloat16   # quick script check (CPU)

Grids are ``HxW`` (an image) or ``TxHxW`` (a video chunk of T temporal patches, one attention segment). On CUDA the
default grids reach 64 x 64 patches (an 896 x 896 image, 4096 patches) and a 4-temporal-patch 32 x 32 video chunk.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import RESULTS, write_results  # noqa: E402  (bench/results_file.py)

from m3export.config import VisionConfig  # noqa: E402
from m3export.model.media import VisionEncoder  # noqa: E402
from m3export.model.projector import MultiModalProjector  # noqa: E402
from m3export.model.vision import VisionTower, vision_position_ids  # noqa: E402

TEXT_HIDDEN = 6144  # the release's text width (the projector's output)


def build(cfg: VisionConfig, device: str, dtype: torch.dtype) -> VisionEncoder:
    with torch.device("meta"):
        enc = VisionEncoder(VisionTower(cfg), MultiModalProjector(cfg, TEXT_HIDDEN))
    enc.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in enc.named_parameters():
            if "norm" in name:  # LayerNorm: weight one, bias zero
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                fan_in = p[0].numel() if p.dim() > 1 else 1
                p.normal_(0.0, fan_in**-0.5, generator=g)
    return enc.to(dtype).eval()


def flops(cfg: VisionConfig, n: int) -> float:
    """Matmul FLOPs of one item of ``n`` patches."""
    d, i, p = cfg.hidden_size, cfg.intermediate_size, cfg.projector_hidden_size
    per_layer = 2 * n * (4 * d * d + 2 * d * i) + 2 * 2 * n * n * d  # q k v o, fc1 fc2; QK^T and PV
    embed = 2 * n * cfg.patch_dim * d
    projector = 2 * n * (d * p + p * TEXT_HIDDEN) + 2 * (n // cfg.merge_unit) * (TEXT_HIDDEN * cfg.merge_unit * p
                                                                               + p * TEXT_HIDDEN)
    return cfg.num_hidden_layers * per_layer + embed + projector


def timed(fn, device: str, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--layers", type=int, default=VisionConfig.num_hidden_layers)
    ap.add_argument("--grids", default=None, help="patch grids HxW (image) or TxHxW (video chunk), comma separated "
                    "(default: 16x16,32x32 on CPU; 16x16,32x32,64x64,4x32x32 on CUDA)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs per grid, median reported (default: 2 on CPU, "
                    "10 on CUDA)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible to torch")
    cuda = args.device == "cuda"
    grids = args.grids or ("16x16,32x32,64x64,4x32x32" if cuda else "16x16,32x32")
    reps = args.reps or (10 if cuda else 2)
    cfg = VisionConfig(num_hidden_layers=args.layers)
    dtype = getattr(torch, args.dtype)
    enc = build(cfg, args.device, dtype)
    rows = []
    for spec in grids.split(","):
        dims = [int(x) for x in spec.split("x")]
        if len(dims) not in (2, 3) or min(dims) < 1 or any(d % cfg.spatial_merge_size for d in dims[-2:]):
            raise SystemExit(f"--grids: {spec!r} is not HxW or TxHxW with H and W multiples of "
                             f"{cfg.spatial_merge_size}")
        t, h, w = dims if len(dims) == 3 else [1, *dims]
        pos = vision_position_ids(t, h, w, cfg.spatial_merge_size, args.device)
        pixels = torch.randn(t * h * w, cfg.patch_dim, device=args.device)
        with torch.inference_mode():
            sec = timed(lambda: enc(pixels, pos), args.device, reps)
        n = t * h * w
        rows.append({"grid": [t, h, w], "image_px": [h * cfg.patch_size, w * cfg.patch_size], "patches": n,
                     "tokens": n // cfg.merge_unit, "seconds": sec, "patches_per_s": n / sec,
                     "tokens_per_s": n / cfg.merge_unit / sec, "gflop_per_s": flops(cfg, n) / sec / 1e9})
    print(f"vision encoder, {cfg.num_hidden_layers} layers x {cfg.hidden_size} wide, projector -> {TEXT_HIDDEN}, "
          f"{args.device} {args.dtype}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}")
    print(f"{'grid':>10s} {'image px':>11s} {'patches':>8s} {'seconds':>9s} {'patches/s':>10s} {'tokens/s':>9s} "
          f"{'GFLOP/s':>8s}")
    for r in rows:
        print(f"{'x'.join(map(str, r['grid'][1:] if r['grid'][0] == 1 else r['grid'])):>10s} {'x'.join(map(str, r['image_px'])):>11s} {r['patches']:8d} "
              f"{r['seconds']:9.3f} {r['patches_per_s']:10.1f} {r['tokens_per_s']:9.1f} {r['gflop_per_s']:8.1f}")
    out = args.out or RESULTS / f"vision_encoder_{args.device}.json"
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    # The CPU machine is shared: the load average says how much of it the run had.
    write_results({"device": device_name, "dtype": args.dtype, "threads": torch.get_num_threads(),
                   "load_average_1m": os.getloadavg()[0],
                   "torch": torch.__version__, "layers": cfg.num_hidden_layers, "reps": reps,
                   "rows": rows}, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
