"""``checkpoint.loader.check_finite``'s fast path: a slice whose sum is finite holds no NaN or infinity, and only a
slice whose sum is not finite is counted value by value. Finite values whose sum overflows must still pass, and
every bad value must still be counted, wherever it lies."""

import pytest
import torch

from m3export.checkpoint import loader
from m3export.errors import CheckpointError


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_finite_values_whose_sum_overflows_pass(dtype, monkeypatch):
    monkeypatch.setattr(loader, "FINITE_CHUNK_BYTES", 64)
    big = torch.finfo(dtype).max
    t = torch.full((100,), big, dtype=dtype)  # every slice sums to +inf: the exact count says 0
    assert torch.isinf(t[:16].sum())
    assert loader.check_finite(t, "t") is t


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_bad_value_beside_ones_that_cancel_or_overflow_is_counted(bad, monkeypatch):
    monkeypatch.setattr(loader, "FINITE_CHUNK_BYTES", 64)  # 16 float32 values a slice
    t = torch.randn(100)
    t[3], t[40], t[41] = bad, torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max
    t[77] = float("nan")
    with pytest.raises(CheckpointError, match=r"holds 2 NaN or infinite"):
        loader.check_finite(t, "tensor 'x'")
