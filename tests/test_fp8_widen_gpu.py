"""The E4M3 -> bf16 bit placement (``plugins/kernels/_fp8.widen_by_bits``, the indexer scan's ``fp8_dot="bits"``)
compiled for the GPU, on every byte: the PTX (``prmt`` sign extension, shift, mask, one ``mul.rn.bf16x2`` by 2^120)
must give PyTorch's own E4M3 -> bf16 conversion for all 254 non-NaN codes, subnormals and both zeros included, in
every position of a packed register (four bytes a register: the byte at each position differs across the rows).
The interpreter has no PTX (it runs ``widen``), so this is the test of the placement itself. Skipped without a GPU
(CI); on the H200: ``python3 -m pytest -q -m gpu tests/test_fp8_widen_gpu.py``."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_every_e4m3_byte_widens_to_pytorchs_bf16_in_every_packed_position():
    import triton
    import triton.language as tl

    from m3export.plugins.kernels._fp8 import widen_by_bits

    @triton.jit
    def widen_rows(x_ptr, y_ptr, N: tl.constexpr):
        r = tl.program_id(0)
        i = tl.arange(0, N)
        x = tl.load(x_ptr + r * N + i)
        tl.store(y_ptr + r * N + i, widen_by_bits(x, False))

    codes = torch.arange(256, dtype=torch.int32)
    rows = torch.stack([(codes + shift) % 256 for shift in range(4)]).to(torch.uint8)  # each byte at 4 positions
    x = rows.cuda().view(torch.float8_e4m3fn)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device="cuda")
    widen_rows[(x.shape[0],)](x, y, N=256)
    want = x.to(torch.bfloat16)
    real = ~want.isnan()
    assert real.sum() == 4 * 254  # 0x7F and 0xFF are E4M3's NaNs, never written by the cache (clamped to +-448)
    assert torch.equal(y[real].view(torch.int16), want[real].view(torch.int16))  # bit for bit: -0.0 stays -0.0
    nonzero = want[real][want[real] != 0].float().abs()
    assert nonzero.numel() == 4 * 252 and nonzero.min() == 2.0 ** -9  # the subnormals were among them
