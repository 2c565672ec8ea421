"""The vision tower + projector on a CUDA device (SDPA's GPU kernels, cuBLAS) against the same weights in fp32 on
the CPU: fp32 to summation order, bf16 to bf16's rounding. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from m3export.config import preset
from m3export.model import M3ForCausalLM

from .vl_config import VISION

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    m = M3ForCausalLM(preset("tiny").replace(num_mtp_modules=0, vision=VISION)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.startswith(("vision_tower", "multi_modal_projector")) and "norm" not in name:
                p.normal_(0.0, 0.3)
    return m


@pytest.mark.parametrize("dtype, bound", [
    (torch.float32, 1e-4),  # TF32 is off by default for matmuls; only the summation order differs
    (torch.bfloat16, 5e-2),  # verify's bf16 tolerance; these weights in bf16 on the CPU: 1.7e-2 and 2.0e-2
])
def test_tower_on_cuda_equals_cpu_fp32(model, dtype, bound):
    grids = torch.tensor([[1, 6, 8], [4, 4, 6]])  # an image and a 4-temporal-patch video chunk
    pixels = torch.randn(int(grids.prod(-1).sum()), VISION.patch_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.encode_media(pixels, grids)
        gpu = M3ForCausalLM(model.config).eval()
        gpu.load_state_dict(model.state_dict())
        gpu = gpu.to("cuda", dtype)
        got = gpu.encode_media(pixels.to("cuda"), grids)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert float((g.float().cpu() - w).abs().max() / w.abs().max()) <= bound
