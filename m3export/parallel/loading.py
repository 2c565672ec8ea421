"""Build one rank's shard of M3 and fill it with only that rank's slices of the checkpoint.

The shard is built on ``meta`` from the rank's local config with the parallel modules in place
(``m3export.parallel.layers``), then allocated like the single-GPU model (``checkpoint.loader.materialize``).
The checkpoint is validated against the *global* model exactly as ``load_model`` validates it
(``check_tensors``: names, shapes, dtypes), then streamed tensor by tensor in file order; for a split parameter
each checkpoint tensor is intersected with the rank's ranges (``sharding.shard_of``) and only the overlap is read
out of the memory map (``Checkpoint.get_slice``; an MXFP8 scale sliced with its weight), converted and finiteness
checked as ``load_model`` does, and copied into its place. Peak memory: the shard plus one slice.
"""

from __future__ import annotations

import os
import resource
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..checkpoint.loader import (_convert, build_empty, check_finite, check_tensors, load_model, materialize,
                                 open_checkpoint)
from ..checkpoint.random_init import random_parameter
from ..checkpoint.shards import Checkpoint
from ..config import ConfigError, M3Config, preset
from ..errors import CheckpointError
from ..model import M3ForCausalLM, fusion
from ..model.mlp import MoE
from ..ops import mxfp8 as mx
from ..sources import is_preset
from .config import MX_BLOCK, ParallelConfig
from .layers import ExpertParallelMoE, RowParallelLinear, TensorParallelMLP, TensorParallelMoE, VocabParallelLMHead
from .sharding import SCALE, Shard, shard_of


@dataclass
class LoadStats:
    """What one rank's load read and held: checkpoint bytes copied out of the shards (slices counted by their own
    size) and the number of reads; the process's peak resident memory (``VmHWM``: includes the interpreter and
    torch, and the page cache of the memory-mapped shards it touched) and, after loading with the shards closed,
    its anonymous resident memory (the shard's host-side tensors plus the baseline, no file pages)."""

    bytes_read: int = 0
    reads: int = 0
    peak_rss_bytes: int = 0
    anon_rss_bytes: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def measure_memory(self) -> None:
        # VmHWM is this process image's own peak; ru_maxrss would carry the peak of a large parent that forked
        # the rank (Linux keeps it across fork + exec). Without procfs, ru_maxrss (KiB on Linux) is all there is.
        self.peak_rss_bytes = (_status_kib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        self.anon_rss_bytes = _status_kib("RssAnon") * 1024


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` memory field in KiB (0 where there is no procfs)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def build_shard(cfg: M3Config, parallel: ParallelConfig, rank: int, dtype: torch.dtype, device, mxfp8: bool = False,
                num_mtp_modules: int | None = None, group=None) -> M3ForCausalLM:
    """Rank ``rank``'s model, uninitialised, parameters allocated on ``device`` at their local shapes."""
    parallel.validate(cfg, mxfp8)
    local = parallel.local_config(cfg)
    tp = parallel.tensor_parallel_size
    with torch.device("meta"):
        model = M3ForCausalLM(local, mxfp8=mxfp8, num_mtp_modules=num_mtp_modules)
        layers = [*model.model.layers, *(m.transformer_layer for m in model.mtp)]
        for layer in layers:
            layer.self_attn.o_proj = RowParallelLinear(local.num_attention_heads * local.head_dim, local.hidden_size,
                                                       mxfp8)
            if isinstance(layer.mlp, MoE):
                if parallel.expert_parallel:
                    n = parallel.experts_per_rank(cfg)
                    layer.mlp = ExpertParallelMoE(local, mxfp8, rank * n, n)
                else:
                    layer.mlp = TensorParallelMoE(local, mxfp8)
            else:
                layer.mlp = TensorParallelMLP(local, local.dense_intermediate_size, mxfp8)
            layer.self_attn.o_proj.group = layer.mlp.group = group
        model.lm_head = VocabParallelLMHead(cfg.hidden_size, cfg.vocab_size // tp)
        model.lm_head.group = group
    model = materialize(model, dtype, device)
    model.parallel, model.rank, model.global_config = parallel, rank, cfg
    return model


def _check_group(parallel: ParallelConfig, rank: int, group) -> None:
    """``rank`` must be a rank of the split and, once the process group exists, this process's rank in a group of
    ``tensor_parallel_size`` (a mismatch would hang or mix shards in the first collective). Loading before
    ``init_process_group`` is allowed (inspection, export); the first collective then says it is missing."""
    tp = parallel.tensor_parallel_size
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside tensor_parallel_size {tp}")
    if not (dist.is_available() and dist.is_initialized()):
        return
    size, mine = dist.get_world_size(group), dist.get_rank(group)
    if size != tp:
        raise ConfigError(f"tensor_parallel_size {tp} but the process group has {size} ranks (world size must "
                          "equal tensor_parallel_size: no data parallelism)")
    if mine != rank:
        raise ValueError(f"asked for rank {rank}'s shard in the process of rank {mine}")


def _check_shapes(model: M3ForCausalLM, full: dict[str, torch.Tensor], cfg: M3Config, parallel: ParallelConfig,
                  rank: int) -> dict[str, Shard]:
    """{parameter: Shard}, after checking that every local parameter has its shard's shape of the global one."""
    shards = {}
    for name, p in model.named_parameters():
        shard = shard_of(name, cfg, parallel, rank)
        want = shard.local_shape(tuple(full[name].shape))
        if tuple(p.shape) != want:
            raise AssertionError(f"rank {rank}: parameter {name} has shape {list(p.shape)}, its shard of "
                                 f"{list(full[name].shape)} is {list(want)}")
        shards[name] = shard
    return shards


def load_model_shard(source: str | os.PathLike, parallel: ParallelConfig, rank: int, device="cpu",
                     dtype: torch.dtype = torch.float32, group=None, progress: bool = False,
                     seed: int = 0, mxfp8: bool = False, dequantize: bool = False) -> M3ForCausalLM:
    """A checkpoint directory or a preset name -> rank ``rank``'s shard of M3 (``docs/parallel.md``).

    Its ``step`` / ``mtp_step`` return the full logits and hidden states on every rank (collectives on ``group``,
    else the default ``torch.distributed`` group, which must be initialised); its caches hold the rank's KV heads
    (its ``config`` is the local one). ``model.load_stats`` says what the rank read and its peak host memory.
    With ``tensor_parallel_size == 1`` this is ``m3export.load_model``.

    On CUDA, as ``m3export.load_model``: the Triton kernels serve the ops and each attention layer's input
    projections are fused into one buffer (``fusion.serve_on``). That is exact on a rank too: its q / k / v
    (+ index q) projections are plain ``Linear``s holding whole output rows of the global weight (the sharding
    splits them along N, never K; the index key projection is replicated), so the fused product's columns are the
    same dot products of the same rows as each member's own product.
    """
    dtype = dtype or torch.float32
    if parallel.tensor_parallel_size == 1:
        model = load_model(source, device=device, dtype=dtype, dequantize=dequantize, seed=seed, mxfp8=mxfp8,
                           progress=progress)
    else:
        model = _load_shard(source, parallel, rank, device, dtype, group, progress, seed, mxfp8, dequantize)
    fusion.serve_on(model, device)
    return model


def _load_shard(source, parallel: ParallelConfig, rank: int, device, dtype, group, progress, seed, mxfp8,
                dequantize) -> M3ForCausalLM:
    _check_group(parallel, rank, group)
    stats = LoadStats()
    if is_preset(source):
        cfg = preset(str(source))
        model = build_shard(cfg, parallel, rank, dtype, device, mxfp8, group=group)
        _fill_random(model, cfg, parallel, rank, seed, dtype, mxfp8)
    else:
        ckpt, cfg, layout, n_mtp, quantized = open_checkpoint(source)
        mxfp8 = quantized and not dequantize
        full = dict(build_empty(cfg, dtype, "meta", mxfp8, n_mtp).named_parameters())
        plan = check_tensors(ckpt, layout, full)
        model = build_shard(cfg, parallel, rank, dtype, device, mxfp8, n_mtp, group)
        model.checkpoint_info = {"layout": layout.kind, "mxfp8": quantized, "mtp_modules": n_mtp,
                                 "path": str(ckpt.dir)}
        shards = _check_shapes(model, full, cfg, parallel, rank)
        _stream_slices(ckpt, plan, model, shards, full, stats, progress)
        ckpt.close()
    stats.measure_memory()
    model.load_stats = stats
    return model.requires_grad_(False).eval()


def _fill_random(model, cfg, parallel, rank, seed, dtype, mxfp8) -> None:
    """A preset's weights: the same values ``random_model`` gives the whole model, each parameter's rank slice
    (quantised as a whole first, so an MXFP8 shard holds exactly the single-GPU E4M3 values and scales)."""
    full = dict(build_empty(cfg, dtype, "meta", mxfp8, len(model.mtp)).named_parameters())
    shards = _check_shapes(model, full, cfg, parallel, rank)
    params = dict(model.named_parameters())
    for name, p in params.items():
        if p.dtype == torch.uint8:
            continue  # scales come with their fp8 weight
        values = random_parameter(name, tuple(full[name].shape), seed)
        if p.dtype == torch.float8_e4m3fn:
            q, s = mx.quantize(values)
            p.data.copy_(shards[name].take(q))
            params[name + SCALE].data.copy_(shards[name + SCALE].take(s))
        else:
            p.data.copy_(shards[name].take(values))


def _overlaps(index: tuple, shape: tuple[int, ...], shard: Shard):
    """Where a checkpoint piece filling ``index`` of a global parameter of ``shape`` meets the rank's ``shard``.

    Yields (src, dst): ``src`` None (the whole piece) or (dim of the piece, start, stop) to read; ``dst`` the index
    of the local parameter it fills."""
    norm = list(index) + [slice(None)] * (len(shape) - len(index))
    if shard.replicated:
        yield None, tuple(norm)
        return
    d = shard.dim
    entry = norm[d]
    if isinstance(entry, int):
        p0, p1 = entry, entry + 1
    else:
        p0 = entry.start or 0
        p1 = shape[d] if entry.stop is None else entry.stop
    piece_dim = d - sum(isinstance(e, int) for e in norm[:d])
    offset = 0
    for g0, g1 in shard.ranges:
        lo, hi = max(p0, g0), min(p1, g1)
        if lo < hi:
            dst = list(norm)
            if isinstance(entry, int):
                dst[d] = offset + entry - g0
                yield None, tuple(dst)
            else:
                dst[d] = slice(offset + lo - g0, offset + hi - g0)
                full_piece = (lo, hi) == (p0, p1)
                yield (None if full_piece else (piece_dim, lo - p0, hi - p0)), tuple(dst)
        offset += g1 - g0


def _stream_slices(ckpt: Checkpoint, plan: dict, model: M3ForCausalLM, shards: dict[str, Shard],
                   full: dict[str, torch.Tensor], stats: LoadStats, progress: bool) -> None:
    params = dict(model.named_parameters())
    order = sorted(plan, key=lambda n: (os.path.basename(ckpt.tensors[n].file), ckpt.tensors[n].offset))
    for name in tqdm(order, desc="loading weights (shard)", unit="tensor", disable=not progress, leave=False):
        pname, index = plan[name]
        info = ckpt.tensors[name]
        where = f"{info.file}: tensor {name!r}"
        for src, dst in _overlaps(index, tuple(full[pname].shape), shards[pname]):
            target = params[pname].data[dst]
            read = _reader(ckpt, name, src, stats)
            value = check_finite(_convert(ckpt, name, target.dtype, where, read), where)
            if tuple(value.shape) != tuple(target.shape):
                raise CheckpointError(f"{where}: slice of shape {list(value.shape)} does not fit "
                                      f"{list(target.shape)} of parameter {pname}")
            target.copy_(value)


def _reader(ckpt: Checkpoint, name: str, src, stats: LoadStats):
    """``read(tensor)`` for ``_convert``: the whole tensor, or its slice ``src``; the weight's MXFP8 scale (read
    when dequantising) is sliced along the same dimension, by 32 when that is the last (K)."""
    ndim = len(ckpt.tensors[name].shape)

    def read(n: str) -> torch.Tensor:
        if src is None:
            t = ckpt.get(n)
        else:
            dim, lo, hi = src
            if n != name and dim == ndim - 1:
                if lo % MX_BLOCK or hi % MX_BLOCK:
                    raise CheckpointError(f"{ckpt.tensors[n].file}: tensor {n!r}: slice {lo}:{hi} of its weight "
                                          f"does not fall on {MX_BLOCK}-value scale blocks")
                lo, hi = lo // MX_BLOCK, hi // MX_BLOCK
            t = ckpt.get_slice(n, dim, lo, hi)
        stats.bytes_read += t.numel() * t.element_size()
        stats.reads += 1
        return t

    return read
