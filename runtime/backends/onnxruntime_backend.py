"""ONNX Runtime backend: the artifact's ``model`` and ``mtp{k}`` graphs, with cache pools updated in place.

The pools and the in-place binding (one buffer bound as a graph's cache input and as the aliased cache output)
are ``PagedSession``'s job (``m3export.plugins.onnxruntime.session``); this class maps the engine's batches onto
the graphs' inputs and hands logits and hidden states back as torch tensors.

The execution provider decides where everything lives (``--provider``; ``Provider.device``): on the CPU EP the
batches, pools and outputs are host tensors; on a CUDA-like EP they are device tensors bound in place, so a
step's inputs, the pools and the outputs (the hidden state chained into the MTP graphs included) stay on the
device between steps. CI runs the CPU EP; the GPU path is the same code and is unverified here.

Decode steps (every sequence one new token) go through the artifact's decode-only graph (``model.decode.onnx``,
``m3export/export/decode_graph.py``: no control flow, no size computed from the step's values, the same inputs,
outputs and pools) where the artifact has one, on a device EP by default (``decode_graph``); every other step
through the general graph. Both sessions bind one set of pools (``PagedSession.allocate(pools_of=...)``). With
the CUDA EP's provider option ``enable_cuda_graph=1`` (``--provider cuda:enable_cuda_graph=1``) decode steps are
replayed as ONNX Runtime CUDA graphs: padded to a batch bucket as the torch backend's graphs are
(``cuda_graph.step_shape`` and ``DecodeInputs``: padding sequences on a scratch page beyond the engine's, fixed
input buffers refilled by one copy per step), the block-table width padded to within 25 % (``padded_table_width``),
one captured graph per (bucket, width) through ORT's ``gpu_graph_id`` (``PagedSession.run_replayed``). Only the decode session
gets the option: ORT refuses it for a graph with control flow, so the general graph (MoE ``If`` / ``Scan``) runs as
before. ``pad_decode`` runs the same padded inputs through the decode graph without capture (any EP: tests).
MTP modules' one-token steps (the drafter's chain steps) go through ``mtp{k}.decode.onnx`` eagerly, never captured.
Every session of the backend reads its weights from one copy in the EP's memory (``SharedWeights``,
``plugins/onnxruntime/shared_weights.py``; ``share_weights=False``: each session loads its own, as before).

Which graphs: ``from_artifact`` (the CLI's path) runs the artifact's ``ort-contrib`` flavour on the CUDA EP where it
is recorded as verified on GPU (``auto_flavour``: ONNX Runtime's own kernels for the MoE and the dense layers' paged
attention, ``m3export/export/lowering.py``), the plain graphs otherwise, and logs the choice.

Images and video (a vision-language artifact): ``vision.onnx`` encodes each media item once (``encode_media``),
and the step graph takes the media tokens of a step as ``media_rows`` / ``media_embeds`` (``MEDIA_INPUTS``),
placed over the token embeddings; steps without media feed zero rows.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from m3export.dtypes import BY_NAME, MODEL_DTYPES
from m3export.errors import BackendUnavailable, MediaError
from m3export.model.batch import Batch

from .base import Backend
from .cuda_graph import DEFAULT_BUCKETS, DecodeInputs, step_shape

CUDA_GRAPH = "enable_cuda_graph"  # the CUDA EP's provider option (plugins/onnxruntime/session.py CUDA_GRAPH)
FAST_FLAVOUR = "ort-contrib"  # the flavour ``auto_flavour`` picks on the CUDA EP
log = logging.getLogger(__name__)


def provider_for(device: str | torch.device = "cpu", provider=None):
    """The execution provider for a backend asked to run on ``device`` with ``provider`` (either may be left
    at its default): ``cpu`` -> the CPU EP, ``cuda[:n]`` -> the CUDA EP on device n; a provider whose memory is
    not ``device`` (other than the default ``cpu``) is an error."""
    from m3export.plugins.onnxruntime.providers import parse_provider

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda": the first GPU, as a provider without device_id
        device = torch.device("cuda", 0)
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


def auto_flavour(artifact, provider) -> str | None:
    """The flavour the onnxruntime backend runs unless told otherwise: ``ort-contrib`` (ONNX Runtime's own CUDA
    kernels for the MoE and the dense layers' paged attention, ``m3export/export/lowering.py``) on the CUDA EP when
    the artifact has it and every graph's record says ``verified on GPU`` (every lowering it applied matched the
    torch backend on the H200, ``lowering.VERIFIED``); else None (the plain graphs: any EP runs them). The choice
    is logged, so a user sees which graphs run."""
    from m3export.export.lowering import VERIFIED_STATUS

    record = artifact.manifest.flavours.get(FAST_FLAVOUR, {})
    verified = bool(record) and all(str(r.get("status", "")).startswith(VERIFIED_STATUS) for r in record.values())
    chosen = FAST_FLAVOUR if provider.name == "CUDAExecutionProvider" and verified else None
    why = ("" if chosen else "not the CUDA EP" if provider.name != "CUDAExecutionProvider" else
           "not in the artifact (export --flavour ort-contrib)" if not record else "a lowering not verified on GPU")
    log.info("onnxruntime backend: %s graphs%s", chosen or "plain", f" ({FAST_FLAVOUR}: {why})" if why else "")
    return chosen


def padded_table_width(width: int) -> int:
    """The block-table width (pages) a replayed decode step of ``width`` pages is padded to: the next ``m * 2^e``
    with ``m`` in 4..8, so less than 25 % past ``width`` (4 widths, so 4 captured graphs, per doubling; widths up
    to 8 exact). A captured graph's dense attention and indexer bodies read every key of the width: the power of
    two this replaces read up to 2x (a 4k context, 65 pages of 64, read 128 pages: 80 now)."""
    if width <= 8:
        return max(width, 1)
    step = 1 << ((width - 1).bit_length() - 3)
    return -(-width // step) * step


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

    def __init__(self, artifact, provider="cpu", flavour: str | None = None, threads: int | None = None,
                 decode_graph: bool | None = None, pad_decode: bool = False,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS, share_weights: bool = True):
        """``flavour``: run the graphs' recorded flavour (e.g. ``ort-contrib``, experimental) instead of the plain
        ones; it has the same signatures. ``threads``: ONNX Runtime's intra-op threads per session
        (``PagedSession``). ``decode_graph``: decode steps through the artifact's decode-only graph (None: where
        the artifact has one and the EP keeps its tensors on a device; on the CPU EP it saves no copy and costs a
        second copy of the weights). ``enable_cuda_graph=1`` among a CUDA provider's options: decode steps
        replayed as CUDA graphs, padded to ``buckets``; ``pad_decode``: the same padding without capture.
        ``share_weights``: every session reads one copy of the weights (``SharedWeights``)."""
        from m3export.plugins.onnxruntime.providers import Provider, parse_provider
        from m3export.plugins.onnxruntime.session import PagedSession
        from m3export.plugins.onnxruntime.shared_weights import SharedWeights

        provider = parse_provider(provider)
        self.cuda_graphs = provider.options.get(CUDA_GRAPH, "0").strip().lower() in ("1", "true")
        if self.cuda_graphs and provider.name != "CUDAExecutionProvider":
            raise BackendUnavailable(f"{CUDA_GRAPH} is an option of the CUDA execution provider (ONNX Runtime's CUDA "
                                     f"graphs), not of {provider.name}")
        general = Provider(provider.name, {k: v for k, v in provider.options.items() if k != CUDA_GRAPH})
        from m3export.export.decode_graph import MOE_FORMS, flavour_name

        # decode graphs of the plain graphs, or of flavour's: per MoE form (``decode_graph.moe_form``)
        self._decode_flavours = {form: flavour_name(flavour, form) for form in MOE_FORMS
                                 if "model" in artifact.manifest.flavours.get(flavour_name(flavour, form), {})}
        has_decode = MOE_FORMS[0] in self._decode_flavours
        self.pad_decode = pad_decode or self.cuda_graphs
        if (decode_graph or self.pad_decode) and not has_decode:  # before any session is opened
            why = (f"{CUDA_GRAPH}=1 replays it" if self.cuda_graphs else
                   "pad_decode runs it" if pad_decode else "decode_graph=True asks for it")
            raise BackendUnavailable(
                f"{artifact.root}: no decode-only graph (manifest flavour {flavour_name(flavour)!r}), and {why}: "
                "export the artifact again with this m3export (MXFP8 artifacts have none: ONNX Runtime's CUDA EP has "
                "no float8 Gather for their experts)")

        self.artifact = artifact
        self.config = artifact.config
        self.required_page_size = artifact.page_size
        if artifact.manifest.dtype not in MODEL_DTYPES:
            raise BackendUnavailable(f"{artifact.root}: graphs of dtype {artifact.manifest.dtype!r} cannot be fed "
                                     "from here")
        self.graph_dtype = BY_NAME[artifact.manifest.dtype]  # activations, hidden states and pools
        # one copy of the weights for every session below (None: each session loads its own)
        self._weights = SharedWeights(general.device) if share_weights else None
        self._main = PagedSession.from_artifact(artifact, "model", flavour=flavour, providers=general, threads=threads,
                                                weights=self._weights)
        self.provider = self._main.provider
        self.flavour = flavour  # which graphs run (``auto_flavour``): None for the plain ones
        self.device = self._main.device  # where the engine builds batches: the EP's memory
        self._mtp = [PagedSession.from_artifact(artifact, f"mtp{k}", flavour=flavour, providers=self.provider,
                                                threads=threads, weights=self._weights)
                     for k in range(artifact.manifest.mtp_modules)]
        for session in (self._main, *self._mtp):
            _check_signature(session, artifact.root)
        names = {t.name for t in self._main.graph.inputs}
        self._media_inputs = {"media_rows", "media_embeds"} <= names
        self._vision = None  # vision.onnx's session, opened at the first media item
        self._threads = threads
        if decode_graph is None:
            decode_graph = has_decode and (self.pad_decode or self.device.type != "cpu")
        self._decode_provider = provider  # with enable_cuda_graph where asked: the decode session only
        # the decode sessions by MoE form: the per-assignment one at once, the all-experts one at its first step
        try:
            self._decodes = {MOE_FORMS[0]: self._open_decode(MOE_FORMS[0])} if decode_graph else {}
        except BaseException:  # the sessions opened so far go now, while the CUDA runtime is up (PagedSession.close)
            for session in (self._main, *self._mtp):
                session.close()
            if self._weights is not None:
                self._weights.close()
            raise
        self._mtp_decodes: dict[tuple[int, str], object] = {}  # (module, MoE form) -> its decode session, eager
        self.buckets = tuple(sorted(buckets))
        self._inputs: dict[tuple[int, int], DecodeInputs] = {}  # (bucket, table width) -> fixed padded inputs
        self._graph_ids: dict[tuple, int] = {}  # (MoE form, bucket, table width) -> ORT's gpu_graph_id
        self._media_zeros: dict[str, torch.Tensor] = {}  # fixed empty media inputs of padded decode steps
        # how the steps went (benchmarks, tests): general graph, decode graph as is, decode graph padded / replayed
        self.general_steps = self.decode_steps = self.padded_decode_steps = self.replays = 0

    @property
    def _decode(self):
        """The per-assignment decode session (None: decode steps take the general graph)."""
        return self._decodes.get("per-assignment")

    def _decode_session(self, tokens: int):
        """The decode session for a step of ``tokens`` tokens (its MoE form, ``decode_graph.moe_form``; the
        per-assignment one where the artifact has no other), opened and given the pools at its first step."""
        from m3export.export.decode_graph import moe_form

        cfg = self.config
        form = moe_form(tokens, cfg.num_experts_per_tok, cfg.num_local_experts)
        if form not in self._decode_flavours:
            form = "per-assignment"
        if form not in self._decodes:
            self._decodes[form] = session = self._open_decode(form)
            if self._main.pool_tensors:
                session.allocate(next(iter(self._main.pool_tensors.values())).shape[0], pools_of=self._main)
        return form, self._decodes[form]

    def _open_decode(self, form: str):
        """The decode graph's session of MoE form ``form`` (with ``enable_cuda_graph`` where asked); ORT refusing
        to capture it is one error naming the cause."""
        from m3export.plugins.onnxruntime.session import PagedSession

        try:
            session = PagedSession.from_artifact(self.artifact, "model", flavour=self._decode_flavours[form],
                                                 providers=self._decode_provider, threads=self._threads,
                                                 weights=self._weights)
        except BackendUnavailable as e:
            if self.cuda_graphs:
                raise BackendUnavailable(f"ONNX Runtime refused {CUDA_GRAPH}=1 for the decode graph: {e}") from e
            raise
        _check_signature(session, self.artifact.root)
        return session

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

    @property
    def graphs_description(self) -> str:
        """Which graphs run on which provider, for the CLI's summary line (``generate``)."""
        return f"{self.flavour or 'plain'} graphs on {self.provider.name}"

    @classmethod
    def from_artifact(cls, path: str | Path, device: str = "cpu", provider=None, threads: int | None = None,
                      flavour: str | None = "auto") -> OnnxRuntimeBackend:
        """``flavour``: ``auto`` (the default) runs the verified ``ort-contrib`` flavour where ``auto_flavour`` finds
        one, else the plain graphs; None: the plain graphs; a name: that flavour."""
        from m3export.export.artifact import load_artifact

        chosen = provider_for(device, provider)
        # structure at start-up; hashes: verify
        artifact = load_artifact(path, verify_checksums=False)
        if flavour == "auto":
            flavour = auto_flavour(artifact, chosen)
        return cls(artifact, chosen, flavour=flavour, threads=threads)

    def close(self) -> None:
        """Close every ONNX Runtime session this backend opened (``PagedSession.close``; the vision session is
        dropped) while the CUDA runtime is still up; idempotent, called by ``Engine.close``. A later step raises."""
        for session in (self._main, *self._mtp, *self._decodes.values(), *self._mtp_decodes.values()):
            session.close()
        self._vision = None  # its only reference: ORT frees the session here
        if self._weights is not None:  # after every session that reads them
            self._weights.close()

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

    @property
    def batch_device(self) -> torch.device:
        """Padded decode steps copy the batch into fixed buffers of their own (``DecodeInputs``): the engine then
        builds batches on the host (one copy per step, the layout readable without a device read)."""
        return torch.device("cpu") if self.pad_decode else self.device

    def allocate(self, num_pages: int, page_size: int) -> None:
        """Pools of ``num_pages`` pages (plus a scratch page for padding sequences when decode steps are padded),
        shared by the general and the decode graph. Captured CUDA graphs read the old pools' addresses: their
        session is opened again (ORT drops a session's graphs only with the session)."""
        if page_size != self.required_page_size:
            raise ValueError(f"the artifact's graphs take pages of {self.required_page_size} tokens, not {page_size}")
        self._main.allocate(num_pages + 1 if self.pad_decode else num_pages)
        for session in self._mtp:
            session.allocate(num_pages)
        for (module, _), session in self._mtp_decodes.items():
            session.allocate(num_pages, pools_of=self._mtp[module])
        for form, session in list(self._decodes.items()):
            if any(key[0] == form for key in self._graph_ids):
                session.close()
                self._decodes[form] = session = self._open_decode(form)
            session.allocate(num_pages + 1 if self.pad_decode else num_pages, pools_of=self._main)
        self._scratch_page, self._num_pages = num_pages, num_pages
        self._inputs, self._graph_ids, self._media_zeros = {}, {}, {}

    def _run(self, session, batch: Batch, hidden_name: str, **extra: torch.Tensor):
        """One step of ``session``. Host tensors are fed as they are (``run_torch`` copies them into its device
        buffers through pinned memory, without a host wait: a host batch, as the engine builds it for padded decode
        steps, ``batch_device``); tensors on another device are moved first."""
        feeds = {name: t if t.device.type == "cpu" else t.to(self.device)
                 for name, t in (*zip(batch.input_names(), batch.inputs()), *extra.items())}
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
        if self._decode is not None and media is None and input_ids.shape[0] == batch.seq_lens.shape[0]:
            # a decode step: every sequence has one new token (each has at least one, and T == B)
            if self.pad_decode:
                out = self._padded_decode(input_ids, batch, logits_indices)
                if out is not None:
                    return out
            self.decode_steps += 1
            _, session = self._decode_session(input_ids.shape[0])
            return self._run(session, batch, "hidden", input_ids=input_ids, logits_indices=logits_indices, **extra)
        self.general_steps += 1
        return self._run(self._main, batch, "hidden", input_ids=input_ids, logits_indices=logits_indices, **extra)

    def _table_width(self, width: int) -> int:
        """The padded block-table width of a step whose tables are ``width`` pages (``padded_table_width``), at most
        the pool's pages (no sequence holds more); one captured graph per width."""
        return min(padded_table_width(width), self._num_pages)

    def _padded_decode(self, input_ids, batch: Batch, logits_indices):
        """A decode step padded to its bucket (``cuda_graph.step_shape``) and table width in fixed buffers
        (``DecodeInputs``), replayed as an ORT CUDA graph (``cuda_graphs``) or run as is (``pad_decode``). None
        when the step has no bucket (past the largest) or asks for other logits rows than its tokens'."""
        key = step_shape(input_ids, batch, logits_indices, self.buckets, self.required_page_size)
        if key is None or key[1] != 1:
            return None
        shape = (key[0], self._table_width(batch.block_tables.shape[1]))
        inputs = self._inputs.get(shape)
        if inputs is None:
            inputs = self._inputs[shape] = DecodeInputs(shape[0], 1, shape[1], self._scratch_page,
                                                        self.required_page_size, self.device)
        inputs.fill(input_ids, batch, logits_indices)
        inputs.upload()
        feeds = {"input_ids": inputs.input_ids, "logits_indices": inputs.logits_indices,
                 **dict(zip(inputs.batch.input_names(), inputs.batch.inputs()))}
        if self._media_inputs:  # a decode step places no media: fixed empty inputs
            if not self._media_zeros:
                self._media_zeros = {"media_rows": torch.zeros(0, dtype=torch.int64, device=self.device),
                                     "media_embeds": torch.zeros(0, self.config.hidden_size,
                                                                 dtype=self.graph_dtype.torch, device=self.device)}
            feeds.update(self._media_zeros)
        self.padded_decode_steps += 1
        form, session = self._decode_session(shape[0])
        if self.cuda_graphs:
            # ids from 1: ORT reserves 0 (the graph of runs that name none) and -1 (no capture)
            graph_id = self._graph_ids.setdefault((form, *shape), len(self._graph_ids) + 1)
            out = session.run_replayed(feeds, graph_id)
            self.replays += 1
        else:
            out = session.run_torch(feeds)
        t = input_ids.shape[0]
        logits, hidden = out["logits"][:t], out["hidden"][:t]
        # a replay's outputs are rewritten by the graph's next replay: the caller gets its own copies
        return (logits.clone() if logits.dtype == torch.float32 else logits.float()), hidden.clone()

    def mtp_forward(self, module, input_ids, hidden, batch: Batch, logits_indices):
        """MTP module ``module``'s step: a decode-shaped one (one token per sequence: the drafter's chain steps)
        through the module's decode graph where the backend runs decode graphs (eagerly: no capture), any other
        through its general graph."""
        session = self._mtp[module]
        if self._decodes and input_ids.shape[0] == batch.seq_lens.shape[0]:
            session = self._mtp_decode_session(module, input_ids.shape[0])
        return self._run(session, batch, "hidden_out", input_ids=input_ids, logits_indices=logits_indices,
                         hidden=hidden.to(self.graph_dtype.torch))

    def _mtp_decode_session(self, module: int, tokens: int):
        """MTP module ``module``'s decode graph for a step of ``tokens`` tokens (its MoE form), opened at its first
        step on the general provider (no ``enable_cuda_graph``: MTP steps run eagerly) and given the module's
        pools; the module's general session where the artifact has no decode form of it."""
        from m3export.export.decode_graph import moe_form
        from m3export.plugins.onnxruntime.session import PagedSession

        form = moe_form(tokens, self.config.num_experts_per_tok, self.config.num_local_experts)
        graph = f"mtp{module}"
        if graph not in self.artifact.manifest.flavours.get(self._decode_flavours.get(form, ""), {}):
            form = "per-assignment"
            if graph not in self.artifact.manifest.flavours.get(self._decode_flavours[form], {}):
                return self._mtp[module]
        key = (module, form)
        if key not in self._mtp_decodes:
            session = PagedSession.from_artifact(self.artifact, graph, flavour=self._decode_flavours[form],
                                                 providers=self.provider, threads=self._threads,
                                                 weights=self._weights)
            _check_signature(session, self.artifact.root)
            general = self._mtp[module]
            if general.pool_tensors:
                session.allocate(next(iter(general.pool_tensors.values())).shape[0], pools_of=general)
            self._mtp_decodes[key] = session
        return self._mtp_decodes[key]
