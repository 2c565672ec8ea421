"""FP8 (E4M3) cache format for K, V and index keys: one fp32 scale per cached row, stored in its own pool.

A *row* is what one token writes for one KV head (``[D]`` of a K or V pool ``[pages, page, Hkv, D]``) or for the
one index-key head (``[D]`` of ``[pages, page, D]``). Its scale pool is the value pool without the last dimension
(``[pages, page, Hkv]`` / ``[pages, page]``, float32), addressed by the same slots.

Quantisation (the write path, ``docs/ops.md`` §1 "FP8 cache"), per row, in fp32:

    amax  = max |x|                   (x: the row in the model dtype, upcast to fp32)
    scale = amax / 448                (448: E4M3's largest finite value)
    q     = e4m3(clamp(x / scale, -448, 448))   rounded to nearest, ties to even;  q = 0 where scale == 0

and dequantisation (every reader): ``float(q) * scale`` in fp32. A zero row gets scale 0 and dequantises to
exact zeros (never 0/0). Every row's bytes depend on that row alone, so chunked prefill, batching and prefix
caching give identical caches (the property the indexer's selection relies on).

Why per row and not per block: the cache is appended one token at a time. A per-block scale is either static
(calibrated, or 1.0 as vLLM's default per-tensor ``k_scale``) and saturates or underflows on M3's un-normalised
V and on rotated keys far from the calibration, or it must grow with the block's running amax, which rewrites
rows already cached (and pages already shared). Per row costs 4 bytes per 128 (3%): a 128-dim bf16 row of 256
bytes becomes 132 (1.94x the tokens per byte). This is the layout of DeepSeek-V3.2's FP8 indexer-key cache and
FlashMLA's FP8 sparse KV cache (one scale per token per 128-element tile).
"""

from __future__ import annotations

import torch

from ..dtypes import KV_CACHE_DTYPES

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
SCALE_DTYPE = torch.float32
# E4M3 keeps 3 mantissa bits: a normal value rounds to within half a unit, 2^-4 of itself. Rows are scaled so
# their largest element is 448 (normal); elements below 2^-6 * scale (subnormal range) have an absolute error of
# at most 2^-10 * scale instead. Bounds built on these live beside the tests that use them.
E4M3_REL_STEP = 2.0**-3
E4M3_HALF_ULP = 2.0**-4
E4M3_SUBNORMAL_ABS = 2.0**-10  # half the subnormal spacing 2^-9, relative to the row's scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (q [..., D] float8_e4m3fn, scale [...] float32), as the module says."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(-1)
    # A tensor divisor, not the Python float: PyTorch's CUDA division by a CPU scalar multiplies by its rounded
    # reciprocal (amax * fl(1/448) differs from amax / 448 in the last bit for some rows), so the reference
    # gave other scales, and then other codes, on the GPU than on the CPU, the kernels and ONNX (all divide).
    scale = amax / torch.full_like(amax, E4M3_MAX)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (xf / safe.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    q = torch.where((scale > 0).unsqueeze(-1), q, torch.zeros_like(q))
    return q.to(FP8), scale


def quantize_codes_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``m3::quantize_kv_rows``: ``quantize_rows`` with the E4M3 values as their bit patterns, ``uint8`` (the
    ONNX form of an FP8 pool, ``read_pool``). An op of its own so that a traced cache write of a code pool
    stays one node, which the exporter translates to ``export/kv_fp8_onnx.encode_rows`` (standard ONNX ops, the
    same bytes), never into float8 casts that no ONNX scatter takes; eager, it is this function."""
    q, scale = quantize_rows(x)
    return q.view(torch.uint8), scale


quantize_kv_rows = torch.library.custom_op("m3::quantize_kv_rows", quantize_codes_reference, mutates_args=())


@quantize_kv_rows.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=torch.uint8), x.new_empty(x.shape[:-1], dtype=SCALE_DTYPE)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., D] float8_e4m3fn, scale [...] -> [..., D] ``float(q) * scale`` computed in ``dtype``'s precision
    (fp32 for the contract; float64 when the conformance oracle asks, then exact)."""
    acc = torch.promote_types(dtype, torch.float32)
    return (q.to(acc) * scale.to(acc).unsqueeze(-1)).to(dtype)


def check_pair(name: str, pool: torch.Tensor, scale: torch.Tensor | None) -> None:
    """An fp8 pool needs its fp32 scale pool (the pool's shape without the last dimension); others take none."""
    if pool.dtype == FP8:
        if scale is None:
            raise ValueError(f"{name} is float8_e4m3fn but no {name}_scale pool was given")
        if scale.dtype != SCALE_DTYPE or tuple(scale.shape) != tuple(pool.shape[:-1]):
            raise ValueError(f"{name}_scale must be float32 {tuple(pool.shape[:-1])} beside {name} "
                             f"{tuple(pool.shape)}, got {scale.dtype} {tuple(scale.shape)}")
    elif scale is not None:
        raise ValueError(f"{name}_scale given but {name} is {pool.dtype}, not float8_e4m3fn")


def read_pool(name: str, pool: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The pool a cache reader reads: a ``uint8`` pool holds E4M3 codes (the ONNX form of an FP8 pool, no opset
    gathers float8: ``docs/ops.md`` §9) and is viewed as float8_e4m3fn, so an export traced with code pools and
    the references agree byte for byte; then ``check_pair``. A uint8 pool without scales is an error (its codes
    are not numbers)."""
    if pool.dtype == torch.uint8:
        if scale is None:
            raise ValueError(f"{name} is uint8 (E4M3 codes) but no {name}_scale pool was given")
        pool = pool.view(FP8)
    check_pair(name, pool, scale)
    return pool


def resolve_cache_dtype(name: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """``--kv-cache-dtype`` -> the dtype of the K/V and index-key pools (``auto``/None: the model's)."""
    if name is None or name == "auto":
        return model_dtype
    if name == "bf16":
        return torch.bfloat16
    if name == "fp8":
        return FP8
    raise ValueError(f"--kv-cache-dtype {name!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")


def cache_dtype_name(dtype: torch.dtype) -> str:
    """The manifest / CLI spelling of a pool dtype: ``fp8`` for E4M3, else torch's name (``bfloat16``, ...)."""
    return "fp8" if dtype == FP8 else str(dtype).removeprefix("torch.")
