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

``close()`` (also ``with PagedSession(...) as s:``) releases the session before the interpreter exits: the
io_binding first (its OrtValues wrap the pools' memory), then the ``InferenceSession`` (and with it the EP's own
buffers, pinned host memory on CUDA among them), then the torch buffers and the stream. Left to the interpreter's
exit, a CUDA session was destroyed after the CUDA runtime had shut down, and ``cudaFreeHost`` failing there
(error 800) aborted a process whose work had succeeded (exit 134 after an FP8 artifact's ``verify`` had PASSED, on
the H200): the ``_HostPools`` view held its session, a reference cycle that only the cyclic collector freed (it
holds a weak reference now, so a session nobody holds goes at once; ``close()`` does not wait for that).

A step re-binds nothing that did not change (``_BindTable``): the session's io_binding is made once per
``allocate``, the pools (every aliased cache input / output, scale pools included) are bound there and never
again, each fed input is copied into a session-owned buffer of its shape (a view of one growing buffer per input,
in the EP's memory) and each plain output is written into a session-owned buffer, kept bound while the caller no
longer holds the previous step's result. In a steady decode loop a step binds nothing and allocates nothing; a
shape change re-binds only the names whose shape changed.

This module sits below ``m3export.export`` (whose ``verify`` uses it): it reads an artifact only through the
duck-typed ``artifact.path(graph)`` / ``artifact.graphs[graph]`` and never imports the export package.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from m3export.dtypes import BY_NAME
from m3export.errors import BackendUnavailable

from .providers import Provider, parse_provider, require
from .streams import SharedStream, run_options

CUDA_GRAPH = "enable_cuda_graph"  # the CUDA EP's provider option for ONNX Runtime's CUDA graphs (``run_replayed``)
# ONNX Runtime folds no constant node whose output passes this many bytes (its default is 1 GiB: "Skipping constant
# folding for Reshape node ... estimated output size (1207959552 bytes) exceeds the limit (1073741824 bytes)",
# onnxruntime 1.31.1). Such a node then runs on every step instead: the lowered MoE's gate / up interleave of a `mini`
# layer's w13 (16 experts x 6144 x 6144 bf16 = 1.2 GB) was a 657 us Transpose per layer and step on the H200
# (2026-12-01 14:05 UTC). Every session lifts the limit: a fold costs its output's memory once, per session.
FOLD_LIMIT = ("optimization.constant_folding_max_output_size_in_bytes", str(1 << 40))

if TYPE_CHECKING:
    from m3export.export.manifest import GraphInfo

    from .shared_weights import SharedWeights


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
        self._session = weakref.ref(session)  # not a reference cycle: a dropped session goes at once

    def __getitem__(self, name: str) -> np.ndarray:
        session = self._session()
        session._check_open()
        return BY_NAME[session._inputs[name].dtype].to_numpy(session.pool_tensors[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._session().pool_tensors)

    def __len__(self) -> int:
        return len(self._session().pool_tensors)


class PagedSession:
    """A graph of an artifact in ONNX Runtime; ``pool_tensors`` hold the caches between steps, in the memory of
    the execution provider (``device``), and ``pools`` shows them as host numpy arrays."""

    def __init__(self, path: Path, graph: GraphInfo, providers: str | Provider | Sequence = "cpu", options=None,
                 threads: int | None = None, model: bytes | None = None, weights: SharedWeights | None = None):
        """``threads``: ONNX Runtime's intra-op threads (default: one per physical core, spinning while idle,
        which on a machine shared with other work costs several times the step; benchmarks pin it).
        ``model``: a serialised variant of the graph at ``path`` to run instead (``verify``'s copy with extra
        outputs: ``graph`` lists them); its external weights load from ``path``'s folder. ``weights``: the graph's
        external weights from this one copy, shared with the other sessions given it (``shared_weights.py``;
        added to ``options``), instead of a copy of the session's own."""
        ort = _ort()
        self.graph = graph
        self.provider = require(parse_provider(providers))
        self.device = torch.device(self.provider.device)
        self._stream = SharedStream.for_provider(self.provider)  # None: the EP cannot share torch's stream
        # a session opened with enable_cuda_graph captures a run that names no graph as ORT's graph 0 and replays
        # that one from then on, whatever the shapes: ``run`` / ``run_torch`` steps say -1 (no capture)
        self._run_options = (run_options(ort, -1 if self.captures else None) if self._stream is not None else None)
        providers = (self._stream.session_providers() if self._stream is not None
                     else self.provider.session_providers())
        if options is None:
            options = ort.SessionOptions()
            options.log_severity_level = 3  # errors only: ORT warns about kernels it cannot constant-fold
            if threads is not None:
                options.intra_op_num_threads = threads
        elif threads is not None:
            raise ValueError("give session options or threads, not both")
        options.add_session_config_entry(*FOLD_LIMIT)
        if model is not None:  # bytes have no folder of their own to resolve external data locations against
            options.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                             str(Path(path).parent))
        if weights is not None:
            import onnx

            proto = onnx.load(str(path), load_external_data=False) if model is None else onnx.load_from_string(model)
            weights.add_to(options, proto, Path(path).parent)
        try:
            self._session = ort.InferenceSession(str(path) if model is None else model, sess_options=options,
                                                 providers=providers)
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
        self._feed_names = set(self._inputs) - set(self.pool_inputs)
        self._plain_outputs = [t for t in graph.outputs if t.name not in graph.aliases]
        self._dtypes = {t.name: BY_NAME[t.dtype] for t in graph.outputs}
        self._onnx_types = {t.name: BY_NAME[t.dtype].onnx for t in (*graph.inputs, *graph.outputs)}
        self._table: _BindTable | None = None  # the io_binding steps keep (``allocate`` makes it)
        self._flat: dict[str, torch.Tensor] = {}  # the session's buffer of each fed input and plain output
        self._free_users: dict[str, int | None] = {}  # an output buffer's storage users when nothing else holds it
        self._input_views: dict[str, torch.Tensor] = {}  # each fed input's buffer at its last shape
        self._replays: dict[int, _Replay] = {}  # ``run_replayed``: each CUDA graph id's run options and outputs

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

    def close(self) -> None:
        """Release ONNX Runtime's session and everything bound to it, in this order: the io_binding (its OrtValues
        wrap the pools' and buffers' memory), the ``InferenceSession`` (the EP's own allocations go with it), the
        torch buffers (pools, fed inputs, outputs; results a caller still holds stay valid: torch owns them), the
        shared stream. On a CUDA device the queued work finishes first. Idempotent; any later use raises."""
        if self.closed:
            return
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)  # ORT's last step may still read or write the bound buffers
        if self._table is not None:
            self._table.binding.clear_binding_inputs()
            self._table.binding.clear_binding_outputs()
        self._table = None
        self._session = None  # the one reference to the InferenceSession: ORT frees it (and its EP's memory) here
        self.pool_tensors, self._flat, self._input_views, self._free_users, self._replays = {}, {}, {}, {}, {}
        self._stream = self._run_options = None

    @property
    def session(self):
        """The ``onnxruntime.InferenceSession``; after ``close()`` one clear error (the session's one notion of
        being closed: ``close()`` drops this reference, every use goes through here)."""
        if self._session is None:
            raise RuntimeError(f"{self.graph.file}: this PagedSession was closed (close()); open a new one")
        return self._session

    @property
    def closed(self) -> bool:
        return self._session is None

    def __enter__(self) -> PagedSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        self.session  # noqa: B018 - raises once closed

    def allocate(self, num_pages: int, pools_of: PagedSession | None = None) -> None:
        """Zeroed pools of ``num_pages`` pages for every cache input, in the execution provider's memory, bound as
        their cache inputs and aliased outputs in a new io_binding that every later step keeps. ``pools_of``:
        bind that session's pools instead (allocated already, same names, shapes and memory), so that two graphs
        of one model (the general step graph and its decode-only form) update one set of caches."""
        self._check_open()
        self._table = None  # the previous pools' binding goes before the new pools are allocated
        self.pool_tensors = {}
        for name in self.pool_inputs:
            sig = self._inputs[name]
            shape = [num_pages if d == "pages" else d for d in sig.shape]
            if not all(isinstance(d, int) for d in shape):
                raise ValueError(f"{name}: cannot size pool dims {sig.shape} (only 'pages' is free)")
            dtype = BY_NAME[sig.dtype].torch
            if pools_of is None:
                self.pool_tensors[name] = torch.zeros(shape, dtype=dtype, device=self.device)
                continue
            shared = pools_of.pool_tensors.get(name)
            if shared is None or list(shared.shape) != shape or shared.dtype != dtype or shared.device != self.device:
                has = "none" if shared is None else f"{shared.dtype} {list(shared.shape)} on {shared.device}"
                raise ValueError(f"{self.graph.file}: pool {name} cannot be shared with {pools_of.graph.file}'s (it "
                                 f"has {has}; this graph needs {dtype} {shape} on {self.device})")
            self.pool_tensors[name] = shared
        table = _BindTable(self.session.io_binding())
        for sig in self.graph.outputs:  # graph order, so ORT's outputs come back in the order table keeps
            if sig.name in self.graph.aliases:
                pool = self.graph.aliases[sig.name]
                table.bind("input", pool, self.pool_tensors[pool], self._onnx_types[pool])
                table.bind("output", sig.name, self.pool_tensors[pool], self._onnx_types[pool])
        self._table = table

    def run(self, feeds: Mapping[str, np.ndarray | torch.Tensor]) -> dict[str, np.ndarray]:
        """One step: ``feeds`` holds every non-pool input; returns every non-pool output as a host numpy array
        (bfloat16 as uint16 bits). On the CPU EP the arrays are views of the memory ORT wrote (held arrays keep
        it: the next step writes into a new buffer)."""
        return {name: self._dtypes[name].to_numpy(t) for name, t in self.run_torch(feeds).items()}

    def run_torch(self, feeds: Mapping[str, np.ndarray | torch.Tensor]) -> dict[str, torch.Tensor]:
        """One step; returns every non-pool output as a torch tensor in the execution provider's memory.

        Numpy feeds are host arrays (bfloat16 as uint16 bits); torch feeds may live on the host or in the EP's
        memory. Each is copied into the session's buffer for that input (in the EP's memory, bound once per
        shape); pools stay bound from ``allocate``. Outputs are written into the session's buffer for that output
        while nothing outside the session holds the previous step's result (then no rebinding); a held result is
        never overwritten: the step gets a new buffer, bound once. On a shared stream (CUDA / TensorRT EPs) this
        returns once the step is queued: the outputs are ready for work queued afterwards on torch's current
        stream, and reading them on the host (``.cpu()``, ``.tolist()``) is the step's one synchronisation.
        """
        self._check_open()
        table = self._table
        if table is None:
            raise RuntimeError("call allocate(num_pages) before run()")
        if feeds.keys() != self._feed_names:
            missing = sorted(self._feed_names - set(feeds))
            unknown = sorted(set(feeds) - self._feed_names)
            raise ValueError(f"{self.graph.file}: missing inputs {missing}, unexpected feeds {unknown} "
                             "(cache pools are bound from the session's own buffers, never fed)")
        dims: dict[str, int] = {}
        for name, value in feeds.items():
            t = self._as_tensor(name, value)
            for d, n in zip(self._inputs[name].shape, t.shape):
                if isinstance(d, str) and dims.setdefault(d, n) != n or isinstance(d, int) and d != n:
                    raise ValueError(f"{self.graph.file}: input {name} dim {d!r} is {n}, but the graph needs "
                                     f"{dims.get(d, d)}")
            table.bind("input", name, self._fill(name, t), self._onnx_types[name])
        results = {}
        for sig in self._plain_outputs:
            shape = [dims[d] if isinstance(d, str) else d for d in sig.shape]
            results[sig.name] = out = self._output_buffer(sig.name, shape)
            table.bind("output", sig.name, out, self._onnx_types[sig.name])
        if self._stream is not None:
            self._stream.before_run()  # ORT's stream waits for torch's writes to the bound buffers (device side)
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # an EP on a stream of its own: torch's writes are done first
        try:
            self.session.run_with_iobinding(table.binding, self._run_options)
        except Exception as e:  # a kernel this execution provider lacks at run time (e.g. 16-bit scatters)
            raise BackendUnavailable(f"{self.graph.file}: ONNX Runtime failed to run this graph with "
                                     f"{self.session.get_providers()}: {e}") from e
        if self._stream is not None:
            self._stream.after_run()  # readers of the outputs on torch's stream wait for ORT (device side)
        else:
            table.binding.synchronize_outputs()
        table.check_outputs(self.graph.file)
        return results

    @property
    def captures(self) -> bool:
        """Whether the session was opened with ONNX Runtime's CUDA graphs (the CUDA EP's provider option
        ``enable_cuda_graph``): steps then go through ``run_replayed``."""
        return self.provider.options.get(CUDA_GRAPH, "0").strip().lower() in ("1", "true")

    def run_replayed(self, inputs: Mapping[str, torch.Tensor], graph_id: int) -> dict[str, torch.Tensor]:
        """One step as ONNX Runtime's CUDA graph ``graph_id`` (run option ``gpu_graph_id``) of a session opened
        with ``enable_cuda_graph=1``: the first run of an id captures it (ORT runs the step normally first, then
        captures it, then replays it: one call), every later run replays it with one launch.

        A captured graph reads and writes the addresses it was captured with, so ``inputs`` (every non-pool
        input, torch tensors in the EP's memory) are bound where they are, by address, never copied: the caller
        keeps each id's inputs at fixed addresses and shapes and refills them in place (a moved or reshaped input
        is an error here, not a silent read of stale memory). The pools stay bound from ``allocate``; the outputs
        are this id's own buffers, rewritten by its next replay (copy what you keep). The step must give the same
        result when run twice (ORT's warm-up runs before the capture): a step's cache writes rewrite the same
        rows with the same values, so every step graph's does."""
        self._check_open()
        if not self.captures:
            raise RuntimeError(f"{self.graph.file}: run_replayed needs a session opened with {CUDA_GRAPH}=1 "
                               f"(this one: {self.provider})")
        if graph_id < 1:
            raise ValueError(f"{self.graph.file}: CUDA graph id {graph_id}: ids start at 1 (ONNX Runtime reserves 0 "
                             "for runs that name no graph and -1 for runs without capture)")
        table = self._table
        if table is None:
            raise RuntimeError("call allocate(num_pages) before run_replayed()")
        if inputs.keys() != self._feed_names:
            raise ValueError(f"{self.graph.file}: missing inputs {sorted(self._feed_names - set(inputs))}, "
                             f"unexpected {sorted(set(inputs) - self._feed_names)}")
        placed = {name: (t.data_ptr(), tuple(t.shape)) for name, t in inputs.items()}
        replay = self._replays.get(graph_id)
        if replay is None:
            dims: dict[str, int] = {}
            for name, t in inputs.items():
                if self._as_tensor(name, t).data_ptr() != t.data_ptr():
                    raise ValueError(f"{self.graph.file}: input {name} is not contiguous; a captured graph binds "
                                     "its inputs where they are")
                if t.device != self.device:
                    raise ValueError(f"{self.graph.file}: input {name} is on {t.device}; a captured graph reads "
                                     f"{self.device} memory")
                for d, n in zip(self._inputs[name].shape, t.shape):
                    if isinstance(d, str) and dims.setdefault(d, n) != n:
                        raise ValueError(f"{self.graph.file}: input {name} dim {d!r} is {n}, not {dims[d]}")
            outputs = {sig.name: torch.empty([dims[d] if isinstance(d, str) else d for d in sig.shape],
                                             dtype=self._dtypes[sig.name].torch, device=self.device)
                       for sig in self._plain_outputs}
            replay = self._replays[graph_id] = _Replay(run_options(_ort(), graph_id), outputs, placed)
        elif placed != replay.inputs:
            moved = sorted(n for n in placed if placed[n] != replay.inputs[n])
            raise ValueError(f"{self.graph.file}: CUDA graph {graph_id} was captured with other addresses or shapes "
                             f"of {moved}: a replay reads the captured ones (keep each graph's inputs in place)")
        for name, t in inputs.items():
            table.bind("input", name, t, self._onnx_types[name])
        for name, out in replay.outputs.items():
            table.bind("output", name, out, self._onnx_types[name])
        if self._stream is not None:
            self._stream.before_run()
        try:
            self.session.run_with_iobinding(table.binding, replay.options)
        except Exception as e:
            raise BackendUnavailable(f"{self.graph.file}: ONNX Runtime failed to capture or replay CUDA graph "
                                     f"{graph_id} with {self.session.get_providers()}: {e}") from e
        if self._stream is not None:
            self._stream.after_run()
        table.check_outputs(self.graph.file)
        return dict(replay.outputs)

    def _fill(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The session's buffer for input ``name`` at ``t``'s shape, holding ``t``'s values. On a shared stream a
        host feed goes through pinned memory without a host wait (a copy from pageable memory would block)."""
        view = self._input_views.get(name)
        if view is None or view.shape != t.shape:
            view = self._input_views[name] = self._buffer(name, list(t.shape), t.dtype)
        if view.numel() and view.data_ptr() != t.data_ptr():  # (a caller may have written into the buffer)
            if self._stream is not None and t.device.type == "cpu":
                view.copy_(t.pin_memory(), non_blocking=True)
            else:
                view.copy_(t)
        return view

    def _output_buffer(self, name: str, shape: list[int]) -> torch.Tensor:
        """A tensor of ``shape`` for output ``name`` in the session's buffer, or in a new one while something
        outside the session (a caller's tensor, view or numpy array) still holds the previous one."""
        flat = self._flat.get(name)
        users = None if flat is None else _storage_users(flat)
        held = flat is not None and (users is None or users != self._free_users[name])
        return self._buffer(name, shape, self._dtypes[name].torch, fresh=held)

    def _buffer(self, name: str, shape: list[int], dtype: torch.dtype, fresh: bool = False) -> torch.Tensor:
        """A ``shape`` view of ``name``'s flat buffer in the EP's memory, which is replaced by a new one when
        ``fresh`` and grown (to at least twice its size) when too small."""
        numel = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or fresh or flat.numel() < numel:
            size = 0 if flat is None else flat.numel()
            flat = self._flat[name] = torch.empty(max(numel, size if size >= numel else 2 * size, 1), dtype=dtype,
                                                  device=self.device)
            self._free_users[name] = _storage_users(flat)
        return flat[:numel].view(shape)

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


class _Replay:
    """One captured CUDA graph of a session (``run_replayed``): its run options (``gpu_graph_id``), its output
    buffers and the (address, shape) of each input it was captured with."""

    def __init__(self, options, outputs: dict[str, torch.Tensor], inputs: dict[str, tuple]):
        self.options, self.outputs, self.inputs = options, outputs, inputs


class _BindTable:
    """One io_binding kept between steps, and what each of its names holds (device, address, shape, type): a
    name is bound again only when that changes. Pools, scale pools, fed inputs and outputs are all entries."""

    def __init__(self, binding):
        self.binding = binding
        self._held: dict[tuple[str, str], tuple] = {}  # ("input" | "output", name) -> what is bound there
        self._output_order: list[str] = []  # ORT returns bound outputs in the order first bound
        self._unchecked: set[str] = set()  # outputs bound since ORT's results were last compared with them

    def bind(self, kind: str, name: str, t: torch.Tensor, onnx_type: int) -> None:
        """Bind ``t``'s memory by address (``IOBinding.bind_input`` / ``bind_output``: no copy, on any device)
        unless ``name`` holds it already. An empty tensor has no address (torch gives 0), so it is bound to a
        one-element scratch buffer's address."""
        device = (t.device.type, t.device.index or 0) if t.numel() else ("cpu", 0)
        held = (device, t.data_ptr() if t.numel() else _SCRATCH.data_ptr(), tuple(t.shape), onnx_type)
        if self._held.get((kind, name)) == held:
            return
        bind = self.binding.bind_input if kind == "input" else self.binding.bind_output
        bind(name, device[0], device[1], onnx_type, list(t.shape), held[1])
        self._held[kind, name] = held
        if kind == "output":
            if name not in self._output_order:
                self._output_order.append(name)
            self._unchecked.add(name)

    def check_outputs(self, file: str) -> None:
        """After a run: ORT wrote each newly bound output into the bound buffer (it is an implementation property
        that it keeps a bound buffer, the pools' no-copy update rests on it). A binding that did not change is
        not checked again: ORT keeps the same bound value between runs."""
        if not self._unchecked:
            return
        for name, value in zip(self._output_order, self.binding.get_outputs()):
            _, ptr, shape, _ = self._held["output", name]
            if name in self._unchecked and math.prod(shape) and value.data_ptr() != ptr:
                raise RuntimeError(f"{file}: ONNX Runtime did not write {name} into the bound buffer")
        self._unchecked.clear()


def _storage_users(t: torch.Tensor) -> int | None:
    """How many tensors (views, and numpy arrays through them) share ``t``'s memory; None where torch cannot say
    (a private counter), so that an output buffer is then never reused."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else count(t.untyped_storage()._cdata)


_SCRATCH = torch.zeros(8, dtype=torch.uint8)
