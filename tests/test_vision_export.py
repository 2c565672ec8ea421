"""``vision.onnx`` in ONNX Runtime against the PyTorch tower + projector, for items of different sizes."""

from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest
import torch

from m3export.checkpoint.loader import build_empty, random_model
from m3export.config import preset
from m3export.export.exporter import _weights_from_model
from m3export.export.vision_graph import VISION_FILE, export_vision_graph, run_vision_onnx

from .test_vision_model import VISION


@pytest.mark.slow  # one dynamo export (~25 s on the 2-core CI machine, mostly the exporter's fixed cost)
def test_vision_graph_matches_pytorch(tmp_path):
    cfg = preset("tiny").replace(num_mtp_modules=0, vision=VISION)
    model = random_model(cfg, seed=5)
    tensors = _weights_from_model(tmp_path, model, progress=False)
    proto = export_vision_graph(build_empty(cfg, torch.float32, "meta"), tensors, tmp_path)
    (tmp_path / VISION_FILE).write_bytes(proto.SerializeToString(deterministic=True))
    onnx.checker.check_model(str(tmp_path / VISION_FILE), full_check=True)
    assert [i.name for i in proto.graph.input] == ["pixel_values", "position_ids"]
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # a dynamic number of patches
    # Every tower / projector parameter is a reference into the weight file, not a copy inside the graph.
    params = {n for n, _ in model.named_parameters() if n.startswith(("vision_tower.", "multi_modal_projector."))}
    external = {t.name for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    assert params == external

    session = ort.InferenceSession(str(tmp_path / VISION_FILE), providers=["CPUExecutionProvider"])
    grids = torch.tensor([[1, 6, 8], [1, 2, 2], [2, 4, 2]])  # two images and a two-frame video chunk
    pixels = torch.randn(int(grids.prod(-1).sum()), VISION.patch_dim, generator=torch.Generator().manual_seed(1))
    got = run_vision_onnx(session, pixels, grids, VISION.spatial_merge_size)
    with torch.no_grad():
        want = model.encode_media(pixels, grids)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        # fp32 both sides; ONNX Runtime's fused attention / LayerNorm sum in another order: ~5e-7 measured.
        assert float((g - w).abs().max() / w.abs().max()) <= 1e-5
