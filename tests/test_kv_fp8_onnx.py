"""The ONNX form of the FP8 cache (``m3export/export/kv_fp8_onnx.py``) against ``m3export/ops/kv_fp8.py``.

The encoder must give the very bytes torch's quantiser gives (an exported graph and the torch backend then write
identical caches), so the inputs are built to sit on every rounding decision: every finite E4M3 value, every
midpoint between neighbours (ties: even mantissa wins) and the fp32 values just above and below each midpoint,
both signs, at a row scale of one and at scales that make the divisions inexact; plus random rows over 16
decades, negative zeros, tiny values that round to signed zeros, and an all-zero row (scale 0).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from m3export.export import kv_fp8_onnx
from m3export.export.onnx_builder import Builder
from m3export.export.schemas import ONNX_OPSET
from m3export.ops import kv_fp8

_TYPES = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16}


def _session(dtype: torch.dtype) -> ort.InferenceSession:
    """x [R, D] -> (codes, scales, decoded): the encoder, then the decoder on its output."""
    b = Builder("")
    codes, scale = kv_fp8_onnx.encode_rows(b, "x")
    decoded = kv_fp8_onnx.decode_rows(b, codes, scale)
    outputs = [helper.make_tensor_value_info(codes, TensorProto.UINT8, ["R", "D"]),
               helper.make_tensor_value_info(scale, TensorProto.FLOAT, ["R"]),
               helper.make_tensor_value_info(decoded, TensorProto.FLOAT, ["R", "D"])]
    graph = helper.make_graph(b.nodes, "fp8_rows", [helper.make_tensor_value_info("x", _TYPES[dtype], ["R", "D"])],
                              outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)])
    model.ir_version = 10
    onnx.checker.check_model(onnx.shape_inference.infer_shapes(model, strict_mode=True))
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _boundary_rows() -> torch.Tensor:
    """Rows whose amax is 448 (scale 1, every value reaches the rounding as is) holding every finite E4M3
    magnitude, every midpoint and its two fp32 neighbours; their negatives; the same rows scaled (inexact
    divisions, decisions moved by one fp32 ulp)."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(kv_fp8.FP8).to(torch.float32)
    grid = torch.unique(values[torch.isfinite(values)].abs())
    mids = (grid[1:] + grid[:-1]) / 2
    up, down = torch.nextafter(mids, torch.tensor(np.inf)), torch.nextafter(mids, torch.tensor(-np.inf))
    row = torch.cat([grid, mids, up, down])
    rows = torch.stack([row, -row, torch.cat([-row[:-1], row[-1:]])])
    return torch.cat([rows, rows * 3.7, rows * 2.0**-20, rows * 1e-3])


def _random_rows(d: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, d, generator=gen) * torch.logspace(-8, 8, 64).unsqueeze(1)
    x[1, :5] = torch.tensor([-0.0, 0.0, -1e-30, 1e-30, -1e-20])  # signed zeros and values rounding to them
    x[2] = 0.0  # scale 0: codes 0, reads back 0
    x[3] = -0.0
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_encoder_bytes_and_decoder_values_equal_torch(dtype):
    boundary = _boundary_rows()
    x = torch.cat([boundary, _random_rows(boundary.shape[1])]).to(dtype)
    x = x[torch.isfinite(x).all(1)]  # fp16 overflows the widest random rows: non-finite rows are out of contract
    assert len(x) > 50
    codes, scales, decoded = _session(dtype).run(None, {"x": x.numpy()})
    want_q, want_scale = kv_fp8.quantize_rows(x)
    want_codes = want_q.view(torch.uint8)
    bad = (torch.from_numpy(codes) != want_codes).nonzero()
    assert len(bad) == 0, f"{len(bad)} codes differ, first at {bad[:5].tolist()}"
    assert torch.equal(torch.from_numpy(scales), want_scale)
    # decode: float(q) * scale in fp32, the reference's own products, so equal (not close)
    assert torch.equal(torch.from_numpy(decoded), kv_fp8.dequantize_rows(want_q, want_scale))
    assert (want_codes == 0x80).any() and (want_codes == 0x7E).any() and (want_codes == 0xFE).any()


def test_code_table_is_torch_e4m3_with_nan_codes():
    table = torch.from_numpy(kv_fp8_onnx.code_table())
    nan = torch.isnan(table)
    assert nan.nonzero().flatten().tolist() == [0x7F, 0xFF]
    want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(kv_fp8.FP8).to(torch.float32)
    assert torch.equal(table[~nan], want[~nan]) and table[0x7E] == kv_fp8.E4M3_MAX and table[1] == 2.0**-9
