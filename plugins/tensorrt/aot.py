"""Ahead-of-time kernels for the TensorRT plugins: the Triton kernels of ``plugins/kernels`` compiled for one GPU
architecture, with the launch that TensorRT must make (kernel name, PTX, grid, block, shared memory, extra scalar
arguments as symbolic expressions of the plugin's input dimensions).

**The launch convention.** A ``tensorrt.plugin.aot_impl`` kernel is launched by TensorRT with the arguments
``(input pointers..., extra int32 scalars..., output pointers...)`` in that order, and nothing else. Our kernels
were written for their torch launchers (strides, split-K scratch and tile maps as arguments), so each plugin kernel
here is a thin ``@triton.jit`` wrapper in TensorRT's order that calls the existing kernel body (inlined by Triton:
the same code, not a copy). Arguments a TensorRT launch cannot carry become compile-time constants: float
attributes (the softmax scale), strides of contiguous tensors (products of static dimensions), the decode-shaped
tiling (one program per token, the sequence found by binary search in the kernel) and a single context split
(a split-K merge would be a second launch, and an AOT plugin launches exactly one kernel).

Triton >= 3.3 appends hidden pointer parameters to every kernel (``global_scratch``, and since 3.5
``profile_scratch``) after the declared ones; TensorRT does not know them. :func:`launch_convention` proves from the
PTX that each compiled kernel has exactly the declared parameters in TensorRT's order plus only such trailing
pointers, that the kernel never reads them (no ``ld.param`` of them in the PTX) and that Triton asked for no scratch
memory (``global_scratch_size == profile_scratch_size == 0``): whatever TensorRT leaves in those slots (null
padding) is never dereferenced. A kernel failing any of these is refused with its name.

Dimensions are ints here (the CPU tests) or TensorRT ``ShapeExpr`` (under ``plugins.py``): grids and extras use
only ``+ - * //`` on them. Dimensions that become constants (heads, head size, page size, the MoE widths) must be
ints: ``plugins.py`` reads them from TensorRT's constant shape expressions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .shapes import PluginShapeError, TensorInfo, cdiv

#: Triton element type of each m3export.dtypes name a plugin input or output may have.
TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int32": "i32", "int64": "i64",
                "float8_e4m3fn": "fp8e4nv", "uint8": "u8"}

#: Binary-search steps for a token's sequence (the torch launchers use log2(B); a constant here, because a compiled
#: kernel must serve every batch up to 2**16 sequences; the extra steps settle on the same answer).
LOG2_MAX_SEQS = 16

#: The default target: Hopper (H100 / H200).
SM90 = 90


def static(op: str, what: str, d: Any) -> int:
    """A dimension the kernel is compiled for: it must be a known int (TensorRT: a constant ShapeExpr)."""
    if isinstance(d, bool) or not isinstance(d, int):
        raise PluginShapeError(f"{op}: {what} must be static (known when the engine is built), got {d!r}")
    return d


@dataclass(frozen=True)
class KernelPlan:
    """Everything about one plugin launch except the compiled code: which wrapper, compiled how, launched how."""

    plugin: str
    kernel: Callable  # the @triton.jit wrapper in TensorRT's argument order
    signature: dict[str, str]  # runtime parameters in order: inputs, extras, outputs
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    num_inputs: int
    num_outputs: int
    extra_args: tuple  # int32 values / ShapeExprs, one per extra scalar parameter
    grid: tuple  # (x, y, z): ints / ShapeExprs

    @property
    def num_extras(self) -> int:
        return len(self.extra_args)


@dataclass(frozen=True)
class AotKernel:
    """What ``aot_impl`` returns to TensorRT, plus what the checks and the GPU launch test need."""

    plan: KernelPlan
    name: str
    ptx: str
    cubin: bytes
    shared_mem: int
    block: tuple[int, int, int]
    params: tuple[str, ...]  # PTX parameter types in order ('u64 ptr', 'u32', ...)
    hidden_params: int  # trailing parameters Triton added (scratch pointers), never read by the kernel
    metadata: dict = field(default_factory=dict)


class LaunchConventionError(RuntimeError):
    """A compiled kernel's parameters are not what TensorRT will pass; the message names kernel and parameter."""


def compile_plan(plan: KernelPlan, arch: int = SM90) -> AotKernel:
    """Compile ``plan`` for ``sm_{arch}`` with Triton (no GPU needed) and check its launch convention."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**plan.signature, **{k: "constexpr" for k in plan.constexprs}}
    compiled = triton.compile(ASTSource(plan.kernel, sig, dict(plan.constexprs)), target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=plan.num_warps, num_stages=plan.num_stages))
    md = compiled.metadata
    params, hidden = launch_convention(plan, compiled.asm["ptx"], md.name, md)
    return AotKernel(plan=plan, name=md.name, ptx=compiled.asm["ptx"], cubin=compiled.asm["cubin"],
                     shared_mem=int(md.shared), block=(int(md.num_warps) * 32, 1, 1), params=params,
                     hidden_params=hidden,
                     metadata={"triton": triton.__version__, "arch": arch, "num_warps": int(md.num_warps),
                               "num_stages": plan.num_stages, "global_scratch_size": int(md.global_scratch_size),
                               "profile_scratch_size": int(getattr(md, "profile_scratch_size", 0))})


_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)", re.S)
_PARAM = re.compile(r"\.param\s+\.(\w+)((?:\s+\.\w+(?:\s+\d+)?)*)\s+(\w+)")


def ptx_params(ptx: str, name: str) -> list[tuple[str, str]]:
    """(type, PTX parameter name) of kernel ``name``'s parameters, in order."""
    for m in _ENTRY.finditer(ptx):
        if m[1] == name:
            out = []
            for p in _PARAM.finditer(m[2]):
                out.append((p[1] + (" ptr" if ".ptr" in p[2] else ""), p[3]))
            return out
    raise LaunchConventionError(f"{name}: no .entry of that name in the PTX")


def launch_convention(plan: KernelPlan, ptx: str, name: str, md: Any) -> tuple[tuple[str, ...], int]:
    """Check the compiled kernel against TensorRT's launch (see the module docstring). Returns (param types,
    number of hidden trailing parameters)."""
    params = ptx_params(ptx, name)
    declared = list(plan.signature.items())
    if len(params) < len(declared):
        raise LaunchConventionError(f"{name}: PTX has {len(params)} parameters, fewer than the {len(declared)} "
                                    "declared")
    for i, ((pname, ttype), (ptype, _)) in enumerate(zip(declared, params)):
        want = "u64 ptr" if ttype.startswith("*") else {"i32": "u32", "i64": "u64"}.get(ttype)
        if ptype != want:
            raise LaunchConventionError(f"{name}: parameter {i} ({pname}: {ttype}) is .{ptype} in the PTX, "
                                        f"expected .{want}")
    if plan.num_extras != len(declared) - plan.num_inputs - plan.num_outputs:
        raise LaunchConventionError(f"{name}: {plan.num_extras} extra arguments for "
                                    f"{len(declared) - plan.num_inputs - plan.num_outputs} scalar parameters")
    for i, (pname, ttype) in enumerate(declared):
        is_ptr = ttype.startswith("*")
        want_ptr = i < plan.num_inputs or i >= len(declared) - plan.num_outputs
        if is_ptr != want_ptr:
            raise LaunchConventionError(f"{name}: parameter {i} ({pname}) breaks TensorRT's order (inputs, int32 "
                                        "extras, outputs)")
        if not is_ptr and ttype != "i32":
            raise LaunchConventionError(f"{name}: extra argument {pname} is {ttype}; TensorRT passes int32 only")
    hidden = params[len(declared):]
    body = ptx[_ENTRY.search(ptx).end():] if _ENTRY.search(ptx) else ptx
    for ptype, pname in hidden:
        if ptype != "u64 ptr":
            raise LaunchConventionError(f"{name}: hidden parameter {pname} is .{ptype}, not a pointer")
        if re.search(rf"\[{re.escape(pname)}\]", body):
            raise LaunchConventionError(f"{name}: the kernel reads hidden parameter {pname} (Triton scratch), which "
                                        "TensorRT does not provide")
    for what in ("global_scratch_size", "profile_scratch_size"):
        if int(getattr(md, what, 0) or 0):
            raise LaunchConventionError(f"{name}: needs {what}={getattr(md, what)} bytes, which TensorRT does not "
                                        "allocate")
    # launch features TensorRT's plain launch (grid, block, dynamic shared memory) cannot reproduce
    for what, plain in (("num_ctas", 1), ("launch_cooperative_grid", False), ("launch_pdl", False), ("tmem_size", 0)):
        value = getattr(md, what, plain)
        if value != plain:
            raise LaunchConventionError(f"{name}: {what}={value!r} needs a launch TensorRT does not make")
    return tuple(t for t, _ in params), len(hidden)


def _wrappers() -> dict:
    """The @triton.jit wrappers (imported on first use, so importing this module needs no Triton)."""
    from .wrappers import WRAPPERS

    return WRAPPERS


_LOG2E = 1.4426950408889634


def _ptr(t: TensorInfo) -> str:
    return "*" + TRITON_TYPES[t.dtype]


def _prec(dtype: str) -> str:
    return "ieee" if dtype == "float32" else "tf32"


def _sig(names: Sequence[str], tensors: Sequence[TensorInfo], extras: Sequence[str], out_names: Sequence[str],
         outputs: Sequence[TensorInfo]) -> dict[str, str]:
    sig = {n: _ptr(t) for n, t in zip(names, tensors, strict=True)}
    sig.update({n: "i32" for n in extras})
    sig.update({n: _ptr(t) for n, t in zip(out_names, outputs, strict=True)})
    return sig


def _attention_consts(op, q: TensorInfo, k: TensorInfo, v: TensorInfo) -> dict:
    from m3export.plugins.kernels._batch import next_pow2  # the kernels' own tile arithmetic (needs Triton)

    hq, hkv = static(op, "query heads", q.shape[1]), static(op, "KV heads", k.shape[2])
    d, dv, page = static(op, "head size", q.shape[2]), static(op, "value head size", v.shape[3]), \
        static(op, "page size", k.shape[1])
    g = hq // hkv
    return dict(HQ=hq, HKV=hkv, G=g, G_PAD=next_pow2(g), D=d, BLOCK_D=next_pow2(max(d, 16)), DV=dv,
                BLOCK_DV=next_pow2(max(dv, 16)), PAGE=page, ROWS=max(16, next_pow2(g)), LOG2_SEQS=LOG2_MAX_SEQS,
                PREC=_prec(q.dtype))


def paged_attention(inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo], attrs: dict, tactic: int = 0
                    ) -> KernelPlan:
    """One program per (token, KV head), the whole context in one split."""
    q, k, v, bt, qsl, sl, pos = inputs
    c = _attention_consts("PagedAttention", q, k, v) | dict(BLOCK_N=64, QK_SCALE=float(attrs["scale"]) * _LOG2E)
    sig = _sig(("q_ptr", "k_ptr", "v_ptr", "bt_ptr", "qsl_ptr", "seq_lens_ptr", "pos_ptr"), inputs,
               ("num_seqs", "max_pages"), ("out_ptr",), outputs)
    return KernelPlan("PagedAttention", _wrappers()["PagedAttention"], sig, c, 4, 2, 7, 1,
                      (sl.shape[0], bt.shape[1]), (q.shape[0], c["HKV"], 1))


def sparse_paged_attention(inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo], attrs: dict,
                           tactic: int = 0) -> KernelPlan:
    from m3export.plugins.kernels._batch import next_pow2

    q, k, v, bt, qsl, sl, pos, sel = inputs
    op = "SparsePagedAttention"
    topk = static(op, "selected blocks per token (block_idx dim 2)", sel.shape[2])
    bs = int(attrs["block_size"])
    c = _attention_consts(op, q, k, v) | dict(BS=bs, K=topk, K_PAD=next_pow2(max(topk, 2)),
                                              BLOCK_N=min(64, max(16, next_pow2(bs))),
                                              QK_SCALE=float(attrs["scale"]) * _LOG2E)
    sig = _sig(("q_ptr", "k_ptr", "v_ptr", "bt_ptr", "qsl_ptr", "seq_lens_ptr", "pos_ptr", "sel_ptr"), inputs,
               ("num_seqs", "max_pages"), ("out_ptr",), outputs)
    return KernelPlan(op, _wrappers()[op], sig, c, 4, 2, 8, 1, (sl.shape[0], bt.shape[1]), (q.shape[0], c["HKV"], 1))


#: LightningIndexerScan tactics: context splits per token (each split writes its own blocks; no merge needed).
SCAN_SPLITS = {0: 1, 1: 4, 2: 16}


def lightning_indexer_scan(inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo], attrs: dict,
                           tactic: int = 0) -> KernelPlan:
    from m3export.plugins.kernels._batch import next_pow2

    q, kc, bt, qsl, pos = inputs
    op = "LightningIndexerScan"
    h, d, page = static(op, "index heads", q.shape[1]), static(op, "index head size", q.shape[2]), \
        static(op, "page size", kc.shape[1])
    bs = int(attrs["block_size"])
    if bs & (bs - 1) or bs > 256:
        raise PluginShapeError(f"{op}: block_size {bs} must be a power of two <= 256 for the kernel")
    splits = SCAN_SPLITS[tactic]
    c = dict(H=h, H_PAD=next_pow2(h), D=d, BLOCK_D=next_pow2(max(d, 16)), PAGE=page, BS=bs,
             ROWS=max(16, next_pow2(h)), LOG2_SEQS=LOG2_MAX_SEQS, BLOCK_N=max(64, bs), SPLITS=splits,
             PREC=_prec(q.dtype))
    sig = _sig(("q_ptr", "k_ptr", "bt_ptr", "qsl_ptr", "pos_ptr"), inputs, ("num_seqs", "max_pages", "num_blocks"),
               ("out_ptr",), outputs)
    nb = cdiv(bt.shape[1] * page, bs)
    return KernelPlan(op, _wrappers()[op], sig, c, 4, 3, 5, 1, (qsl.shape[0] - 1, bt.shape[1], nb),
                      (q.shape[0], splits, 1))


def lightning_indexer_topk(inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo], attrs: dict,
                           tactic: int = 0) -> KernelPlan:
    from m3export.plugins.kernels import lightning_indexer as li

    scores, pos = inputs
    op = "LightningIndexerTopK"
    h = static(op, "index heads", scores.shape[1])
    nb_max = int(attrs["max_blocks"])
    topk, local = int(attrs["topk_blocks"]), int(attrs["local_blocks"])
    # the torch launcher's top-k (``li.topk_launch`` with the defaults): the tiers rank each row over its own length,
    # not over max_blocks (a plan is compiled for the whole max_model_len)
    tiers, warps = li.topk_launch(nb_max, topk, local, li.DEFAULTS["topk"])
    c = dict(H=h, NB=nb_max, BS=int(attrs["block_size"]), TOPK=topk, LOCAL=local, INIT=int(attrs["init_blocks"]),
             TIERS=(), GROUPED_FROM=0, LOCAL_PAD=1) | tiers
    sig = _sig(("scores_ptr", "pos_ptr"), inputs, ("num_blocks",), ("out_ptr",), outputs)
    return KernelPlan(op, _wrappers()[op], sig, c, warps, 1, 2, 1, (scores.shape[2],), (scores.shape[0], h, 1))


#: MXFP8Linear tactics: the torch launcher's tiles for decode, medium and large row counts (mxfp8_linear.tile_config).
LINEAR_TILES = {0: 1, 1: 64, 2: 512}


def mxfp8_linear(inputs: Sequence[TensorInfo], outputs: Sequence[TensorInfo], attrs: dict, tactic: int = 0
                 ) -> KernelPlan:
    x, w, s = inputs
    op = "MXFP8Linear"
    n, k = static(op, "weight rows", w.shape[0]), static(op, "weight columns", w.shape[1])
    from m3export.plugins.kernels.mxfp8_linear import tile_config

    cfg = tile_config(LINEAR_TILES[tactic], mx_mode2=x.dtype == "bfloat16")
    rows = x.shape[0]
    for d in x.shape[1:-1]:
        rows = rows * d
    c = dict(N=n, K=k, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
             F32=x.dtype == "float32", PREC="tf32", MX_MODE=cfg["MX_MODE"])
    sig = _sig(("x_ptr", "w_ptr", "s_ptr"), inputs, ("rows",), ("y_ptr",), outputs)
    return KernelPlan(op, _wrappers()[op], sig, c, cfg["num_warps"], cfg["num_stages"], 3, 1, (rows,),
                      (cdiv(n, cfg["BLOCK_N"]), cdiv(rows, cfg["BLOCK_M"]), 1))


#: MoE GEMV tiles (moe_gemv.launch's defaults): one program per (row, BLOCK_N output columns).
_GEMV = dict(BLOCK_N=32, BLOCK_K=128)


def moe_route(inputs, outputs, attrs, tactic=0) -> KernelPlan:
    from m3export.plugins.kernels._batch import next_pow2

    logits, bias = inputs
    e = static("MoERoute", "experts", logits.shape[1])
    block_e = next_pow2(e)
    block_t = max(1, min(16, 4096 // block_e))
    c = dict(E=e, TOP_K=int(attrs["top_k"]), BLOCK_T=block_t, BLOCK_E=block_e)
    sig = _sig(("logits_ptr", "bias_ptr"), inputs, ("num_tokens",), ("ids_ptr", "w_ptr"), outputs)
    t = logits.shape[0]
    return KernelPlan("MoERoute", _wrappers()["MoERoute"], sig, c, 4, 1, 2, 2, (t,), (cdiv(t, block_t), 1, 1))


def _gemv_plan(plugin, names, out_names, inputs, outputs, consts, rows, cols) -> KernelPlan:
    sig = _sig(names, inputs, (), out_names, outputs)
    return KernelPlan(plugin, _wrappers()[plugin], sig, consts | _GEMV, 4, 3, len(inputs), len(outputs), (),
                      (rows, cdiv(cols, _GEMV["BLOCK_N"]), 1))


def moe_gate_up(inputs, outputs, attrs, tactic=0) -> KernelPlan:
    mx = len(inputs) == 4
    plugin = "MoEGateUp" + ("MXFP8" if mx else "")
    x, w = inputs[0], inputs[1]
    h, i = static(plugin, "hidden", w.shape[2]), static(plugin, "expert width", w.shape[1]) // 2
    k = int(attrs["top_k"])
    c = dict(H=h, I=i, TOP_K=k, ALPHA=float(attrs["swiglu_alpha"]), LIMIT=float(attrs["swiglu_limit"]))
    names = ("x_ptr", "w_ptr", *(("s_ptr",) if mx else ()), "ids_ptr")
    return _gemv_plan(plugin, names, ("act_ptr",), inputs, outputs, c, x.shape[0] * k, i)


def moe_shared_gate_up(inputs, outputs, attrs, tactic=0) -> KernelPlan:
    mx = len(inputs) == 3
    plugin = "MoESharedGateUp" + ("MXFP8" if mx else "")
    x, w = inputs[0], inputs[1]
    h, i = static(plugin, "hidden", w.shape[1]), static(plugin, "shared width", w.shape[0]) // 2
    c = dict(H=h, I=i, ALPHA=float(attrs["swiglu_alpha"]), LIMIT=float(attrs["swiglu_limit"]))
    names = ("x_ptr", "w_ptr", *(("s_ptr",) if mx else ()))
    return _gemv_plan(plugin, names, ("act_ptr",), inputs, outputs, c, x.shape[0], i)


def moe_down(inputs, outputs, attrs, tactic=0) -> KernelPlan:
    mx = len(inputs) == 5
    plugin = "MoEDown" + ("MXFP8" if mx else "")
    act, w = inputs[0], inputs[1]
    h, i = static(plugin, "hidden", w.shape[1]), static(plugin, "expert width", w.shape[2])
    c = dict(H=h, I=i, TOP_K=int(attrs["top_k"]))
    names = ("act_ptr", "w_ptr", *(("s_ptr",) if mx else ()), "ids_ptr", "rw_ptr")
    return _gemv_plan(plugin, names, ("y_ptr",), inputs, outputs, c, act.shape[0], h)


def moe_shared_down(inputs, outputs, attrs, tactic=0) -> KernelPlan:
    mx = len(inputs) == 4
    plugin = "MoESharedDown" + ("MXFP8" if mx else "")
    act, w = inputs[0], inputs[1]
    h, i = static(plugin, "hidden", w.shape[0]), static(plugin, "shared width", w.shape[1])
    c = dict(H=h, I=i, TOP_K=int(attrs["top_k"]))
    names = ("act_ptr", "w_ptr", *(("s_ptr",) if mx else ()), "y_in_ptr")
    return _gemv_plan(plugin, names, ("y_ptr",), inputs, outputs, c, act.shape[0], h)


def moe_combine(inputs, outputs, attrs, tactic=0) -> KernelPlan:
    (y,) = inputs
    h = static("MoECombine", "hidden", y.shape[2])
    c = dict(H=h, TOP_K=int(attrs["top_k"]), SCALING=float(attrs["routed_scaling_factor"]), BLOCK_H=1024)
    sig = _sig(("y_ptr",), inputs, ("num_tokens",), ("out_ptr",), outputs)
    return KernelPlan("MoECombine", _wrappers()["MoECombine"], sig, c, 4, 1, 1, 1, (y.shape[0],),
                      (y.shape[0], cdiv(h, 1024), 1))


#: plugin -> (planner, tactics). Plugins absent here have no AOT kernel (see plugins/tensorrt/__init__.py).
PLANNERS: dict[str, tuple[Callable[..., KernelPlan], tuple[int, ...]]] = {
    "PagedAttention": (paged_attention, (0,)),
    "SparsePagedAttention": (sparse_paged_attention, (0,)),
    "LightningIndexerScan": (lightning_indexer_scan, tuple(SCAN_SPLITS)),
    "LightningIndexerTopK": (lightning_indexer_topk, (0,)),
    "MXFP8Linear": (mxfp8_linear, tuple(LINEAR_TILES)),
    "MoERoute": (moe_route, (0,)),
    "MoECombine": (moe_combine, (0,)),
    **{f"MoEGateUp{mx}": (moe_gate_up, (0,)) for mx in ("", "MXFP8")},
    **{f"MoESharedGateUp{mx}": (moe_shared_gate_up, (0,)) for mx in ("", "MXFP8")},
    **{f"MoEDown{mx}": (moe_down, (0,)) for mx in ("", "MXFP8")},
    **{f"MoESharedDown{mx}": (moe_shared_down, (0,)) for mx in ("", "MXFP8")},
}


def plan(plugin: str, inputs: Sequence[TensorInfo], attrs: dict, tactic: int = 0) -> KernelPlan:
    """The launch plan of ``plugin`` for these inputs (outputs from ``shapes``) and attributes."""
    from .shapes import PLUGINS

    if plugin not in PLANNERS:
        raise PluginShapeError(f"{plugin}: no ahead-of-time kernel (it runs through its ONNX function body or is "
                               "cut into kernel steps; see plugins/tensorrt/__init__.py)")
    planner, tactics = PLANNERS[plugin]
    if tactic not in tactics:
        raise PluginShapeError(f"{plugin}: tactic {tactic} is not one of {tactics}")
    outputs = PLUGINS[plugin].infer(inputs, attrs)
    return planner(inputs, outputs, attrs, tactic)
