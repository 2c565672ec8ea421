"""Write an M3 checkpoint (either layout; BF16, FP32 or MXFP8) from a model or from seeded random weights.

Used by ``m3export synth`` and the tests, and to convert between layouts; ``sparse.py`` writes full-size
checkpoints through the same code without values. What a checkpoint holds (names, dtypes, shapes, order) is
decided once, by ``planned_tensors``; shards are then streamed tensor by tensor (``write_safetensors``). Everything
goes to a hidden staging directory beside the output (``m3export.output_dir``: removed on error, Ctrl-C or SIGTERM,
and by the next write after a SIGKILL) that is renamed into place at the end, so an interrupted write never leaves
a half-written checkpoint behind; the checkpoint is readable by others (mode 0755), as an artifact is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..config import M3Config, QuantConfig
from ..errors import CheckpointError
from ..output_dir import make_parent, os_errors_as, staging
from ..model import M3ForCausalLM
from ..ops import mxfp8 as mx
from ..safetensors_io import nbytes, write_safetensors
from ..tokenizer import byte_level_tokenizer, tokenizer_config
from .layout import Layout
from .loader import keeps_fp32
from .random_init import random_parameter
from .shards import INDEX_FILE

FORMATS = {"bf16": torch.bfloat16, "fp32": torch.float32, "mxfp8": None}


def quantized_names(cfg: M3Config, n_mtp: int) -> set[str]:
    """Parameters an MXFP8 checkpoint stores as E4M3 (decided by the model definition, in one place)."""
    with torch.device("meta"):
        m = M3ForCausalLM(cfg, mxfp8=True, num_mtp_modules=n_mtp)
    return {n for n, p in m.named_parameters() if p.dtype == torch.float8_e4m3fn}


def _source_values(model: M3ForCausalLM | None, cfg: M3Config, seed: int, n_mtp: int):
    """Yield (name, fp32 values or (fp8, scale)) for every parameter, in definition order."""
    if model is None:
        with torch.device("meta"):
            shapes = [(n, tuple(p.shape)) for n, p in M3ForCausalLM(cfg, num_mtp_modules=n_mtp).named_parameters()]
        for name, shape in shapes:
            yield name, random_parameter(name, shape, seed)
        return
    params = dict(model.named_parameters())
    for name, p in params.items():
        if p.dtype == torch.uint8:
            continue
        if p.dtype == torch.float8_e4m3fn:
            yield name, (p.detach().cpu(), params[name + "_scale_inv"].detach().cpu())
        else:
            yield name, p.detach().cpu().float()


def planned_tensors(cfg: M3Config, layout: Layout, fmt: str, n_mtp: int):
    """Yield (checkpoint name, dtype, shape) of every tensor a checkpoint holds, in file order."""
    quantized = quantized_names(cfg, n_mtp) if fmt == "mxfp8" else set()
    with torch.device("meta"):
        model = M3ForCausalLM(cfg, num_mtp_modules=n_mtp)
    for name, p in model.named_parameters():
        how = piece_format(name, fmt, name in quantized)
        for piece in layout.pieces(name):
            shape = tuple(p[piece.index].shape)
            if how == "mxfp8":
                yield piece.name, torch.float8_e4m3fn, shape
                yield piece.name + "_scale_inv", torch.uint8, (*shape[:-1], shape[-1] // 32)
            else:
                yield piece.name, how, shape


def checkpoint_config(cfg: M3Config, layout: str) -> dict:
    """config.json for a layout: the release's nested form (original) or transformers' flat one (hf), each with
    its ``quantization_config`` when the weights are MXFP8."""
    if layout == "original":
        return cfg.to_original_dict()
    d = cfg.to_hf_dict()
    if cfg.quantization is not None:
        d["quantization_config"] = cfg.quantization.to_dict()
    return d


def write_checkpoint(out_dir: str | os.PathLike, cfg: M3Config, layout: str = "original", fmt: str = "bf16",
                     model: M3ForCausalLM | None = None, seed: int = 0, shard_bytes: int = 64 << 20,
                     hf_prefix: str = "model.language_model.", with_tokenizer: bool = True,
                     with_mtp: bool = True, progress: bool = True) -> Path:
    if fmt not in FORMATS:
        raise ValueError(f"unknown checkpoint format {fmt!r}: expected one of {list(FORMATS)}")
    out = Path(out_dir)
    make_parent(out, CheckpointError)  # a file as --out, or a parent that cannot be made: one clear error
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out}: output directory exists and is not empty")
    n_mtp = (len(model.mtp) if model is not None else cfg.num_mtp_modules) if with_mtp else 0
    if fmt == "mxfp8":
        cfg = cfg.replace(quantization=QuantConfig())
    lay = Layout(layout, cfg, hf_prefix)
    quantized = quantized_names(cfg, n_mtp) if fmt == "mxfp8" else set()
    produced = (t for name, values in _source_values(model, cfg, seed, n_mtp)
                for t in _tensors(name, values, lay, fmt, name in quantized))

    def value(name: str) -> torch.Tensor:  # tensors come in planned order, one at a time
        got, tensor = next(produced)
        if got != name:
            raise AssertionError(f"checkpoint writer produced {got!r} where {name!r} was planned")
        return tensor

    def extra(tmp: Path) -> None:
        if with_tokenizer:
            byte_level_tokenizer(cfg).save(str(tmp / "tokenizer.json"))
            (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(cfg), indent=2) + "\n")

    return write_shards(out, cfg, lay, planned_tensors(cfg, lay, fmt, n_mtp), shard_bytes, value, single_file=True,
                        extra=extra, progress=progress)


def write_shards(out: Path, cfg: M3Config, layout: Layout, specs, shard_bytes: int, value=None,
                 single_file: bool = True, extra=None, progress: bool = True) -> Path:
    """Write ``specs`` (name, dtype, shape) as shards of at most ``shard_bytes`` (a larger tensor gets its own),
    the index, ``config.json`` and whatever ``extra(tmp)`` adds, atomically into ``out``.

    ``value(name)`` supplies each tensor as it is written; ``value=None`` leaves the data regions as holes (sparse
    files). One shard is named ``model.safetensors`` without an index when ``single_file``.
    """
    groups: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dtype, shape in specs:
        n = nbytes(dtype, shape)
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, dtype, shape))
        size += n
    make_parent(out, CheckpointError)
    with os_errors_as(CheckpointError), staging(out.parent, out.name, CheckpointError) as tmp:
        names = (["model.safetensors"] if single_file and len(groups) == 1 else
                 [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)])
        weight_map, total = {}, 0
        for fname, group in zip(names, groups):
            entries = write_safetensors(tmp / fname, group, value, progress)
            total += sum(e.length for e in entries.values())
            weight_map.update(dict.fromkeys(entries, fname))
        if len(names) > 1 or not single_file:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        config = checkpoint_config(cfg, layout.kind)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if extra is not None:
            extra(tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    return out


def piece_format(name: str, fmt: str, quantize: bool):
    """How one checkpoint tensor is stored: "mxfp8" (E4M3 + UE8M0 sibling) or a torch dtype.

    MXFP8 releases keep what they do not quantise (embeddings, norms, lm_head) in BF16 and the router in fp32.
    """
    if quantize:
        return "mxfp8"
    if keeps_fp32(name):
        return torch.float32
    return torch.bfloat16 if fmt == "mxfp8" else FORMATS[fmt]


def _tensors(name: str, values, lay: Layout, fmt: str, quantize: bool):
    """Checkpoint tensors for one parameter: its pieces, cast or quantised as the format asks."""
    how = piece_format(name, fmt, quantize)
    for piece in lay.pieces(name):
        if isinstance(values, tuple):  # the source already holds MXFP8 (fp8, scale)
            q, s = values[0][piece.index], values[1][piece.index]
            if how == "mxfp8":
                yield piece.name, q
                yield piece.name + "_scale_inv", s
                continue
            v = mx.dequantize(q, s)
        else:
            v = values[piece.index]
        if how == "mxfp8":
            q, s = mx.quantize(v)
            yield piece.name, q
            yield piece.name + "_scale_inv", s
        else:
            yield piece.name, v.to(how)
