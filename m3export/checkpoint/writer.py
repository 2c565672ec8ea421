"""Write an M3 checkpoint (either layout; BF16, FP32 or MXFP8) from a model or from seeded random weights.

Used by ``m3export synth`` and the tests, and to convert between layouts. Tensors are produced one parameter
at a time and flushed shard by shard; everything goes to a temporary sibling directory that is renamed into
place at the end, so an interrupted write never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..config import M3Config, QuantConfig
from ..errors import CheckpointError
from ..model import M3ForCausalLM
from ..ops import mxfp8 as mx
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


def write_checkpoint(out_dir: str | os.PathLike, cfg: M3Config, layout: str = "original", fmt: str = "bf16",
                     model: M3ForCausalLM | None = None, seed: int = 0, shard_bytes: int = 64 << 20,
                     hf_prefix: str = "model.language_model.", with_tokenizer: bool = True,
                     with_mtp: bool = True, progress: bool = True) -> Path:
    if fmt not in FORMATS:
        raise ValueError(f"unknown checkpoint format {fmt!r}: expected one of {list(FORMATS)}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out}: output directory exists and is not empty")
    n_mtp = (len(model.mtp) if model is not None else cfg.num_mtp_modules) if with_mtp else 0
    if fmt == "mxfp8":
        cfg = cfg.replace(quantization=QuantConfig())
    lay = Layout(layout, cfg, hf_prefix)
    quantized = quantized_names(cfg, n_mtp) if fmt == "mxfp8" else set()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        shard: dict[str, torch.Tensor] = {}
        written: list[list[str]] = []  # tensor names per flushed shard
        size = 0
        sources = _source_values(model, cfg, seed, n_mtp)
        for name, values in tqdm(sources, desc="writing checkpoint", unit="param", disable=not progress, leave=False):
            for tname, tensor in _tensors(name, values, lay, fmt, name in quantized):
                nbytes = tensor.numel() * tensor.element_size()
                if shard and size + nbytes > shard_bytes:
                    written.append(_flush(tmp, shard, len(written)))
                    shard, size = {}, 0
                shard[tname] = tensor.contiguous()
                size += nbytes
        written.append(_flush(tmp, shard, len(written)))
        _name_shards(tmp, written)
        config = cfg.to_original_dict() if layout == "original" else _hf_config(cfg)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if with_tokenizer:
            byte_level_tokenizer(cfg).save(str(tmp / "tokenizer.json"))
            (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(cfg), indent=2) + "\n")
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _hf_config(cfg: M3Config) -> dict:
    d = cfg.to_hf_dict()
    if cfg.quantization is not None:
        d["quantization_config"] = cfg.quantization.to_dict()
    return d


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


def _flush(tmp: Path, shard: dict[str, torch.Tensor], i: int) -> list[str]:
    """Write one full shard now (memory stays at one shard), under a provisional name."""
    save_file(shard, str(tmp / f"shard-{i}.tmp"), metadata={"format": "pt"})
    return list(shard)


def _name_shards(tmp: Path, written: list[list[str]]) -> None:
    """Give shards their final ``model-i-of-n`` names (n is known only now) and write the index."""
    n = len(written)
    if n == 1:
        (tmp / "shard-0.tmp").rename(tmp / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(written):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (tmp / f"shard-{i}.tmp").rename(tmp / fname)
        weight_map.update(dict.fromkeys(names, fname))
    total = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
