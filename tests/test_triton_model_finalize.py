"""``TritonPythonModel.finalize`` frees the engine (its ONNX Runtime sessions) once the driver thread has stopped,
and leaves it alone while a thread still steps it. Unloading a model on a GPU provider without closing its sessions
left them to interpreter exit, where ONNX Runtime can free pinned memory after the CUDA runtime has gone."""

from __future__ import annotations

from m3export.serve.triton_model import TritonPythonModel


class _Engine:
    def __init__(self):
        self.closed = 0

    def close(self):
        self.closed += 1


class _Driver:
    def __init__(self, stops: bool):
        self.engine, self.alive, self._stops = _Engine(), True, stops

    def close(self):
        self.alive = not self._stops


def _finalized(stops: bool) -> _Engine:
    model = TritonPythonModel.__new__(TritonPythonModel)  # initialize() needs Triton's stub; finalize does not
    model._driver = _Driver(stops)
    model.finalize()
    return model._driver.engine


def test_finalize_closes_the_engine_after_the_driver_stopped():
    assert _finalized(stops=True).closed == 1


def test_finalize_leaves_an_engine_a_live_thread_still_steps():
    assert _finalized(stops=False).closed == 0
