"""The GPU tier's engine check: greedy tokens of the engine on CUDA (the registered Triton kernels) against
continuations recomputed on the CPU by the references, near-tie aware. Run by ``scripts/gpu_check.sh`` on the
H200 (``pytest -m gpu``) in a process without ``TRITON_INTERPRET``.

A CUDA-side recompute would be no oracle once kernels serve CUDA: the reference is the CPU model in float64, with
a flip accepted as a near-tie only within twice the largest logit difference measured between the two on a
whole sequence (at least ``floor``), as ``m3export verify`` judges greedy flips.
"""

from __future__ import annotations

import pytest
import torch

import m3export
from m3export.model import Batch
from m3export.runtime import Engine, SamplingParams
from m3export.runtime.backends.torch_backend import TorchBackend

from .greedy_agreement import agreeing_prefix
from .runtime_fixtures import prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


# fp32 only: in 16 bit the random-weight tiny model turns rounding into different indexer selections, which
# move its logits by O(1) (measured on the CPU: bf16 0.8, PyTorch fp16 0.7 of the logit scale against float64 of
# the same weights), so a whole-model greedy comparison says nothing there; the 16-bit semantics of each op are
# checked by the op conformance suite on cuda.
@pytest.mark.parametrize("dtype, floor", [(torch.float32, 1e-4)])
@pytest.mark.parametrize("k", [0, 2])
def test_cuda_engine_tokens_equal_cpu_reference_continuations(dtype, floor, k):
    """``floor``: the smallest near-tie bound (fp32: 100x the ~1e-6 of differently ordered fp32 sums)."""
    model = m3export.load_model("tiny", device="cuda", dtype=dtype)
    ps = prompts(6, seed=21, lo=5, hi=60)  # > 12 tokens: the tiny indexer selects (block 4, top-3)
    eng = Engine(TorchBackend(model), page_size=8, num_pages=256, num_speculative_tokens=k,
                 max_num_batched_tokens=64)
    outs = eng.generate(ps, GREEDY)
    reference = m3export.load_model("tiny", dtype=dtype).double()
    ids = torch.tensor(ps[-1] + outs[-1].token_ids)
    n = len(ids)
    got, _ = eng.backend.forward(ids.cuda(), Batch.contiguous(1, n, 8, "cuda"), torch.arange(n, device="cuda"))
    with torch.no_grad():
        want = reference(ids[None])[0].double()
    err = float((got.double().cpu() - want).abs().max() / want.abs().max())
    assert err < 0.05, f"CUDA logits differ from the CPU reference by {err:.2e} of the logit scale"
    agreed = [agreeing_prefix(reference, p, o.token_ids, max(floor, 2 * err)) for p, o in zip(ps, outs, strict=True)]
    assert sum(agreed) >= 0.75 * sum(len(o.token_ids) for o in outs), agreed
    assert eng.blocks.num_free == eng.blocks.num_pages
