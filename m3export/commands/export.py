"""``m3export export``: a checkpoint or preset -> an artifact directory for every backend."""

from __future__ import annotations

import argparse

from ..dtypes import MODEL_DTYPES
from .arguments import MAX_PAGE_SIZE, add_kv_cache_dtype_argument, bounded_int

NAME = "export"
HELP = ("Export M3 to an artifact: ONNX graphs (m3 custom nodes + ONNX function bodies, paged caches), "
        "weights as external data, manifest.json, tokenizer.")
EXAMPLES = """\
  m3export export --out art/code-tiny                          # the embedded trained checkpoint (m3export.embedded)
  m3export export --preset tiny --out art/tiny
  m3export export --checkpoint ckpt/tiny --out art/tiny-mx --weights mxfp8 --page-size 8
  m3export export --checkpoint ckpt/tiny --out art/tiny --force      # replace an existing artifact
  m3export export --checkpoint /data/MiniMax-M3-MXFP8 --in-place --dtype bfloat16   # zero copy, full size
  m3export export --preset tiny --out art/tiny-split --split-layers 2                 # + model.part{0,1}.onnx
  m3export export --preset tiny --out art/tiny-fp8 --kv-cache-dtype fp8   # E4M3 cache: uint8 codes + fp32 scales
  m3export export --preset mini --dtype bfloat16 --out art/mini --flavour ort-contrib \
      --lower MoE,MXFP8Linear,PagedAttention          # + <graph>.ort.onnx for ONNX Runtime's CUDA kernels
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", metavar="DIR",
                     help="checkpoint directory (config.json + safetensors); default: the embedded trained checkpoint")
    src.add_argument("--preset", choices=["tiny", "mini"], help="random-weight preset instead of a checkpoint")
    p.add_argument("--out", metavar="DIR",
                   help="artifact directory to create, parents included (not with --in-place)")
    p.add_argument("--dtype", default="auto", choices=["auto", *MODEL_DTYPES],
                   help="activation / weight dtype of the graphs. Default auto: with --in-place the checkpoint's own "
                        "dtype (only tensors in another dtype are converted and written), otherwise float32 (ONNX "
                        "Runtime's CPU EP runs float32 and float16, not bfloat16)")
    p.add_argument("--weights", choices=["mxfp8", "bf16"], default=None,
                   help="mxfp8: E4M3 + UE8M0 weights (MXFP8Linear / MoEMXFP8 nodes); bf16: unquantised weights "
                        "in --dtype. Default: whatever the source holds")
    p.add_argument("--page-size", type=bounded_int(1, MAX_PAGE_SIZE), default=16, metavar="N",
                   help=f"tokens per KV-cache page, 1 .. {MAX_PAGE_SIZE} (static in the graphs; recorded in the "
                        "manifest; default %(default)s)")
    p.add_argument("--force", action="store_true",
                   help="replace --out if it already holds files (never the source, a directory holding it or the "
                        "current directory); with --in-place, replace the files of an earlier export (never a "
                        "file of the checkpoint)")
    p.add_argument("--split-layers", type=int, metavar="N",
                   help="also write the model as parts of N layers each (model.part{j}.onnx) for builders that "
                        "cannot take the whole graph; the manifest's 'parts' says how they chain")
    p.add_argument("--flavour", choices=["tensorrt", "ort-contrib"], default=None,
                   help="also write each graph's TensorRT flavour (<graph>.trt.onnx: m3 nodes as m3 plugin nodes "
                        "for TensorRT's ONNX parser; 'm3export build' uses it) or its ONNX Runtime contrib-op flavour "
                        "(<graph>.ort.onnx: MoE and 16-bit MXFP8Linear lowered to com.microsoft kernels; the MoE "
                        "lowering matched the torch backend on an H200, MXFP8Linear is unverified on GPU); recorded "
                        "in the manifest's 'flavours' with that status")
    p.add_argument("--lower", metavar="OP[,OP...]", type=lambda text: tuple(filter(None, text.split(","))),
                   help="with --flavour ort-contrib: the m3 ops to lower (MoE, MXFP8Linear, PagedAttention, "
                        "PagedAttentionCore, DecodeAttention; default MoE,MXFP8Linear,PagedAttentionCore,"
                        "DecodeAttention). PagedAttentionCore (matched the torch backend on an H200; not with "
                        "PagedAttention): the dense layers' cache writes and attention as com.microsoft.PagedAttention "
                        "on 16-bit pools, the graph's own QK norm and RoPE feeding it; in the decode graphs with "
                        "one-token bounds, so ONNX Runtime reads K / V in place (cuDNN paged attention). "
                        "DecodeAttention (matched too): in the lowered decode graphs, the dense nodes still there as "
                        "the standard ONNX Attention-24 op on gathered 16-bit rows. PagedAttention (dense layers -> "
                        "com.microsoft.PagedAttention doing the QK norm, RoPE and cache write too) is opt-in and "
                        "rejected: its norm gain (1 + w) is rounded to the activation dtype")
    add_kv_cache_dtype_argument(p)
    p.add_argument("--tensor-parallel-size", "-tp", type=bounded_int(1), default=1, metavar="N",
                   help="N >= 2: a per-rank artifact instead (rank{r}.safetensors with only the rank's slices, its "
                        "graphs cut at every all-reduce / all-gather, which the runtime performs between them; "
                        "manifest.json lists ranks, slices and collectives; docs/parallel.md). Floating-point "
                        "weights; not with --in-place, --split-layers, --flavour or --expert-parallel")
    p.add_argument("--expert-parallel", action="store_true",
                   help="refused with --tensor-parallel-size: the expert-parallel MoE block is not exported per rank")
    p.add_argument("--in-place", action="store_true",
                   help="zero copy: write the graphs and manifest into the --checkpoint directory itself, referencing "
                        "the shards' bytes (ONNX Runtime only reads external data inside the model's directory); "
                        "existing files are never modified")


def run(args: argparse.Namespace) -> int:
    import time

    from ..errors import ArtifactError

    if args.in_place == bool(args.out) or (args.in_place and not args.checkpoint):
        raise ArtifactError("give exactly one of --out DIR or --in-place (which needs --checkpoint)")
    if not args.checkpoint and not args.preset:
        from ..embedded import default_model

        args.checkpoint = str(default_model())

    from ..export.exporter import export_artifact

    start = time.perf_counter()
    if args.tensor_parallel_size > 1 or args.expert_parallel:
        return _export_ranks(args, start)
    out = export_artifact(args.checkpoint or args.preset, args.out, dtype=args.dtype, weights=args.weights,
                          page_size=args.page_size, force=args.force, in_place=args.in_place,
                          split_layers=args.split_layers, flavour=args.flavour, lower=args.lower,
                          kv_cache_dtype=args.kv_cache_dtype)
    print(f"wrote artifact {out} in {time.perf_counter() - start:.1f} s")
    return 0


def _export_ranks(args: argparse.Namespace, start: float) -> int:
    """``--tensor-parallel-size N``: the per-rank artifact (``m3export/export/rank_export.py``)."""
    import time

    from ..dtypes import BY_NAME
    from ..errors import ArtifactError
    from ..export.rank_export import export_rank_artifact

    clash = [flag for flag, on in (("--in-place", args.in_place), ("--split-layers", args.split_layers),
                                   ("--flavour", args.flavour), ("--weights mxfp8", args.weights == "mxfp8"),
                                   (f"--kv-cache-dtype {args.kv_cache_dtype}", args.kv_cache_dtype != "auto")) if on]
    if clash:
        raise ArtifactError(f"--tensor-parallel-size writes a per-rank artifact: not with {', '.join(clash)}")
    dtype = BY_NAME["float32" if args.dtype == "auto" else args.dtype].torch
    out = export_rank_artifact(args.checkpoint or args.preset, args.out, args.tensor_parallel_size,
                               args.expert_parallel, dtype=dtype, page_size=args.page_size, force=args.force,
                               progress=True)
    print(f"wrote per-rank artifact {out} ({args.tensor_parallel_size} ranks) in {time.perf_counter() - start:.1f} s")
    return 0
