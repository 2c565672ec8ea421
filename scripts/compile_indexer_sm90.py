"""Compile the lightning indexer's launches for sm_90 (H100 / H200) on a machine without a GPU; print what they became.

The interpreter checks what the indexer computes, not what the device runs. This captures the launch that
``lightning_indexer.scan`` / ``block_topk`` make at M3's dims (4 index heads of 128, blocks and pages of 128 keys,
top-16) for one decode token at a given context, compiles it with Triton's own JIT specialisation and ptxas for
sm_90, and prints per setting: shared memory, registers, spills, the SASS instruction count and its most frequent
opcodes (conversions ``F2F`` / ``F2FP`` run at a quarter of the integer rate on sm_90), and whether the dot became
warpgroup MMAs (``HGMMA``) or ``HMMA``. Nothing is timed: it says where to look, the H200 says how fast.

  python scripts/compile_indexer_sm90.py                         # scan and top-k, bf16 and FP8 keys, defaults
  python scripts/compile_indexer_sm90.py --keys fp8 --scan-variants tma-host-n128-w4-s10-waves1-max1024
  python scripts/compile_indexer_sm90.py --part topk --topk-variants bitonic-w4 --context 131072
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_moe_kernels_sm90 import resources, sass  # noqa: E402  (one owner of the cubin readers)

from m3export.plugins.kernels import lightning_indexer as LI  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
HEADS, DIM, BLOCK, PAGE, TOPK, LOCAL, INIT = 4, 128, 128, 128, 16, 1, 0
SASS_OP = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


class _Launched(Exception):
    pass


def capture(module, kernel_name: str, call, quiet: tuple = ()) -> dict:
    """The launch ``call`` makes of ``module.<kernel_name>``, captured instead of run: {"fn", "args", "kwargs",
    "grid"}. ``quiet``: (module, name) pairs of other kernels launched before it, replaced by launches that do
    nothing (their outputs are only passed on to the captured one). The tests' sm_90 checks use it too
    (``tests/test_kernels_attention_shared_memory.py``)."""
    got = {}

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                got.update(args=args, kwargs=kwargs, grid=grid)
                raise _Launched

            return launch

    class Nothing:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    saved = [(module, kernel_name, getattr(module, kernel_name))] + [(m, n, getattr(m, n)) for m, n in quiet]
    setattr(module, kernel_name, Recorder())
    for m, n in quiet:
        setattr(m, n, Nothing())
    try:
        call()
    except _Launched:
        pass
    finally:
        for m, n, kernel in saved:
            setattr(m, n, kernel)
    return dict(got, fn=saved[0][2])


def compile_launch(launch: dict) -> dict:
    """A captured launch compiled for sm_90 by Triton's own JIT specialisation (argument alignment, strides equal
    to 1 as constants) and ptxas, without a GPU (Triton's compiler: no TRITON_INTERPRET in this process); a
    kernel's ``INTERPRETED`` flag is set to False (captured on CPU tensors: the device's code path). Resources and
    the SASS opcode counts."""
    fn = launch["fn"]
    backend = make_backend(TARGET)
    kwargs = dict(launch["kwargs"], INTERPRETED=False) if "INTERPRETED" in fn.arg_names else dict(launch["kwargs"])
    bound, spec, options = create_function_from_signature(fn.signature, fn.params, backend)(*launch["args"], **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    k = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    ops = collections.Counter(SASS_OP.findall(sass(k.asm["cubin"])))
    return {"grid": list(launch["grid"]), "shared": int(k.metadata.shared), **resources(k.asm["cubin"]),
            "sass_instructions": sum(ops.values()), "conversions": ops["F2F"] + ops["F2FP"],
            "mma": {op: ops[op] for op in ("HGMMA", "HMMA") if ops[op]}, "top": dict(ops.most_common(8))}


def inputs(keys: str, context: int):
    """One decode token at position ``context`` over a block table of the pages it needs (CPU tensors)."""
    pages = -(-(context + 1) // PAGE)
    q = torch.zeros(1, HEADS, DIM, dtype=torch.bfloat16)
    pool = torch.zeros(pages, PAGE, DIM, dtype=torch.float8_e4m3fn if keys == "fp8" else torch.bfloat16)
    scale = torch.ones(pages, PAGE) if keys == "fp8" else None
    table = torch.arange(pages, dtype=torch.int32).view(1, -1)
    return q, pool, table, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([context + 1], dtype=torch.int32), \
        torch.tensor([context]), scale


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["scan", "topk", "both"], default="both", help="(default: %(default)s)")
    ap.add_argument("--keys", choices=["bf16", "fp8", "both"], default="both",
                    help="index-key pool dtype for the scan (default: %(default)s)")
    ap.add_argument("--context", type=int, default=131072, help="the decode token's position (default: %(default)s)")
    ap.add_argument("--sms", type=int, default=132, help="multiprocessors the split count is sized for "
                    "(default: %(default)s, the H200's)")
    ap.add_argument("--scan-variants", default="", help="comma-separated lightning_indexer.VARIANTS['scan'] names "
                    "compiled beside the defaults (default: none)")
    ap.add_argument("--topk-variants", default="", help="the same for VARIANTS['topk'] (default: none)")
    ap.add_argument("--json", default="", help="also write the rows to this file (default: none)")
    args = ap.parse_args(argv)
    from m3export.plugins.kernels import _batch

    _batch.num_sms = lambda device: args.sms  # CPU tensors: size the launch as the H200 would
    LI.num_sms = _batch.num_sms
    rows = []
    for part in (("scan", "topk") if args.part == "both" else (args.part,)):
        names = [n for n in (args.scan_variants if part == "scan" else args.topk_variants).split(",") if n]
        unknown = set(names) - set(LI.VARIANTS[part])
        if unknown:
            raise SystemExit(f"compile_indexer_sm90: unknown {part} variants {sorted(unknown)}")
        for keys in (("bf16", "fp8") if args.keys == "both" and part == "scan" else
                     (("bf16",) if part == "topk" else (args.keys,))):
            q, pool, table, qsl, lens, pos, scale = inputs(keys, args.context)
            for name in ["default", *names]:
                config = None if name == "default" else {part: LI.VARIANTS[part][name]}
                if part == "scan":
                    launch = capture(LI, "_index_scan", lambda: LI.scan(q, pool, table, qsl, lens, pos, BLOCK, scale,
                                                                    config=config))
                else:
                    scores = torch.zeros(1, HEADS, table.shape[1] * PAGE // BLOCK)
                    launch = capture(LI, "_block_topk", lambda: LI.block_topk(scores, pos, BLOCK, TOPK, LOCAL, INIT,
                                                                          config=config))
                row = {"part": part, "keys": keys, "variant": name, **compile_launch(launch)}
                rows.append(row)
                print(json.dumps(row))
    if args.json:
        Path(args.json).write_text(json.dumps({"context": args.context, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
