"""ONNX Runtime's CUDA graphs on the decode-only graph (H200 + onnxruntime-gpu; skipped without them): a captured
and replayed decode step equals the eager decode graph's step exactly (the same kernels on the same inputs), and
generation with replayed decode steps equals the eager decode graph's and the torch backend's token for token."""

from __future__ import annotations

import pytest
import torch

from m3export.export.artifact import load_artifact
from m3export.export.exporter import export_artifact
from m3export.model.batch import Segment, build_batch
from m3export.runtime import Engine, SamplingParams
from m3export.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

ort = pytest.importorskip("onnxruntime")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers() or not torch.cuda.is_available(),
                       reason="needs onnxruntime-gpu and a CUDA device"),
]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return load_artifact(export_artifact("tiny", tmp_path_factory.mktemp("art") / "tiny", page_size=4,
                                         progress=False))


def _decode_step(art, batch_size: int, context: int):
    page = art.page_size
    pages = -(-(context + 1) // page)
    segments = [Segment(list(range(b * pages, (b + 1) * pages)), context, [7 + b]) for b in range(batch_size)]
    return build_batch(segments, page), pages * batch_size


def _fill_pools(be, pages: int) -> None:
    """The first ``pages`` pages of every pool hold the same seeded values in every backend (a padding backend's
    pools have one scratch page more)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    for t in be._main.pool_tensors.values():
        t[:pages].copy_(torch.randn(t[:pages].shape, generator=gen, device="cuda").to(t.dtype))


def test_ort_cuda_graph_replay_equals_eager_decode(artifact):
    """The same decode steps (batch 3 -> bucket 4, then batch 1) through the decode graph on the same padded
    inputs run eagerly (``pad_decode``) and captured and replayed, on pools holding the same values: logits and
    hidden states bit-equal (the same kernels on the same shapes), one graph per bucket and width."""
    eager = OnnxRuntimeBackend(artifact, "cuda", pad_decode=True)
    replayed = OnnxRuntimeBackend(artifact, "cuda:enable_cuda_graph=1")
    try:
        for batch_size, context in ((3, 21), (1, 9), (3, 21)):
            (ids, batch), _ = _decode_step(artifact, batch_size, context)
            rows = torch.arange(batch_size)
            results = []
            for be in (eager, replayed):
                if not be._main.pool_tensors:
                    be.allocate(32, artifact.page_size)
                    _fill_pools(be, 32)
                for _ in range(3):  # capture, then replays
                    logits, hidden = be.forward(ids, batch, rows)
                results.append((logits.clone(), hidden.clone()))
            assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
        assert replayed.replays == 9 and len(replayed._graph_ids) == 2 and replayed.decode_steps == 0
        assert eager.padded_decode_steps == 9 and eager.replays == 0
    finally:
        eager.close()
        replayed.close()


def test_steps_past_the_buckets_run_uncaptured(artifact):
    """A decode step past the largest bucket runs the capturing session's decode graph without capture (run option
    ``gpu_graph_id`` -1: a run naming no graph would be captured as ORT's graph 0 and that graph replayed for every
    later such step, whatever its shapes), equal to the eager decode graph's on the same inputs."""
    eager = OnnxRuntimeBackend(artifact, "cuda", decode_graph=True)
    replayed = OnnxRuntimeBackend(artifact, "cuda:enable_cuda_graph=1", buckets=(1, 2))
    try:
        for be in (eager, replayed):
            be.allocate(40, artifact.page_size)
            _fill_pools(be, 40)
        for batch_size, context in ((3, 21), (4, 13), (3, 30)):
            (ids, batch), _ = _decode_step(artifact, batch_size, context)
            rows = torch.arange(batch_size)
            (la, ha), (lb, hb) = (be.forward(ids, batch, rows) for be in (eager, replayed))
            assert torch.equal(la, lb) and torch.equal(ha, hb), (batch_size, context)
        assert replayed.decode_steps == 3 and replayed.replays == 0 and not replayed._graph_ids
    finally:
        eager.close()
        replayed.close()


@pytest.mark.parametrize("k", [0, 2])
def test_ort_cuda_graph_generation_equals_torch(artifact, k):
    """Greedy and seeded generation (with and without MTP drafts) through replayed decode steps equals the eager
    decode graph's and the torch backend's token for token."""
    g = torch.Generator().manual_seed(20 + k)
    prompts = [torch.randint(0, 256, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 2 + \
             [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=16, ignore_eos=True) for i in range(2)]
    outs = {}
    for name, backend in (("torch", "torch"), ("eager", "cuda"), ("replayed", "cuda:enable_cuda_graph=1")):
        if backend == "torch":
            eng = Engine.from_artifact(artifact.root, backend="torch", num_pages=48, num_speculative_tokens=k,
                                       max_num_batched_tokens=24)
        else:
            eng = Engine(OnnxRuntimeBackend(artifact, backend, decode_graph=True), num_pages=48,
                         num_speculative_tokens=k, max_num_batched_tokens=24)
        try:
            outs[name] = [o.token_ids for o in eng.generate(prompts, params)]
            if name == "replayed":
                assert eng.backend.replays > 0
        finally:
            eng.close()
    assert outs["replayed"] == outs["eager"] == outs["torch"]


@pytest.fixture(scope="module")
def contrib_artifact(tmp_path_factory):
    """The tiny preset in float16 at pages of 16 with the ort-contrib flavour and its default lowerings (the MoE as
    com.microsoft.MoE, the dense layer as com.microsoft.PagedAttention, the decode graphs with one-token bounds)."""
    return load_artifact(export_artifact("tiny", tmp_path_factory.mktemp("art") / "tiny-ort", dtype="float16",
                                         page_size=16, progress=False, flavour="ort-contrib"))


def test_the_cli_path_runs_the_verified_flavour_and_generates_the_torch_tokens(contrib_artifact):
    """``create_backend`` (what ``generate`` / ``serve`` open) on the CUDA EP runs the artifact's ort-contrib flavour
    (``auto_flavour``: every graph verified on GPU), its decode steps replayed as CUDA graphs, and generates the torch
    backend's greedy tokens."""
    from m3export.export.decode_graph import MOE_FORMS, flavour_name
    from m3export.runtime.backends import create_backend

    art = contrib_artifact
    assert all(r["status"].startswith("verified on GPU") for r in art.manifest.flavours["ort-contrib"].values())
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (23, 40, 7)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for name in ("torch", "onnxruntime"):
        if name == "torch":
            eng = Engine.from_artifact(art.root, backend="torch", num_pages=48, max_num_batched_tokens=32)
        else:
            be = create_backend("onnxruntime", art.root, device="cuda", provider="cuda:enable_cuda_graph=1")
            assert be._decode_flavours[MOE_FORMS[0]] == flavour_name("ort-contrib")
            eng = Engine(be, num_pages=48, max_num_batched_tokens=32)
        try:
            outs[name] = [o.token_ids for o in eng.generate(prompts, [params] * len(prompts))]
            if name == "onnxruntime":
                assert eng.backend.replays > 0
        finally:
            eng.close()
    assert outs["onnxruntime"] == outs["torch"]
