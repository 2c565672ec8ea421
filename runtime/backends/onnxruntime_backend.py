"""ONNX Runtime backend: the artifact's ``model`` and ``mtp{k}`` graphs, with cache pools updated in place.

The pools and the in-place binding (one buffer bound as a graph's cache input and as the aliased cache output)
are ``PagedSession``'s job (``m3export.plugins.onnxruntime.session``); this class maps the engine's batches onto
the graphs' inputs and hands logits and hidden states back as torch tensors.

The execution provider decides where everything lives (``--provider``; ``Provider.device``): on the CPU EP the
batches, pools and outputs are host tensors; on a CUDA-like EP they are device tensors bound in place, so a
step's inputs, the pools and the outputs (the hidden state chained into the MTP graphs included) stay on the
device between steps. CI runs the CPU EP; the GPU path is the same code and is unverified here.

Images and video (a vision-language artifact): ``vision.onnx`` encodes each media item once (``encode_media``),
and the step graph takes the media tokens of a step as ``media_rows`` / ``media_embeds`` (``MEDIA_INPUTS``),
placed over the token embeddings; steps without media feed zero rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from m3export.dtypes import BY_NAME, MODEL_DTYPES
from m3export.errors import BackendUnavailable, MediaError
from m3export.model.batch import Batch

from .base import Backend


def provider_for(device: str | torch.device = "cpu", provider=None):
    """The execution provider for a backend asked to run on ``device`` with ``provider`` (either may be left
    at its default): ``cpu`` -> the CPU EP, ``cuda[:n]`` -> the CUDA EP on device n; a provider whose memory is
    not ``device`` (other than the default ``cpu``) is an error."""
    from m3export.plugins.onnxruntime.providers import parse_provider

    device = torch.device(device)
    if provider is None:
        if device.type == "cpu":
            return parse_provider("cpu")
        if device.type == "cuda":
            return parse_provider(f"cuda:device_id={device.index or 0}")
        raise BackendUnavailable(f"the onnxruntime backend has no default execution provider for device "
                                 f"{str(device)!r}: pass provider=... (--provider)")
    chosen = parse_provider(provider)
    if device.type != "cpu" and torch.device(chosen.device) != device:
        raise BackendUnavailable(f"execution provider {chosen} keeps its tensors on {chosen.device}, not on "
                                 f"{device}: leave the device out or make them agree")
    return chosen


def _check_signature(session, root: Path) -> None:
    """The manifest's signature of a graph (names and static dims, which pools, feeds and outputs are sized from)
    against the graph ONNX Runtime loaded; ``load_artifact`` has checked the signature against the config."""
    sig = session.graph
    for kind, declared, actual in (("input", sig.inputs, session.session.get_inputs()),
                                   ("output", sig.outputs, session.session.get_outputs())):
        got = {a.name: a.shape for a in actual}
        if [t.name for t in declared] != [a.name for a in actual]:
            raise BackendUnavailable(f"{root / sig.file}: the graph's {kind}s {list(got)} are not the ones "
                                     f"manifest.json declares {[t.name for t in declared]}")
        for t in declared:
            shape = got[t.name]
            if len(shape) != len(t.shape) or any(isinstance(d, int) and isinstance(a, int) and d != a
                                                 for d, a in zip(t.shape, shape)):
                raise BackendUnavailable(f"{root / sig.file}: {kind} {t.name} has shape {shape} in the graph, "
                                         f"manifest.json says {list(t.shape)} (the manifest does not describe "
                                         "these graphs)")


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"

    def __init__(self, artifact, provider="cpu", flavour: str | None = None, threads: int | None = None):
        """``flavour``: run the graphs' recorded flavour (e.g. ``ort-contrib``, experimental) instead of the plain
        ones; it has the same signatures. ``threads``: ONNX Runtime's intra-op threads per session
        (``PagedSession``)."""
        from m3export.plugins.onnxruntime.session import PagedSession

        self.artifact = artifact
        self.config = artifact.config
        self.required_page_size = artifact.page_size
        if artifact.manifest.dtype not in MODEL_DTYPES:
            raise BackendUnavailable(f"{artifact.root}: graphs of dtype {artifact.manifest.dtype!r} cannot be fed "
                                     "from here")
        self.graph_dtype = BY_NAME[artifact.manifest.dtype]  # activations, hidden states and pools
        self._main = PagedSession.from_artifact(artifact, "model", flavour=flavour, providers=provider, threads=threads)
        self.provider = self._main.provider
        self.device = self._main.device  # where the engine builds batches: the EP's memory
        self._mtp = [PagedSession.from_artifact(artifact, f"mtp{k}", flavour=flavour, providers=self.provider,
                                                threads=threads)
                     for k in range(artifact.manifest.mtp_modules)]
        for session in (self._main, *self._mtp):
            _check_signature(session, artifact.root)
        names = {t.name for t in self._main.graph.inputs}
        self._media_inputs = {"media_rows", "media_embeds"} <= names
        self._vision = None  # vision.onnx's session, opened at the first media item
        self._threads = threads

    @property
    def supports_media(self) -> bool:
        """A vision-language artifact whose step graph takes media embeddings and which has ``vision.onnx``
        (artifacts exported before the step graphs took media do not)."""
        return self.config.vision is not None and self._media_inputs and "vision" in self.artifact.graphs

    def encode_media(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """One media item through ``vision.onnx`` (one run per grid row) -> float32 [tokens, H] blocks."""
        if not self.supports_media:
            raise MediaError(f"{self.artifact.root}: this artifact cannot take images or video with the onnxruntime "
                             "backend (no vision.onnx, or a step graph without media inputs: export it again)")
        from m3export.export.vision_graph import run_vision_onnx

        if self._vision is None:
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.log_severity_level = 3  # errors only, as the step graphs' sessions
            if self._threads is not None:
                options.intra_op_num_threads = self._threads
            self._vision = ort.InferenceSession(str(self.artifact.path("vision")), sess_options=options,
                                                providers=self.provider.session_providers())

        return run_vision_onnx(self._vision, pixel_values.cpu(), grid_thw, self.config.vision.spatial_merge_size)

    @classmethod
    def from_artifact(cls, path: str | Path, device: str = "cpu", provider=None, threads: int | None = None
                      ) -> OnnxRuntimeBackend:
        from m3export.export.artifact import load_artifact

        chosen = provider_for(device, provider)
        # structure at start-up; hashes: verify
        return cls(load_artifact(path, verify_checksums=False), chosen, threads=threads)

    def close(self) -> None:
        """Close every ONNX Runtime session this backend opened (``PagedSession.close``; the vision session is
        dropped) while the CUDA runtime is still up; idempotent, called by ``Engine.close``. A later step raises."""
        for session in (self._main, *self._mtp):
            session.close()
        self._vision = None  # its only reference: ORT frees the session here

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

    def _run(self, session, batch: Batch, hidden_name: str, **extra: torch.Tensor):
        feeds = {name: t.to(self.device) for name, t in zip(batch.input_names(), batch.inputs())}
        feeds.update({name: t.to(self.device) for name, t in extra.items()})
        out = session.run_torch(feeds)
        return out["logits"].float(), out[hidden_name]

    def forward(self, input_ids, batch: Batch, logits_indices, media=None):
        """``media``: (rows [M], embeddings [M, H]) of this step's media tokens (the engine's; see ``Backend``)."""
        extra = {}
        if self._media_inputs:
            rows, values = media if media is not None else (torch.zeros(0, dtype=torch.int64),
                                                            torch.zeros(0, self.config.hidden_size))
            extra = {"media_rows": rows.to(torch.int64), "media_embeds": values.to(self.graph_dtype.torch)}
        elif media is not None:
            raise MediaError("this artifact's step graph takes no media embeddings (export it again)")
        return self._run(self._main, batch, "hidden", input_ids=input_ids, logits_indices=logits_indices, **extra)

    def mtp_forward(self, module, input_ids, hidden, batch: Batch, logits_indices):
        return self._run(self._mtp[module], batch, "hidden_out", input_ids=input_ids, logits_indices=logits_indices,
                         hidden=hidden.to(self.graph_dtype.torch))
