"""ONNX Runtime backend: the artifact's ``model`` and ``mtp{k}`` graphs, with cache pools updated in place.

The pools and the in-place binding (one buffer bound as a graph's cache input and as the aliased cache output)
are ``PagedSession``'s job (``m3export.plugins.onnxruntime.session``); this class maps the engine's batches onto
the graphs' inputs and brings logits and hidden states back as torch tensors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ...errors import BackendUnavailable
from ...model.batch import Batch
from .base import Backend

NUMPY_STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def _feeds(input_ids: torch.Tensor, batch: Batch, logits_indices: torch.Tensor) -> dict[str, np.ndarray]:
    return {"input_ids": input_ids.cpu().numpy(), "positions": batch.positions.cpu().numpy(),
            "query_start_loc": batch.query_start_loc.cpu().numpy(), "seq_lens": batch.seq_lens.cpu().numpy(),
            "block_tables": batch.block_tables.cpu().numpy(), "slot_mapping": batch.slot_mapping.cpu().numpy(),
            "logits_indices": logits_indices.cpu().numpy()}


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"

    def __init__(self, artifact, providers: tuple[str, ...] = ("CPUExecutionProvider",)):
        from ...plugins.onnxruntime.session import PagedSession

        self.artifact = artifact
        self.config = artifact.config
        self.required_page_size = artifact.page_size
        self.device = torch.device("cpu")
        self.dtype_name = artifact.manifest.dtype
        if self.dtype_name not in NUMPY_STORAGE:
            raise BackendUnavailable(f"{artifact.root}: graphs of dtype {self.dtype_name!r} cannot be fed from here")
        self._main = PagedSession.from_artifact(artifact, "model", providers=providers)
        self._mtp = [PagedSession.from_artifact(artifact, f"mtp{k}", providers=providers)
                     for k in range(artifact.manifest.mtp_modules)]

    @classmethod
    def from_artifact(cls, path: str | Path, device: str = "cpu") -> OnnxRuntimeBackend:
        from ...export.artifact import load_artifact

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
                total += elems * np.dtype(NUMPY_STORAGE.get(sig.dtype, np.float32)).itemsize
        return total

    def allocate(self, num_pages: int, page_size: int) -> None:
        if page_size != self.required_page_size:
            raise ValueError(f"the artifact's graphs take pages of {self.required_page_size} tokens, not {page_size}")
        for session in [self._main, *self._mtp]:
            session.allocate(num_pages)

    def _to_torch(self, value: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(value)
        return t.view(torch.bfloat16) if self.dtype_name == "bfloat16" else t

    def _to_numpy(self, value: torch.Tensor) -> np.ndarray:
        value = value.detach().cpu().contiguous()
        if self.dtype_name == "bfloat16":
            return value.to(torch.bfloat16).view(torch.uint16).numpy()
        return value.to(getattr(torch, self.dtype_name)).numpy()

    def _run(self, session, feeds: dict[str, np.ndarray], hidden_name: str):
        # PagedSession rejects an output it cannot see written, which a zero-row logits tensor never is:
        # ask for one row then and drop it (a step of prefill chunks that all stop short of their end).
        want = len(feeds["logits_indices"])
        if want == 0:
            feeds["logits_indices"] = np.zeros(1, dtype=np.int64)
        out = session.run(feeds)
        return self._to_torch(out["logits"][:want]).float(), self._to_torch(out[hidden_name])

    def forward(self, input_ids, batch: Batch, logits_indices):
        return self._run(self._main, _feeds(input_ids, batch, logits_indices), "hidden")

    def mtp_forward(self, module, input_ids, hidden, batch: Batch, logits_indices):
        feeds = _feeds(input_ids, batch, logits_indices)
        feeds["hidden"] = self._to_numpy(hidden)
        return self._run(self._mtp[module], feeds, "hidden_out")
