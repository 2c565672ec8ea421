"""The engine thread behind the Triton model, driven with the real tiny engine and fake response senders:
results equal the engine's own, and every failure stays with the request it belongs to."""

import threading
import time

import pytest

from m3export.runtime import Engine, SamplingParams
from m3export.serve.driver import EngineDriver
from m3export.serve.protocol import GenerateRequest


class ListSink:
    def __init__(self, cancel_after: int | None = None, broken: bool = False):
        self.chunks, self.error, self.closed = [], None, False
        self.done = threading.Event()
        self.cancel_after, self.broken = cancel_after, broken

    def send(self, chunk):
        if self.broken:
            raise RuntimeError("Unable to send response: the client is gone")
        self.chunks.append((chunk.text, list(chunk.token_ids), chunk.final))
        if chunk.final:
            self.done.set()

    def fail(self, message):
        self.error = message
        self.done.set()

    def close(self):
        self.closed = True
        self.done.set()

    def cancelled(self):
        return self.cancel_after is not None and len(self.chunks) >= self.cancel_after

    def wait(self, timeout=60):
        assert self.done.wait(timeout), "request never completed"
        return self

    @property
    def text(self):
        return "".join(c[0] for c in self.chunks)

    @property
    def ids(self):
        return [t for c in self.chunks for t in c[1]]


@pytest.fixture(scope="module")
def engine():
    return Engine.from_checkpoint("tiny")


@pytest.fixture
def driver(engine):
    d = EngineDriver(engine, cancel_poll_s=0.0, idle_wait_s=0.05)
    yield d
    d.close()
    assert not engine.has_unfinished()


def req(prompt, stream=True, exclude=None, **sampling):
    return GenerateRequest(prompt, sampling, stream, stream if exclude is None else exclude)


def reference(cases):
    """A fresh engine, so that nothing the shared one did can matter."""
    return Engine.from_checkpoint("tiny").generate([p for p, _ in cases], [SamplingParams(**s) for _, s in cases])


def test_concurrent_requests_equal_the_engine(driver):
    cases = [(f"prompt {i}", {"temperature": 0.9, "seed": i, "max_tokens": 6 + i % 5}) for i in range(10)]
    cases.append(([3, 1, 4, 1, 5], {"temperature": 0, "max_tokens": 5, "ignore_eos": True}))
    sinks = [ListSink() for _ in cases]
    for i, ((prompt, sampling), sink) in enumerate(zip(cases, sinks)):
        driver.submit(req(prompt, stream=i % 2 == 0, **sampling), sink)
    expected = reference(cases)
    for i, (sink, exp) in enumerate(zip(sinks, expected)):
        sink.wait()
        assert sink.error is None and sink.chunks[-1][2]
        if i % 2 == 0:  # streamed deltas add up to the whole
            assert (sink.text, sink.ids) == (exp.text, exp.token_ids)
        else:  # one response, prompt first
            assert len(sink.chunks) == 1
            prompt = cases[i][0] if isinstance(cases[i][0], str) else ""
            assert sink.text.endswith(exp.text) and sink.text.startswith(prompt)
            assert sink.ids == exp.prompt_token_ids + exp.token_ids


@pytest.mark.parametrize("prompt, match", [
    ("x" * 5000, "allows at most"),
    ([], "empty"),
    ([10**6], "token ids must be integers in"),
])
def test_bad_prompts_fail_alone(driver, prompt, match):
    bad, good = ListSink(), ListSink()
    driver.submit(req(prompt, max_tokens=3), bad)
    driver.submit(req("fine", max_tokens=3), good)
    assert match in bad.wait().error
    assert good.wait().error is None and len(good.ids) == 3


def test_out_of_range_sampling_fails_alone(driver):
    bad = ListSink()
    driver.submit(req("a", top_p=0.0), bad)
    assert "top_p" in bad.wait().error


def test_cancelled_and_unreachable_clients_are_aborted(driver, engine):
    gone, broken, good = ListSink(cancel_after=2), ListSink(broken=True), ListSink()
    driver.submit(req("long", max_tokens=400, ignore_eos=True), gone)
    driver.submit(req("long", max_tokens=400, ignore_eos=True), broken)
    driver.submit(req("short", max_tokens=4), good)
    assert gone.wait().closed and len(gone.chunks) < 400
    assert good.wait().error is None
    deadline = time.monotonic() + 30
    while (engine.has_unfinished() or driver.running) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.has_unfinished() and driver.running == 0


class FlakyEngine:
    """The real engine, except that one chosen step raises."""

    def __init__(self, engine, fail_on_step):
        self._engine, self._fail_on, self._steps = engine, fail_on_step, 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        self._steps += 1
        if self._steps == self._fail_on:
            raise RuntimeError("simulated kernel failure")
        return self._engine.step()


def test_step_failure_fails_in_flight_requests_and_keeps_serving(engine):
    driver = EngineDriver(FlakyEngine(engine, fail_on_step=2), cancel_poll_s=0.0, idle_wait_s=0.05)
    try:
        first = ListSink()
        driver.submit(req("a", max_tokens=50, ignore_eos=True), first)
        assert "simulated kernel failure" in first.wait().error
        after = ListSink()
        driver.submit(req("b", max_tokens=3), after)
        assert after.wait().error is None and len(after.ids) == 3
    finally:
        driver.close()


def test_close_fails_what_is_left(engine):
    driver = EngineDriver(engine, idle_wait_s=0.05)
    sinks = [ListSink() for _ in range(3)]
    for s in sinks:
        driver.submit(req("z", max_tokens=4000, ignore_eos=True), s)
    time.sleep(0.2)
    driver.close()
    for s in sinks:
        assert "unloaded" in s.wait(5).error
    late = ListSink()
    driver.submit(req("z"), late)
    assert "unloading" in late.wait(5).error
    engine.step()  # reports the aborts
    assert not engine.has_unfinished()
