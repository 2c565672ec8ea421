"""ONNX Runtime backend: the artifact's ``model`` and ``mtp{k}`` graphs, with cache pools updated in place.

The pools and the in-place binding (one buffer bound as a graph's cache input and as the aliased cache output)
are ``PagedSession``'s job (``m3export.plugins.onnxruntime.session``); this class maps the engine's batches onto
the graphs' inputs and brings logits and hidden states back as torch tensors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from m3export.dtypes import BY_NAME, MODEL_DTYPES
from m3export.errors import BackendUnavailable
from m3export.model.batch import Batch

from .base import Backend


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"

    def __init__(self, artifact, providers: tuple[str, ...] = ("CPUExecutionProvider",)):
        from m3export.plugins.onnxruntime.session import PagedSession

        self.artifact = artifact
        self.config = artifact.config
        self.required_page_size = artifact.page_size
        self.device = torch.device("cpu")
        if artifact.manifest.dtype not in MODEL_DTYPES:
            raise BackendUnavailable(f"{artifact.root}: graphs of dtype {artifact.manifest.dtype!r} cannot be fed "
                                     "from here")
        self.graph_dtype = BY_NAME[artifact.manifest.dtype]  # activations, hidden states and pools
        self._main = PagedSession.from_artifact(artifact, "model", providers=providers)
        self._mtp = [PagedSession.from_artifact(artifact, f"mtp{k}", providers=providers)
                     for k in range(artifact.manifest.mtp_modules)]

    @classmethod
    def from_artifact(cls, path: str | Path, device: str = "cpu") -> OnnxRuntimeBackend:
        from m3export.export.artifact import load_artifact

        if str(device) != "cpu":
            raise BackendUnavailable(
                f"the onnxruntime backend runs on device 'cpu' only so far (got {device!r}): its cache pools are "
                "host arrays (m3export/plugins/onnxruntime/session.py); use backend='torch' on GPUs for now")
        return cls(load_artifact(path, verify_checksums=False))  # structure at start-up; hashes: verify

    @property
    def num_mtp_modules(self) -> int:
        return len(self._mtp)

    def page_bytes(self, page_size: int) -> int:
        total = 0
        for session in [self._main, *self._mtp]:
            for name in session.pool_inputs:
                sig = next(t for t in session.graph.inputs if t.name == name)
                elems = int(np.prod([1 if d == "pages" else d for d in sig.shape]))
                total += elems * BY_NAME[sig.dtype].itemsize
        return total

    def allocate(self, num_pages: int, page_size: int) -> None:
        if page_size != self.required_page_size:
            raise ValueError(f"the artifact's graphs take pages of {self.required_page_size} tokens, not {page_size}")
        for session in [self._main, *self._mtp]:
            session.allocate(num_pages)

    def _run(self, session, feeds: dict[str, np.ndarray], hidden_name: str):
        # PagedSession rejects an output it cannot see written, which a zero-row logits tensor never is:
        # ask for one row then and drop it (a step of prefill chunks that all stop short of their end).
        want = len(feeds["logits_indices"])
        if want == 0:
            feeds["logits_indices"] = np.zeros(1, dtype=np.int64)
        out = session.run(feeds)
        return self.graph_dtype.to_torch(out["logits"][:want]).float(), self.graph_dtype.to_torch(out[hidden_name])

    def forward(self, input_ids, batch: Batch, logits_indices):
        return self._run(self._main, batch.feeds(input_ids=input_ids, logits_indices=logits_indices), "hidden")

    def mtp_forward(self, module, input_ids, hidden, batch: Batch, logits_indices):
        feeds = batch.feeds(input_ids=input_ids, logits_indices=logits_indices)
        feeds["hidden"] = self.graph_dtype.to_numpy(hidden)
        return self._run(self._mtp[module], feeds, "hidden_out")
