"""The onnxruntime backend's choice of graph (CPU EP): decode steps go through the decode-only graph
(``model.decode.onnx``, or ``model.decode-all-experts.onnx`` once gathering a step's experts costs more than
reading them all: ``decode_graph.moe_form``), every other step through the general graph, on one set of pools;
generation is token for token the general graph's alone, with the decode batch as is and padded to a bucket
(``pad_decode``: the inputs a captured ORT CUDA graph replays, here run without capture); wrong requests are one
clear error. The captured replay itself is the GPU test ``test_ort_cuda_graph_replay_equals_eager_decode``."""

from __future__ import annotations

import pytest
import torch

from m3export.dtypes import BY_NAME
from m3export.errors import BackendUnavailable
from m3export.export.artifact import load_artifact
from m3export.runtime import Engine, SamplingParams
from m3export.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

ort = pytest.importorskip("onnxruntime")


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _params(n: int) -> list[SamplingParams]:
    """Greedy for all but the last request, which samples (seeded)."""
    return [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * (n - 1) + \
           [SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=12, ignore_eos=True)]


def _generate(backend, prompts, k: int = 0) -> list[list[int]]:
    params = _params(len(prompts))
    eng = Engine(backend, num_pages=48, num_speculative_tokens=k, max_num_batched_tokens=32)
    try:
        return [o.token_ids for o in eng.generate(prompts, params)]
    finally:
        eng.close()


@pytest.fixture
def both_moe_forms(monkeypatch):
    """The tiny model (8 experts, top 2) takes the all-experts form at every batch (``decode_graph.GATHER_COST``);
    at the cost of the copy's bytes alone (3) a lone sequence's step gathers its experts and batches of 2+ run
    every expert, so that both decode graphs run."""
    from m3export.export import decode_graph

    monkeypatch.setattr(decode_graph, "GATHER_COST", 3)


@pytest.mark.parametrize("mode", ["decode_graph", "pad_decode"])
def test_decode_steps_take_the_decode_graph(tiny_artifact, mode, both_moe_forms):
    art = load_artifact(tiny_artifact)
    prompts = _prompts(5, seed=1)
    want = _generate(OnnxRuntimeBackend(art, "cpu", threads=1, decode_graph=False), prompts)
    backend = OnnxRuntimeBackend(art, "cpu", threads=1, **{mode: True})
    assert backend._decode is not None and backend._decode.pool_tensors is not backend._main.pool_tensors
    assert _generate(backend, prompts) == want
    assert backend.decode_steps + backend.padded_decode_steps >= 11  # 12 tokens: the first comes from a prefill
    assert backend.general_steps >= 1  # the prefills
    assert set(backend._decodes) == {"per-assignment", "all-experts"}  # both_moe_forms
    if mode == "pad_decode":
        assert backend.padded_decode_steps >= 11 and backend.decode_steps == 0 and backend.replays == 0
        assert {b for b, _ in backend._inputs} <= set(backend.buckets)  # batches of 1..5 padded to 1, 2, 4, 8
        assert backend.batch_device.type == "cpu"


def test_decode_graph_with_mtp_drafts(tiny_artifact):
    """Speculative rounds: verify steps (several tokens per sequence) go through the general graph, the plain
    decode steps between them through the decode graph, the MTP module's one-token steps through its decode graph
    (``mtp0.decode.onnx``) on the module's pools; tokens as without the decode graphs."""
    art = load_artifact(tiny_artifact)
    prompts = _prompts(3, seed=2)
    want = _generate(OnnxRuntimeBackend(art, "cpu", threads=1, decode_graph=False), prompts, k=2)
    backend = OnnxRuntimeBackend(art, "cpu", threads=1, pad_decode=True)
    assert _generate(backend, prompts, k=2) == want
    assert backend.general_steps >= 2
    assert backend._mtp_decodes and all(module == 0 for module, _ in backend._mtp_decodes)


def test_the_cpu_ep_defaults_to_the_general_graph(tiny_artifact):
    backend = OnnxRuntimeBackend(load_artifact(tiny_artifact), "cpu", threads=1)
    assert backend._decode is None and not backend.pad_decode  # no copy saved there, a second weight copy spent
    backend.close()


def test_requests_the_backend_cannot_serve_are_clear_errors(tiny_artifact, mxfp8_artifact):
    art = load_artifact(tiny_artifact)
    with pytest.raises(BackendUnavailable, match="enable_cuda_graph is an option of the CUDA execution provider"):
        OnnxRuntimeBackend(art, "cpu:enable_cuda_graph=1")
    with pytest.raises(BackendUnavailable, match="no decode-only graph .*decode_graph=True.*MXFP8 artifacts have none"):
        OnnxRuntimeBackend(load_artifact(mxfp8_artifact), "cpu", decode_graph=True)
    backend = OnnxRuntimeBackend(art, "cpu", threads=1, decode_graph=True)
    backend.allocate(8, art.page_size)
    with pytest.raises(RuntimeError, match="run_replayed needs a session opened with enable_cuda_graph=1"):
        backend._decode.run_replayed({}, 1)
    backend.close()


def test_replay_path_binds_fixed_buffers_per_graph(tiny_artifact, monkeypatch, both_moe_forms):
    """The replay path's bookkeeping on the CPU EP, which runs a ``gpu_graph_id`` run as an ordinary run: the
    backend's CUDA-graph path (``PagedSession.run_replayed``, one graph id per (MoE form, bucket, width), ids from
    1) generates the general graph's tokens, each id's inputs stay at the addresses it was first run with, and a
    moved input is refused. What only a GPU shows (the capture itself) is ``tests/test_ort_decode_graph_gpu.py``."""
    from m3export.plugins.onnxruntime.session import PagedSession

    monkeypatch.setattr(PagedSession, "captures", property(lambda self: True))
    art = load_artifact(tiny_artifact)
    prompts = _prompts(4, seed=5)
    want = _generate(OnnxRuntimeBackend(art, "cpu", threads=1, decode_graph=False), prompts)
    backend = OnnxRuntimeBackend(art, "cpu", threads=1, pad_decode=True)
    backend.cuda_graphs = True
    eng = Engine(backend, num_pages=48, max_num_batched_tokens=32)
    try:
        assert [o.token_ids for o in eng.generate(prompts, _params(len(prompts)))] == want
        ids = sorted(backend._graph_ids.values())
        assert backend.replays >= 11 and ids == list(range(1, len(ids) + 1))
        assert {form for form, _, _ in backend._graph_ids} == {"per-assignment", "all-experts"}
        session = backend._decodes["all-experts"]
        graph_id, replay = next(iter(session._replays.items()))
        moved = {name: torch.zeros(shape, dtype=BY_NAME[session._inputs[name].dtype].torch)
                 for name, (_, shape) in replay.inputs.items()}
        with pytest.raises(ValueError, match=f"CUDA graph {graph_id} was captured with other addresses"):
            session.run_replayed(moved, graph_id)
        with pytest.raises(ValueError, match="ids start at 1"):
            session.run_replayed(moved, 0)
    finally:
        eng.close()


def test_decode_graph_step_matches_the_torch_backend(tiny_artifact):
    """The decode graph's step against the reference ops (the torch backend on the CPU: ``m3export.ops``' bodies) on
    the same caches: a prefill of two sequences through both backends, then decode steps (the second sequence's
    context past several indexer blocks)."""
    from m3export.model.batch import Segment, build_batch
    from m3export.runtime.backends import create_backend

    art = load_artifact(tiny_artifact)
    ort_be = OnnxRuntimeBackend(art, "cpu", threads=1, decode_graph=True)
    ref = create_backend("torch", tiny_artifact)
    page, pages = art.page_size, [[0, 1, 2, 3], [4, 5, 6, 7]]
    prompts = _prompts(2, seed=7)
    for be in (ort_be, ref):
        be.allocate(16, page)
        ids, batch = build_batch([Segment(p, 0, t) for p, t in zip(pages, prompts)], page)
        be.forward(ids, batch, torch.arange(ids.shape[0]))
    lengths = [len(p) for p in prompts]
    for step in range(3):
        ids, batch = build_batch([Segment(p, n, [11 + step]) for p, n in zip(pages, lengths)], page)
        (lo, ho), (lt, ht) = (be.forward(ids, batch, torch.arange(2)) for be in (ort_be, ref))
        # fp32 against the fp32 reference ops: the bound test_runtime_onnxruntime holds the general graph to
        assert torch.allclose(lo, lt, atol=1e-4) and torch.allclose(ho.float(), ht.float(), atol=1e-4), step
        lengths = [n + 1 for n in lengths]
    assert ort_be.decode_steps == 3 and ort_be.general_steps == 1
    ort_be.close()


def test_padded_table_width_is_within_a_quarter():
    """Replayed decode steps pad their block tables to ``padded_table_width``: never narrower than the step's (a
    sequence's pages would be cut), less than 25 % wider past 8 pages (the dense and indexer bodies read every
    key of the width), exact up to 8, and 4 widths per doubling (each width is one captured graph)."""
    from m3export.runtime.backends.onnxruntime_backend import padded_table_width

    widths = [padded_table_width(w) for w in range(1, 4097)]
    for w, p in zip(range(1, 4097), widths):
        assert w <= p and (p == w if w <= 8 else p - w < w / 4), (w, p)
    assert padded_table_width(65) == 80  # a 4k context in pages of 64 (the power of two read 128)
    assert len({p for p in widths if 1024 < p <= 2048}) == 4
