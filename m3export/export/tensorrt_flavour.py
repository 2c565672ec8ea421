"""The TensorRT flavour of an exported graph: every ``m3`` node becomes the plugin node(s) TensorRT's ONNX parser
maps onto the ``m3`` plugins (``plugins/tensorrt``), and the ONNX function bodies are dropped.

TensorRT's parser turns a node it has no importer for into the plugin whose name is the node's ``op_type``, whose
version is the node's ``plugin_version`` attribute and whose namespace is its ``plugin_namespace`` attribute; an
``aot`` attribute of 1 selects the plugin's ahead-of-time implementation (the compiled Triton kernel, so the
engine runs without Python). Every other attribute is handed to the plugin as a field. Model-local functions would
be inlined by the parser instead, so the flavour graph carries none for ``m3`` ops.

Ops whose kernel needs more than one launch are cut into the steps of ``plugins/tensorrt/steps.py``
(``LightningIndexer`` -> ``LightningIndexerScan`` -> ``LightningIndexerTopK``, the top-k compiled for
``max_blocks = ceil(max_model_len / block_size)``; ``MoE`` / ``MoEMXFP8`` -> an fp32 router ``Gemm`` and six plugin
steps). Every plugin node is AOT. The graph keeps its inputs, outputs, initializers (external data) and every
other node, so the manifest's signatures describe it unchanged.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import helper

from ..errors import ArtifactError
from ..ops import DOMAIN
from .flavour_files import write_flavour_graphs

NAMESPACE = "m3"
PLUGIN_VERSION = "1"
FLAVOUR = "tensorrt"


def _plugin_attrs(aot: bool) -> list[onnx.AttributeProto]:
    return [helper.make_attribute("plugin_namespace", NAMESPACE), helper.make_attribute("plugin_version",
                                                                                        PLUGIN_VERSION),
            helper.make_attribute("aot", int(aot))]


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _moe_nodes(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """MoE / MoEMXFP8 -> router logits in fp32 (Cast, Cast, Gemm with transB: ``float(x) @ float(router)^T``) and the
    GEMV plugin chain of ``plugins/tensorrt/steps.py``; the shared expert's output is written in place into the
    routed output's last slot (``MoESharedDown``'s output aliases its ``y`` input)."""
    a = _attrs(node)
    mx = node.op_type == "MoEMXFP8"
    sfx = "MXFP8" if mx else ""
    if mx:
        x, router, bias, w13, s13, w2, s2, sw13, ss13, sw2, ss2 = node.input
    else:
        x, router, bias, w13, w2, sw13, sw2 = node.input
    p = f"{node.output[0]}.moe"
    name = node.name or node.output[0]
    w = lambda t, s: [t, s] if mx else [t]  # noqa: E731
    k = a["top_k"]
    swiglu = dict(swiglu_alpha=a["swiglu_alpha"], swiglu_limit=a["swiglu_limit"])
    f32 = onnx.TensorProto.FLOAT
    return [
        helper.make_node("Cast", [x], [f"{p}.x_f32"], name=f"{name}.x_f32", to=f32),
        helper.make_node("Cast", [router], [f"{p}.router_f32"], name=f"{name}.router_f32", to=f32),
        helper.make_node("Gemm", [f"{p}.x_f32", f"{p}.router_f32"], [f"{p}.logits"], name=f"{name}.router",
                         transB=1),
        helper.make_node("MoERoute", [f"{p}.logits", bias], [f"{p}.ids", f"{p}.weights"], name=f"{name}.route",
                         domain=DOMAIN, top_k=k),
        helper.make_node(f"MoEGateUp{sfx}", [x, *w(w13, s13 if mx else None), f"{p}.ids"], [f"{p}.act"],
                         name=f"{name}.gate_up", domain=DOMAIN, top_k=k, **swiglu),
        helper.make_node(f"MoESharedGateUp{sfx}", [x, *w(sw13, ss13 if mx else None)], [f"{p}.act_shared"],
                         name=f"{name}.shared_gate_up", domain=DOMAIN, **swiglu),
        helper.make_node(f"MoEDown{sfx}", [f"{p}.act", *w(w2, s2 if mx else None), f"{p}.ids", f"{p}.weights"],
                         [f"{p}.y_routed"], name=f"{name}.down", domain=DOMAIN, top_k=k),
        helper.make_node(f"MoESharedDown{sfx}", [f"{p}.act_shared", *w(sw2, ss2 if mx else None), f"{p}.y_routed"],
                         [f"{p}.y"], name=f"{name}.shared_down", domain=DOMAIN, top_k=k),
        helper.make_node("MoECombine", [f"{p}.y"], list(node.output), name=f"{name}.combine", domain=DOMAIN, top_k=k,
                         routed_scaling_factor=a["routed_scaling_factor"]),
    ]


def flavour_graph(model: onnx.ModelProto, max_model_len: int) -> tuple[onnx.ModelProto, dict]:
    """A copy of ``model`` with plugin nodes; returns it and a record of what was rewritten (for the manifest)."""
    from m3export.plugins.tensorrt.shapes import OP_PLUGINS
    from m3export.plugins.tensorrt.steps import STEPS, max_blocks

    if max_model_len < 1:
        raise ArtifactError(f"max_model_len must be >= 1, got {max_model_len}")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes: list[onnx.NodeProto] = []
    counts: dict[str, int] = {}
    aot_flags: dict[str, bool] = {}
    for node in model.graph.node:
        if node.domain != DOMAIN:
            nodes.append(node)
            continue
        if node.op_type not in STEPS:
            raise ArtifactError(f"node {node.name or node.op_type}: m3::{node.op_type} has no TensorRT plugin")
        takes = OP_PLUGINS[node.op_type].inputs
        given = len(node.input)
        while given and not node.input[given - 1]:  # omitted optional inputs ("") at the end
            given -= 1
        if given > len(takes):  # e.g. the FP8 cache's scale pools, optional trailing inputs
            raise ArtifactError(f"node {node.name or node.op_type}: m3::{node.op_type} has {given} inputs, its "
                                f"TensorRT plugin takes {len(takes)} ({', '.join(takes)}); the plugins read no FP8 "
                                "cache (scale inputs) yet")
        if given < len(node.input):
            trimmed = onnx.NodeProto()
            trimmed.CopyFrom(node)
            del trimmed.input[given:]
            node = trimmed
        steps = STEPS[node.op_type]
        if node.op_type == "LightningIndexer":
            a = _attrs(node)
            index_q, kc, bt, qsl, _seq_lens, pos = node.input
            scores = f"{node.output[0]}.block_scores"
            scan = helper.make_node("LightningIndexerScan", [index_q, kc, bt, qsl, pos], [scores],
                                    name=f"{node.name}.scan", domain=DOMAIN, block_size=a["block_size"])
            topk = helper.make_node("LightningIndexerTopK", [scores, pos], list(node.output), name=f"{node.name}.topk",
                                    domain=DOMAIN, block_size=a["block_size"], topk_blocks=a["topk_blocks"],
                                    local_blocks=a["local_blocks"], init_blocks=a["init_blocks"],
                                    max_blocks=max_blocks(max_model_len, a["block_size"]))
            new = [scan, topk]
        elif node.op_type in ("MoE", "MoEMXFP8"):
            new = _moe_nodes(node)
        else:
            new = [onnx.NodeProto()]
            new[0].CopyFrom(node)
        for n in new:
            if n.domain != DOMAIN:  # the router's fp32 MatMul and its Casts: standard ONNX
                continue
            n.attribute.extend(_plugin_attrs(aot=steps is not None))
            counts[n.op_type] = counts.get(n.op_type, 0) + 1
            aot_flags[n.op_type] = steps is not None
        nodes.extend(new)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    kept = [f for f in out.functions if f.domain != DOMAIN]
    del out.functions[:]
    out.functions.extend(kept)
    record = {"flavour": FLAVOUR, "plugin_namespace": NAMESPACE, "plugin_version": PLUGIN_VERSION,
              "max_model_len": max_model_len, "plugin_nodes": dict(sorted(counts.items())),
              "aot": sorted(n for n, a in aot_flags.items() if a),
              "python_impl": sorted(n for n, a in aot_flags.items() if not a)}
    return out, record


def flavour_file(graph: str) -> str:
    return f"{graph}.trt.onnx"


def write_flavour_files(directory: Path, graphs: dict, max_model_len: int, names: list[str] | None = None,
                        protected: set[str] = frozenset()) -> dict:
    """Write ``<graph>.trt.onnx`` beside each graph file of ``graphs`` (name -> manifest ``GraphInfo``) in
    ``directory``, where the graphs' external data resolves (parsers read it relative to the graph, and ONNX
    refuses symbolic or hard links to it), through the flavours' one writer (``flavour_files``: atomic;
    ``protected`` files are never replaced, an earlier build's flavour file is). Returns the manifest record:
    per graph, the file, its source and external data, and what was rewritten."""
    return write_flavour_graphs(directory, graphs, names or [g for g in graphs if g != "vision"], FLAVOUR,
                                flavour_file, lambda name, model: flavour_graph(model, max_model_len),
                                protected=protected, replace=True)


def write_flavour(artifact, max_model_len: int, graphs: list[str] | None = None) -> dict:
    """The flavour of an exported artifact's graphs (``write_flavour_files`` in its directory); the artifact's own
    files are never touched, an earlier build's flavour files are replaced. An artifact with an FP8 cache is
    refused: the plugins read no E4M3 pools."""
    from .manifest import KV_FP8

    if artifact.manifest.cache_dtype == KV_FP8:
        raise ArtifactError(f"{artifact.root}: exported with an FP8 cache (kv_cache_dtype {KV_FP8}), which the "
                            "TensorRT plugins do not read; export it again without --kv-cache-dtype fp8 to build "
                            "TensorRT engines")
    return write_flavour_files(artifact.root, artifact.graphs, max_model_len, graphs,
                               protected=set(artifact.manifest.files))
