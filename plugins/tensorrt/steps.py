"""Which plugin nodes an ``m3`` op becomes in the TensorRT flavour of a graph, and running that chain without
TensorRT (each step's AOT kernel launched with TensorRT's argument list) for the tests and the H200 check.

An AOT plugin launches exactly one kernel, so an op whose kernel needs two launches is cut into steps joined by an
intermediate tensor: ``LightningIndexer`` -> ``LightningIndexerScan`` (fp32 block maxima ``[T, H, NB]``) ->
``LightningIndexerTopK``; ``MoE`` / ``MoEMXFP8`` become an fp32 router MatMul (standard ONNX) then
``MoERoute`` -> ``MoEGateUp`` -> ``MoESharedGateUp`` -> ``MoEDown`` -> ``MoESharedDown`` (writes the shared slot of
the routed output in place: an aliased output) -> ``MoECombine``, on the permutation-free GEMV kernels of
``plugins/kernels/moe_gemv.py`` (the grouped tensor-core GEMMs of ``moe.py`` need a device-side permutation with
torch glue between launches).
"""

from __future__ import annotations

from typing import Callable, Sequence

from . import aot
from .shapes import PLUGINS, TensorInfo

#: op -> its plugin nodes in order (every one an AOT kernel).
STEPS: dict[str, tuple[str, ...] | None] = {
    "LightningIndexer": ("LightningIndexerScan", "LightningIndexerTopK"),
    "PagedAttention": ("PagedAttention",),
    "SparsePagedAttention": ("SparsePagedAttention",),
    "MXFP8Linear": ("MXFP8Linear",),
    "MoE": ("MoERoute", "MoEGateUp", "MoESharedGateUp", "MoEDown", "MoESharedDown", "MoECombine"),
    "MoEMXFP8": ("MoERoute", "MoEGateUpMXFP8", "MoESharedGateUpMXFP8", "MoEDownMXFP8", "MoESharedDownMXFP8",
                 "MoECombine"),
}


def max_blocks(max_model_len: int, block_size: int) -> int:
    """The bound ``LightningIndexerTopK`` is compiled for: every block of a sequence of ``max_model_len`` tokens."""
    return -(-int(max_model_len) // int(block_size))


def _tactic(plugin: str, wanted: int) -> int:
    tactics = aot.PLANNERS[plugin][1]
    return wanted if wanted in tactics else tactics[0]


def run_plugin_steps(op: str, inputs: Sequence, attrs: dict, compiled: bool = False, cache: dict | None = None,
                     launcher: Callable | None = None):
    """Run ``op`` as its chain of plugin kernels on torch tensors; ``attrs`` may carry ``_tactic`` and
    ``_max_blocks`` (default: the batch's block count plus slack, to exercise the compiled bound).

    ``compiled`` False launches the wrappers through Triton's launcher (interpreter on CPU, JIT on GPU); True
    compiles the AOT artifact (PTX) and launches it through the CUDA driver (``launch.DriverKernel``).
    ``launcher(plan, inputs, outputs)``, when given, makes every launch instead (the H200 test: the artifacts
    ``compile.py`` wrote, launched with the formulas of ``kernels.json``)."""
    import torch

    from .launch import DriverKernel, run_wrapper, tensor_infos

    steps = STEPS[op]
    if steps is None:
        raise NotImplementedError(f"{op}: no AOT kernel chain (see plugins/tensorrt/steps.py)")
    tactic = int(attrs.get("_tactic", 0))
    attrs = {k: v for k, v in attrs.items() if not k.startswith("_")} | {
        k[1:]: v for k, v in attrs.items() if k == "_max_blocks"}
    device = inputs[0].device

    def launch(plugin, ins, step_attrs, alias=None):
        infos = tensor_infos(ins)
        outs_info = PLUGINS[plugin].infer(infos, step_attrs)
        plan = aot.plan(plugin, infos, step_attrs, _tactic(plugin, tactic))
        ins = [t.contiguous() for t in ins]
        # an aliased output is its input's buffer (TensorRT: TensorDesc.aliased()), written in place
        outs = [(alias or {}).get(i) if (alias or {}).get(i) is not None else
                torch.empty(o.shape, dtype=_torch_dtype(o.dtype), device=device) for i, o in enumerate(outs_info)]
        if launcher is not None:
            launcher(plan, ins, outs)
        elif compiled:
            key = (plugin, repr(sorted(plan.constexprs.items())), tuple(plan.signature.values()))
            kernel = (cache if cache is not None else {}).get(key)
            if kernel is None:
                cc = torch.cuda.get_device_capability(device)
                kernel = DriverKernel(aot.compile_plan(plan, cc[0] * 10 + cc[1]))
                if cache is not None:
                    cache[key] = kernel
            kernel.launch(ins, outs)
        else:
            run_wrapper(plan, ins, outs)
        return outs

    if op == "LightningIndexer":
        index_q, kc, bt, qsl, seq_lens, pos = inputs
        nb = -(-bt.shape[1] * kc.shape[1] // attrs["block_size"])
        (scores,) = launch("LightningIndexerScan", [index_q, kc, bt, qsl, pos], {"block_size": attrs["block_size"]})
        topk_attrs = {k: attrs[k] for k in ("block_size", "topk_blocks", "local_blocks", "init_blocks")}
        topk_attrs["max_blocks"] = int(attrs.get("max_blocks", nb + 5))
        (sel,) = launch("LightningIndexerTopK", [scores, pos], topk_attrs)
        return sel
    if op in ("MoE", "MoEMXFP8"):
        return _moe(op, inputs, attrs, launch)
    (out,) = launch(steps[0], list(inputs), attrs)
    return out


def _moe(op: str, inputs, attrs: dict, launch):
    """The MoE chain; the router logits are an fp32 MatMul in the graph (``tensorrt_flavour``), here torch's."""
    mx = op == "MoEMXFP8"
    if mx:
        x, router, bias, w13, s13, w2, s2, sw13, ss13, sw2, ss2 = inputs
    else:
        x, router, bias, w13, w2, sw13, sw2 = inputs
        s13 = s2 = ss13 = ss2 = None
    k = int(attrs["top_k"])
    sfx = "MXFP8" if mx else ""
    swiglu = {"swiglu_alpha": attrs["swiglu_alpha"], "swiglu_limit": attrs["swiglu_limit"]}
    w = lambda t, s: [t] if s is None else [t, s]  # noqa: E731
    logits = x.float() @ router.float().t()
    ids, weights = launch("MoERoute", [logits, bias], {"top_k": k})
    (act,) = launch(f"MoEGateUp{sfx}", [x, *w(w13, s13), ids], {"top_k": k, **swiglu})
    (act_s,) = launch(f"MoESharedGateUp{sfx}", [x, *w(sw13, ss13)], swiglu)
    (y,) = launch(f"MoEDown{sfx}", [act, *w(w2, s2), ids, weights], {"top_k": k})
    (y,) = launch(f"MoESharedDown{sfx}", [act_s, *w(sw2, ss2), y], {"top_k": k}, alias={0: y})
    (out,) = launch("MoECombine", [y], {"top_k": k, "routed_scaling_factor": attrs["routed_scaling_factor"]})
    return out


def _torch_dtype(name: str):
    from m3export.dtypes import by_name

    return by_name(name).torch


__all__ = ["STEPS", "TensorInfo", "max_blocks", "run_plugin_steps"]
