"""The FP8 (E4M3) cache format of ``m3export/ops/kv_fp8.py`` in ONNX: pools carried as UINT8 codes.

No ONNX opset (<= 25) has Gather / GatherND / ScatterND on float8, and ONNX Runtime's CPU provider rejects such
graphs, so an exported graph carries each FP8 pool as its bit patterns, uint8 (the bytes of
``torch.float8_e4m3fn`` viewed as ``torch.uint8``), beside its float32 scale pool. Gather and ScatterND move
uint8 everywhere; only the two conversions need care, and both are exact:

* decode: ``Gather`` from a 256-entry float32 table of every code's E4M3 value (the NaN codes 0x7F / 0xFF read
  NaN), then ``* scale`` in fp32: the same products as ``kv_fp8.dequantize_rows``.
* encode: ``kv_fp8.quantize_rows`` step by step (amax / 448, the zero-row rule, clamp), then the round to E4M3
  arithmetically, because ONNX has no bitcast to turn ``Cast(to=FLOAT8E4M3FN)``'s bytes into codes: with
  ``a = |v|`` and ``e = max(floor(log2 a), -6)`` (-6: the subnormals share the smallest normal's spacing), the
  code is ``8 e + 48 + Round(a * 2^(3 - e))`` (``Round`` is ties-to-even; the product is exact, a power-of-two
  scaling), plus 128 for a negative sign (``-0`` included, as torch's cast). A rounding that carries into the
  next binade (``Round`` = 16) lands on that binade's first code by the same formula. ``floor(log2 a)`` comes
  from ``Log`` and is then corrected against exact powers of two, so ``Log``'s rounding never matters.
  ``tests/test_kv_fp8_onnx.py`` checks the bytes against torch over every code boundary.

Rows with non-finite values are outside the contract (torch's NaN sign is the platform's); the model's K, V and
index keys are finite.
"""

from __future__ import annotations

import numpy as np
import torch
from onnx import TensorProto

from ..ops import kv_fp8
from .onnx_builder import Builder

U8 = TensorProto.UINT8
F32 = TensorProto.FLOAT


def code_table() -> np.ndarray:
    """float32 [256]: the E4M3 value of every code (torch's own conversion: the format has one owner)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(kv_fp8.FP8).to(torch.float32).numpy()


def decode_rows(b: Builder, codes: str, scale: str) -> str:
    """uint8 codes [..., D] and fp32 scales [...] -> fp32 ``value(code) * scale`` [..., D]."""
    values = b.Gather(b.const(code_table(), np.float32), b.Cast(codes, to=TensorProto.INT32), axis=0)
    return b.Mul(values, b.Unsqueeze(scale, b.const([-1])))


def encode_rows(b: Builder, x: str) -> tuple[str, str]:
    """x [..., D] (any float type) -> (uint8 codes [..., D], fp32 scales [...]): ``kv_fp8.quantize_rows``."""
    xf = b.Cast(x, to=F32)
    scale = b.Div(b.ReduceMax(b.Abs(xf), b.const([-1]), keepdims=0), b.const(kv_fp8.E4M3_MAX, np.float32))
    positive = b.Greater(scale, b.const(0.0, np.float32))
    safe = b.Unsqueeze(b.Where(positive, scale, b.const(1.0, np.float32)), b.const([-1]))
    limit = b.const(kv_fp8.E4M3_MAX, np.float32)
    v = b.Clip(b.Div(xf, safe), b.Neg(limit), limit)
    v = b.Where(b.Unsqueeze(positive, b.const([-1])), v, b.const(0.0, np.float32))

    a = b.Abs(v)
    two = b.const(2.0, np.float32)
    e = b.Floor(b.Mul(b.Log(a), b.const(1.0 / np.log(2.0), np.float32)))  # within one of floor(log2 a)
    e = b.Sub(e, b.Cast(b.Greater(b.Pow(two, e), a), to=F32))
    e = b.Add(e, b.Cast(b.LessOrEqual(b.Pow(two, b.Add(e, b.const(1.0, np.float32))), a), to=F32))
    e = b.Max(e, b.const(-6.0, np.float32))  # a == 0: Log gives -inf, the clamp gives the subnormal exponent
    steps = b.Round(b.Mul(a, b.Pow(two, b.Sub(b.const(3.0, np.float32), e))))
    magnitude = b.Add(b.Add(b.Mul(e, b.const(8.0, np.float32)), b.const(48.0, np.float32)), steps)
    negative = b.Less(b.Div(b.const(1.0, np.float32), v), b.const(0.0, np.float32))  # 1 / -0 = -inf
    code = b.Add(magnitude, b.Mul(b.Cast(negative, to=F32), b.const(128.0, np.float32)))
    return b.Cast(code, to=U8), scale
