"""Continuous batching across concurrent Triton requests: one thread owns the engine and drives ``step()``.

Triton calls ``execute`` with whatever requests arrived; the engine must see them all in one batch, so
``execute`` only hands them over (``submit``) and returns. The driver thread is the only caller of the engine,
so the engine needs no locks: it admits new requests between steps, aborts those whose client went away, and
routes every step's outputs to their senders. A failure is confined to the request it belongs to: a bad
prompt fails that request, a client that vanished is aborted, and an exception inside ``step()`` fails the
requests in flight while the thread keeps serving the next ones.

Images and video are decoded and preprocessed on a small thread pool before a request reaches the engine thread,
so a large image or a long video never stalls the steps of the streams in flight (the vision tower itself then
runs once per item inside ``Engine.add_request``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from .protocol import Chunk, GenerateRequest, RequestError, chunk_for, prompt_text, sampling_params

log = logging.getLogger("m3export.serve")


class Sink(Protocol):
    """Where one request's responses go (a Triton response sender, an HTTP stream, a list in tests)."""

    def send(self, chunk: Chunk) -> None: ...

    def fail(self, message: str) -> None: ...  # final error response

    def close(self) -> None: ...  # final flag without a response (the client is gone)

    def cancelled(self) -> bool: ...


class Metrics(Protocol):
    def step(self, new_tokens: int, running: int) -> None: ...


class _NoMetrics:
    def step(self, new_tokens: int, running: int) -> None:
        pass


@dataclass
class _Active:
    request: GenerateRequest
    sink: Sink


_STOP = object()


class EngineDriver:
    """``cancel_poll_s`` bounds how often each sender is asked whether its client left (an IPC round trip in
    Triton); ``idle_wait_s`` is how long the idle thread sleeps between checks for shutdown; ``media_workers``
    threads decode and preprocess requests' images and video."""

    def __init__(self, engine, metrics: Metrics | None = None, *, name: str = "m3", cancel_poll_s: float = 0.05,
                 idle_wait_s: float = 0.5, media_workers: int = 2):
        self.engine = engine
        self.metrics = metrics or _NoMetrics()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[str, _Active] = {}
        self._ids = itertools.count()
        self._name = name
        self._cancel_poll_s = cancel_poll_s
        self._idle_wait_s = idle_wait_s
        self._last_poll = 0.0
        self._stopping = False
        self._media = ThreadPoolExecutor(media_workers, thread_name_prefix=f"{name}-media")
        self._thread = threading.Thread(target=self._run, name=f"{name}-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called from Triton's threads
    def submit(self, request: GenerateRequest, sink: Sink) -> None:
        if self._stopping:
            sink.fail("the model is unloading; retry on another instance")
            return
        if request.images or request.videos:
            self._media.submit(self._prepare, request, sink)
            return
        self._inbox.put((request, sink))

    def _prepare(self, request: GenerateRequest, sink: Sink) -> None:
        """On a media thread: decode and preprocess the request's images / video, expand its prompt's markers,
        then hand it to the engine thread; bad media fail this request only."""
        from .media import media_settings, prepare_media

        if self._stopping:
            _quietly(sink.fail, "the model is unloading; retry on another instance")
            return
        try:
            prompt, items = prepare_media(self.engine.config, request.prompt, request.images, request.videos,
                                          settings=media_settings(self.engine))
        except ValueError as e:  # MediaError: the client's media
            _quietly(sink.fail, str(e))
            return
        except Exception as e:  # noqa: BLE001 - a bug on one request's media must not reach the others
            log.exception("preparing the media of %s failed", request.client_id or "a request")
            _quietly(sink.fail, f"internal error while preparing the media: {type(e).__name__}: {e}")
            return
        self._inbox.put((dataclasses.replace(request, prompt=prompt, images=(), videos=(),
                                             media=(*request.media, *items)), sink))

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still in flight get an error instead of hanging their clients."""
        self._stopping = True
        self._media.shutdown(wait=True)  # requests still queued there are failed by _prepare (stopping)
        self._inbox.put(_STOP)
        self._thread.join(timeout)
        leftovers = list(self._active.values())
        if not self._thread.is_alive():  # the engine is ours again: free what the requests held
            for rid in list(self._active):
                self._drop(rid, final=False)
        self._active.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                leftovers.append(_Active(*item))
        for a in leftovers:
            _quietly(a.sink.fail, "the model was unloaded before this request finished")

    @property
    def media_executor(self) -> ThreadPoolExecutor:
        """The threads that decode and preprocess media: also for a front end that prepares its requests' media
        itself (the OpenAI server's chat prompts), so that an engine has one media pool, not one idling beside
        another. Shut down by ``close``."""
        return self._media

    @property
    def alive(self) -> bool:
        """The engine thread is running (False after close, or if it died)."""
        return self._thread.is_alive()

    @property
    def running(self) -> int:
        return len(self._active)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        while True:
            try:
                busy = self.engine.has_unfinished()
                if not self._admit(block=not busy):
                    return
                self._poll_cancelled()
                if self.engine.has_unfinished():
                    self._step()
            except Exception:  # noqa: BLE001 - the thread must outlive any bug, or every later request hangs
                log.exception("engine driver iteration failed")
                time.sleep(0.1)

    def _admit(self, block: bool) -> bool:
        """Move submitted requests into the engine; False once shutdown was requested."""
        while True:
            try:
                item = self._inbox.get(timeout=self._idle_wait_s) if block else self._inbox.get_nowait()
            except queue.Empty:
                return not self._stopping
            if item is _STOP:
                return False
            block = False
            self._add(*item)

    def _add(self, request: GenerateRequest, sink: Sink) -> None:
        rid = f"{self._name}-{next(self._ids)}"
        try:
            prompt, media = request.prompt, list(request.media)  # images / video: prepared by _prepare
            if media:
                self.engine.add_request(rid, prompt, sampling_params(request), media=media)
            else:
                self.engine.add_request(rid, prompt, sampling_params(request))
        except (RequestError, ValueError) as e:
            _quietly(sink.fail, str(e))
            return
        except Exception as e:  # noqa: BLE001 - an engine bug on one request must not reach the others
            log.exception("add_request failed for %s", request.client_id or rid)
            _quietly(sink.fail, f"internal error while adding the request: {type(e).__name__}: {e}")
            return
        self._active[rid] = _Active(request, sink)

    def _poll_cancelled(self) -> None:
        now = time.monotonic()
        if now - self._last_poll < self._cancel_poll_s:
            return
        self._last_poll = now
        for rid, a in list(self._active.items()):
            try:
                gone = a.sink.cancelled()
            except Exception:  # noqa: BLE001 - a sender that cannot answer has no client behind it
                gone = True
            if gone:
                self._drop(rid, final=True)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail what was in flight, keep serving
            log.exception("engine.step() failed; failing %d request(s)", len(self._active))
            for rid, a in list(self._active.items()):
                self._drop(rid, final=False)
                _quietly(a.sink.fail, f"internal error during generation: {type(e).__name__}: {e}")
            return
        new_tokens = 0
        for out in outputs:
            new_tokens += len(out.new_token_ids)
            a = self._active.get(out.request_id)
            if a is None:  # aborted by us meanwhile
                continue
            if out.finished:
                del self._active[out.request_id]
            try:
                self._deliver(out, a)
            except Exception as e:  # noqa: BLE001 - a bug in answering one request stays with that request
                log.exception("could not answer %s", a.request.client_id or out.request_id)
                self._drop(out.request_id, final=False)
                _quietly(a.sink.fail, f"internal error while answering: {type(e).__name__}: {e}")
        self.metrics.step(new_tokens, len(self._active))

    def _deliver(self, out, a: _Active) -> None:
        req = a.request
        if out.finish_reason == "abort":  # our own aborts never get here: their entries are gone already
            _quietly(a.sink.fail, "the engine aborted this request")
            return
        needs_prompt = out.finished and not req.stream and not req.exclude_input
        prompt = prompt_text(req, list(out.prompt_token_ids), self.engine.tokenizer) if needs_prompt else ""
        chunk = chunk_for(req, out, prompt)
        if chunk is None:
            return
        try:
            a.sink.send(chunk)
        except Exception:  # noqa: BLE001 - the client went away between the poll and the send
            log.info("dropping %s: its response could not be sent", req.client_id or out.request_id)
            if not out.finished:
                self._drop(out.request_id, final=False)

    def _drop(self, rid: str, final: bool) -> None:
        a = self._active.pop(rid, None)
        try:
            self.engine.abort(rid)
        except Exception:  # noqa: BLE001
            log.exception("engine.abort(%s) failed", rid)
        if a is not None and final:
            _quietly(a.sink.close)


def _quietly(fn, *args) -> None:
    """Responses to clients that may already be gone: failing to reach them is not an error of the server."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        log.debug("could not reach a client", exc_info=True)
