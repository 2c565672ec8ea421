"""Compile every TensorRT plugin kernel (every tactic) ahead of time for one GPU architecture, without a GPU.

Writes, per kernel, the PTX TensorRT is handed (``<plugin>.t<tactic>.ptx``) and the cubin ptxas makes of it, plus
``kernels.json``: kernel name, launch parameters (block, shared memory), the grid and the extra int32 arguments as
formulas of the plugin's input dimensions (the symbolic extents ``aot_impl`` returns), the parameter list and the
hidden Triton parameters checked by ``aot.launch_convention``. Run it without ``TRITON_INTERPRET`` (the
interpreter's code paths would be compiled otherwise).

  python -m m3export.plugins.tensorrt.compile --out build/aot                 # mini dims, bf16, pages of 16
  python -m m3export.plugins.tensorrt.compile --out build/aot --preset full --dtype float32 --page-size 64
  python -m m3export.plugins.tensorrt.compile --out build/aot64 --page-size 64 --plugins PagedAttention
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import aot
from .shapes import Symbol, TensorInfo, describe
from .steps import max_blocks


def plugin_instances(cfg, dtype: str, page_size: int, max_model_len: int) -> list[tuple[str, list, dict]]:
    """(plugin, symbolic inputs, attributes) for every plugin kernel a model with ``cfg`` uses."""
    t, b, mp, pages = Symbol("T"), Symbol("B"), Symbol("max_pages"), Symbol("pages")
    paged = [TensorInfo((b, mp), "int32"), TensorInfo((b + 1,), "int32"), TensorInfo((b,), "int32"),
             TensorInfo((t,), "int64")]
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = TensorInfo((t, hq, d), dtype)
    kv = TensorInfo((pages, page_size, hkv, d), dtype)
    scale = d ** -0.5
    bs, topk = cfg.index_block_size, cfg.index_topk_blocks
    iq = TensorInfo((t, cfg.index_n_heads, cfg.index_head_dim), dtype)
    ik = TensorInfo((pages, page_size, cfg.index_head_dim), dtype)
    nb = Symbol("num_blocks")
    out = [("PagedAttention", [q, kv, kv, *paged], dict(scale=scale)),
           ("SparsePagedAttention", [q, kv, kv, *paged, TensorInfo((t, hkv, topk), "int32")],
            dict(block_size=bs, scale=scale)),
           ("LightningIndexerScan", [iq, ik, paged[0], paged[1], paged[3]], dict(block_size=bs)),
           ("LightningIndexerTopK", [TensorInfo((t, cfg.index_n_heads, nb), "float32"), paged[3]],
            dict(block_size=bs, topk_blocks=topk, local_blocks=cfg.index_local_blocks,
                 init_blocks=cfg.index_init_blocks, max_blocks=max_blocks(max_model_len, bs))),
           ("MXFP8Linear", [TensorInfo((t, cfg.hidden_size), dtype),
                            TensorInfo((cfg.hidden_size, cfg.hidden_size), "float8_e4m3fn"),
                            TensorInfo((cfg.hidden_size, cfg.hidden_size // 32), "uint8")], {})]
    h, e, k = cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok
    i, i_s = cfg.intermediate_size, cfg.shared_intermediate_size
    swiglu = dict(swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit)
    x = TensorInfo((t, h), dtype)
    ids, weights = TensorInfo((t, k), "int32"), TensorInfo((t, k), "float32")
    out.append(("MoERoute", [TensorInfo((t, e), "float32"), TensorInfo((e,), "float32")], dict(top_k=k)))
    out.append(("MoECombine", [TensorInfo((t, k + 1, h), dtype)],
                dict(top_k=k, routed_scaling_factor=cfg.routed_scaling_factor)))
    for mx in (False, True):
        sfx = "MXFP8" if mx else ""

        def w(*shape):
            if not mx:
                return [TensorInfo(shape, dtype)]
            return [TensorInfo(shape, "float8_e4m3fn"), TensorInfo((*shape[:-1], shape[-1] // 32), "uint8")]

        out += [(f"MoEGateUp{sfx}", [x, *w(e, 2 * i, h), ids], dict(top_k=k, **swiglu)),
                (f"MoESharedGateUp{sfx}", [x, *w(2 * i_s, h)], swiglu),
                (f"MoEDown{sfx}", [TensorInfo((t * k, i), dtype), *w(e, h, i), ids, weights], dict(top_k=k)),
                (f"MoESharedDown{sfx}", [TensorInfo((t, i_s), dtype), *w(h, i_s), TensorInfo((t, k + 1, h), dtype)],
                 dict(top_k=k))]
    return out


def compile_all(cfg, dtype: str, page_size: int, max_model_len: int, out: Path | None, arch: int = aot.SM90,
                log=print, plugins: set[str] | None = None) -> list[dict]:
    """Compile every kernel (or those of ``plugins``) from symbolic inputs, as ``aot_impl`` does under TensorRT
    (dimensions that vary between steps are symbols; the rest are the engine's constants)."""
    import triton

    if triton.knobs.runtime.interpret:
        raise RuntimeError("TRITON_INTERPRET is set: unset it to compile the kernels for the GPU")
    unknown = sorted(set(plugins or ()) - set(aot.PLANNERS))
    if unknown:
        raise RuntimeError(f"no AOT kernel for plugins {unknown} (known: {', '.join(sorted(aot.PLANNERS))})")
    report = []
    for plugin, inputs, attrs in plugin_instances(cfg, dtype, page_size, max_model_len):
        if plugins is not None and plugin not in plugins:
            continue
        for tactic in aot.PLANNERS[plugin][1]:
            plan = aot.plan(plugin, inputs, attrs, tactic)
            k = aot.compile_plan(plan, arch)
            entry = {"plugin": plugin, "tactic": tactic, "name": k.name, "block": list(k.block),
                     "shared_mem": k.shared_mem, "grid": describe(plan.grid), "extra_args": describe(plan.extra_args),
                     "num_inputs": plan.num_inputs, "num_extras": plan.num_extras,
                     "num_outputs": plan.num_outputs, "params": list(k.params), "hidden_params": k.hidden_params,
                     "inputs": [{"shape": describe(t.shape), "dtype": t.dtype} for t in inputs], "attrs": attrs,
                     "signature": plan.signature, "constexprs": {c: v for c, v in plan.constexprs.items()},
                     **k.metadata}
            if out is not None:
                stem = f"{plugin}.t{tactic}"
                (out / f"{stem}.ptx").write_text(k.ptx)
                (out / f"{stem}.cubin").write_bytes(k.cubin)
                entry.update(ptx=f"{stem}.ptx", cubin=f"{stem}.cubin")
            report.append(entry)
            log(f"{plugin:22} t{tactic} {k.name:28} grid {str(entry['grid']):44} block {k.block[0]:4} "
                f"smem {k.shared_mem:6} params {len(k.params)} (hidden {k.hidden_params})")
    return report


def main(argv: list[str] | None = None) -> int:
    from m3export.config import preset

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="directory for the PTX, cubins and kernels.json")
    ap.add_argument("--preset", default="mini", help="model dims (tiny, mini, full; default mini)")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=131072, help="bounds the indexer top-k's block axis")
    ap.add_argument("--arch", type=int, default=aot.SM90, help="compute capability x 10 (default 90: H100/H200)")
    ap.add_argument("--plugins", default=None, help="comma-separated plugins to compile (default: every one)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    only = set(args.plugins.split(",")) if args.plugins else None
    try:
        report = compile_all(preset(args.preset), args.dtype, args.page_size, args.max_model_len, args.out, args.arch,
                             plugins=only)
    except (aot.LaunchConventionError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    import triton

    (args.out / "kernels.json").write_text(json.dumps(
        {"triton": triton.__version__, "arch": args.arch, "preset": args.preset, "dtype": args.dtype,
         "page_size": args.page_size, "max_model_len": args.max_model_len, "kernels": report}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
