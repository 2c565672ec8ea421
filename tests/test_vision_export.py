"""``vision.onnx`` in a real export: written next to the step graph, checked by ``m3export verify`` and directly in
ONNX Runtime against the PyTorch tower + projector, for items of different sizes."""

from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest
import torch

import m3export
from m3export.export.verify import verify_artifact
from m3export.export.vision_graph import VISION_FILE, run_vision_onnx

from .vl_config import VISION


@pytest.mark.slow  # a verify of the session's VL export (vl_artifact: two dynamo exports, step + vision graph)
def test_vl_checkpoint_exports_and_verifies_with_a_vision_graph(vl_artifact):
    art = vl_artifact  # a VL checkpoint with one MTP module, exported: the step, MTP and vision graphs
    assert sorted(art.graphs) == ["model", "mtp0", "vision"] and art.config.vision == VISION

    report = verify_artifact(art, decode_steps=2, progress=False)
    assert report.passed, "\n".join(report.lines())
    assert report.outputs["vision:media_embeds"].max_rel <= 1e-5  # fp32; ~7e-7 measured (summation order)

    proto = onnx.load(str(art.path("vision")), load_external_data=False)
    assert [i.name for i in proto.graph.input] == ["pixel_values", "position_ids"]
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # a dynamic number of patches
    model = m3export.load_model(art.root.parent / "ckpt", progress=False)
    # Every tower / projector parameter is a reference into the weight file, not a copy inside the graph.
    params = {n for n, _ in model.named_parameters() if n.startswith(("vision_tower.", "multi_modal_projector."))}
    assert params == {t.name for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}

    session = ort.InferenceSession(str(art.path("vision")), providers=["CPUExecutionProvider"])
    grids = torch.tensor([[1, 6, 8], [1, 2, 2], [3, 4, 2]])  # sizes verify does not use, a three-frame chunk
    pixels = torch.randn(int(grids.prod(-1).sum()), VISION.patch_dim, generator=torch.Generator().manual_seed(1))
    got = run_vision_onnx(session, pixels, grids, VISION.spatial_merge_size)
    with torch.no_grad():
        want = model.encode_media(pixels, grids)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        # fp32 both sides; ONNX Runtime's attention / LayerNorm sum in another order: ~5e-7 measured.
        assert float((g - w).abs().max() / w.abs().max()) <= 1e-5
    assert VISION_FILE == art.graphs["vision"].file
