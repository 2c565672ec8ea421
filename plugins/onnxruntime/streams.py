"""ONNX Runtime's CUDA work on a stream torch knows, so a step needs no host synchronisation.

By default the CUDA execution provider runs on a stream of its own and ``run_with_iobinding`` ends with a
``cudaStreamSynchronize``; a runtime that feeds it tensors torch wrote then has to ``torch.cuda.synchronize()``
before each run as well. Instead the session is created with ``user_compute_stream`` (a stream torch created, or
the caller's own, wrapped as ``torch.cuda.ExternalStream``), each run is told not to synchronise at its end
(run option ``disable_synchronize_execution_providers``), and ordering is stream ordering:

* before a run, ORT's stream waits (on the device) for the caller's current torch stream, where the feeds, the
  output buffers and the pools were written or allocated;
* after it, the caller's stream waits for ORT's, so whatever reads the outputs (sampling, the next step) runs
  after ORT has written them, and memory the caller frees is reused only after ORT is done with it.

Nothing waits on the host; a step costs the host only the time to enqueue it (plus whatever device-to-host reads
ORT's own kernels make, e.g. shapes that depend on data). The EPs that take ``user_compute_stream`` are the CUDA
and TensorRT ones; every other device EP keeps the synchronising path (``SharedStream.for_provider`` is None).
"""

from __future__ import annotations

from .providers import Provider

# Execution providers whose options take a ``user_compute_stream`` (a cudaStream_t as an integer string).
STREAM_EPS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")
STREAM_OPTION = "user_compute_stream"
HAS_STREAM_OPTION = "has_user_compute_stream"  # both EPs parse it; set with the stream, not left to inference
NO_SYNC = "disable_synchronize_execution_providers"  # run option: skip the stream sync at the end of a run
GRAPH_ID = "gpu_graph_id"  # run option: which captured CUDA graph a run captures or replays (-1: none)


def session_providers(provider: Provider, stream_handle: int) -> list:
    """``InferenceSession``'s providers for ``provider`` running on the stream ``stream_handle``; its session
    options are kept (``Provider.session_options``; a ``user_compute_stream`` of its own must be that same stream)."""
    given = provider.options.get(STREAM_OPTION)
    if given is not None and int(given) != stream_handle:
        raise ValueError(f"{provider}: {STREAM_OPTION} {given} is not the stream {stream_handle} the session uses")
    options = {**provider.session_options(), HAS_STREAM_OPTION: "1", STREAM_OPTION: str(stream_handle)}
    return [(provider.name, options), "CPUExecutionProvider"]


def run_options(ort, graph_id: int | None = None):
    """``RunOptions`` that leave the end-of-run stream synchronisation out; ``graph_id``: also ONNX Runtime's
    ``gpu_graph_id``, the CUDA graph a run of a session opened with ``enable_cuda_graph`` captures (its first run
    of that id) or replays (every later run)."""
    options = ort.RunOptions()
    options.add_run_config_entry(NO_SYNC, "1")
    if graph_id is not None:
        options.add_run_config_entry(GRAPH_ID, str(graph_id))
    return options


class SharedStream:
    """The stream one session's ORT work runs on, and the device-side waits that order it with torch's."""

    def __init__(self, provider: Provider):
        import torch

        self.device = torch.device(provider.device)
        given = provider.options.get(STREAM_OPTION)
        self.stream = (torch.cuda.ExternalStream(int(given), device=self.device) if given is not None
                       else torch.cuda.Stream(self.device))
        self.provider = provider

    @classmethod
    def for_provider(cls, provider: Provider) -> SharedStream | None:
        """A shared stream for an EP that takes one and keeps its tensors on a CUDA device, else None."""
        if provider.name not in STREAM_EPS or not provider.device.startswith("cuda"):
            return None
        return cls(provider)

    @property
    def handle(self) -> int:
        return int(self.stream.cuda_stream)

    def session_providers(self) -> list:
        return session_providers(self.provider, self.handle)

    def before_run(self) -> None:
        """ORT's stream waits for the work torch queued so far on the caller's stream (no host wait)."""
        import torch

        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def after_run(self) -> None:
        """The caller's stream waits for ORT's work (no host wait)."""
        import torch

        torch.cuda.current_stream(self.device).wait_stream(self.stream)
