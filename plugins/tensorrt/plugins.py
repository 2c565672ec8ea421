"""Register every m3 plugin with TensorRT's Python plugin API (``tensorrt.plugin``, TensorRT >= 10.9; 11.x).

For each plugin of ``shapes.PLUGINS``, under the namespace ``m3`` (``m3::<Name>``, version "1"):

* ``register``: output shapes and types from ``shapes`` (the CPU-tested functions), on TensorRT's ShapeExprs;
* ``aot_impl`` (plugins with a kernel in ``aot.PLANNERS``): the Triton kernel compiled for the build GPU, its name,
  PTX, launch parameters and extra int32 arguments as symbolic expressions: engines then run without Python;
* ``impl``: the same op through the torch launchers of ``plugins/kernels`` (needs Python at run time; used when
  a node's ``aot`` attribute is 0; the TensorRT flavour writes every node AOT);
* ``autotune``: the dtypes each position accepts (activations fp32 / fp16 / bf16 together) and the tactics of
  ``aot.PLANNERS`` (context splits, linear tiles) that TensorRT times at build.

This module is the only one here that imports TensorRT; nothing in it runs on a machine without TensorRT (it
cannot be installed on the development machine), so it is kept to a thin translation of the tested functions.
"""

from __future__ import annotations

from typing import Any

from . import aot
from .shapes import PLUGINS, PluginDef, TensorInfo

NAMESPACE = "m3"
VERSION = "1"

_ATTR_TYPES = {"scale": "float", "routed_scaling_factor": "float", "swiglu_alpha": "float",
               "swiglu_limit": "float"}  # every other attribute is an int
_DTYPES = ("float32", "float16", "bfloat16", "int32", "int64", "uint8", "float8_e4m3fn")
_AUTOTUNE_NAMES = {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16", "int32": "INT32", "int64": "INT64",
                   "uint8": "UINT8", "float8_e4m3fn": "FP8"}
_registered: list[str] | None = None


def _trt():
    from m3export.runtime.backends.tensorrt_backend import require_tensorrt

    trt = require_tensorrt()
    import tensorrt.plugin as trtp

    return trt, trtp


def dtype_maps(trt) -> tuple[dict, dict]:
    """m3export.dtypes name -> TensorRT DataType, and back (the types plugin and engine I/O tensors may have)."""
    to_trt = {"float32": trt.float32, "float16": trt.float16, "bfloat16": trt.bfloat16, "int32": trt.int32,
              "int64": trt.int64, "uint8": trt.uint8, "float8_e4m3fn": trt.fp8}
    return to_trt, {v: k for k, v in to_trt.items()}


def _dim(d: Any) -> Any:
    """A ShapeExpr that is a build-time constant becomes an int (the kernels are compiled for it)."""
    try:
        if d.is_constant:
            return int(d.constant_value())
    except (AttributeError, RuntimeError):  # an int already, or a "fake" ShapeExpr outside shape calculations
        pass
    return d


def _info(desc, from_trt) -> TensorInfo:
    return TensorInfo(tuple(_dim(d) for d in desc.shape_expr), from_trt[desc.dtype])


def _io_types(p: PluginDef) -> list[str]:
    """Per input and output position, the dtypes it accepts as a TensorRT autotune string; activation positions
    (those whose dtype follows the first input) list FP32|FP16|BF16 in the same order, so they vary together."""
    from .shapes import E4M3, UE8M0

    fixed = {"block_tables": "INT32", "query_start_loc": "INT32", "seq_lens": "INT32", "positions": "INT64",
             "block_idx": "INT32", "selected_blocks": "INT32", "block_scores": "FP32",
             "router_weight": "FP32|FP32|FP32", "e_score_correction_bias": "FP32|FP32|FP32",
             "router_logits": "FP32", "expert_ids": "INT32", "expert_weights": "FP32"}
    if p.name == "MoERoute":  # no activation position: the router runs in fp32
        fixed["e_score_correction_bias"] = "FP32"
    mx = p.name.endswith("MXFP8") or p.name == "MXFP8Linear"
    out = []
    for name in (*p.inputs, *p.outputs):
        if name in fixed:
            out.append(fixed[name])
        elif name.endswith("_scale") or name == "weight_scale":
            out.append(_AUTOTUNE_NAMES[UE8M0])
        elif mx and name in ("weight", "w13", "w2", "shared_w13", "shared_w2"):
            out.append(_AUTOTUNE_NAMES[E4M3])
        else:
            out.append("FP32|FP16|BF16")
    return out


def _define(name: str, params: list[tuple[str, str]], returns: str, body: str, env: dict):
    """A function with these annotated parameters (tensorrt.plugin reads signatures and annotations)."""
    sig = ", ".join(f"{n}: {a}" for n, a in params)
    src = f"def {name}({sig}) -> {returns}:\n" + "".join(f"    {line}\n" for line in body.splitlines())
    scope: dict = {}
    exec(compile(src, f"<m3 plugin {name}>", "exec"), env, scope)  # noqa: S102 - our own generated signature
    return scope[name]


def register() -> list[str]:
    """Register every plugin with TensorRT (idempotent); returns their names. BackendUnavailable without TensorRT."""
    global _registered
    if _registered is not None:
        return _registered
    trt, trtp = _trt()
    to_trt, from_trt = dtype_maps(trt)
    for p in PLUGINS.values():
        _register_one(p, trt, trtp, to_trt, from_trt)
    _registered = sorted(PLUGINS)
    return _registered


def _register_one(p: PluginDef, trt, trtp, to_trt, from_trt) -> None:
    pid = f"{NAMESPACE}::{p.name}"
    ins = [(n, "trtp.TensorDesc") for n in p.inputs]
    attrs = [(a, _ATTR_TYPES.get(a, "int")) for a in p.attributes]
    n_out = len(p.outputs)
    env = {"trtp": trtp, "Tuple": tuple, "_impl": None}
    args = ", ".join(p.inputs)
    attr_dict = "{" + ", ".join(f"'{a}': {a}" for a in p.attributes) + "}"

    def shapes(inputs, attr_values):
        outs = p.infer([_info(d, from_trt) for d in inputs], attr_values)
        aliased = dict(p.aliases)  # written in place: the output is its input's buffer
        return tuple(inputs[aliased[j]].aliased() if j in aliased else
                     trtp.from_shape_expr(tuple(o.shape), dtype=to_trt[o.dtype]) for j, o in enumerate(outs))

    env["_shapes"] = shapes
    desc = _define(f"{p.name}_desc", ins + attrs, "Tuple[" + ", ".join(["trtp.TensorDesc"] * n_out) + "]",
                   f"return _shapes([{args}], {attr_dict})", env)
    trtp.register(pid)(desc)

    tactics = [t + 1 for t in aot.PLANNERS.get(p.name, (None, (0,)))[1]]  # TensorRT tactic ids start at 1

    def autotune(inputs, outputs):
        c = trtp.AutoTuneCombination(", ".join(_io_types(p)), "LINEAR")
        if len(tactics) > 1:
            c.tactics(tactics)
        return [c]

    env["_autotune"] = autotune
    tune = _define(f"{p.name}_autotune", ins + [("outputs", "Tuple[trtp.TensorDesc]")],
                   "list", f"return _autotune([{args}], outputs)", env)
    trtp.autotune(pid)(tune)

    if p.name in aot.PLANNERS:
        def aot_impl(inputs, attr_values, outputs, tactic):
            infos = [_info(d, from_trt) for d in inputs]
            plan = aot.plan(p.name, infos, attr_values, max(0, int(tactic or 1) - 1))
            k = aot.compile_plan(plan, _device_arch())
            launch = trtp.KernelLaunchParams()
            launch.grid_x, launch.grid_y, launch.grid_z = plan.grid
            launch.block_x, launch.block_y, launch.block_z = k.block
            launch.shared_mem = k.shared_mem
            extra = trtp.SymIntExprs(len(plan.extra_args))
            for i, v in enumerate(plan.extra_args):
                extra[i] = trtp.SymInt32(v)
            return k.name.encode(), k.ptx.encode(), launch, extra

        env["_aot"] = aot_impl
        fn = _define(f"{p.name}_aot_impl", ins + attrs + [("outputs", "Tuple[trtp.TensorDesc]"), ("tactic", "int")],
                     "tuple", f"return _aot([{args}], {attr_dict}, outputs, tactic)", env)
        trtp.aot_impl(pid)(fn)

    def impl(inputs, attr_values, outputs, stream):
        import torch

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            tin = [torch.as_tensor(t, device="cuda") for t in inputs]
            tout = [torch.as_tensor(t, device="cuda") for t in outputs]
            results = _run_python(p, tin, attr_values)
            for o, r in zip(tout, results):
                o.copy_(r)

    env["_impl"] = impl
    fn = _define(f"{p.name}_impl", [(n, "trtp.Tensor") for n in p.inputs] + attrs +
                 [("outputs", "Tuple[trtp.Tensor]"), ("stream", "int")], "None",
                 f"_impl([{args}], {attr_dict}, outputs, stream)", env)
    trtp.impl(pid)(fn)


def _run_python(p: PluginDef, inputs, attrs) -> list:
    """The plugin through the torch launchers (JIT path): the op's kernel, or the step's wrapper kernel."""
    from m3export.ops import OPS
    from m3export.plugins.kernels import kernels

    from .launch import run_wrapper, tensor_infos

    if p.name in OPS:
        return [kernels()[OPS[p.name]](*inputs, *attrs.values())]
    import torch

    infos = tensor_infos(inputs)
    outs = [torch.empty(o.shape, dtype=_torch(o.dtype), device=inputs[0].device) for o in p.infer(infos, attrs)]
    run_wrapper(aot.plan(p.name, infos, attrs), [t.contiguous() for t in inputs], outs)
    return outs


def _torch(name: str):
    from m3export.dtypes import by_name

    return by_name(name).torch


def _device_arch() -> int:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor
