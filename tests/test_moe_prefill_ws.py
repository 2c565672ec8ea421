"""The warp-specialised MXFP8 MoE prefill GEMMs (``plugins/kernels/moe_prefill_ws.py``, Gluon) without and with a GPU.

Gluon kernels do not run under the Triton interpreter, so on the CPU each kernel is compiled for sm_90 at the
``mini`` dims (H 6144, I 3072) as the launcher specialises it, and the compiled form is checked for what the design
needs: the three partitions (1 loader warp, 4 converter warps, the MMA warps) with their register budgets
(``setmaxnreg``), the weight and activation tiles by TMA, the products as wgmma, no register spills, and shared memory
within the H200's 227 KB per block. The ``gpu`` tests run the whole layer through ``moe.run_moe`` with the variant's
config against the float64 evaluation of the reference, with ``tests/test_kernels_moe.py``'s bound (``_close``: no
less accurate than the bf16 reference, plus one bf16 ulp at the output's magnitude for roundings placed elsewhere).
"""

from __future__ import annotations

import functools
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from bench.moe import NAMES, PREFILL_WS
from tests.test_kernels_moe import (ALPHA, INTERPRETED, LIMIT, SCALING, MoECase, _as64, _close, _off_alignment,
                                    cpu_only)
from m3export.ops import moe as ref
from m3export.plugins.kernels import moe as moe_kernel

triton = pytest.importorskip("triton")
H, I, TOP_K = 6144, 3072, 4  # the mini preset's MoE dims
SMEM_LIMIT = 227 * 1024  # the H200's shared memory per block


@functools.lru_cache(maxsize=2)
def _mini_case(tokens: int, experts: int, seed: int):
    """MoECase's MXFP8 arguments (x, router, bias, then values and scales of w13, w2, shared w13, shared w2) at the
    mini dims, drawn and quantised on the GPU one expert at a time (128 experts of 6144 x 6144 and 6144 x 3072 fp32
    would take ~30 GB and minutes on the host); weights N(0, 0.02^2) as MoECase(gain=0.02), kept for the next test
    of the same shape."""
    from m3export.ops import mxfp8

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, H, device="cuda", generator=g).bfloat16()
    router = torch.randn(experts, H, device="cuda", generator=g) * 0.3
    bias = torch.randn(experts, device="cuda", generator=g) * 0.05
    q13 = torch.empty(experts, 2 * I, H, dtype=torch.float8_e4m3fn, device="cuda")
    s13 = torch.empty(experts, 2 * I, H // 32, dtype=torch.uint8, device="cuda")
    q2 = torch.empty(experts, H, I, dtype=torch.float8_e4m3fn, device="cuda")
    s2 = torch.empty(experts, H, I // 32, dtype=torch.uint8, device="cuda")
    for e in range(experts):
        q13[e], s13[e] = mxfp8.quantize(torch.randn(2 * I, H, device="cuda", generator=g) * 0.02)
        q2[e], s2[e] = mxfp8.quantize(torch.randn(H, I, device="cuda", generator=g) * 0.02)
    shared13 = mxfp8.quantize(torch.randn(2 * I, H, device="cuda", generator=g) * 0.02)
    shared2 = mxfp8.quantize(torch.randn(H, I, device="cuda", generator=g) * 0.02)
    return (x, router, bias, q13, s13, q2, s2, *shared13, *shared2)


@functools.lru_cache(maxsize=2)
def _references(tokens: int, experts: int, seed: int):
    """The bf16 reference and its float64 evaluation on ``_mini_case``'s arguments, once per shape."""
    args = list(_mini_case(tokens, experts, seed))
    attrs = (TOP_K, SCALING, ALPHA, LIMIT)
    return ref.moe_mxfp8_reference(*args, *attrs), ref.moe_mxfp8_reference(*_as64(args), *attrs)


def _compile_sm90(cfg: dict, gate_up: bool, routed: bool):
    """``_gemm_ws`` compiled for sm_90 as ``moe_prefill_ws._launch`` specialises it at the mini dims."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from m3export.plugins.kernels import moe_prefill_ws as ws

    def desc(dtype, gl_dtype, block):
        t = torch.empty(block, dtype=dtype)
        return mangle_type(TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block,
                                                                                                       gl_dtype)))

    bn = cfg["BLOCK_N"] if gate_up else cfg["BLOCK_N_DOWN"]
    n_out, k = (I, H) if gate_up else (H, I)
    half = bool(cfg.get("HALF_TAIL")) and routed
    sig = {"a_desc": desc(torch.bfloat16, gl.bfloat16, [cfg["BLOCK_M"], cfg["BLOCK_K"]]),
           "a_half_desc": desc(torch.bfloat16, gl.bfloat16, [cfg["BLOCK_M"] // (2 if half else 1), cfg["BLOCK_K"]]),
           "w_desc": desc(torch.uint8, gl.uint8, [bn, cfg["BLOCK_K"]]),
           "s_ptr": "*u8", "out_ptr": "*bf16",
           "rows_ptr": "*i32", "block_expert_ptr": "*i32", "route_w_ptr": "*fp32", "num_rows": "i32",
           "num_m": "i32", "alpha": "fp32", "limit": "fp32", "ss_e": "i32", "ss_n": "i32", "so_r": "i32",
           "so_s": "i32"}
    consts = dict(N_OUT=n_out, K=k, W_E=2 * I if gate_up else H, TOP_K=TOP_K, ROUTED=routed, GATE_UP=gate_up,
                  HALF_TAIL=half, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=bn,
                  BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], STAGES=cfg["STAGES"],
                  CONV_STAGES=cfg["CONV_STAGES"], CONV_WARPS=ws.CONVERTER_WARPS,
                  FAST_CONVERT=bool(cfg.get("FAST_CONVERT")), num_warps=cfg["num_warps"])
    sig.update({name: "constexpr" for name in consts})
    return triton.compile(GluonASTSource(ws._gemm_ws, sig, consts), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=cfg["num_warps"], maxnreg=ws.maxnreg(cfg["num_warps"])))


def _resources(cubin: bytes) -> dict:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)
    assert m, out[-500:]
    return {"regs": int(m[1]), "stack": int(m[2]), "local": int(m[3])}


# (variant, GEMM) pairs the compile test checks: both GEMMs of every variant, the shared expert's gate-up (no row
# gather, rows past the tokens) of the launcher's tile.
KINDS = {"gate_up": (True, True), "down": (False, True), "shared_gate_up": (True, False)}
BUILDS = [(name, kind) for name in PREFILL_WS for kind in ("gate_up", "down")] + [
    ("prefill_ws_bm256_down128_s4c2", "shared_gate_up")]


def _kernel_key(name: str, kind: str) -> str:
    """Variants that differ only in a launch key (PERSISTENT) compile to the same kernel."""
    cfg = PREFILL_WS[name]
    return "-".join([kind] + [str(cfg[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_N_DOWN", "BLOCK_K", "GROUP_M",
                                                     "STAGES", "CONV_STAGES", "num_warps")]
                    + [str(cfg.get("HALF_TAIL", 0))])


def build_all(out: str) -> None:
    """Compile every kernel of BUILDS once into ``out`` (PTX, TTGIR, cubin and metadata per kernel key)."""
    import json

    done = {}
    for name, kind in BUILDS:
        key = _kernel_key(name, kind)
        if key in done:
            continue
        k = _compile_sm90(PREFILL_WS[name], *KINDS[kind])
        for ext in ("ptx", "ttgir"):
            Path(out, f"{key}.{ext}").write_text(k.asm[ext])
        Path(out, f"{key}.cubin").write_bytes(k.asm["cubin"])
        done[key] = {"shared": k.metadata.shared, "num_warps": k.metadata.num_warps}
    Path(out, "kernels.json").write_text(json.dumps(done))


@pytest.fixture(scope="module")
def sm90_builds(tmp_path_factory):
    """BUILDS compiled in a clean process: after kernels ran under the Triton interpreter in this process (the CPU
    suite), Gluon's front end no longer compiles (the interpreter patches the language's builtins)."""
    import json
    import os
    import sys

    out = tmp_path_factory.mktemp("ws_sm90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import sys; from tests.test_moe_prefill_ws import build_all; build_all(sys.argv[1])"
    proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "kernels.json").read_text())


def test_ws_variants_are_named():
    from m3export.plugins.kernels import moe_prefill_ws as ws

    assert all(NAMES[name] == c for name, c in PREFILL_WS.items())
    assert ws.WS_TILE in PREFILL_WS.values()  # the launcher's tile is a swept one (the bench names it)


@pytest.mark.parametrize("name,kind", BUILDS)
def test_ws_kernels_compile_for_sm90_at_mini_dims(sm90_builds, name, kind):
    from m3export.plugins.kernels import moe_prefill_ws as ws

    out, meta = sm90_builds
    cfg, key = PREFILL_WS[name], _kernel_key(name, kind)
    ptx, ttgir = (out / f"{key}.ptx").read_text(), (out / f"{key}.ttgir").read_text()
    assert meta[key]["shared"] <= SMEM_LIMIT, f"{meta[key]['shared']} bytes of shared memory"
    # One warp_specialize with the loader (1 warp) and converter (4 warps) partitions and their register requests.
    assert ttgir.count("ttg.warp_specialize(") == 1
    assert re.search(r"partition0\([^{]*\) num_warps\(1\) \{", ttgir)
    assert re.search(rf"partition1\([^{{]*\) num_warps\({ws.CONVERTER_WARPS}\) \{{", ttgir)
    assert f"requestedRegisters = array<i32: {ws.LOADER_REGS.value}, {ws.CONVERTER_REGS.value}>" in ttgir
    assert meta[key]["num_warps"] == cfg["num_warps"] + 8  # the workers' 5 warps take two more warpgroups
    regs = {int(r) for r in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)}
    assert {ws.LOADER_REGS.value, ws.CONVERTER_REGS.value} <= regs
    # Triton splits the launch's cap (.maxnreg per thread over every thread) between the partitions: it must fit
    # the SM's 64K registers for the program to run at all.
    cap, threads = int(re.search(r"\.maxnreg (\d+)", ptx)[1]), int(re.search(r"\.reqntid (\d+)", ptx)[1])
    assert threads == 32 * meta[key]["num_warps"] and cap * threads <= 65536
    assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx and "mbarrier.try_wait" in ptx
    # The converter loads each scale byte once (one per thread and 32-code group), not once per code.
    rows = 2 * cfg["BLOCK_N"] if kind != "down" else cfg["BLOCK_N_DOWN"]
    assert ptx.count("ld.global.b8") == rows * cfg["BLOCK_K"] // 32 // (32 * ws.CONVERTER_WARPS)
    res = _resources((out / f"{key}.cubin").read_bytes())
    assert res["stack"] == 0 and res["local"] == 0, res


@pytest.mark.parametrize("name,persistent,bm,bm_shared", [
    ("prefill_ws_bm256_down128_s4c2", 0, 256, 256), ("prefill_ws_bm256_down128_s4c2", 1, 256, 256),
    ("prefill_ws_bm256_down128_s4c2_half", 0, 256, 256)])
def test_ws_launches_through_run_moe(monkeypatch, name, persistent, bm, bm_shared):
    # The host side on the CPU (the kernels themselves need the device): run_moe with a WS config hands moe_prefill_ws
    # the blocks it routed and launches the four GEMMs with the row blocks of those blocks (BLOCK_M is the
    # launcher's, not a key of the tile config it passes on; the shared expert's blocks as many tokens), the gate-up
    # launches N tiles of BLOCK_N over I and the down launches N tiles of BLOCK_N_DOWN over H, one program per
    # tile, or one per SM with PERSISTENT; then the combine of their expert outputs. The kernel, the device checks
    # and the combine (its kernel is every MoE test's; here it would sum unwritten memory, one interpreted program
    # per token) are replaced by recorders.
    from m3export.plugins.kernels import moe_prefill_ws as ws

    launches, halves = [], []

    class Recorder:
        def __getitem__(self, grid):
            def record(*args, **consts):
                launches.append((grid[0], args[9], consts))  # args[9]: num_m, the row blocks
                halves.append(list(args[1].block_shape))  # the HALF_TAIL descriptor's box
            return record

    monkeypatch.setattr(ws, "_gemm_ws", Recorder())
    monkeypatch.setattr(ws, "check", lambda weights, dtype, cfg: None)
    monkeypatch.setattr(ws, "_programs", lambda tiles, device, on: min(tiles, 3) if on else tiles)
    combined = []
    monkeypatch.setattr(moe_kernel, "_combine_launch", lambda y, out, *a: combined.append((y.shape, a)) or out)
    case = MoECase(300, 128, 64, 64, 4, 2, seed=75)
    args = case.mxfp8_args(torch.bfloat16)
    cfg = dict(PREFILL_WS[name], PERSISTENT=persistent)
    out = moe_kernel.run_moe(*args[:3], *args[3::2], *case.attrs(), scales=tuple(args[4::2]), config=cfg)
    assert out.shape == (300, 128)
    assert combined == [((300, 3, 128), (SCALING, 128, 2))]  # once, over the four GEMMs' outputs (top-2 + shared)
    kinds = [(c["GATE_UP"], c["ROUTED"], c["BLOCK_M"], c["BLOCK_N"], c["N_OUT"], c["K"]) for _, _, c in launches]
    assert kinds == [(True, True, bm, 64, 64, 128), (True, False, bm_shared, 64, 64, 128),
                     (False, True, bm, 128, 128, 64), (False, False, bm_shared, 128, 128, 64)]
    routed_blocks = launches[0][1]  # 600 assignments over 4 experts: at least 600 / bm blocks
    assert routed_blocks == launches[2][1] >= 600 // bm
    assert launches[1][1] == launches[3][1] == -(-300 // bm_shared)  # 300 tokens
    # HALF_TAIL for the routed launches only, their second descriptor's box half the row block (otherwise the
    # kernel never reads it: the first descriptor again).
    half = bool(PREFILL_WS[name].get("HALF_TAIL"))
    assert [c["HALF_TAIL"] for _, _, c in launches] == [half, False, half, False]
    assert [h[0] for h in halves] == [bm // 2 if half else bm, bm_shared, bm // 2 if half else bm, bm_shared]
    tiles = [num_m * -(-c["N_OUT"] // c["BLOCK_N"]) for _, num_m, c in launches]
    assert [g for g, _, _ in launches] == ([min(n, 3) for n in tiles] if persistent else tiles)


def test_ws_check_refuses_wider_wgmmas(monkeypatch):
    # check refuses tiles whose wgmma N would pass 128 (gate-up: 2 x BLOCK_N; down: BLOCK_N_DOWN): ptxas cannot fit a
    # wider one's accumulator in the launch's 128 registers per thread. Its tile checks alone: no weights, and the
    # interpreter's refusal (which comes first) switched off.
    from m3export.plugins.kernels import moe_prefill_ws as ws

    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    ws.check([], torch.bfloat16, dict(ws.WS_TILE))
    for bad in (dict(BLOCK_N=128), dict(BLOCK_N_DOWN=256), dict(BLOCK_M=320)):
        with pytest.raises(ValueError, match="must be a multiple of 64 up to"):
            ws.check([], torch.bfloat16, dict(ws.WS_TILE, **bad))


def test_ws_refuses_what_it_cannot_run():
    # Under the interpreter (CPU CI) the WS config is refused before any launch, with the reason; on a device the
    # format checks name the tensor.
    case = MoECase(8, 64, 64, 64, 4, 2, seed=71)
    args = case.mxfp8_args(torch.bfloat16)
    cfg = dict(PREFILL_WS["prefill_ws_bm256_down128_s4c2"])
    if INTERPRETED:
        with pytest.raises(ValueError, match="Gluon kernels do not run under the Triton interpreter"):
            moe_kernel.run_moe(*args[:3], *args[3::2], *case.attrs(), scales=tuple(args[4::2]), config=cfg)
        return
    pytest.skip("the refusals under the interpreter; the device checks are the gpu tests'")


def _stacks(act: torch.dtype, fmt: str, aligned: bool = True):
    """MoECase(300 tokens, top-2 over 2 experts: 300 assignments per expert, above PREFILL_MXFP8's 256) as run_moe's
    arguments and its four weight stacks; not ``aligned``: w2 one element off a 16-byte boundary (TMA cannot read
    it)."""
    case = MoECase(300, 64, 64, 64, 2, 2, seed=76)
    args = list(case.bf16_args(act) if fmt == "bf16" else case.mxfp8_args(act))
    if not aligned:
        w2 = 4 if fmt == "bf16" else 5
        args[w2] = _off_alignment(args[w2])
    weights = args[3:] if fmt == "bf16" else args[3::2]
    scales = (None,) * 4 if fmt == "bf16" else tuple(args[4::2])
    return case, args[:3], weights, scales, [moe_kernel._Weights(w, s) for w, s in zip(weights, scales)]


@pytest.mark.parametrize("device", [False, True], ids=["interpreter", "device"])
def test_ws_default_asks_why_not_once(monkeypatch, device):
    # moe.default_config, given the launcher's weight stacks, takes WS_TILE only where moe_prefill_ws.why_not has
    # no reason, else PREFILL_MXFP8_LARGE (the one fallback); without weights, the choice by shapes. "device": the
    # interpreter's refusal switched off (no kernel runs here: default_config only asks why_not).
    from m3export.plugins.kernels import moe_prefill_ws as ws

    monkeypatch.setattr(triton.knobs.runtime, "interpret", not device)
    asked = []
    why_not = ws.why_not
    monkeypatch.setattr(ws, "why_not", lambda *a: asked.append(a) or why_not(*a))
    d = moe_kernel.default_config
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    for aligned in (True, False):
        stacks = _stacks(bf16, "mxfp8", aligned)[-1]
        asked.clear()
        want = ws.WS_TILE if device and aligned else moe_kernel.PREFILL_MXFP8_LARGE
        assert d(300, 600, 2, True, bf16, stacks) == want and len(asked) == 1, (aligned, asked)
        reason = why_not(stacks, bf16, ws.WS_TILE)
        assert (reason is None) == (device and aligned), reason
        assert d(300, 600, 2, True, bf16) == ws.WS_TILE  # no weights: by shapes
        # Not asked where WS is not the shape's choice: fp16 / fp32 activations, bf16 weights, fewer assignments.
        asked.clear()
        assert d(300, 600, 2, True, f16, stacks) == moe_kernel.PREFILL_MXFP8_LARGE
        assert d(300, 600, 2, True, f32, stacks) == {"BLOCK_M": 128, "BLOCK_N": 128}
        assert d(300, 600, 2, False, bf16, _stacks(bf16, "bf16", aligned)[-1]) == moe_kernel.PREFILL_BF16
        assert d(80, 160, 3, True, bf16, stacks) == moe_kernel.PREFILL_MXFP8
        assert asked == []


@cpu_only
@pytest.mark.parametrize("aligned", [True, False], ids=["tma", "no_tma"])
def test_ws_fallback_runs_the_large_triton_tile(monkeypatch, aligned):
    # Under the interpreter the launcher's default at 300 assignments per expert (WS_TILE by shape) runs
    # PREFILL_MXFP8_LARGE's Triton tiles, whole: its 256-row blocks, the MX_MODE of moe.gemm_config (1 here: never
    # WS_TILE's label 3, whose Triton tiles are refused), no WS key; without TMA where w2 cannot be read by it.
    # Explicit configs still raise: WS_TILE with the interpreter's reason, WS_TILE with WS 0 (the refused Triton
    # MX_MODE 3 tiles) with that refusal. The kernels are replaced by recorders (the combine returns its output).
    from m3export.plugins.kernels import moe_prefill_ws as ws

    launched = []
    # (kind, routed: blocks given, BLOCK_M, the tile config) of each Triton launch
    monkeypatch.setattr(moe_kernel, "_launch_gate_up", lambda *a: launched.append(("gate_up", a[3] is not None,
                                                                                   *a[10:12])))
    monkeypatch.setattr(moe_kernel, "_launch_down", lambda *a: launched.append(("down", a[3] is not None, *a[9:11])))
    monkeypatch.setattr(moe_kernel, "_combine_launch", lambda y, out, *a: out)
    monkeypatch.setattr(ws, "launch", lambda *a: launched.append("ws"))
    case, head, weights, scales, _ = _stacks(torch.bfloat16, "mxfp8", aligned)
    moe_kernel.run_moe(*head, *weights, *case.attrs(), scales=scales)
    large = {k: v for k, v in moe_kernel.PREFILL_MXFP8_LARGE.items() if k != "BLOCK_M"}
    assert len(launched) == 4 and "ws" not in launched
    for kind, routed, bm, cfg in launched:
        want = moe_kernel.gemm_config(bm, mx_mode2=False) | large | {"TMA": int(aligned)}
        assert cfg == want and cfg["MX_MODE"] == 1 and "WS" not in cfg, (kind, routed, cfg)
        assert bm == (moe_kernel.PREFILL_MXFP8_LARGE["BLOCK_M"] if routed else 128), (kind, routed, bm)
    with pytest.raises(ValueError, match="Gluon kernels do not run under the Triton interpreter"):
        moe_kernel.run_moe(*head, *weights, *case.attrs(), scales=scales, config=dict(ws.WS_TILE))
    with pytest.raises(ValueError, match="got 3 .3, the integer conversion, raced"):
        moe_kernel.run_moe(*head, *weights, *case.attrs(), scales=scales, config=dict(ws.WS_TILE, WS=0))
    assert len(launched) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
@pytest.mark.parametrize("name", list(PREFILL_WS))
@pytest.mark.parametrize("tokens,experts", [(700, 16), (4096, 128)], ids=["700tok_16exp", "4096tok_128exp"])
def test_gpu_ws_layer_mini_dims(name, tokens, experts):
    # The mini dims: 700 tokens over 16 experts (175 assignments per expert: padding rows in every expert's last
    # 256-row block, a partial shared-expert block read past the tokens as TMA zeros) and 4096 tokens over 128
    # experts (the bench's shape at 4k), against the float64 reference with _close's bound.
    args = list(_mini_case(tokens, experts, 72))
    attrs = (TOP_K, SCALING, ALPHA, LIMIT)
    want, want64 = _references(tokens, experts, 72)
    got = moe_kernel.run_moe(*args[:3], *args[3::2], *attrs, scales=tuple(args[4::2]), config=dict(PREFILL_WS[name]))
    _close(got, want, want64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
def test_gpu_ws_refuses_other_formats():
    case = MoECase(300, 256, 256, 256, 4, 2, seed=73)
    cfg = dict(PREFILL_WS["prefill_ws_bm256_down128_s4c2"])
    bf = [a.cuda() for a in case.bf16_args(torch.bfloat16)]
    with pytest.raises(ValueError, match="WS takes MXFP8 weights"):
        moe_kernel.run_moe(*bf, *case.attrs(), config=cfg)
    mx = [a.cuda() for a in case.mxfp8_args(torch.float32)]
    with pytest.raises(ValueError, match="WS .* takes bf16 activations"):
        moe_kernel.run_moe(*mx[:3], *mx[3::2], *case.attrs(), scales=tuple(mx[4::2]), config=cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
def test_gpu_ws_each_gemm_next_to_the_triton_tiles():
    # Each GEMM alone, next to moe._launch_gate_up / moe._launch_down with the launcher's default 16k tile
    # (PREFILL_MXFP8_LARGE) on the same routing: the routed and shared gate-up activations, then each path's down
    # outputs from its own activations. Both multiply the same bf16 weights (exact) and round at the same points;
    # only the fp32 summation order differs (~1e-6 relative), so an element differs only where a sum straddles a
    # bf16 rounding boundary, by one rounding step (2^-8 relative) carried through SwiGLU: the norm of the
    # difference stays far below 2^-8 of the norm, while a wrong tile, scale row, K step or slot is off by O(1).
    # The report names the GEMM that fails.
    from m3export.plugins.kernels import moe_prefill_ws as ws
    from m3export.plugins.kernels.moe_routing import group_by_expert, route

    x, router, bias, w13, s13, w2, s2, sw13, ss13, sw2, ss2 = _mini_case(1000, 32, 74)
    cfg = dict(ws.WS_TILE)
    tri = moe_kernel.gemm_config(cfg["BLOCK_M"]) | {k: v for k, v in moe_kernel.PREFILL_MXFP8_LARGE.items()
                                                    if k != "BLOCK_M"}
    ids, route_w = route(x, router, bias, TOP_K)
    t, n = x.shape[0], x.shape[0] * TOP_K
    blocks = group_by_expert(ids, w13.shape[0], cfg["BLOCK_M"])
    weights = [moe_kernel._Weights(w, s) for w, s in ((w13, s13), (w2, s2), (sw13, ss13), (sw2, ss2))]
    ws.check(weights, x.dtype, cfg)
    tri = moe_kernel._check_tma(tri, weights, fallback=False)
    outs = {}
    for kind in ("ws", "triton"):
        act = torch.zeros((blocks.rows.shape[0], I), dtype=x.dtype, device=x.device)
        act_s = torch.zeros((t, I), dtype=x.dtype, device=x.device)
        y = torch.zeros((t, TOP_K + 1, H), dtype=x.dtype, device=x.device)
        if kind == "ws":
            ws.launch(x, weights, act, act_s, y, blocks, route_w, n, ALPHA, LIMIT, TOP_K, cfg)
        else:
            bm = cfg["BLOCK_M"]
            moe_kernel._launch_gate_up(x, weights[0], act, blocks, n, ALPHA, LIMIT, H, I, TOP_K, bm, tri, False, "tf32")
            moe_kernel._launch_gate_up(x, weights[2], act_s, None, t, ALPHA, LIMIT, H, I, TOP_K, bm, tri, False, "tf32")
            moe_kernel._launch_down(act, weights[1], y, blocks, route_w, n, H, I, TOP_K, bm, tri, False, "tf32")
            moe_kernel._launch_down(act_s, weights[3], y, None, None, t, H, I, TOP_K, bm, tri, False, "tf32")
        outs[kind] = dict(act=act[blocks.rows < n], act_s=act_s, y_routed=y[:, :TOP_K], y_shared=y[:, TOP_K])
    report = {}
    for key, want in outs["triton"].items():
        got = outs["ws"][key]
        report[key] = float((got.float() - want.float()).norm() / want.float().norm())
    print(report)
    assert all(v <= 2.0 ** -8 for v in report.values()), report


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
def test_gpu_ws_is_the_default_in_prefill():
    # The op as the model calls it (m3::moe_mxfp8's launcher, no config): 2100 tokens x top-4 over 16 experts is 525
    # assignments per expert, above moe.WS_LEAST_MEAN, so moe.default_config takes WS_TILE; against the float64
    # reference with _close's bound (the Triton tile it replaced is the bench's comparison: its four kernels take
    # ~80 s to compile).
    from m3export.plugins.kernels import moe_mxfp8 as moe_mxfp8_kernel
    from m3export.plugins.kernels import moe_prefill_ws as ws

    assert moe_kernel.default_config(2100, 8400, 16, True) == ws.WS_TILE
    args = list(_mini_case(2100, 16, 76))
    attrs = (TOP_K, SCALING, ALPHA, LIMIT)
    want, want64 = _references(2100, 16, 76)
    got = moe_mxfp8_kernel.forward(*args, *attrs)
    _close(got, want, want64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
@pytest.mark.parametrize("keys", [dict(HALF_TAIL=1)], ids=["half"])
@pytest.mark.parametrize("tokens,experts", [(700, 16), (4096, 128), (1280, 16)],
                         ids=["700tok_16exp", "4096tok_128exp", "1280tok_16exp_tails"])
def test_gpu_ws_keys_same_bits_as_default(keys, tokens, experts):
    # HALF_TAIL runs a routed block whose rows from 128 on are padding as a 128-row wgmma on the first half of its
    # slot: every stored element sums the same K steps of the same bf16 operands in the same order as in the 256-row
    # wgmma (a row's products do not depend on the rows beside it). So the layer's output is the same bits as the
    # 256-row tile's without the key.
    # 700 / 16: one block per expert, those with <= 128 assignments halved; 4096 / 128: 128 per expert on average,
    # about half the experts halved; 1280 / 16: 320 per expert, a full block and a tail of ~64 rows for most, checked
    # below (the premise), and against the float64 reference with _close's bound.
    from m3export.plugins.kernels.moe_routing import route

    args = list(_mini_case(tokens, experts, 72))
    attrs = (TOP_K, SCALING, ALPHA, LIMIT)
    tile = dict(PREFILL_WS["prefill_ws_bm256_down128_s4c2"])  # 256-row blocks, no keys: WS_TILE before HALF_TAIL
    bm = tile["BLOCK_M"]
    ids, _ = route(args[0], args[1], args[2], TOP_K)
    tail = torch.bincount(ids.reshape(-1).long(), minlength=experts) % bm
    halved = int(((tail > 0) & (tail <= bm // 2)).sum())
    print(f"{halved} of {experts} experts' last blocks at most half full")
    assert halved >= (experts // 4 if tokens == 1280 else 1), tail.tolist()
    base = moe_kernel.run_moe(*args[:3], *args[3::2], *attrs, scales=tuple(args[4::2]), config=tile)
    got = moe_kernel.run_moe(*args[:3], *args[3::2], *attrs, scales=tuple(args[4::2]), config=dict(tile, **keys))
    assert torch.equal(got, base), float((got.float() - base.float()).abs().max())
    if tokens == 1280:
        _close(got, *_references(tokens, experts, 72))
