"""``vision.onnx``: the vision tower + projector for one media item, with a dynamic number of patches.

Inputs ``pixel_values`` [patches, C*T*P*P] (float32, what preprocessing writes) and ``position_ids`` [patches, 3]
(int64, from ``vision_position_ids``: the runtime computes them from the item's grid); output ``media_embeds``
[patches / merge_unit, hidden] in float32 (numpy has no bfloat16; the runtime casts when it places them at the
item's placeholder tokens). One run per item (an image, or one temporal chunk of a video): attention spans exactly
the item, so no segment mask.

Traced on the ``meta`` device like the step graphs; the parameters become external-data references into the
artifact's weight file (the exporter's ``finalize``, as for every graph).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch
from torch import nn

from ..errors import ArtifactError
from ..model import M3ForCausalLM
from ..model.vision import vision_position_ids
from .graphs import ROOT, GraphSignature, torch_to_onnx

VISION_FILE = "vision.onnx"
VISION_SIGNATURE = GraphSignature(("pixel_values", "position_ids"), ("media_embeds",), {})


class VisionGraph(nn.Module):
    def __init__(self, model: M3ForCausalLM):
        super().__init__()
        setattr(self, ROOT, model)

    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        m = getattr(self, ROOT)
        return m.multi_modal_projector(m.vision_tower(pixel_values, position_ids)).float()


def _example(model: M3ForCausalLM) -> tuple[torch.Tensor, torch.Tensor]:
    """A 1 x 4 x 6 grid (24 patches, 6 tokens): no dimension is 0, 1 or equal to another."""
    v = model.config.vision
    m = v.spatial_merge_size
    pos = vision_position_ids(1, 2 * m, 3 * m, m)
    return torch.empty((pos.shape[0], v.patch_dim), device="meta"), pos.to("meta")


def trace_vision(model: M3ForCausalLM) -> ir.Model:
    """``model`` (typically on ``meta``) -> the un-finalised ONNX IR of ``vision.onnx``."""
    if model.config.vision is None:
        raise ArtifactError("the model has no vision tower: there is no vision graph to export")
    unit = model.config.vision.merge_unit
    tokens = torch.export.Dim("tokens", min=1)
    patches = unit * tokens  # the projector folds every ``unit`` consecutive patches into one token
    return torch_to_onnx(VisionGraph(model), _example(model), VISION_SIGNATURE, shapes=({0: patches}, {0: patches}))


def run_vision_onnx(session, pixel_values: torch.Tensor, grid_thw, merge_size: int) -> list[torch.Tensor]:
    """Encode each grid row with an ONNX Runtime session of ``vision.onnx`` -> one token block per item."""
    out, start = [], 0
    for t, h, w in torch.as_tensor(grid_thw).reshape(-1, 3).tolist():
        n = t * h * w
        feeds = {"pixel_values": pixel_values[start:start + n].float().numpy(),
                 "position_ids": vision_position_ids(t, h, w, merge_size).numpy().astype(np.int64)}
        (embeds,) = session.run(None, feeds)
        out.append(torch.from_numpy(embeds))
        start += n
    return out


def compare_vision(artifact, model: M3ForCausalLM, stat, providers=("CPUExecutionProvider",), seed: int = 0):
    """``m3export verify``'s vision check: ``vision.onnx`` in ONNX Runtime against the PyTorch tower + projector on
    two images of different sizes and a two-frame video chunk; errors accumulate into ``stat`` (verify's Stat)."""
    import onnxruntime as ort

    v = model.config.vision
    m = v.spatial_merge_size
    grids = torch.tensor([[1, 2 * m, 3 * m], [1, m, m], [2, 2 * m, m]])
    pixels = torch.randn(int(grids.prod(-1).sum()), v.patch_dim, generator=torch.Generator().manual_seed(seed))
    session = ort.InferenceSession(str(artifact.path("vision")), providers=list(providers))
    got = run_vision_onnx(session, pixels, grids, m)
    with torch.no_grad():
        want = model.encode_media(pixels, grids)
    for g, w in zip(got, want, strict=True):
        stat.update(g, w.float())
    return stat

