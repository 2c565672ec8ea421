"""``PagedSession.close()`` releases ONNX Runtime's session at once (not at the cyclic collector's or the
interpreter's leisure), is idempotent and a context manager, and a closed session refuses to run with a clear error;
the onnxruntime backend and ``verify`` close every session they open. On the H200 an unclosed CUDA session was freed
after the CUDA runtime had shut down and aborted the process at exit (``cudaFreeHost`` error 800); on the CPU the
observable part is that nothing holds the ``InferenceSession`` once ``close()`` returns. Every check runs with the
cyclic collector off, so that a session kept alive by a reference cycle shows up as one still alive."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from m3export.export import verify
from m3export.export.artifact import load_artifact
from m3export.model.batch import Segment, build_batch
from m3export.plugins.onnxruntime.session import PagedSession

ort = pytest.importorskip("onnxruntime")

CUDA_EP = pytest.mark.skipif(
    "CUDAExecutionProvider" not in ort.get_available_providers() or not torch.cuda.is_available(),
    reason="needs onnxruntime-gpu and a CUDA device")


@contextmanager
def no_cyclic_collector():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _one_step(sess: PagedSession) -> dict[str, np.ndarray]:
    ids, batch = build_batch([Segment([1], 0, [5, 7, 9])], 16)
    return sess.run(batch.feeds(input_ids=ids, logits_indices=torch.tensor([2])))


def test_close_releases_the_session_at_once_and_twice_is_fine(tiny_artifact):
    with no_cyclic_collector():
        sess = PagedSession.from_artifact(load_artifact(tiny_artifact), threads=1)
        sess.allocate(4)
        out = _one_step(sess)
        alive = weakref.ref(sess.session)
        sess.close()
        assert alive() is None, "the InferenceSession outlived close()"
        assert sess.closed and not sess.pool_tensors
        sess.close()  # idempotent
        assert np.isfinite(out["logits"]).all()  # a result the caller held stays valid


def test_a_closed_session_says_so(tiny_artifact):
    with PagedSession.from_artifact(load_artifact(tiny_artifact), threads=1) as sess:
        sess.allocate(4)
        _one_step(sess)
    assert sess.closed
    for use in (lambda: _one_step(sess), lambda: sess.allocate(4), lambda: sess.session.get_inputs()):
        with pytest.raises(RuntimeError, match="closed"):
            use()


def test_a_dropped_session_goes_without_the_cyclic_collector(tiny_artifact):
    """The host view of the pools (``pools``) holds its session weakly: dropping an unclosed session frees it."""
    with no_cyclic_collector():
        sess = PagedSession.from_artifact(load_artifact(tiny_artifact), threads=1)
        sess.allocate(4)
        assert sess.pools.keys()
        alive = weakref.ref(sess.session)
        del sess
        assert alive() is None


def test_backend_close_closes_every_session(tiny_artifact):
    from m3export.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

    backend = OnnxRuntimeBackend.from_artifact(tiny_artifact, threads=1)
    sessions = [backend._main, *backend._mtp]
    assert len(sessions) == 2
    backend.close()
    backend.close()
    assert all(s.closed for s in sessions)


def test_verify_closes_its_sessions(tiny_artifact, monkeypatch):
    opened = []
    init = PagedSession.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        opened.append(weakref.ref(self.session))

    monkeypatch.setattr(PagedSession, "__init__", recording)
    with no_cyclic_collector():
        report = verify.verify_artifact(tiny_artifact, decode_steps=0, progress=False, hash_files=False)
        assert report.passed and len(opened) == 2
        assert all(ref() is None for ref in opened), "verify returned with an ONNX Runtime session alive"


@pytest.mark.gpu
@CUDA_EP
def test_verify_on_cuda_exits_cleanly(fp8_artifact):
    """The H200 abort: a process that ran the FP8-cache artifact's verify on the CUDA EP exited 134 after PASSED
    (ORT's ``cudaFreeHost`` failing after the CUDA runtime's shutdown). In a process of its own, without the CLI's
    garbage collection, verify's explicit closes must leave nothing of ORT's to free at exit: exit code 0."""
    code = ("import sys; from m3export.export.verify import verify_artifact; "
            "r = verify_artifact(sys.argv[1], decode_steps=1, providers='cuda', progress=False, hash_files=False); "
            "print(r.passed); sys.exit(0 if r.passed else 1)")
    proc = subprocess.run([sys.executable, "-c", code, str(fp8_artifact)], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stdout[-500:]} {proc.stderr[-2000:]}"
