"""Compile the MoE / MXFP8 Triton kernels for sm_90 (H100 / H200) on a machine without a GPU, and report resources.

The interpreter (CPU tests) checks what the kernels compute but not that they compile for the device, and GPU time
is scarce: this builds every tile variant the launchers and ``bench/moe.py`` use, at the ``mini`` / release dims,
with Triton's own ptxas, and prints registers, spills, shared memory, whether the dots became wgmma (Hopper's
warpgroup MMA) or mma.sync, and whether the loads are cp.async or TMA bulk tensor copies. A compile error names the
kernel and variant.

  python scripts/compile_moe_kernels_sm90.py            # all variants (about a minute per dozen)
  python scripts/compile_moe_kernels_sm90.py --quick    # the launchers' default tiles only
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from m3export.plugins.kernels import moe as moe_kernels
from m3export.plugins.kernels import gemv, moe_gemv
from m3export.plugins.kernels import mxfp8_linear

TARGET = GPUTarget("cuda", 90, 32)
H, I, TOP_K = 6144, 3072, 4


def _cuobjdump() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def resources(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(_cuobjdump()), "--dump-resource-usage", f.name], capture_output=True, text=True)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", out.stdout)
    return {"regs": int(m[1]), "stack": int(m[2]), "static_smem": int(m[3])} if m else {"raw": out.stdout[-200:]}


def sass(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(_cuobjdump()), "-sass", f.name], capture_output=True, text=True).stdout


def pending_a_writes(sass_text: str) -> int:
    """How many (instruction, wgmma) pairs of the kernel's K loop have the instruction write a register that the
    wgmma, issued earlier and not yet retired, reads as its A operand. An HGMMA with a register A fragment (four
    registers from the one it names) reads them asynchronously: writing them before the WARPGROUP.DEPBAR that
    retires it is undefined (PTX ISA, wgmma.mma_async). Triton 3.6 pipelines such loops with all but 3 wgmmas
    retired at the end of a K step and leaves the registers to ptxas; the integer E4M3 conversion's tiles
    (MX_MODE 3, refused since) had 1-12 such writes per loop and gave wrong outputs on the H200, not in every run,
    tl.dot_scaled's (MX_MODE 2) none. The loop runs from the target of the backward branch after the last HGMMA to
    that branch, walked twice so that the wgmmas still pending at its end meet the next step's writes; a write is
    an instruction whose first operand is a general register (two for .64 / wide forms, four for .128 and LDSM .4)."""
    ins = [(int(m[1], 16), m[2]) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass_text)]
    hgmma = [i for i, (_, t) in enumerate(ins) if "HGMMA" in t]
    if not hgmma:
        return 0
    end = next((i for i in range(hgmma[-1], len(ins)) if (m := re.search(r"BRA (0x[0-9a-f]+)", ins[i][1]))
                and int(m[1], 16) <= ins[hgmma[0]][0]), None)
    if end is None:
        return 0
    target = int(re.search(r"BRA (0x[0-9a-f]+)", ins[end][1])[1], 16)
    body = [t for a, t in ins if target <= a <= ins[end][0]]
    pending: list[set] = []
    hits = 0
    for _ in range(2):
        for t in body:
            t = re.sub(r"^@!?U?P\w+\s+", "", t.strip())
            if m := re.search(r"HGMMA\.\S+ R\d+, R(\d+), gdesc", t):
                pending.append({int(m[1]) + j for j in range(4)})
            elif m := re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)", t):
                keep = int(m[1], 16)
                pending = pending[len(pending) - keep:] if keep else []
            elif (m := re.match(r"(\S+)\s+R(\d+)\b", t)) and not m[1].startswith("HGMMA"):
                width = 4 if ".128" in m[1] or re.match(r"LDSM.*\.4$", m[1]) else 2 if ".64" in m[1] or "WIDE" in m[1] \
                    else 1
                written = {int(m[2]) + j for j in range(width)}
                hits += sum(bool(written & regs) for regs in pending)
    return hits


UNIT_STRIDES = ("sw_k", "ss_k")  # weights and scales are contiguous along K in every launch


def build(fn, signature: dict, constexprs: dict, warps: int, stages: int) -> dict:
    """Compile as the JIT specialises a launch at the mini / release dims: pointers 16-byte aligned, the K strides
    equal to 1 (compile-time constants), every other stride a multiple of 16. Without these hints Triton can prove
    no vector width, so it neither pipelines the loads (no cp.async) nor vectorises them, and registers and
    spills read far worse than what runs (an earlier version of this script did that)."""
    constexprs = {**{n: 1 for n in UNIT_STRIDES if n in signature}, **constexprs}
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    sig = {n: sig[n] for n in fn.arg_names if n in sig}  # the kernel's order (some take arguments after constexprs)
    names = [n for n in sig]
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n] != "constexpr" and (sig[n].startswith("*") or (n.startswith("s") and sig[n] in ("i32", "i64")))}
    k = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=TARGET,
                       options=dict(num_warps=warps, num_stages=stages))
    ptx = k.asm["ptx"]
    return {**resources(k.asm["cubin"]), "smem": k.metadata.shared, "wgmma": "wgmma" in ptx,
            "mma": "mma.sync" in ptx, "cp_async": "cp.async" in ptx, "tma": "cp.async.bulk.tensor" in ptx,
            "pending_a_writes": pending_a_writes(sass(k.asm["cubin"]))}


def moe_signature(mx: bool, kind: str) -> dict:
    w = "*fp8e4nv" if mx else "*bf16"
    common = {"w_ptr": w, "s_ptr": "*u8" if mx else w}
    if kind == "gate_up":
        return {"x_ptr": "*bf16", **common, "act_ptr": "*bf16", "rows_ptr": "*i32", "block_expert_ptr": "*i32",
                "num_rows": "i32", "sx_t": "i32", "sw_e": "i64", "sw_n": "i32", "sw_k": "i32", "ss_e": "i32",
                "ss_n": "i32", "ss_k": "i32", "sa_p": "i32", "alpha": "fp32", "limit": "fp32"}
    return {"act_ptr": "*bf16", **common, "y_ptr": "*bf16", "rows_ptr": "*i32", "block_expert_ptr": "*i32",
            "route_w_ptr": "*fp32", "num_rows": "i32", "sa_p": "i32", "sw_e": "i64", "sw_n": "i32", "sw_k": "i32",
            "ss_e": "i32", "ss_n": "i32", "ss_k": "i32", "sy_t": "i32", "sy_s": "i32"}


def _bench_moe():
    """bench/moe.py as a module (its sweep lists), so the lists compiled here cannot drift from the ones swept."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import moe as bench_moe

    return bench_moe


def _gemv_tiles(quick: bool) -> list:
    """The GEMV configs to build: the launchers' defaults (moe.GEMV_DECODE, moe.GEMV_DECODE_BF16,
    mxfp8_linear.gemv_config(1)), then unless ``quick`` every GEMV tile of bench/moe.py's sweep (imported from the
    script, so the lists cannot drift apart)."""
    tiles = [moe_kernels.GEMV_DECODE, moe_kernels.GEMV_DECODE_BF16, mxfp8_linear.gemv_config(1)]
    if not quick:
        bench_moe = _bench_moe()
        tiles += [*bench_moe.GEMV_SWEEP, *bench_moe.SPLITK_SWEEP, *bench_moe.NAMES.values()]
    seen, out = set(), []
    for c in tiles:
        if not c.get("GEMV"):
            continue
        key = tuple(sorted(c.items()))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def variants(quick: bool):
    """(label, kernel, signature, constexprs, warps, stages) for every MoE / linear tile the code may launch."""
    out = []
    tiles = [(bm, moe_kernels.gemm_config(bm), True) for bm in (16, 64, 128)]
    if not quick:
        for n, k, w, s in [(64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3)]:  # (64, 128): the batch > 8 default
            tiles.append((16, dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s, MX_MODE=1), False))
        for mode in (0, 2):
            tiles.append((16, {**moe_kernels.gemm_config(16), "MX_MODE": mode}, False))
        for mode in (0, 1):
            tiles.append((128, {**moe_kernels.gemm_config(128), "MX_MODE": mode}, False))
        for bm in (16, 64, 128):  # gate and up as one dot (moe._gate_up GU_FUSED)
            tiles.append((bm, {**moe_kernels.gemm_config(bm), "GU_FUSED": 1}, False))
    formats = {}  # a prefill tile's weight formats (the tiles above: both for the defaults, else MXFP8 only)
    listed = {(bm, tuple(sorted(cfg.items()))) for bm, cfg, _ in tiles}
    # The launcher's prefill defaults (moe.default_config) and the tiles it falls back to where the weights cannot
    # be read by TMA (moe.tma_unusable: the same tile with TMA 0), then unless ``quick`` bench/moe.py's prefill
    # sweep, each tile in the format(s) it is run with.
    defaults = [("mxfp8", moe_kernels.PREFILL_MXFP8), ("mxfp8", moe_kernels.PREFILL_MXFP8_LARGE),
                ("bf16", moe_kernels.PREFILL_BF16)]
    prefill = [*defaults, *((fmt, {**c, "TMA": 0}) for fmt, c in defaults)]
    if not quick:
        prefill += [(fmt, c) for fmt, sweep in _bench_moe().PREFILL_SWEEP.items() for c in sweep]
        prefill += [("mxfp8", c) for c in _bench_moe().PREFILL_ROUND6.values()]  # swept by name, MXFP8 only
    for fmt, c in prefill:
        bm = c["BLOCK_M"]
        cfg = {**moe_kernels.gemm_config(bm), **{k: v for k, v in c.items() if k != "BLOCK_M"}}
        key = (bm, tuple(sorted(cfg.items())))
        if key in listed:
            continue
        if key not in formats:
            tiles.append((bm, cfg, False))
        formats.setdefault(key, set()).add(fmt == "mxfp8")
    for bm, cfg, default in tiles:
        for mx in (True, False):
            swept = formats.get((bm, tuple(sorted(cfg.items()))))
            if swept is not None and mx not in swept:
                continue
            if swept is None and not mx and not default:  # MX_MODE variants only matter for MXFP8 weights
                continue
            for kind, fn in (("gate_up", moe_kernels._gate_up), ("down", moe_kernels._down)):
                bn = cfg.get("BLOCK_N_DOWN") or cfg["BLOCK_N"] if kind == "down" else cfg["BLOCK_N"]
                consts = dict(H=H, I=I, TOP_K=TOP_K, ROUTED=True, MXFP8=mx, BLOCK_M=bm, BLOCK_N=bn,
                              BLOCK_K=cfg["BLOCK_K"], F32=False, PREC="tf32", MX_MODE=cfg["MX_MODE"] if mx else 0)
                if cfg.get("GU_FUSED"):
                    if kind != "gate_up" and not (cfg.get("GROUP_M") or cfg.get("TMA") or cfg["BLOCK_N"] > 64):
                        continue  # the down kernel of a GU_FUSED tile is the plain tile's
                    if kind == "gate_up":
                        consts["GU_FUSED"] = 1
                # trailing constexprs: ASTSource takes no defaults
                for key in ("GROUP_M", "TMA") + (() if kind == "down" else ("X_TMA",)):
                    consts[key] = cfg.get(key, 0)
                label = (f"{kind:7} {'mxfp8' if mx else 'bf16':5} BM{bm:<3} BN{bn:<3} "
                         f"BK{cfg['BLOCK_K']:<3} w{cfg['num_warps']} s{cfg['num_stages']} mode{consts['MX_MODE']}"
                         f"{' gu' if consts.get('GU_FUSED') else ''}"
                         f"{' g%d' % cfg['GROUP_M'] if cfg.get('GROUP_M') else ''}{' tma' if cfg.get('TMA') else ''}"
                         f"{' xtma' if consts.get('X_TMA') else ''}")
                out.append((label, fn, moe_signature(mx, kind), consts, cfg["num_warps"], cfg["num_stages"]))
    # The GEMV tiles (_gemv_tiles), each for both weight formats and the linear.
    for c in _gemv_tiles(quick):
        bn, bk, gw, gs = c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"]
        split, prefetch, pipe = c.get("SPLIT_K", 1), c.get("PREFETCH", 0), gemv.pipeline_kw(c, "compile")
        shared = int(bool(c.get("SHARED_GRID")))  # moe_gemv.launch: shared rows in the routed grid
        tag = (f"BN{bn:<3} BK{bk:<4} w{gw} s{gs} split{split} pf{prefetch} pipe{pipe.get('PIPELINE', 0)}"
               f"{' sg' if shared else ''}{' pdl%d' % c['PDL'] if c.get('PDL') else ''}"
               f"{' gsum' if c.get('GSUM') else ''}{' actf32' if c.get('ACT_F32') else ''}"
               f"{' down%d' % c['BLOCK_N_DOWN'] if c.get('BLOCK_N_DOWN') else ''}")
        for mx in (True, False):
            w = "*fp8e4nv" if mx else "*bf16"
            common = {"w_ptr": w, "s_ptr": "*u8" if mx else w}
            shared_w = {"sh_w_off": "i64", "sh_s_off": "i64"}  # after the constexprs (moe_gemv)
            act = "*fp32" if c.get("ACT_F32") else "*bf16"  # moe_gemv.launch's ACT_F32
            sigs = {
                "gate_up": (moe_gemv._gate_up_gemv, {
                    "x_ptr": "*bf16", **common, "act_ptr": act, "ids_ptr": "*i32", "part_ptr": "*fp32",
                    "cnt_ptr": "*i32", "sx_t": "i32", "sw_e": "i64",
                    "sw_n": "i32", "sw_k": "i32", "ss_e": "i32", "ss_n": "i32", "ss_k": "i32", "sa_p": "i32",
                    "alpha": "fp32", "limit": "fp32", **shared_w, "n_routed": "i32"}),
                "down": (moe_gemv._down_gemv, {
                    "act_ptr": act, **common, "y_ptr": "*bf16", "ids_ptr": "*i32", "route_w_ptr": "*fp32",
                    "part_ptr": "*fp32", "cnt_ptr": "*i32",
                    "sa_p": "i32", "sw_e": "i64", "sw_n": "i32", "sw_k": "i32", "ss_e": "i32", "ss_n": "i32",
                    "ss_k": "i32", "sy_t": "i32", "sy_s": "i32", **shared_w, "n_routed": "i32"}),
            }
            for kind, (fn, sig) in sigs.items():
                bn_k = c.get("BLOCK_N_DOWN") or bn if kind == "down" else bn  # moe_gemv.launch's BLOCK_N_DOWN
                consts = dict(H=H, I=I, TOP_K=TOP_K, ROUTED=True, MXFP8=mx, BLOCK_N=bn_k, BLOCK_K=bk,
                              SPLIT_K=split, PREFETCH=prefetch, PIPELINE=pipe.get("PIPELINE"), SHARED=shared,
                              PDL=c.get("PDL", 0), GSUM=c.get("GSUM", 0))
                out.append((f"{kind + '/gemv':12} {'mxfp8' if mx else 'bf16':5} {tag}", fn, sig, consts, gw, gs))
        sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*u8", "y_ptr": "*bf16", "sx_m": "i32", "sw_n": "i32",
               "sw_k": "i32", "ss_n": "i32", "ss_k": "i32", "sy_m": "i32", "N": "i32"}
        if split > 1:  # the linear GEMV has no split-K
            continue
        if shared or c.get("PDL") or c.get("ACT_F32") or c.get("BLOCK_N_DOWN"):
            # MoE-only keys: the linear is listed without them
            continue
        out.append((f"{'linear/gemv':12} mxfp8 {tag}", gemv._linear_gemv,
                    sig, dict(K=H, MXFP8=True, BLOCK_N=bn, BLOCK_K=bk, PREFETCH=prefetch,
                              PIPELINE=pipe.get("PIPELINE"), GSUM=c.get("GSUM", 0)), gw, gs))
    for m in (1, 64, 512):
        c = mxfp8_linear.tile_config(m)
        bm, bn, bk, w, s = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"]
        sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*u8", "y_ptr": "*bf16", "M": "i32", "N": "i32",
               "sx_m": "i32", "sw_n": "i32", "sw_k": "i32", "ss_n": "i32", "ss_k": "i32", "sy_m": "i32"}
        consts = dict(K=H, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, F32=False, PREC="tf32", MX_MODE=c["MX_MODE"])
        out.append((f"linear  mxfp8 BM{bm:<3} BN{bn:<3} BK{bk:<3} w{w} s{s} mode{c['MX_MODE']}",
                    mxfp8_linear._mxfp8_linear, sig,
                    consts, w, s))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--match", default="", help="build only the variants whose label contains this text (e.g. g8)")
    args = ap.parse_args()
    failed = 0
    print(f"{'kernel / variant':58} {'regs':>4} {'stack':>5} {'smem':>6} dot   loads    pending-A-writes")
    for label, fn, sig, consts, warps, stages in variants(args.quick):
        if args.match not in label:
            continue
        try:
            r = build(fn, sig, consts, warps, stages)
        except Exception as exc:  # report every variant, then fail
            cause = exc.__cause__ or exc
            print(f"{label:58} FAILED {type(cause).__name__}: {str(cause)[-300:]}")
            failed += 1
            continue
        dot = "wgmma" if r["wgmma"] else "mma" if r["mma"] else "fma"
        print(f"{label:58} {r.get('regs', '?'):>4} {r.get('stack', '?'):>5} {r['smem']:>6} {dot:5} "
              f"{'tma' if r['tma'] else 'cp.async' if r['cp_async'] else 'sync':8} {r['pending_a_writes']}",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
