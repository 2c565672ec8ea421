"""PagedSession binds once: a steady decode step rebinds nothing and allocates nothing, a shape change rebinds only
the names whose shape changed, new contents of a same-shaped input are written in place, and a result the caller
still holds is never overwritten. Bindings and allocations are counted by wrapping ONNX Runtime's IOBinding and
torch's allocators around a step (the binding-per-step session this replaced made a new io_binding, bound every
pool, input and output and allocated every output at every step)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from m3export.export.artifact import load_artifact
from m3export.model.batch import Segment, build_batch
from m3export.plugins.onnxruntime.session import PagedSession

ort = pytest.importorskip("onnxruntime")
from onnxruntime.capi.onnxruntime_inference_collection import IOBinding  # noqa: E402

PAGE = 16  # the tiny artifact's page size (tests/export_fixtures.py)


def feeds(tokens: list[list[int]], starts: list[int]) -> dict[str, np.ndarray]:
    """A step of sequence b (on page b + 1) taking ``tokens[b]`` from position ``starts[b]``; logits of each
    sequence's last token (built by the one batch producer, ``build_batch``)."""
    segments = [Segment([b + 1], start, ids) for b, (ids, start) in enumerate(zip(tokens, starts))]
    ids, batch = build_batch(segments, PAGE)
    last = torch.cumsum(torch.tensor([len(t) for t in tokens]), 0) - 1
    return batch.feeds(input_ids=ids, logits_indices=last)


class Calls:
    """ORT binding calls (by method and name) and torch allocations made while ``counting`` is on."""

    BINDING = ("bind_input", "bind_output", "bind_ortvalue_input", "bind_ortvalue_output", "bind_cpu_input",
               "get_outputs", "clear_binding_inputs", "clear_binding_outputs")
    ALLOCATORS = ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "empty_strided")

    def __init__(self, monkeypatch):
        self.counts: Counter = Counter()
        self.counting = False
        for method in self.BINDING:
            monkeypatch.setattr(IOBinding, method, self._wrap(method, getattr(IOBinding, method), named=True))
        monkeypatch.setattr(ort.InferenceSession, "io_binding",
                            self._wrap("io_binding", ort.InferenceSession.io_binding))
        for fn in self.ALLOCATORS:
            monkeypatch.setattr(torch, fn, self._wrap(f"torch.{fn}", getattr(torch, fn)))

    def _wrap(self, label, fn, named=False):
        def counted(*args, **kwargs):
            if self.counting:
                self.counts[label] += 1
                if named and len(args) > 1 and isinstance(args[1], str):
                    self.counts[f"{label}:{args[1]}"] += 1
            return fn(*args, **kwargs)
        return counted

    def step(self, sess: PagedSession, step_feeds) -> Counter:
        """Run one step (outputs dropped) and return what it bound and allocated."""
        step_feeds = on_device(sess, step_feeds)
        self.counts.clear()
        self.counting = True
        try:
            sess.run_torch(step_feeds)
        finally:
            self.counting = False
        return Counter(self.counts)


CUDA_EP = pytest.mark.skipif(
    "CUDAExecutionProvider" not in ort.get_available_providers() or not torch.cuda.is_available(),
    reason="needs onnxruntime-gpu and a CUDA device")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA_EP])])
def session(request, tiny_artifact):
    """The tiny artifact's step graph on the CPU EP (CI) or the CUDA EP (the H200: pools, buffers and feeds on
    the device, ORT on torch's stream)."""
    options = {"threads": 1} if request.param == "cpu" else {}
    sess = PagedSession.from_artifact(load_artifact(tiny_artifact), providers=request.param, **options)
    sess.allocate(8)
    return sess


def on_device(sess: PagedSession, step_feeds: dict) -> dict:
    """Feeds where the engine builds them: in the EP's memory."""
    return {k: torch.from_numpy(v).to(sess.device) for k, v in step_feeds.items()}


def test_a_steady_decode_step_binds_and_allocates_nothing(session, monkeypatch):
    calls = Calls(monkeypatch)
    addresses = {name: t.data_ptr() for name, t in session.pool_tensors.items()}
    first = calls.step(session, feeds([[5, 7, 9]], [0]))  # prefill: every fed input and plain output bound once
    assert first["io_binding"] == 0, "allocate makes the one io_binding"
    assert not any(first[f"bind_input:{p}"] for p in session.pool_inputs), "pools are bound by allocate"
    assert all(first[f"bind_input:{n}"] == 1 for n in session._feed_names)
    # the first decode step: T goes from 3 to 1 (B and N stay 1), so exactly the names with a T dim rebind
    changed = calls.step(session, feeds([[11]], [3]))
    rebound = {k.split(":", 1)[1] for k in changed if k.startswith("bind_") and ":" in k}
    with_t = {t.name for t in (*session.graph.inputs, *session.graph.outputs) if "T" in t.shape}
    assert rebound == with_t and not rebound & set(session.pool_inputs)
    assert not any(changed[f"torch.{fn}"] for fn in Calls.ALLOCATORS), "smaller shapes fit the buffers"
    for position, token in ((4, 13), (5, 2)):  # decode steps: the same shapes, new contents
        steady = calls.step(session, feeds([[token]], [position]))
        assert steady == Counter(), f"a steady step bound or allocated {dict(steady)}"
    assert {name: t.data_ptr() for name, t in session.pool_tensors.items()} == addresses


def test_new_contents_of_a_same_shaped_input_are_used(session, tiny_artifact):
    """A decode step whose inputs only change contents (written into the bound buffers in place) gives what ONNX
    Runtime's own run gives with the same feeds and copies of the pools (no io_binding at all: the oracle)."""
    session.run(feeds([[5, 7, 9], [4]], [0, 0]))
    session.run(feeds([[1], [2]], [3, 1]))  # binds the decode shapes
    step = feeds([[6], [8]], [4, 2])  # same shapes, new contents
    pools_before = {name: t.cpu().numpy() for name, t in session.pool_tensors.items()}
    names = [o.name for o in session.session.get_outputs()]
    expected = dict(zip(names, session.session.run(None, {**step, **pools_before})))
    got = session.run(step)
    # the same kernels on the same inputs: equal to the bit with one intra-op thread on the CPU; on CUDA within
    # 1e-6 of each output's scale, should cuBLAS pick another algorithm for ORT's own run (fp32 sums of <= 320
    # terms reordered: ~1e-7 relative)
    for name, want in [*((n, expected[n]) for n in session.plain_outputs),
                       *((pool, expected[out]) for out, pool in session.graph.aliases.items())]:
        have = got[name] if name in got else session.pools[name]
        if session.device.type == "cpu":
            np.testing.assert_array_equal(have, want, err_msg=name)
        else:
            np.testing.assert_allclose(have, want, rtol=0, atol=1e-6 * float(np.abs(want).max()), err_msg=name)


def test_a_held_result_is_never_overwritten(session):
    """Results the caller keeps (the numpy arrays of ``run``, a torch result or a view of one) keep their values
    through later steps; a dropped result's buffer is reused."""
    session.run(feeds([[5, 7, 9]], [0]))
    held_numpy = session.run(feeds([[1]], [3]))["logits"]
    kept = held_numpy.copy()
    held_view = session.run_torch(feeds([[2]], [4]))["hidden"][:, :8]
    kept_view = held_view.clone()
    later = session.run(feeds([[3]], [5]))["logits"]
    assert not np.array_equal(later, kept), "the steps must differ for this test to mean anything"
    np.testing.assert_array_equal(held_numpy, kept)
    assert torch.equal(held_view, kept_view)
    del held_numpy, held_view, later
    address = session.run_torch(feeds([[4]], [6]))["logits"].data_ptr()
    assert session.run_torch(feeds([[5]], [7]))["logits"].data_ptr() == address, "a dropped result's buffer"
