"""MXFP8 weight format: E4M3 values with one UE8M0 exponent per 32 consecutive elements along K.

The checkpoint calls the scale ``weight_scale_inv`` but multiplies by it: ``W = float(Wq) * 2**(S - 127)``.
Quantisation picks the smallest power of two that keeps the block's absolute maximum at or under 448 (E4M3's
largest finite value), so nothing saturates and a dequantised tensor re-quantises to the same values.
"""

from __future__ import annotations

import logging

import torch

BLOCK = 32
E4M3_MAX = 448.0
SCALE_BIAS = 127

log = logging.getLogger(__name__)

_zero_scales: dict[str, int] = {}  # loaded scale tensor -> its count of byte 0 (note_zero_scales)


def scale_to_float(scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """UE8M0 byte -> power of two (exact in every float dtype we use)."""
    return torch.exp2(scale.to(torch.float32) - SCALE_BIAS).to(dtype)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., N, K] e4m3 + [..., N, K/32] uint8 -> [..., N, K] float (exact in fp32 and bf16)."""
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"MXFP8 weight must be float8_e4m3fn, got {weight.dtype}")
    if scale.dtype != torch.uint8:
        raise TypeError(f"MXFP8 scale must be uint8 (UE8M0), got {scale.dtype}")
    *lead, n, k = weight.shape
    if k % BLOCK or tuple(scale.shape) != (*lead, n, k // BLOCK):
        raise ValueError(f"MXFP8 scale shape {tuple(scale.shape)} does not match weight {tuple(weight.shape)} / 32")
    w = weight.to(torch.float32).reshape(*lead, n, k // BLOCK, BLOCK)
    return (w * scale_to_float(scale).unsqueeze(-1)).reshape(*lead, n, k).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (e4m3 values, UE8M0 scales); K must be a multiple of 32."""
    *lead, n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"MXFP8 needs K ({k}) to be a multiple of {BLOCK}")
    w = weight.to(torch.float32).reshape(*lead, n, k // BLOCK, BLOCK)
    amax = w.abs().amax(-1)
    exp = torch.ceil(torch.log2(amax / E4M3_MAX))
    exp = torch.where(amax > 0, exp, torch.zeros_like(exp)).clamp(-SCALE_BIAS, SCALE_BIAS)
    scale = (exp + SCALE_BIAS).to(torch.uint8)
    q = (w / torch.exp2(exp).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(*lead, n, k), scale


def note_zero_scales(where: str, count: int) -> None:
    """Record that a loaded UE8M0 scale tensor (``where``) holds ``count`` bytes 0, each the scale 2^-127 (exact:
    an fp32 subnormal). ``tl.dot_scaled``, as Triton 3.6 lowers it on sm_90, reads byte 0 as a scale of 0, so the
    Triton kernels' ``MX_MODE`` 2 would disagree with the definition wherever such a block holds non-zero codes;
    once any is recorded the kernels take their exact per-32-scale path (``MX_MODE`` 1) instead, for every model of
    the process (the kernels serve the ``m3`` ops process-wide; their calls carry only tensors). Byte 255 never gets
    here: the checkpoint loader refuses it (``check_finite``). ``quantize`` never writes byte 0 (a zero block gets
    127); a quantiser that writes it for all-zero blocks costs the fast path although zero codes are exact either
    way (the loader counts per scale tensor, without the codes: conservative)."""
    if not _zero_scales:
        log.warning("%s holds %d MXFP8 scale(s) of byte 0 (2^-127): the MXFP8 kernels use their exact scale path "
                    "(MX_MODE 1) instead of tl.dot_scaled, which reads that byte as 0", where, count)
    _zero_scales[where] = _zero_scales.get(where, 0) + count


def zero_scales_loaded() -> dict[str, int]:
    """The scale tensors with byte 0 loaded in this process (``note_zero_scales``), with their counts."""
    return dict(_zero_scales)


def zero_scales_seen() -> bool:
    """Whether any scale tensor with byte 0 was loaded (the kernels ask this per launch: no copy of the record)."""
    return bool(_zero_scales)
