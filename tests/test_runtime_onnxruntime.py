"""The onnxruntime backend against the torch backend on the same exported tiny artifact: the session's
``tiny_artifact`` (pages of 16 tokens), so this module exports nothing of its own. Its prompts (up to 29 tokens
plus 16 generated) cross page boundaries in prefill, decode and verify steps; pages of 4 tokens (one indexer block
per page) on onnxruntime are generated through in ``test_runtime_media_onnxruntime.py``."""

import pytest
import torch

from m3export.errors import BackendUnavailable
from m3export.runtime import Engine, SamplingParams

PAGE = 16  # tiny_artifact's page size


@pytest.fixture(scope="module")
def artifact(tiny_artifact):
    return tiny_artifact


def prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_backend_outputs_match_torch(artifact):
    ort = Engine.from_artifact(artifact, backend="onnxruntime", num_pages=64)
    ref = Engine.from_artifact(artifact, backend="torch", num_pages=64, page_size=PAGE)  # the graph's pages
    ids = torch.tensor(max(prompts(6, 0), key=len))  # 26 tokens: two pages, more than the indexer's top blocks
    from m3export.model.batch import Segment, build_batch

    ids_t, batch = build_batch([Segment(list(range(2)), 0, ids.tolist())], PAGE)
    every = torch.arange(len(ids))
    lo, ho = ort.backend.forward(ids_t, batch, every)
    lt, ht = ref.backend.forward(ids_t, batch, every)
    assert torch.allclose(lo, lt, atol=1e-4) and torch.allclose(ho.float(), ht.float(), atol=1e-4)
    nxt = torch.cat([ids[1:], ids[:1]])
    mo, oo = ort.backend.mtp_forward(0, nxt, ho, batch, every)
    mt, ot = ref.backend.mtp_forward(0, nxt, ht, batch, every)
    assert torch.allclose(mo, mt, atol=1e-4) and torch.allclose(oo.float(), ot.float(), atol=1e-4)


@pytest.mark.parametrize("k", [0, 2])
def test_onnxruntime_generation_equals_torch(artifact, k):
    ps = prompts(6, seed=k)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 3 + \
             [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=16, ignore_eos=True) for i in range(3)]
    outs = {}
    for backend in ("torch", "onnxruntime"):
        eng = Engine.from_artifact(artifact, backend=backend, page_size=PAGE, num_pages=48, num_speculative_tokens=k,
                                   max_num_batched_tokens=24)
        outs[backend] = [o.token_ids for o in eng.generate(ps, params)]
        assert eng.blocks.num_free == eng.blocks.num_pages
        assert eng.tokenizer is not None  # the artifact ships tokenizer.json
    assert outs["onnxruntime"] == outs["torch"]


def test_pool_bytes_match_torch(artifact):
    ort = Engine.from_artifact(artifact, backend="onnxruntime", num_pages=8)
    ref = Engine.from_artifact(artifact, backend="torch", num_pages=8, page_size=PAGE)
    assert ort.backend.page_bytes(PAGE) == ref.backend.page_bytes(PAGE) > 0


def test_page_size_and_device_are_checked(artifact):
    with pytest.raises(ValueError, match=f"pages of {PAGE} tokens"):
        Engine.from_artifact(artifact, backend="onnxruntime", page_size=8)
    if "CUDAExecutionProvider" not in __import__("onnxruntime").get_available_providers():
        with pytest.raises(BackendUnavailable, match="CUDAExecutionProvider .* install onnxruntime-gpu"):
            Engine.from_artifact(artifact, backend="onnxruntime", device="cuda")
    with pytest.raises(BackendUnavailable, match="keeps its tensors on cpu, not on cuda"):
        Engine.from_artifact(artifact, backend="onnxruntime", device="cuda", provider="openvino")
    # "cuda" is the first GPU, where a CUDA provider without device_id keeps its tensors (--device cuda --provider
    # cuda:enable_cuda_graph=1 agree)
    from m3export.runtime.backends.onnxruntime_backend import provider_for

    assert provider_for("cuda", "cuda:enable_cuda_graph=1").options == {"enable_cuda_graph": "1"}
    with pytest.raises(BackendUnavailable, match="not on cuda:1"):
        provider_for("cuda:1", "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("k", [0, 2])
def test_cuda_provider_generation_equals_torch(artifact, k):
    """On the CUDA execution provider (pools, inputs and outputs in device memory, bound in place) greedy and
    seeded generation equals the torch backend's on the CPU token for token, with and without MTP drafts."""
    onnxruntime = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers() or not torch.cuda.is_available():
        pytest.skip("needs onnxruntime-gpu and a CUDA device")
    ps = prompts(4, seed=10 + k)
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 2 + \
             [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=16, ignore_eos=True) for i in range(2)]
    outs = {}
    for backend, provider in (("torch", None), ("onnxruntime", "cuda")):
        eng = Engine.from_artifact(artifact, backend=backend, provider=provider, num_pages=48,
                                   num_speculative_tokens=k, max_num_batched_tokens=24)
        if provider:
            assert eng.backend.device.type == "cuda"
            assert all(t.is_cuda for t in eng.backend._main.pool_tensors.values())
        outs[backend] = [o.token_ids for o in eng.generate(ps, params)]
    assert outs["onnxruntime"] == outs["torch"]
