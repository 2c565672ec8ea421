"""The fused residual add + RMSNorm kernel compiled on a CUDA device at ``mini``'s hidden width (6144, bf16),
against the model's plain ops on the same device, under the bounds derived in ``tests/test_kernels_rms_norm.py``.
Skipped without a GPU (CI); on the H200: ``python3 -m pytest -q -m gpu tests/test_kernels_rms_norm_gpu.py``.

(The whole ``mini`` model with every kernel, these norms included, against its reference path is
``tests/test_kernels_attention_gpu.py::test_mini_model_greedy_tokens_equal_with_kernels_and_references``.)"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HIDDEN = 6144


def _case(rows, dtype, seed):
    from m3export.model.norm import RMSNorm

    gen = torch.Generator(device="cuda").manual_seed(seed)
    norm = RMSNorm(HIDDEN, 1e-6).cuda().to(dtype)
    norm.weight.data.normal_(0, 0.3, generator=gen)
    x = torch.randn(rows, HIDDEN, device="cuda", generator=gen).to(dtype) * 2
    residual = torch.randn(rows, HIDDEN, device="cuda", generator=gen).to(dtype) * 5
    return norm, x, residual


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 8, 300, 8192])  # decode batches, a verify / prefill chunk, a long chunk
def test_mini_width_against_plain_ops_without_host_sync(dtype, rows):
    from m3export.plugins.kernels.rms_norm import add_rms_norm
    from tests.test_kernels_rms_norm import assert_within_norm_bound

    norm, x, residual = _case(rows, dtype, seed=rows)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a device-to-host sync inside the launcher raises
    try:
        normed, h = add_rms_norm(x, residual, norm.weight, norm.eps)
        normed_x, same = add_rms_norm(x, None, norm.weight, norm.eps)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(h, residual + x) and same is x
    assert_within_norm_bound(normed, norm(residual + x), HIDDEN)
    assert_within_norm_bound(normed_x, norm(x), HIDDEN)


def test_graph_replay_reads_new_inputs():
    """Captured in a CUDA graph (as the graphed decode step captures it) and replayed on new values of the same
    buffers: the replay equals an eager launch on those values, bit for bit."""
    from m3export.plugins.kernels.rms_norm import add_rms_norm

    norm, x, residual = _case(8, torch.bfloat16, seed=1)
    add_rms_norm(x, residual, norm.weight, norm.eps)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, h = add_rms_norm(x, residual, norm.weight, norm.eps)
    _, x2, r2 = _case(8, torch.bfloat16, seed=2)
    x.copy_(x2)
    residual.copy_(r2)
    graph.replay()
    want_normed, want_h = add_rms_norm(x2, r2, norm.weight, norm.eps)
    assert torch.equal(h, want_h) and torch.equal(normed, want_normed)
