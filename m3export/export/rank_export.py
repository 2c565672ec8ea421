"""Per-rank ONNX export for tensor parallelism: each rank's weights and graphs, cut at every collective.

ONNX has no collective op, so a rank's computation is cut where the sharded model (``m3export.parallel``)
communicates, and the graphs output what the collective would take in. Per rank, in order:

* ``attn{i}``, one per decoder layer: ``input_layernorm`` + attention on the rank's query / KV heads (its pools
  in, updated pools out, its KV heads' block selection) + its slice of ``o_proj``: the output ``partial`` is the
  rank's partial sum of the attention output. Layer 0's graph also embeds ``input_ids`` and outputs the residual
  stream ``hidden`` (the embedding is replicated; every rank outputs the same).
* ``mlp{i}``: ``post_attention_layernorm`` + the rank's columns of the dense MLP or of every routed expert and
  the shared expert: ``partial`` again (the MoE op on the local slices sums ``routed * scaling + shared``'s
  share). The router is replicated, so every rank routes alike.
* ``head``: final norm + the rank's rows of ``lm_head``: ``logits`` [N, V / TP] (its vocabulary slice) and the
  final-normed ``hidden`` (the same on every rank).

The runtime keeps the residual stream h [T, H] and performs, between graphs (``manifest.json``'s ``segments``):
h = hidden (attn0), then for every layer h += all_reduce_sum(partial of attn{i}), h += all_reduce_sum(partial of
mlp{i}); last logits = all_gather of the ranks' ``logits`` along the vocabulary, in rank order. These are
exactly the collectives of the torch shards, in the same places, so the graphs compute what the sharded model
does (``rank_graphs.RankGraphs`` is the in-process reference runner; ``tests/test_rank_export.py``).

Graphs of the same kind (attention of a dense / sparse layer, dense MLP / MoE, head) have the same structure in
every layer and rank; each kind is traced and optimised once (parameters named generically) and each instance
is that graph with its initializers pointed at its own layer's bytes in its rank's weight file.

Weights are floating point in ``dtype`` (an MXFP8 checkpoint is dequantised slice by slice). Not covered: expert
parallelism (the expert-parallel block's per-expert loop over the rank's experts is data
dependent and is not traced; a clear error) and the MTP modules (not exported per rank: no speculation from these
graphs).
"""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import onnx
import torch
from torch import nn

from ..checkpoint.loader import build_empty
from ..config import M3Config
from ..errors import ArtifactError
from ..model import Batch
from ..output_dir import os_errors_as, staging
from ..safetensors_io import write_safetensors
from .graphs import GraphSignature, _example, finalize, torch_to_onnx
from .manifest import sha256_file, signature_of
from .schemas import register_schemas
from .weights import ParamEntry

FORMAT = "m3export.rank-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
POOLS = ("k_cache", "v_cache", "index_k_cache")


@contextmanager
def local_collectives():
    """Trace the shard without its collectives: the sums and gathers become graph outputs for the runtime."""
    from ..parallel import layers

    with mock.patch.object(layers, "all_reduce", lambda t, group: t), \
            mock.patch.object(layers, "all_gather_last", lambda t, group: t):
        yield


class AttentionSegment(nn.Module):
    """input_layernorm + the rank's attention heads + its o_proj columns -> the partial attention output."""

    def __init__(self, model, layer: int):
        super().__init__()
        self.first = layer == 0
        self.layer = model.model.layers[layer]
        self.rotary = model.rotary
        self.embed_tokens = model.model.embed_tokens if self.first else None
        self.arity = 3 if self.layer.self_attn.indexer is not None else 2

    def forward(self, *inputs):
        x, (batch, pools) = inputs[0], Batch.from_inputs(inputs[1:])
        h = self.embed_tokens(x) if self.first else x
        cos, sin = self.rotary(batch.positions, h.dtype)
        a, cache, sel = self.layer.self_attn(self.layer.input_layernorm(h), cos, sin, batch, tuple(pools), False)
        out = ((h,) if self.first else ()) + (a, *cache)
        return out + ((sel,) if sel is not None else ())


class MLPSegment(nn.Module):
    """post_attention_layernorm + the rank's MLP / MoE slices -> the partial MLP output."""

    def __init__(self, model, layer: int):
        super().__init__()
        self.layer = model.model.layers[layer]

    def forward(self, *inputs):  # (hidden_in,): variadic like every traced graph (dynamic shapes by input name)
        return self.layer.mlp(self.layer.post_attention_layernorm(inputs[0]))


class HeadSegment(nn.Module):
    """Final norm + the rank's lm_head rows -> (its vocabulary slice of the logits, the final-normed hidden)."""

    def __init__(self, model):
        super().__init__()
        self.norm, self.lm_head = model.model.norm, model.lm_head

    def forward(self, *inputs):  # (hidden_in, logits_indices)
        h, logits_indices = inputs
        hidden = self.norm(h)
        return self.lm_head(hidden.index_select(0, logits_indices)).float(), hidden


def segments(cfg: M3Config) -> list[dict]:
    """The per-rank graphs in execution order with the runtime's step after each (what the manifest lists)."""
    out = []
    for i in range(cfg.num_hidden_layers):
        kind = ("attn_first" if i == 0 else "attn_sparse" if cfg.is_sparse_layer(i) else "attn_dense")
        out.append({"graph": f"attn{i}", "kind": kind, "layer": i,
                    "then": ("h = hidden; " if i == 0 else "") + "h += all_reduce_sum(partial)"})
        out.append({"graph": f"mlp{i}", "kind": "moe" if cfg.is_moe_layer(i) else "mlp_dense", "layer": i,
                    "then": "h += all_reduce_sum(partial)"})
    out.append({"graph": "head", "kind": "head", "layer": None,
                "then": "logits = all_gather(logits, dim=-1, rank order)"})
    return out


def _signature(kind: str, sparse: bool) -> GraphSignature:
    if kind == "head":
        return GraphSignature(("hidden_in", "logits_indices"), ("logits", "hidden"), {})
    if kind in ("moe", "mlp_dense"):
        return GraphSignature(("hidden_in",), ("partial",), {})
    pools = POOLS if sparse else POOLS[:2]
    ins = ("input_ids" if kind == "attn_first" else "hidden_in", *Batch.input_names(), *pools)
    outs = (*(("hidden",) if kind == "attn_first" else ()), "partial", *(f"{p}_out" for p in pools),
            *(("selection",) if sparse else ()))
    return GraphSignature(ins, outs, {f"{p}_out": p for p in pools})


def _module_and_args(meta, kind: str, layer: int | None, page_size: int):
    ids, batch, logits_indices, _ = _example(meta, page_size, "main")
    h = torch.empty((ids.numel(), meta.config.hidden_size), dtype=meta.model.embed_tokens.weight.dtype,
                    device="meta")
    if kind == "head":
        return HeadSegment(meta), (h, logits_indices)
    if kind in ("moe", "mlp_dense"):
        return MLPSegment(meta, layer), (h,)
    seg = AttentionSegment(meta, layer)
    pools = meta.allocate_caches(64, page_size, h.dtype, "meta")[layer]
    return seg, ((ids if seg.first else h), *batch.inputs(), *pools)


def _generic_names(module: nn.Module, model, layer: int | None) -> dict[str, str]:
    """The segment's parameter names -> the model's (``layer.self_attn.q_proj.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``)."""
    full = {id(p): n for n, p in model.named_parameters()}
    return {n: full[id(p)] for n, p in module.named_parameters()}


def export_rank_artifact(source: str, out: str | Path, tensor_parallel_size: int, expert_parallel: bool = False,
                         dtype: torch.dtype = torch.float32, page_size: int = 16, force: bool = False,
                         progress: bool = False) -> Path:
    """Write ``out``: per rank ``rank{r}.safetensors`` (only its slices) and its graphs ``rank{r}.{segment}.onnx``,
    and ``manifest.json`` describing the ranks, their slices and the collectives between graphs."""
    from ..parallel import ParallelConfig, build_shard, load_model_shard, shard_of
    from ..sources import is_preset
    from .exporter import _check_graph, _prepare_out, _replace, _tools

    if expert_parallel:
        raise ArtifactError("per-rank ONNX export covers tensor parallelism only: the expert-parallel MoE block "
                            "(a loop over the rank's own experts) is not traced; export without --expert-parallel")
    if tensor_parallel_size < 2:
        raise ArtifactError(f"per-rank export needs --tensor-parallel-size >= 2, got {tensor_parallel_size}")
    register_schemas()
    parallel = ParallelConfig(tensor_parallel_size=tensor_parallel_size, expert_parallel=False)
    out = Path(out).absolute()
    _prepare_out(out, force, source)
    with os_errors_as(ArtifactError), staging(out.parent, out.name, ArtifactError) as tmp:
        entries, cfg, n_mtp = [], None, 0
        for rank in range(tensor_parallel_size):  # each rank's slices only, written one rank at a time
            shard = load_model_shard(source, parallel, rank, dtype=dtype, progress=progress, dequantize=True)
            cfg = shard.global_config
            state = {k: v for k, v in shard.state_dict().items() if not k.startswith("mtp.")}
            written = write_safetensors(tmp / f"rank{rank}.safetensors",
                                        ((k, v.dtype, tuple(v.shape)) for k, v in state.items()),
                                        state.__getitem__, progress)
            entries.append({k: ParamEntry.whole(e) for k, e in written.items()})
            n_mtp = len(shard.mtp)
            del shard, state
        meta = build_shard(cfg, parallel, 0, dtype, "meta", num_mtp_modules=0)
        buffers = {"rotary.inv_freq": meta.rotary._inv_freq()}
        plan = segments(cfg)
        graphs: dict[str, dict] = {}
        prototypes: dict[str, tuple] = {}
        for seg in plan:
            kind, layer = seg["kind"], seg["layer"]
            module, args = _module_and_args(meta, kind, layer, page_size)
            names = _generic_names(module, meta, layer)
            if kind not in prototypes:
                sig = _signature(kind, kind == "attn_sparse")
                with local_collectives():
                    traced = torch_to_onnx(module, args, sig)
                weights = {g: entries[0][n] for g, n in names.items()}
                proto = finalize(traced, weights, buffers, tmp)
                prototypes[kind] = (proto, sig)
            proto, sig = prototypes[kind]
            for rank in range(tensor_parallel_size):
                file = f"rank{rank}.{seg['graph']}.onnx"
                instance = _point_at(proto, {g: entries[rank][n] for g, n in names.items()})
                (tmp / file).write_bytes(instance.SerializeToString(deterministic=True))
                _check_graph(tmp / file)
                graphs[file] = signature_of(instance, file, sig.aliases).to_json()
        ranks = [{"rank": r, "weights": f"rank{r}.safetensors",
                  "graphs": {s["graph"]: f"rank{r}.{s['graph']}.onnx" for s in plan},
                  "slices": {n: _slice_json(shard_of(n, cfg, parallel, r)) for n in sorted(entries[r])},
                  "tensors": {n: e.to_json() for n, e in sorted(entries[r].items())}}
                 for r in range(tensor_parallel_size)]
        files = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in sorted(tmp.iterdir())}
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "config": cfg.to_text_dict(),
            "dtype": str(dtype).removeprefix("torch."), "page_size": page_size,
            "parallel": {"tensor_parallel_size": tensor_parallel_size, "expert_parallel": False},
            "source": f"preset:{source}" if is_preset(source) else f"checkpoint:{Path(source).resolve()}",
            "reduction": "graphs cut at every collective of the sharded model: each attn{i} / mlp{i} graph "
                         "outputs the rank's partial sum ('partial'), which the runtime all-reduces (sum over "
                         "ranks) and adds to the residual stream it keeps; head outputs the rank's vocabulary "
                         "slice of the logits, which the runtime all-gathers in rank order",
            "segments": plan, "ranks": ranks, "graphs": graphs, "files": files, "tools": _tools(),
            "mtp_modules": 0, "mtp_modules_not_exported": n_mtp,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        _replace(tmp, out)
    return out


def _slice_json(shard) -> dict:
    """Which part of the global parameter a rank holds: replicated, or its index ranges along ``dim``."""
    if shard.replicated:
        return {"replicated": True}
    return {"dim": shard.dim, "ranges": [list(r) for r in shard.ranges]}


def _point_at(proto: onnx.ModelProto, weights: dict[str, ParamEntry]) -> onnx.ModelProto:
    """The prototype graph with each external initializer pointing at ``weights[name]``'s bytes."""
    out = copy.deepcopy(proto)
    for init in out.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL or init.name not in weights:
            continue
        e = weights[init.name].single
        fields = {"location": e.file, "offset": str(e.offset), "length": str(e.length)}
        for kv in init.external_data:
            if kv.key in fields:
                kv.value = fields.pop(kv.key)
        for key, value in fields.items():
            init.external_data.add(key=key, value=value)
    return out
