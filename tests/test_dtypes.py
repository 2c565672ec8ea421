"""The dtype table against the libraries whose codes it records: onnx, safetensors, torch and numpy."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from safetensors.torch import save

from m3export.dtypes import BY_NAME, BY_ONNX, BY_SAFETENSORS, DTYPES, MODEL_DTYPES, by_name, of_torch


@pytest.mark.parametrize("d", DTYPES, ids=lambda d: d.name)
def test_row_matches_the_libraries(d):
    assert d.torch == getattr(torch, d.name)
    # onnx's own element type -> numpy mapping (ml_dtypes for bfloat16 / float8) names the same type
    assert onnx.helper.tensor_dtype_to_np_dtype(d.onnx).name == d.name
    # the code safetensors itself writes for this torch dtype
    header = save({"x": torch.zeros(2, dtype=d.torch)})
    n = int.from_bytes(header[:8], "little")
    assert json.loads(header[8:8 + n])["x"]["dtype"] == d.safetensors
    assert d.storage.itemsize == d.torch.itemsize == d.itemsize
    assert of_torch(d.torch) is d is by_name(d.name)


def test_lookups_are_one_to_one():
    assert len(BY_NAME) == len(BY_ONNX) == len(BY_SAFETENSORS) == len(DTYPES)
    assert set(MODEL_DTYPES) <= set(BY_NAME)


@pytest.mark.parametrize("d", DTYPES, ids=lambda d: d.name)
def test_numpy_round_trip_is_bit_exact(d):
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 256, (6 * d.itemsize,), dtype=torch.uint8, generator=g)
    if d.torch == torch.bool:
        bits = bits % 2
    t = bits.view(d.torch)
    a = d.to_numpy(t)
    assert a.dtype == d.storage
    back = d.to_torch(a)
    assert back.dtype == d.torch and torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_to_numpy_converts_to_the_row_dtype():
    a = BY_NAME["bfloat16"].to_numpy(torch.tensor([1.0, -2.5, 3.0]))
    assert a.dtype == np.uint16
    assert BY_NAME["bfloat16"].to_torch(a).tolist() == [1.0, -2.5, 3.0]  # exactly representable in bf16


def test_unknown_names_are_clear_errors():
    with pytest.raises(ValueError, match="unknown dtype 'float128'"):
        by_name("float128")
    with pytest.raises(ValueError, match="no row"):
        of_torch(torch.complex64)
