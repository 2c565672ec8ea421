"""The paged-runtime graphs: ``model.onnx`` (one step of the main model) and ``mtp{k}.onnx`` (one MTP module).

Graphs are traced from a model on the ``meta`` device, so exporting costs the same whatever the weights weigh;
every parameter then becomes an external-data reference into the artifact's weight file. Caches are written
functionally (``inplace=False``), so each pool update is one ScatterND whose output is a graph output: a runtime
binds the same buffer to ``k_cache.{i}`` and ``k_cache_out.{i}`` and ONNX Runtime writes in place.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import onnxscript.optimizer
import onnxscript.rewriter
import torch
from torch import nn

from ..dtypes import BY_NAME
from ..model import Batch, M3ForCausalLM
from ..model.batch import Segment, build_batch
from ..model.media import place_rows
from ..ops import kv_fp8 as kv_fp8_format
from ..safetensors_io import TensorEntry
from .functions import functions_for
from .manifest import SCALE_POOLS
from .schemas import ONNX_OPSET
from .translation import translation_table
from .weights import ParamEntry
from .zero_copy import assemble

BATCH_INPUTS = (*Batch.input_names(), "logits_indices")  # what every step graph takes besides tokens and pools
POOLS = ("k_cache", "v_cache", "index_k_cache")  # per layer; dense layers have no index keys
# An FP8 (E4M3) cache (``--kv-cache-dtype fp8``): each pool holds uint8 codes and has an fp32 scale pool, a graph
# input and aliased output after the layer's pools (the order of ``M3ForCausalLM.cache_shapes(scales=True)``).
SCALES = SCALE_POOLS
# A vision-language model's step graph (its first part) also takes media embeddings placed over the token
# embeddings: rows [M] of the step's tokens take media_embeds [M, hidden]. Text-only steps feed M = 0, so a decode
# step adds one ScatterND with no updates over its [T, hidden] embeddings (an inputs_embeds input instead would
# carry [T, hidden] into every step, a separate embedding graph one more session run per step).
MEDIA_INPUTS = ("media_rows", "media_embeds")
ROOT = "m3"  # attribute under which the wrappers hold the model; stripped from initializer names
IR_VERSION = 10
# onnxscript's default rewrites minus those whose pattern has several output nodes: their matcher tries node
# combinations across the whole graph (quadratic: hours at 60 layers) and none of them applies to M3 anyway.
_REWRITE_RULES = [r for r in onnxscript.rewriter._DEFAULT_REWRITE_RULES if r._target_pattern.has_single_output_node]
PIECED = "pieced"  # location of a multi-piece parameter's stand-in while the graph is optimised (never written)  # ORT 1.30 / 1.31 reject the IR 11+ that onnx 1.23 writes by default


class StepGraph(nn.Module):
    """model.onnx (all layers), or one part of a split export (``model.part{j}.onnx``: a group of layers).

    The first part takes ``input_ids``, later parts the residual stream ``hidden_in``; the last part applies the
    final norm and lm_head (``logits``, ``hidden``), earlier ones hand on ``hidden_out``. Caches in and out, per layer.
    With a vision tower the first part also takes ``MEDIA_INPUTS`` (after the pools). ``kv_fp8``: each layer's
    pools are uint8 E4M3 code pools followed by their scale pools.
    """

    def __init__(self, model: M3ForCausalLM, layers: range | None = None, kv_fp8: bool = False):
        super().__init__()
        setattr(self, ROOT, model)
        n = model.config.num_hidden_layers
        self.layers = layers or range(n)
        self.first, self.last = self.layers.start == 0, self.layers.stop == n
        self.media = self.first and model.config.vision is not None
        arity = [len(s) for s in model.cache_shapes(1, 1, scales=kv_fp8)]
        self.cache_arity = [arity[i] for i in self.layers]

    def forward(self, *inputs):
        """Inputs in ``step_signature`` order: x, the batch, logits_indices (last part only), the pools, the media
        rows and embeddings (first part of a vision-language model only)."""
        x, (batch, rest) = inputs[0], Batch.from_inputs(inputs[1:])
        media_rows, media_embeds = rest[-2:] if self.media else (None, None)
        rest = rest[:-2] if self.media else rest
        logits_indices, pools = (rest[0], rest[1:]) if self.last else (None, rest)
        caches, i = [], 0
        for n in self.cache_arity:
            caches.append(tuple(pools[i:i + n]))
            i += n
        m = getattr(self, ROOT)
        h = m.model.embed_tokens(x) if self.first else x
        if self.media:
            h = place_rows(h, media_rows, media_embeds)
        h, caches, selections = m.run_layers(h, batch, caches, self.layers, inplace=False)
        pools_out = (p for layer in caches for p in layer)
        if not self.last:
            return (h, *pools_out, *selections)
        logits, hidden = m.head(h, logits_indices)
        return (logits.float(), hidden, *pools_out, *selections)


class MTPGraph(nn.Module):
    """mtp{k}.onnx: MTP module k (input_ids are the next tokens, hidden the main model's final-normed h)."""

    def __init__(self, model: M3ForCausalLM, k: int):
        super().__init__()
        setattr(self, ROOT, model)
        self.k = k

    def forward(self, *inputs):
        """Inputs in ``mtp_signature`` order: input_ids, hidden, the batch, logits_indices, the three pools (and
        their three scale pools with an FP8 cache)."""
        input_ids, hidden = inputs[:2]
        batch, (logits_indices, *pools) = Batch.from_inputs(inputs[2:])
        logits, out, cache, sel = getattr(self, ROOT).mtp_step(
            self.k, input_ids, hidden, batch, tuple(pools), logits_indices, inplace=False
        )
        return (logits.float(), out, *cache, sel)


@dataclass(frozen=True)
class GraphSignature:
    """Names of a graph's inputs and outputs, in order, and which pool outputs alias which inputs."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    aliases: dict[str, str]  # cache output -> the cache input it updates in place


def _layer_pools(sparse: bool, kv_fp8: bool) -> tuple[str, ...]:
    """A layer's pool names in cache-tuple order: the pools, then (FP8) their scale pools."""
    n = 3 if sparse else 2
    return POOLS[:n] + (SCALES[:n] if kv_fp8 else ())


def step_signature(model: M3ForCausalLM, layers: range | None = None, kv_fp8: bool = False) -> GraphSignature:
    cfg = model.config
    layers = layers or range(cfg.num_hidden_layers)
    first, last = layers.start == 0, layers.stop == cfg.num_hidden_layers
    batch = BATCH_INPUTS if last else tuple(b for b in BATCH_INPUTS if b != "logits_indices")
    ins = ["input_ids" if first else "hidden_in", *batch]
    outs, aliases, sel = (["logits", "hidden"] if last else ["hidden_out"]), {}, []
    for i in layers:
        for n in _layer_pools(cfg.is_sparse_layer(i), kv_fp8):
            ins.append(f"{n}.{i}")
            outs.append(f"{n}_out.{i}")
            aliases[f"{n}_out.{i}"] = f"{n}.{i}"
        if cfg.is_sparse_layer(i):
            sel.append(f"selection.{i}")
    if first and cfg.vision is not None:
        ins += MEDIA_INPUTS
    return GraphSignature(tuple(ins), tuple(outs + sel), aliases)


def mtp_signature(kv_fp8: bool = False) -> GraphSignature:
    pools = _layer_pools(True, kv_fp8)
    return GraphSignature(
        ("input_ids", "hidden", *BATCH_INPUTS, *pools),
        ("logits", "hidden_out", *(f"{p}_out" for p in pools), "selection"),
        {f"{p}_out": p for p in pools},
    )


def _example(model: M3ForCausalLM, page_size: int, layers: str, kv_fp8: bool = False):
    """Meta-device inputs of a mixed batch (a 4-token prefill chunk after 2 cached tokens, plus a 3-token
    verify), sized so that no dynamic dimension is 0 or 1 or equal to another (T 7, B 2, N 5, max_pages >= 11,
    pages >= 32) for any page size: the tracer must not specialise or unify them. ``kv_fp8``: uint8 code pools
    (float8 pools viewed as their bytes) and fp32 scale pools.
    -> (input_ids, Batch, logits_indices, pools)."""
    lens, new = [6, 9], [4, 3]
    pages_per = [-(-n // page_size) for n in lens]
    segments = [Segment(list(range(first, first + p)), n - q, [0] * q)
                for first, p, n, q in zip((0, pages_per[0]), pages_per, lens, new)]
    ids, batch = build_batch(segments, page_size, min_table_width=max(pages_per) + 10)
    num_pages = sum(pages_per) + 30
    dtype = kv_fp8_format.FP8 if kv_fp8 else model.model.embed_tokens.weight.dtype
    pools = [p.view(torch.uint8) if p.dtype == kv_fp8_format.FP8 else p
             for layer in model.allocate_caches(num_pages, page_size, dtype, "meta", layers) for p in layer]
    logits_indices = torch.tensor([3, 5, 6, 1, 2], dtype=torch.int64)
    return ids.to("meta"), batch.to("meta"), logits_indices.to("meta"), pools


# Symbolic dimensions of every graph input by name (pools are named "<pool>" or "<pool>.<layer>").
INPUT_DIMS = {"input_ids": ("T",), "hidden_in": ("T",), "hidden": ("T",), "logits_indices": ("N",),
              **Batch.input_dims(), **dict.fromkeys(POOLS + SCALES, ("pages",)), **dict.fromkeys(MEDIA_INPUTS, ("M",))}


def dynamic_shapes(names: tuple[str, ...]) -> tuple:
    """``torch.export`` dynamic shapes for a graph whose ``forward`` takes ``names`` in order, declared by name."""
    d = torch.export.Dim
    T, B, N, P, MP = d("T", min=1), d("B", min=1), d("N", min=1), d("pages", min=1), d("max_pages", min=1)
    symbols = {"T": T, "B": B, "B+1": B + 1, "N": N, "pages": P, "max_pages": MP, "M": d("M", min=0)}
    return tuple({axis: symbols[s] for axis, s in enumerate(INPUT_DIMS[name.split(".")[0]])} for name in names)


def trace_step(model: M3ForCausalLM, page_size: int, layers: range | None = None, kv_fp8: bool = False) -> ir.Model:
    """The whole model, or (``layers``) one part of a split export; ``kv_fp8``: on FP8 (uint8 code) pools."""
    layers = layers or range(model.config.num_hidden_layers)
    graph = StepGraph(model, layers, kv_fp8)
    ids, batch, logits_indices, pools = _example(model, page_size, "main", kv_fp8)
    dtype = model.model.embed_tokens.weight.dtype
    arity = [len(s) for s in model.cache_shapes(1, 1, scales=kv_fp8)]
    first_pool = sum(arity[:layers.start])
    pools = pools[first_pool:first_pool + sum(graph.cache_arity)]
    x = ids if graph.first else torch.empty((ids.numel(), model.config.hidden_size), dtype=dtype, device="meta")
    head = (logits_indices,) if graph.last else ()  # logits_indices belongs to the part with the head
    media = ()
    if graph.media:  # 4 media rows (of T = 7): equal to no other dynamic dimension
        media = (torch.tensor([1, 2, 3, 5]).to("meta"),
                 torch.empty((4, model.config.hidden_size), dtype=dtype, device="meta"))
    return torch_to_onnx(graph, (x, *batch.inputs(), *head, *pools, *media), step_signature(model, layers, kv_fp8))


def trace_mtp(model: M3ForCausalLM, k: int, page_size: int, kv_fp8: bool = False) -> ir.Model:
    ids, batch, logits_indices, pools = _example(model, page_size, "mtp", kv_fp8)
    hidden = torch.empty((ids.numel(), model.config.hidden_size), dtype=model.model.embed_tokens.weight.dtype,
                         device="meta")
    args = (ids, hidden, *batch.inputs(), logits_indices, *pools[:len(_layer_pools(True, kv_fp8))])  # module 0's pools: all modules' are alike
    return torch_to_onnx(MTPGraph(model, k), args, mtp_signature(kv_fp8))


def torch_to_onnx(module: nn.Module, args, sig: GraphSignature, shapes: tuple | None = None) -> ir.Model:
    """Trace ``module`` on ``args`` (meta tensors) into un-finalised ONNX IR named by ``sig``. ``shapes``: the
    ``torch.export`` dynamic shapes; by default every input's, by name (``dynamic_shapes``), for ``forward(*inputs)``."""
    if len(args) != len(sig.inputs):
        raise AssertionError(f"{type(module).__name__}: {len(args)} example inputs for {len(sig.inputs)} names")
    registry_log = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registry_log.level
    registry_log.setLevel(logging.ERROR)  # "torchvision is not installed" for ops M3 never uses
    # torch_lib's index_put on a uint8 pool (the FP8 cache's code pools) builds a Constant whose empty attribute
    # list onnx_ir reports as an "ambiguous attribute type" once per write: noise, the node is right
    attr_log = logging.getLogger("onnx_ir._convenience")
    attr_level = attr_log.level
    attr_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's deprecation chatter; failures still raise
            program = torch.onnx.export(
                module, args, dynamo=True, dynamic_shapes=shapes or (dynamic_shapes(sig.inputs),),
                custom_translation_table=translation_table(), input_names=list(sig.inputs),
                output_names=list(sig.outputs), opset_version=ONNX_OPSET, optimize=False, verbose=False, report=False,
            )
    finally:
        registry_log.setLevel(level)
        attr_log.setLevel(attr_level)
    return program.model


def finalize(model: ir.Model, weights: dict[str, ParamEntry], buffers: dict[str, torch.Tensor],
             base_dir: Path, kv_fp8: bool = False) -> onnx.ModelProto:
    """Point parameters at their bytes, fold and clean the graph, attach the m3 function bodies (``kv_fp8``: the
    cache readers' bodies on uint8 E4M3 code pools with scale inputs, ``functions.body``).

    Parameters are never folded into other constants, so each stays named initializers whose bytes are the
    tensor map's ranges; a parameter stored as several pieces (checkpoint tensors referenced in place) is
    reassembled by Concat / Unsqueeze nodes. Buffers (RoPE frequencies) are small and embedded.
    """
    prefix = ROOT + "."
    graph = model.graph
    frozen: set[str] = set()
    pieced: list[str] = []
    for old, value in list(graph.initializers.items()):
        name = old[len(prefix):] if old.startswith(prefix) else old
        del graph.initializers[old]
        if name in buffers:
            value.const_value = ir.Tensor(buffers[name].numpy(), name=name)
        elif name not in weights:
            raise ValueError(f"initializer {old!r} is neither a parameter in the weight file nor a known buffer")
        else:
            e = weights[name]
            # A multi-piece parameter keeps a whole-tensor stand-in while the graph is optimised (cheap passes on
            # a small graph); its Concat assembly, thousands of nodes at full size, is put in afterwards.
            stand_in = e.single or TensorEntry(PIECED, 0, 0, e.dtype, e.shape)
            value.const_value = _external(stand_in, name, base_dir)
            frozen.add(name)
            if e.single is None:
                pieced.append(name)
        value.name = name
        graph.register_initializer(value)

    def should_fold(node: ir.Node) -> bool | None:
        return False if any(v is not None and v.name in frozen for v in node.inputs) else None

    onnxscript.optimizer.fold_constants_ir(model, should_fold=should_fold)
    onnxscript.rewriter.rewrite(model, pattern_rewrite_rules=_REWRITE_RULES)
    onnxscript.optimizer.fold_constants_ir(model, should_fold=should_fold)
    _bf16_clamps_in_fp32(graph)
    _share_small_constants(graph, frozen | set(buffers))
    ir.passes.Sequential(
        common_passes.RemoveUnusedNodesPass(),
        common_passes.CommonSubexpressionEliminationPass(),
        common_passes.RemoveUnusedNodesPass(),
        common_passes.ClearMetadataAndDocStringPass(),  # stack traces name local source paths
        common_passes.NameFixPass(),
    )(model)
    _assemble_pieces(graph, {n: weights[n] for n in pieced}, base_dir)
    used = {n.op_type for n in graph.all_nodes() if n.domain == "m3"}
    for fn in functions_for(used, kv_fp8):
        f = ir.serde.deserialize_function(fn)
        model.functions[f.identifier()] = f
    model.ir_version = IR_VERSION
    model.producer_name, model.producer_version = "m3export", _version()
    return ir.serde.serialize_model(model)


def _share_small_constants(graph: ir.Graph, keep: set[str], size_limit: int = 64) -> None:
    """One initializer per distinct small constant (dtype, shape, bytes) that the trace and folding made (``keep``:
    parameters and buffers, never merged: the manifest names them), so that the CSE pass after it merges the nodes
    they feed. The exporter writes one constant per use (the same ``[2]`` 42 times in the tiny graph, the ``True``
    of each cache write's floor division once per pool), and neither onnx_ir's CSE nor ONNX Runtime's (which keys
    initializers by name) merges nodes over two equal initializers: each cache write kept its own copy of the
    ``slot // page_size`` arithmetic, 6 nodes per pool per step."""
    first: dict[tuple, ir.Value] = {}
    for name, value in list(graph.initializers.items()):
        tensor = value.const_value
        if name in keep or tensor is None or tensor.size > size_limit or value.is_graph_input():
            continue
        key = (tensor.dtype, tuple(tensor.shape), tensor.tobytes())
        if key in first:
            value.replace_all_uses_with(first[key])
            del graph.initializers[name]
        else:
            first[key] = value


def _bf16_clamps_in_fp32(graph: ir.Graph) -> None:
    """Each bfloat16 ``Clip`` (the traced ``clamp`` of SwiGLU) becomes Cast fp32 -> Clip -> Cast back: exact, the
    result is the input or a bound, both bf16 values. ONNX Runtime has no bf16 ``Clip`` kernel on its CUDA or CPU
    EP, and the ``Less`` of the function body it then expands to has none either: the step would not load."""
    bf16 = ir.DataType.BFLOAT16
    for node in [n for n in graph if n.op_type == "Clip" and n.domain == "" and n.inputs[0].dtype == bf16]:
        tape = ir.tape.Tape()
        args = [None if v is None else tape.op("Cast", [v], attributes={"to": ir.DataType.FLOAT}) for v in node.inputs]
        clamped = tape.op("Clip", args)
        out = tape.op("Cast", [clamped], attributes={"to": bf16})
        for v in (*args, clamped):
            if v is not None:
                v.dtype = ir.DataType.FLOAT
        out.dtype, out.shape = bf16, node.outputs[0].shape
        ir.convenience.replace_nodes_and_values(graph, node, [node], tape.nodes, node.outputs, [out])


def _assemble_pieces(graph: ir.Graph, pieced: dict[str, ParamEntry], base_dir: Path) -> None:
    """Replace each multi-piece stand-in by its pieces (initializers pointing at the checkpoint) and the
    Concat / Unsqueeze nodes that rebuild it, placed first in the graph."""
    assembly: list[ir.Node] = []
    for name, entry in pieced.items():
        stand_in = graph.initializers.pop(name)
        parts = []
        for j, piece in enumerate(entry.pieces):
            pv = ir.Value(name=f"{name}.piece{j}", const_value=_external(piece.entry, f"{name}.piece{j}", base_dir))
            graph.register_initializer(pv)
            parts.append((piece.index, pv))
        assembled, nodes = assemble(graph, name, parts, entry.shape)
        assembly += nodes
        stand_in.replace_all_uses_with(assembled)
    if assembly:
        graph.insert_before(graph.node(0), assembly)


def _external(e: TensorEntry, name: str, base_dir: Path) -> ir.ExternalTensor:
    dtype = ir.DataType(BY_NAME[e.dtype].onnx)
    return ir.ExternalTensor(e.file, e.offset, e.length, dtype, shape=ir.Shape(e.shape), name=name, base_dir=base_dir)


def _version() -> str:
    from .. import __version__

    return __version__
