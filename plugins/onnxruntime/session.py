"""ONNX Runtime glue: one artifact graph as a session whose cache pools are updated in place.

Each cache output of an artifact graph is a ScatterND over the matching cache input. Binding one buffer as both
(``io_binding``) makes ONNX Runtime write the new tokens' rows straight into the pool, so a step costs what its
tokens cost, never a copy of the pool. ``run`` checks that ORT really kept the buffer (it is an implementation
property, not a promise of the ONNX standard) and fails loudly if it did not.

Where the tensors live follows the execution provider (``providers.Provider.device``): host memory for the CPU
EP (and every EP that takes host tensors), device memory for CUDA-like EPs. The pools, and the outputs of
``run_torch``, are torch tensors in that memory, bound through io_binding by address (ONNX Runtime wraps them
as OrtValues over the same bytes), so one code path serves every EP: CI runs it on the CPU EP, where it binds
host memory; on a GPU EP the pools stay on the device between steps and nothing copies a pool. On the CUDA and
TensorRT EPs ORT runs on a stream shared with torch (``streams.SharedStream``): a step is ordered by device-side
stream waits and never synchronises the host. That GPU path is unverified in this repository's CI (no GPU, no
onnxruntime-gpu here).

This module sits below ``m3export.export`` (whose ``verify`` uses it): it reads an artifact only through the
duck-typed ``artifact.path(graph)`` / ``artifact.graphs[graph]`` and never imports the export package.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from m3export.dtypes import BY_NAME
from m3export.errors import BackendUnavailable

from .providers import Provider, parse_provider, require
from .streams import SharedStream, run_options

if TYPE_CHECKING:
    from m3export.export.manifest import GraphInfo


def _ort():
    try:
        import onnxruntime
    except ImportError as e:  # pragma: no cover - onnxruntime is a hard dependency of the package
        raise BackendUnavailable("onnxruntime is not installed: pip install onnxruntime") from e
    return onnxruntime


class _HostPools(Mapping):
    """The pools as host numpy arrays (bfloat16 as uint16 bits): views of the live buffers on the CPU EP, copies
    from a device EP (made one pool at a time, when read)."""

    def __init__(self, session: PagedSession):
        self._session = session

    def __getitem__(self, name: str) -> np.ndarray:
        sig = self._session._inputs[name]
        return BY_NAME[sig.dtype].to_numpy(self._session.pool_tensors[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._session.pool_tensors)

    def __len__(self) -> int:
        return len(self._session.pool_tensors)


class PagedSession:
    """A graph of an artifact in ONNX Runtime; ``pool_tensors`` hold the caches between steps, in the memory of
    the execution provider (``device``), and ``pools`` shows them as host numpy arrays."""

    def __init__(self, path: Path, graph: GraphInfo, providers: str | Provider | Sequence = "cpu", options=None,
                 threads: int | None = None):
        """``threads``: ONNX Runtime's intra-op threads (default: one per physical core, spinning while idle,
        which on a machine shared with other work costs several times the step; benchmarks pin it)."""
        ort = _ort()
        self.graph = graph
        self.provider = require(parse_provider(providers))
        self.device = torch.device(self.provider.device)
        self._stream = SharedStream.for_provider(self.provider)  # None: the EP cannot share torch's stream
        self._run_options = run_options(ort) if self._stream is not None else None
        providers = (self._stream.session_providers() if self._stream is not None
                     else self.provider.session_providers())
        if options is None:
            options = ort.SessionOptions()
            options.log_severity_level = 3  # errors only: ORT warns about kernels it cannot constant-fold
            if threads is not None:
                options.intra_op_num_threads = threads
        elif threads is not None:
            raise ValueError("give session options or threads, not both")
        try:
            self.session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
        except Exception as e:  # ORT raises its own exception types; say which graph and why
            hint = (" (no kernel for an op in this dtype: the CPU execution provider runs float32 and float16 "
                    "artifacts, bfloat16 needs e.g. the CUDA one)") if "NOT_IMPLEMENTED" in str(e) else ""
            raise BackendUnavailable(f"{path}: ONNX Runtime cannot load this graph with {self.provider}{hint}: "
                                     f"{e}") from e
        self._inputs = {t.name: t for t in graph.inputs}
        self.pool_inputs = [graph.aliases[o] for o in graph.output_names if o in graph.aliases]
        self.plain_outputs = [o for o in graph.output_names if o not in graph.aliases]
        self.pool_tensors: dict[str, torch.Tensor] = {}  # live: ORT writes new rows into these buffers
        self.pools: Mapping[str, np.ndarray] = _HostPools(self)

    @classmethod
    def from_artifact(cls, artifact, graph: str = "model", flavour: str | None = None, **kwargs) -> PagedSession:
        """Graph ``graph`` of an ``m3export.export.artifact.Artifact``; ``flavour`` (e.g. ``ort-contrib``): the
        flavour of that graph the artifact records, which has the graph's own signature."""
        if flavour is None:
            return cls(artifact.path(graph), artifact.graphs[graph], **kwargs)
        record = artifact.manifest.flavours.get(flavour, {}).get(graph)
        if record is None:
            raise BackendUnavailable(f"{artifact.root}: no {flavour!r} flavour of graph {graph!r} in manifest.json "
                                     f"(export it with --flavour {flavour})")
        return cls(artifact.root / record["file"], artifact.graphs[graph], **kwargs)

    def allocate(self, num_pages: int) -> None:
        """Zeroed pools of ``num_pages`` pages for every cache input, in the execution provider's memory."""
        self.pool_tensors = {}
        for name in self.pool_inputs:
            sig = self._inputs[name]
            shape = [num_pages if d == "pages" else d for d in sig.shape]
            if not all(isinstance(d, int) for d in shape):
                raise ValueError(f"{name}: cannot size pool dims {sig.shape} (only 'pages' is free)")
            self.pool_tensors[name] = torch.zeros(shape, dtype=BY_NAME[sig.dtype].torch, device=self.device)

    def run(self, feeds: Mapping[str, np.ndarray | torch.Tensor]) -> dict[str, np.ndarray]:
        """One step: ``feeds`` holds every non-pool input; returns every non-pool output as a host numpy array
        (bfloat16 as uint16 bits). On the CPU EP nothing is copied: arrays are bound where they are and ORT
        writes the outputs into the returned arrays' memory."""
        dtypes = {sig.name: BY_NAME[sig.dtype] for sig in self.graph.outputs}
        return {name: dtypes[name].to_numpy(t) for name, t in self.run_torch(feeds).items()}

    def run_torch(self, feeds: Mapping[str, np.ndarray | torch.Tensor]) -> dict[str, torch.Tensor]:
        """One step; returns every non-pool output as a torch tensor in the execution provider's memory.

        Numpy feeds are host arrays (bfloat16 as uint16 bits); torch feeds may live on the host or in the EP's
        memory (ORT copies what is not where its kernels run). Pools are bound as both input and output. Output
        buffers come from torch's caching allocator (stream-ordered: after the first steps no cudaMalloc, no
        wait). On a shared stream (CUDA / TensorRT EPs) this returns once the step is queued: the outputs are
        ready for work queued afterwards on torch's current stream, and reading them on the host (``.cpu()``,
        ``.tolist()``) is the step's one synchronisation.
        """
        if not self.pool_tensors:
            raise RuntimeError("call allocate(num_pages) before run()")
        missing = sorted(set(self._inputs) - set(feeds) - set(self.pool_tensors))
        unknown = sorted(set(feeds) - set(self._inputs) | set(feeds) & set(self.pool_tensors))
        if missing or unknown:
            raise ValueError(f"{self.graph.file}: missing inputs {missing}, unexpected feeds {unknown} "
                             "(cache pools are bound from the session's own buffers, never fed)")
        tensors = {**{k: self._on_device(self._as_tensor(k, v)) for k, v in feeds.items()}, **self.pool_tensors}
        dims: dict[str, int] = {}
        binding = self.session.io_binding()
        for name, t in tensors.items():
            sig = self._inputs[name]
            for d, n in zip(sig.shape, t.shape):
                if isinstance(d, str) and dims.setdefault(d, n) != n or isinstance(d, int) and d != n:
                    raise ValueError(f"{self.graph.file}: input {name} dim {d!r} is {n}, but the graph needs "
                                     f"{dims.get(d, d)}")
            _bind(binding.bind_input, name, t, BY_NAME[sig.dtype].onnx)
        results, buffers = {}, {}
        for sig in self.graph.outputs:
            if sig.name in self.graph.aliases:
                buffers[sig.name] = tensors[self.graph.aliases[sig.name]]
            else:
                shape = [dims[d] if isinstance(d, str) else d for d in sig.shape]
                buffers[sig.name] = results[sig.name] = torch.empty(shape, dtype=BY_NAME[sig.dtype].torch,
                                                                    device=self.device)
            _bind(binding.bind_output, sig.name, buffers[sig.name], BY_NAME[sig.dtype].onnx)
        if self._stream is not None:
            self._stream.before_run()  # ORT's stream waits for torch's writes to the bound buffers (device side)
        elif any(t.is_cuda for t in tensors.values()):
            torch.cuda.synchronize(self.device)  # an EP on a stream of its own: torch's writes are done first
        try:
            self.session.run_with_iobinding(binding, self._run_options)
        except Exception as e:  # a kernel this execution provider lacks at run time (e.g. 16-bit scatters)
            raise BackendUnavailable(f"{self.graph.file}: ONNX Runtime failed to run this graph with "
                                     f"{self.session.get_providers()}: {e}") from e
        if self._stream is not None:
            self._stream.after_run()  # readers of the outputs on torch's stream wait for ORT (device side)
        else:
            binding.synchronize_outputs()
        for sig, value in zip(self.graph.outputs, binding.get_outputs()):
            buffer = buffers[sig.name]
            if buffer.numel() and value.data_ptr() != buffer.data_ptr():  # (an empty output has no address)
                raise RuntimeError(f"{self.graph.file}: ONNX Runtime did not write {sig.name} into the bound buffer")
        return results

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        """On a shared stream, a host feed goes to the device through pinned memory without a host wait (ORT
        would otherwise copy it from pageable memory, which blocks); elsewhere feeds are bound where they are."""
        if self._stream is None or t.device == self.device:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _as_tensor(self, name: str, value: np.ndarray | torch.Tensor) -> torch.Tensor:
        """A feed as a contiguous torch tensor of the input's dtype, sharing the caller's memory."""
        sig = self._inputs[name]
        dtype = BY_NAME[sig.dtype]
        if isinstance(value, np.ndarray):
            ok = value.dtype == dtype.storage
            value = dtype.to_torch(np.ascontiguousarray(value)) if ok else value
        else:
            ok = value.dtype == dtype.torch
        if not ok or value.ndim != len(sig.shape):
            raise ValueError(f"{self.graph.file}: input {name} must be {sig.dtype} of rank {len(sig.shape)}, "
                             f"got {value.dtype} {list(value.shape)}")
        return value.contiguous()


def _bind(bind, name: str, t: torch.Tensor, onnx_type: int) -> None:
    """Bind a tensor's memory by address (``IOBinding.bind_input`` / ``bind_output``): no copy, on any device.
    An empty tensor has no address (torch gives 0), so it is bound to a one-element scratch buffer's address."""
    ptr = t.data_ptr() if t.numel() else _SCRATCH.data_ptr()
    bind(name, t.device.type if t.numel() else "cpu", t.device.index or 0, onnx_type, list(t.shape), ptr)


_SCRATCH = torch.zeros(8, dtype=torch.uint8)
