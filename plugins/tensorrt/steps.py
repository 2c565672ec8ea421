"""Which plugin nodes an ``m3`` op becomes in the TensorRT flavour of a graph, and running that chain without
TensorRT (each step's AOT kernel launched with TensorRT's argument list) for the tests and the H200 check.

An AOT plugin launches exactly one kernel, so an op whose kernel needs two launches is cut into steps joined by an
intermediate tensor: ``LightningIndexer`` -> ``LightningIndexerScan`` (fp32 block maxima ``[T, H, NB]``) ->
``LightningIndexerTopK``. ``MoE`` / ``MoEMXFP8`` have no AOT chain yet (routing, the grouped GEMMs and the combine
are five launches plus torch glue in ``plugins/kernels/moe.py``): their plugin runs the Triton launcher through
TensorRT's Python ``impl`` (the engine then needs Python at run time), and the flavour graph marks them non-AOT.
"""

from __future__ import annotations

from typing import Sequence

from . import aot
from .shapes import PLUGINS, TensorInfo

#: op -> its plugin nodes in order; None: one non-AOT plugin node (Python impl).
STEPS: dict[str, tuple[str, ...] | None] = {
    "LightningIndexer": ("LightningIndexerScan", "LightningIndexerTopK"),
    "PagedAttention": ("PagedAttention",),
    "SparsePagedAttention": ("SparsePagedAttention",),
    "MXFP8Linear": ("MXFP8Linear",),
    "MoE": None,
    "MoEMXFP8": None,
}


def max_blocks(max_model_len: int, block_size: int) -> int:
    """The bound ``LightningIndexerTopK`` is compiled for: every block of a sequence of ``max_model_len`` tokens."""
    return -(-int(max_model_len) // int(block_size))


def _tactic(plugin: str, wanted: int) -> int:
    tactics = aot.PLANNERS[plugin][1]
    return wanted if wanted in tactics else tactics[0]


def run_plugin_steps(op: str, inputs: Sequence, attrs: dict, compiled: bool = False, cache: dict | None = None):
    """Run ``op`` as its chain of plugin kernels on torch tensors; ``attrs`` may carry ``_tactic`` and
    ``_max_blocks`` (default: the batch's block count plus slack, to exercise the compiled bound).

    ``compiled`` False launches the wrappers through Triton's launcher (interpreter on CPU, JIT on GPU); True
    compiles the AOT artifact (PTX) and launches it through the CUDA driver (``launch.DriverKernel``)."""
    import torch

    from .launch import DriverKernel, run_wrapper, tensor_infos

    steps = STEPS[op]
    if steps is None:
        raise NotImplementedError(f"{op}: no AOT kernel chain (see plugins/tensorrt/steps.py)")
    tactic = int(attrs.get("_tactic", 0))
    attrs = {k: v for k, v in attrs.items() if not k.startswith("_")} | {
        k[1:]: v for k, v in attrs.items() if k == "_max_blocks"}
    device = inputs[0].device

    def launch(plugin, ins, step_attrs):
        infos = tensor_infos(ins)
        outs_info = PLUGINS[plugin].infer(infos, step_attrs)
        plan = aot.plan(plugin, infos, step_attrs, _tactic(plugin, tactic))
        outs = [torch.empty(o.shape, dtype=_torch_dtype(o.dtype), device=device) for o in outs_info]
        ins = [t.contiguous() for t in ins]
        if compiled:
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
    (out,) = launch(steps[0], list(inputs), attrs)
    return out


def _torch_dtype(name: str):
    from m3export.dtypes import by_name

    return by_name(name).torch


__all__ = ["STEPS", "TensorInfo", "max_blocks", "run_plugin_steps"]
