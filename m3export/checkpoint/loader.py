"""Build M3 on the ``meta`` device and stream a checkpoint into it, tensor by tensor.

The model is built once on ``meta`` and every tensor's name, shape and dtype checked against it once, before
anything is allocated; then each checkpoint tensor is memory-mapped, converted if needed (cast, or MXFP8
dequantisation when a floating-point model is asked for), checked finite and copied straight into its slice of the
allocated parameter, so peak memory is the model plus one tensor. Every error names the file and the tensor.

``check_tensors`` (names, shapes, dtypes) and ``check_finite`` are the one validation of a checkpoint's tensors:
loading (generate, the torch backend) and export (copying or zero-copy) both call them, so a checkpoint one path
accepts is never rejected by the other.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..config import M3Config, preset
from ..dtypes import BY_NAME, MODEL_DTYPES
from ..errors import CheckpointError
from ..model import M3ForCausalLM
from ..ops import mxfp8 as mx
from ..safetensors_io import require_regular_file
from ..sources import is_preset
from .layout import IGNORED, Layout, detect, mtp_modules_present
from .random_init import random_parameter
from .shards import Checkpoint

log = logging.getLogger("m3export.load")
FLOAT_TYPES = tuple(BY_NAME[name].torch for name in MODEL_DTYPES)
FP32_PARAMS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


def keeps_fp32(name: str) -> bool:
    """Router weight and correction bias stay fp32 whatever the model dtype (the checkpoint stores them so)."""
    return name.endswith(FP32_PARAMS)


def build_empty(cfg: M3Config, dtype: torch.dtype, device, mxfp8: bool = False,
                num_mtp_modules: int | None = None) -> M3ForCausalLM:
    """Allocate (uninitialised) parameters directly in their final dtype on ``device``; no fp32 detour."""
    with torch.device("meta"):
        model = M3ForCausalLM(cfg, mxfp8=mxfp8, num_mtp_modules=num_mtp_modules)
    return materialize(model, dtype, device)


def materialize(model: M3ForCausalLM, dtype: torch.dtype, device) -> M3ForCausalLM:
    """A model built on ``meta`` -> uninitialised parameters in their final dtype on ``device`` (the router stays
    fp32), rotary tables computed. A tensor-parallel shard (``m3export.parallel``) is built the same way."""
    for name, p in model.named_parameters():
        if p.dtype in FLOAT_TYPES and not keeps_fp32(name):
            p.data = torch.empty_like(p, dtype=dtype)
    model.to_empty(device=device)
    model.rotary.reset_parameters()
    return model


def random_model(cfg: M3Config, device="cpu", dtype=torch.float32, seed: int = 0, mxfp8: bool = False,
                 num_mtp_modules: int | None = None) -> M3ForCausalLM:
    """A model with the deterministic random weights ``m3export synth`` writes for the same seed."""
    model = build_empty(cfg, dtype, device, mxfp8, num_mtp_modules)
    params = dict(model.named_parameters())
    for name, p in params.items():
        if p.dtype == torch.uint8:
            continue  # scales are produced together with their fp8 weight
        values = random_parameter(name, tuple(p.shape), seed)
        if p.dtype == torch.float8_e4m3fn:
            q, s = mx.quantize(values)
            p.data.copy_(q)
            params[name + "_scale_inv"].data.copy_(s)
        else:
            p.data.copy_(values)
    return model.requires_grad_(False).eval()


def load_model(path_or_preset: str | os.PathLike, device="cpu", dtype: torch.dtype | None = torch.float32,
               dequantize: bool = False, seed: int = 0, mxfp8: bool = False, progress: bool = True
               ) -> M3ForCausalLM:
    """A checkpoint directory (either layout, BF16/FP32 or MXFP8) or a preset name -> ``M3ForCausalLM``.

    MXFP8 checkpoints keep E4M3 weights + UE8M0 scales unless ``dequantize``; presets give random weights
    (``mxfp8=True`` quantises them). Checkpoints without MTP tensors load with no MTP modules, and say so.
    """
    dtype = dtype or torch.float32
    if is_preset(path_or_preset):
        return random_model(preset(str(path_or_preset)), device, dtype, seed, mxfp8)
    ckpt, cfg, layout, n_mtp, quantized = open_checkpoint(path_or_preset)
    mxfp8 = quantized and not dequantize
    # Built once, checked once, on meta first: a config that does not fit the tensors (hidden_size 1e9) is an
    # error, not a 1 TB allocation; the same model is then allocated on ``device`` and filled by the checked plan.
    model = build_empty(cfg, dtype, "meta", mxfp8, n_mtp)
    plan = check_tensors(ckpt, layout, dict(model.named_parameters()))
    model = materialize(model, dtype, device)
    model.checkpoint_info = {"layout": layout.kind, "mxfp8": quantized, "mtp_modules": n_mtp, "path": str(ckpt.dir)}
    _stream(ckpt, plan, model, progress)
    return model.requires_grad_(False).eval()


def open_checkpoint(path: str | os.PathLike) -> tuple[Checkpoint, M3Config, Layout, int, bool]:
    """Validated shards + config + detected layout, the number of MTP modules shipped, and whether it is MXFP8.

    A config that declares more MTP modules than the checkpoint ships is reported (the release may omit them).
    """
    ckpt = Checkpoint(path)
    if (ckpt.dir / "config.json").exists():
        require_regular_file(ckpt.dir / "config.json")  # a FIFO would block the read forever
    cfg = M3Config.from_pretrained(ckpt.dir)
    try:
        kind, prefix = detect(ckpt.tensors)
    except ValueError as e:
        raise CheckpointError(f"{ckpt.dir}: {e}") from None
    layout = Layout(kind, cfg, prefix)
    present = mtp_modules_present(set(ckpt.tensors), layout)
    if present != list(range(len(present))):
        raise CheckpointError(f"{ckpt.dir}: MTP modules {present} are not numbered 0..{len(present) - 1}")
    if len(present) < cfg.num_mtp_modules:
        log.warning("%s: config declares %d MTP modules but the checkpoint ships %d; %s", ckpt.dir,
                    cfg.num_mtp_modules, len(present),
                    "speculative decoding is unavailable" if not present else "loading those")
    quantized = any(t.torch_dtype == torch.float8_e4m3fn for t in ckpt.tensors.values())
    return ckpt, cfg, layout, len(present), quantized


def _plan(layout: Layout, params: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple]]:
    plan = {}
    for pname in params:
        for piece in layout.pieces(pname):
            plan[piece.name] = (pname, piece.index)
    return plan


#: Bytes of a tensor that ``check_finite`` inspects at a time: its temporaries (``isfinite``'s same-dtype copy
#: and mask, the E4M3 code masks) are bounded by one such slice, never the size of the tensor (an MXFP8 expert
#: stack of the full model is gigabytes; the whole checkpoint 444 GB).
FINITE_CHUNK_BYTES = 64 << 20


def check_finite(t: torch.Tensor, where: str) -> torch.Tensor:
    """``t`` if it holds no NaN or infinity (E4M3's NaN codes S.1111.111 and a UE8M0 scale of 255, NaN in the OCP
    MX format, included); otherwise a ``CheckpointError`` naming ``where`` and how many values are bad. UE8M0 bytes
    0 are counted and recorded (``mxfp8.note_zero_scales``: the MXFP8 kernels then avoid ``tl.dot_scaled``).

    Checked in slices of ``FINITE_CHUNK_BYTES`` (views, no copy of ``t``), so the check needs memory for one slice's
    temporaries whatever the tensor's size."""
    if t.dtype == torch.float8_e4m3fn:
        def count(c):
            return torch.count_nonzero((c.view(torch.uint8) & 0x7F) == 0x7F)
    elif t.dtype == torch.uint8:  # the only uint8 tensors of M3 are MXFP8 scales
        def count(c):
            return torch.count_nonzero(c == 255)
    elif t.is_floating_point():
        def count(c):
            # A NaN or an infinity anywhere makes the slice's sum NaN or infinite, so a finite sum proves there is
            # none: one reading pass without temporaries, 30-50x faster than ``isfinite`` on the CPU (bf16 / fp32,
            # 64 MB slices; a zero-copy export checks every referenced byte). Only a slice whose sum is not finite
            # (a bad value, or finite values overflowing) is counted exactly.
            if bool(torch.isfinite(c.sum())):
                return 0
            return c.numel() - torch.count_nonzero(torch.isfinite(c))
    else:
        return t
    most = max(1, FINITE_CHUNK_BYTES // t.element_size())
    bad = zeros = 0
    for c in _slices(t, most):
        if t.dtype == torch.uint8:  # one min / max per slice; the counting passes only where a byte is 0 or 255
            if c.numel() == 0:
                continue
            lo, hi = (int(v) for v in torch.aminmax(c))
            bad += int(count(c)) if hi == 255 else 0
            # scale byte 0 (2^-127): valid, but the kernels' tl.dot_scaled path reads it as 0
            zeros += int(torch.count_nonzero(c == 0)) if lo == 0 else 0
        else:
            bad += int(count(c))
    if bad:
        raise CheckpointError(f"{where} holds {bad} NaN or infinite value(s) (a corrupt or diverged checkpoint)")
    if zeros:
        mx.note_zero_scales(where, zeros)
    return t


def _slices(t: torch.Tensor, most: int):
    """Views of ``t`` that cover each element once, none of more than ``most`` elements: slices of the flat tensor
    when it is contiguous, else blocks of its leading dimension (rows cut further when one row is too large)."""
    if t.dim() == 0 or t.numel() <= most:
        yield t
    elif t.is_contiguous():
        flat = t.view(-1)
        for start in range(0, flat.numel(), most):
            yield flat[start:start + most]
    else:
        rows = most // (t.numel() // t.shape[0])
        if rows:
            for start in range(0, t.shape[0], rows):
                yield t[start:start + rows]
        else:
            for row in t:
                yield from _slices(row, most)


def check_tensors(ckpt: Checkpoint, layout: Layout, params: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple]]:
    """Check the checkpoint's tensors against the model's parameters (``meta`` ones suffice): none missing, none
    unexpected, every shape, and a dtype each parameter can be filled from. Returns {tensor: (parameter, index)}."""
    plan = _plan(layout, params)
    names = set(ckpt.tensors)
    missing = sorted(set(plan) - names)
    if missing:
        raise CheckpointError(f"{ckpt.dir}: {len(missing)} tensor(s) missing from the checkpoint, e.g. "
                              f"{missing[:5]} ({layout.kind} layout)")
    dequant_scales = {n + "_scale_inv" for n in plan if params[plan[n][0]].dtype != torch.uint8
                      and ckpt.tensors[n].torch_dtype == torch.float8_e4m3fn}
    unexpected = sorted(n for n in names - set(plan) - dequant_scales if not IGNORED.match(n))
    if unexpected:
        raise CheckpointError(f"{ckpt.dir}: {len(unexpected)} unexpected tensor(s) for this config, e.g. "
                              f"{unexpected[:5]} ({layout.kind} layout)")
    for name, (pname, index) in plan.items():
        info = ckpt.tensors[name]
        want = params[pname][index]
        where = f"{info.file}: tensor {name!r}"
        if tuple(info.shape) != tuple(want.shape):
            raise CheckpointError(f"{where} has shape {list(info.shape)}, expected {list(want.shape)} "
                                  f"(parameter {pname})")
        have = info.torch_dtype
        if want.dtype in (torch.float8_e4m3fn, torch.uint8):
            if have != want.dtype:
                raise CheckpointError(f"{where} has dtype {have}, expected {want.dtype} (MXFP8 weight or scale)")
        elif have == torch.float8_e4m3fn:
            if name + "_scale_inv" not in ckpt.tensors:
                raise CheckpointError(f"{where} is float8_e4m3fn but its scale {name + '_scale_inv'!r} is missing")
        elif have not in FLOAT_TYPES:
            raise CheckpointError(f"{where} has dtype {have}, expected a floating-point weight")
    return plan


def _stream(ckpt: Checkpoint, plan: dict[str, tuple[str, tuple]], model: M3ForCausalLM, progress: bool) -> None:
    """Copy every tensor of ``plan`` (``check_tensors``' answer for this very model: names, shapes and dtypes are
    checked, so only finiteness is left to check here) into its place, in file order."""
    params = dict(model.named_parameters())
    order = sorted(plan, key=lambda n: (Path(ckpt.tensors[n].file).name, ckpt.tensors[n].offset))
    for name in tqdm(order, desc="loading weights", unit="tensor", disable=not progress, leave=False):
        pname, index = plan[name]
        target = params[pname].data[index]
        where = f"{ckpt.tensors[name].file}: tensor {name!r}"
        target.copy_(check_finite(_convert(ckpt, name, target.dtype, where), where))


def _convert(ckpt: Checkpoint, name: str, want: torch.dtype, where: str, read=None) -> torch.Tensor:
    """Tensor ``name`` ready to copy into a parameter of dtype ``want``, once ``check_tensors`` has accepted the
    checkpoint (dtypes and MXFP8 scales are checked there, not again per tensor); ``read(name)`` (default
    ``ckpt.get``) fetches a tensor or, for a tensor-parallel rank, its slice (an MXFP8 scale sliced with its
    weight)."""
    read = read or ckpt.get
    if want not in (torch.float8_e4m3fn, torch.uint8) and ckpt.tensors[name].torch_dtype == torch.float8_e4m3fn:
        try:
            return mx.dequantize(read(name), read(name + "_scale_inv"), torch.float32)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: {e}") from None
    return read(name)
