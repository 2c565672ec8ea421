"""ONNX Runtime glue: one artifact graph as a session whose cache pools are updated in place.

Each cache output of an artifact graph is a ScatterND over the matching cache input. Binding one ``OrtValue``
as both (``io_binding``) makes ONNX Runtime write the new tokens' rows straight into the pool, so a step costs
what its tokens cost, never a copy of the pool. ``run`` checks that ORT really kept the buffer (it is an
implementation property, not a promise of the ONNX standard) and fails loudly if it did not.

This module sits below ``m3export.export`` (whose ``verify`` uses it): it reads an artifact only through the
duck-typed ``artifact.path(graph)`` / ``artifact.graphs[graph]`` and never imports the export package.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from m3export.dtypes import BY_NAME
from m3export.errors import BackendUnavailable

if TYPE_CHECKING:
    from m3export.export.manifest import GraphInfo


def _ort():
    try:
        import onnxruntime
    except ImportError as e:  # pragma: no cover - onnxruntime is a hard dependency of the package
        raise BackendUnavailable("onnxruntime is not installed: pip install onnxruntime") from e
    return onnxruntime


class PagedSession:
    """A graph of an artifact in ONNX Runtime; ``pools`` hold the caches between steps."""

    def __init__(self, path: Path, graph: GraphInfo, providers: Sequence[str] = ("CPUExecutionProvider",),
                 options=None):
        ort = _ort()
        self.graph = graph
        if options is None:
            options = ort.SessionOptions()
            options.log_severity_level = 3  # errors only: ORT warns about kernels it cannot constant-fold
        try:
            self.session = ort.InferenceSession(str(path), sess_options=options, providers=list(providers))
        except Exception as e:  # ORT raises its own exception types; say which graph and why
            hint = (" (no kernel for an op in this dtype: the CPU execution provider runs float32 and float16 "
                    "artifacts, bfloat16 needs e.g. the CUDA one)") if "NOT_IMPLEMENTED" in str(e) else ""
            raise BackendUnavailable(f"{path}: ONNX Runtime cannot load this graph with {list(providers)}{hint}: "
                                     f"{e}") from e
        self._inputs = {t.name: t for t in graph.inputs}
        self.pool_inputs = [graph.aliases[o] for o in graph.output_names if o in graph.aliases]
        self.plain_outputs = [o for o in graph.output_names if o not in graph.aliases]
        self.pools: dict[str, np.ndarray] = {}  # live: ORT writes new rows into these arrays

    @classmethod
    def from_artifact(cls, artifact, graph: str = "model", **kwargs) -> PagedSession:
        """Graph ``graph`` of an ``m3export.export.artifact.Artifact``."""
        return cls(artifact.path(graph), artifact.graphs[graph], **kwargs)

    def allocate(self, num_pages: int) -> None:
        """Zeroed pools of ``num_pages`` pages for every cache input."""
        self.pools = {}
        for name in self.pool_inputs:
            sig = self._inputs[name]
            shape = [num_pages if d == "pages" else d for d in sig.shape]
            if not all(isinstance(d, int) for d in shape):
                raise ValueError(f"{name}: cannot size pool dims {sig.shape} (only 'pages' is free)")
            self.pools[name] = np.zeros(shape, dtype=BY_NAME[sig.dtype].storage)  # bfloat16 as uint16 bits

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One step: ``feeds`` holds every non-pool input; returns every non-pool output.

        Arrays are bound without copies (bfloat16 ones as uint16 bit patterns); outputs are written by ORT
        straight into fresh numpy arrays, pools into ``self.pools``.
        """
        ort = _ort()
        if not self.pools:
            raise RuntimeError("call allocate(num_pages) before run()")
        missing = sorted(set(self._inputs) - set(feeds) - set(self.pools))
        unknown = sorted(set(feeds) - set(self._inputs) | set(feeds) & set(self.pools))
        if missing or unknown:
            raise ValueError(f"{self.graph.file}: missing inputs {missing}, unexpected feeds {unknown} "
                             "(cache pools are bound from self.pools, never fed)")
        arrays = {**{k: np.ascontiguousarray(v) for k, v in feeds.items()}, **self.pools}
        dims: dict[str, int] = {}
        binding = self.session.io_binding()
        bound = {}  # OrtValues borrow the numpy buffers: keep both alive until the run is over
        for name, arr in arrays.items():
            sig = self._inputs[name]
            if arr.dtype != BY_NAME[sig.dtype].storage or arr.ndim != len(sig.shape):
                raise ValueError(f"{self.graph.file}: input {name} must be {sig.dtype} of rank {len(sig.shape)}, "
                                 f"got {arr.dtype} {list(arr.shape)}")
            for d, n in zip(sig.shape, arr.shape):
                if isinstance(d, str) and dims.setdefault(d, n) != n or isinstance(d, int) and d != n:
                    raise ValueError(f"{self.graph.file}: input {name} dim {d!r} is {n}, but the graph needs "
                                     f"{dims.get(d, d)}")
            bound[name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(arr, BY_NAME[sig.dtype].onnx)
            binding.bind_ortvalue_input(name, bound[name])
        results = {}
        for sig in self.graph.outputs:
            if sig.name in self.graph.aliases:
                value = bound[self.graph.aliases[sig.name]]
            else:
                results[sig.name] = np.empty([dims[d] if isinstance(d, str) else d for d in sig.shape],
                                             dtype=BY_NAME[sig.dtype].storage)
                value = bound[sig.name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                    results[sig.name], BY_NAME[sig.dtype].onnx)
            binding.bind_ortvalue_output(sig.name, value)
        try:
            self.session.run_with_iobinding(binding)
        except Exception as e:  # a kernel this execution provider lacks at run time (e.g. 16-bit scatters)
            raise BackendUnavailable(f"{self.graph.file}: ONNX Runtime failed to run this graph with "
                                     f"{self.session.get_providers()}: {e}") from e
        for sig, value in zip(self.graph.outputs, binding.get_outputs()):
            buffer = self.pools.get(self.graph.aliases.get(sig.name, ""), results.get(sig.name))
            if buffer.size and value.data_ptr() != buffer.ctypes.data:  # (an empty output has no address)
                raise RuntimeError(f"{self.graph.file}: ONNX Runtime did not write {sig.name} into the bound buffer")
        return results
