"""UE8M0 scale bytes 0 and 255 in a loaded MXFP8 checkpoint (docs/ops.md §8).

Byte 255 is refused at load (``CheckpointError`` naming the tensor). Byte 0 (2^-127) is valid; the loader counts it
per tensor and records it (``mxfp8.note_zero_scales``), and from then on the Triton kernels do not take
``tl.dot_scaled`` (``MX_MODE`` 2), which reads that byte as 0 on sm_90, but their exact per-32-scale path
(``MX_MODE`` 1). CPU: the loader's count on a tiny MXFP8 checkpoint with one byte changed, the kernels' path choice,
and ``MX_MODE`` 1 against float64 on rows whose scales are all byte 0 (interpreter). GPU: the default path of
``mxfp8_linear`` at a prefill size, bf16, after such a load. Each test starts with a clean record (the record is
process-wide; ``tests/conftest.py`` resets it).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from m3export.checkpoint.loader import load_model
from m3export.checkpoint.shards import Checkpoint
from m3export.errors import CheckpointError
from m3export.ops import mxfp8

triton = pytest.importorskip("triton", reason="the kernels need triton (the [gpu] extra)")

from m3export.plugins.kernels import moe as moe_kernel  # noqa: E402
from m3export.plugins.kernels import mxfp8_linear as linear_kernel  # noqa: E402

INTERPRETED = bool(triton.knobs.runtime.interpret)


def _with_scale_byte(src, dst, value: int) -> str:
    """A copy of checkpoint ``src`` at ``dst`` whose first routed-expert scale tensor starts with byte ``value``;
    returns that tensor's name."""
    shutil.copytree(src, dst)
    ckpt = Checkpoint(dst)
    name = next(n for n, e in sorted(ckpt.tensors.items()) if e.dtype == "uint8" and ".experts." in n)
    entry = ckpt.tensors[name]
    with open(entry.file, "r+b") as f:
        f.seek(entry.offset)
        f.write(bytes([value]))
    return name


def test_a_scale_byte_0_is_counted_once_at_load_and_named(mxfp8_checkpoint, tmp_path):
    load_model(mxfp8_checkpoint, progress=False)
    assert mxfp8.zero_scales_loaded() == {}  # the quantiser never writes byte 0: a real-style checkpoint is clean
    name = _with_scale_byte(mxfp8_checkpoint, tmp_path / "zero", 0)
    load_model(tmp_path / "zero", progress=False)
    (where, count), = mxfp8.zero_scales_loaded().items()
    assert repr(name) in where and count == 1


def test_a_scale_byte_255_is_refused_naming_the_tensor(mxfp8_checkpoint, tmp_path):
    name = _with_scale_byte(mxfp8_checkpoint, tmp_path / "inf", 255)
    with pytest.raises(CheckpointError, match=f"{name!r} holds 1 NaN or infinite"):
        load_model(tmp_path / "inf", progress=False)


def test_kernels_leave_dot_scaled_once_byte_0_is_loaded(monkeypatch):
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)  # as compiled on the GPU: only the path choice
    assert linear_kernel.mx_mode2_available(torch.bfloat16)
    assert linear_kernel.tile_config(128, linear_kernel.mx_mode2_available(torch.bfloat16))["MX_MODE"] == 2
    mxfp8.note_zero_scales("shard.safetensors: tensor 'w_scale_inv'", 3)
    assert not linear_kernel.mx_mode2_available(torch.bfloat16)
    for bm in (64, 128):
        assert moe_kernel.gemm_config(bm, linear_kernel.mx_mode2_available(torch.bfloat16))["MX_MODE"] == 1
        assert linear_kernel.tile_config(bm, linear_kernel.mx_mode2_available(torch.bfloat16))["MX_MODE"] == 1
    with pytest.raises(ValueError, match="'w_scale_inv'.*MX_MODE 1 or 3"):
        linear_kernel.check_mx_mode(2, torch.bfloat16)


def _zero_scale_rows(n: int, k: int, rows: int, gen: torch.Generator):
    """MXFP8 weights [n, k] whose first ``rows`` rows have every scale byte 0 and codes of magnitude 2-448 (so each
    value, code * 2^-127, is a normal float: no flush-to-zero can hide a wrong scale)."""
    w, s = mxfp8.quantize(torch.randn(n, k, generator=gen))
    codes = w[:rows].float()
    w[:rows] = (codes.sign() + (codes == 0)) * codes.abs().clamp(2.0, 448.0)
    s[:rows] = 0
    return w, s


def _check_against_float64(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, u: float):
    """Per column against float64: each weight is exact in x's dtype (an E4M3 code times a power of two >= 2^-126),
    so the error is the fp32 accumulation's, within gamma_K sum |x w| (Higham), plus the output's one rounding
    (unit roundoff ``u``). A scale of 0 in place of 2^-127 makes the zero-scale columns 0: an error of 100 %."""
    w64 = mxfp8.dequantize(w, s, torch.float32).double()
    want = x.double() @ w64.t()
    k = x.shape[-1]
    bound = u * want.abs() + k * 2.0 ** -24 / (1 - k * 2.0 ** -24) * (x.double().abs() @ w64.abs().t())
    err = (got.double() - want).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


def test_mx_mode_1_is_exact_on_scale_byte_0():
    # fp32 activations under the interpreter (tl.dot_scaled has no interpreter implementation): the fp32 path
    # reads 2^-127 as the constant _SCALE_ZERO_BYTE
    gen = torch.Generator().manual_seed(0)
    w, s = _zero_scale_rows(48, 128, 5, gen)
    x = torch.randn(70, 128, generator=gen)
    got = linear_kernel.run_linear(x, w, s, config=linear_kernel.tile_config(70, False))
    assert bool((got[:, :5] != 0).all())  # the zero-scale columns are tiny, not zero
    _check_against_float64(got, x, w, s, u=2.0 ** -24)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="needs CUDA and compiled kernels")
def test_gpu_default_linear_is_exact_on_scale_byte_0_once_it_is_loaded():
    gen = torch.Generator().manual_seed(0)
    w, s = _zero_scale_rows(256, 1024, 64, gen)
    x = torch.randn(256, 1024, generator=gen).bfloat16()
    mxfp8.note_zero_scales("test: tensor 'w_scale_inv'", int((s == 0).sum()))  # as the loader does
    got = linear_kernel.run_linear(x.cuda(), w.cuda(), s.cuda()).cpu()  # the default: 256 rows, tensor cores
    assert bool((got[:, :64] != 0).all())
    _check_against_float64(got, x, w, s, u=2.0 ** -8)  # bf16 output: unit roundoff 2^-8
