"""TensorRT backend: runs the engines ``m3export build`` wrote (one per graph: ``model``, ``mtp{k}``).

An engine directory's ``build.json`` names the artifact it was built from and the GPU and TensorRT version it was
built for; an engine for another compute capability or TensorRT release is refused before it is deserialized
(``m3export.build.profiles.check_engine``). Per step, every decision (which profile, which shapes, which buffer is
bound to which tensor) is made by the plain functions of ``tensorrt_bindings.py``, tested on the CPU; this module
only turns them into TensorRT calls:

* the cache pools are device buffers bound by address (``set_tensor_address``), two per pool (the step reads one
  and writes the updated pool into the other: TensorRT runs the cache writes out of place, see
  ``tensorrt_bindings.PoolPair``); the pools never leave the GPU;
* the optimisation profile is chosen per step by token count (``set_optimization_profile_async`` when it
  changes), then every input shape is set (``set_input_shape``);
* outputs are written into buffers allocated once for the largest profile; a step returns views of them, valid
  until that graph's next step;
* ``execute_async_v3`` runs on the current torch CUDA stream, so it is ordered after the torch ops that built the
  step's inputs and before whatever reads its outputs; nothing is copied to the host here (the engine decides
  what it copies: the logits rows it samples from).

**Not run yet**: TensorRT cannot be installed on the development machine (its wheels download from NVIDIA's
index), so the TensorRT calls below (marked) have never executed; everything they are fed is tested. Without
TensorRT, ``--backend tensorrt`` fails with one line naming what to install.
"""

from __future__ import annotations

from pathlib import Path

import torch

from m3export.dtypes import BY_NAME
from m3export.errors import ArtifactError, BackendUnavailable
from m3export.model.batch import Batch

from . import tensorrt_bindings as tb
from .base import Backend

INSTALL_HINT = ("pip install 'm3export[trt]' (tensorrt>=10.9 from NVIDIA's package index) on a machine with an "
                "NVIDIA GPU and driver")


def require_tensorrt():
    """The ``tensorrt`` module, or BackendUnavailable naming what to install."""
    try:
        import tensorrt
    except ImportError as e:
        raise BackendUnavailable(f"TensorRT is not installed ({e}): {INSTALL_HINT}") from e
    return tensorrt


def engine_graphs(meta: dict, mtp_modules: int, where: str) -> tuple[str, list[str]]:
    """('model', the MTP graphs usable for speculation) from ``build.json``: MTP modules chain, so only a prefix
    mtp0, mtp1, ... of built engines is usable."""
    engines = meta.get("engines")
    if not isinstance(engines, dict) or "model" not in engines:
        raise ArtifactError(f"{where}: build.json lists no engine of graph 'model' (build it with 'm3export build "
                            "ARTIFACT --out DIR', without --graphs or with 'model' in it)")
    mtp = []
    for k in range(mtp_modules):
        if f"mtp{k}" not in engines:
            break
        mtp.append(f"mtp{k}")
    return "model", mtp


def check_engine_file(root: Path, record: dict, name: str) -> Path:
    """The engine file of ``build.json``'s record, present and of the recorded size (its sha256 is recorded too;
    hashing an engine of the full model at every start-up would take minutes)."""
    file = record.get("file") if isinstance(record, dict) else None
    if not isinstance(file, str) or Path(file).name != file:
        raise ArtifactError(f"{root}: build.json's engine of graph {name!r} names no file in the directory")
    path = root / file
    if not path.is_file():
        raise ArtifactError(f"{path}: engine of graph {name!r} is missing (rebuild with 'm3export build')")
    size = path.stat().st_size
    if size != record.get("bytes"):
        raise ArtifactError(f"{path}: {size} bytes, build.json records {record.get('bytes')} (a partial copy or "
                            "another build's file)")
    return path


def cuda_device(device: str | torch.device) -> torch.device:
    """TensorRT runs on a CUDA device: ``cuda[:n]`` as asked, the current CUDA device for the default ``cpu``."""
    device = torch.device(device)
    if not torch.cuda.is_available():
        raise BackendUnavailable("the tensorrt backend needs an NVIDIA GPU (torch sees no CUDA device)")
    if device.type == "cuda":
        return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    if device.type == "cpu":
        return torch.device("cuda", torch.cuda.current_device())
    raise BackendUnavailable(f"the tensorrt backend runs on CUDA devices, not {str(device)!r}")


def _on(device: torch.device):
    """The CUDA device current while TensorRT objects are made (a CPU device: the tests' stand-in engines)."""
    import contextlib

    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


# ------------------------------------------------------------------------------------------- needs TensorRT
class EngineRunner:
    """One deserialized engine with its execution context, cache pools and output buffers (needs TensorRT; the
    CPU tests drive it with a stand-in engine that reads and writes the bound addresses as TensorRT does)."""

    def __init__(self, trt, runtime, path: Path, graph, recorded_profiles: list, device: torch.device):
        from m3export.plugins.tensorrt.plugins import dtype_maps

        self.graph, self.device, self.where = graph, device, str(path)
        with _on(device):
            engine = runtime.deserialize_cuda_engine(path.read_bytes())  # TensorRT
            if engine is None:
                raise BackendUnavailable(f"{path}: TensorRT {trt.__version__} could not deserialize this engine "
                                         "(see its log above)")
            _, from_trt = dtype_maps(trt)
            names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]  # TensorRT
            tb.check_engine_io(graph, [tb.EngineTensor(n, engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT,
                                                       from_trt.get(engine.get_tensor_dtype(n), "?"),
                                                       tuple(engine.get_tensor_shape(n))) for n in names], self.where)
            self.profiles = [{t.name: [tuple(d) for d in engine.get_tensor_profile_shape(t.name, i)]
                              for t in graph.inputs} for i in range(engine.num_optimization_profiles)]  # TensorRT
            tb.check_profiles(self.profiles, recorded_profiles, self.where)
            self.engine = engine
            self.context = engine.create_execution_context()  # TensorRT
            if self.context is None:
                raise BackendUnavailable(f"{path}: TensorRT could not create an execution context (GPU memory?)")
        self.bounds = tb.dim_bounds(graph, self.profiles, self.where)
        self._active_profile: int | None = None
        # outputs other than the pools: one flat buffer each, of the largest shape any profile allows
        self._out = {}
        for name, shape in tb.output_shapes(graph, self.bounds, self.where).items():
            if name not in graph.aliases:
                numel = 1
                for d in shape:
                    numel *= d
                sig = next(t for t in graph.outputs if t.name == name)
                self._out[name] = torch.empty(max(numel, 1), dtype=BY_NAME[sig.dtype].torch, device=device)
        self._scratch = torch.zeros(1, dtype=torch.uint8, device=device)  # the address of an empty tensor
        self.pools: tb.PoolPair | None = None

    def pool_page_bytes(self) -> int:
        """Bytes of one page across this engine's pools, both buffers of each pair counted."""
        total = 0
        for inp, _ in tb.pool_pairs(self.graph):
            numel = 1
            for d in tb.pool_shape(self.graph, inp, 1):
                numel *= d
            total += 2 * numel * BY_NAME[next(t.dtype for t in self.graph.inputs if t.name == inp)].itemsize
        return total

    def allocate(self, num_pages: int) -> None:
        if num_pages > self.bounds.get("pages", num_pages):
            raise ValueError(f"{self.where}: {num_pages} pages, the engine was built for pools of at most "
                             f"{self.bounds['pages']} (raise it with 'm3export build ... --num-pages')")
        self.pools = None  # the previous pools go before the new ones are allocated
        self.pools = tb.PoolPair(self.graph, num_pages,
                                 lambda n, shape, dtype: torch.zeros(shape, dtype=BY_NAME[dtype].torch,
                                                                     device=self.device))

    def _address(self, t: torch.Tensor) -> int:
        return t.data_ptr() if t.numel() else self._scratch.data_ptr()

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One step; returns the outputs other than the pools (views of this runner's buffers)."""
        if self.pools is None:
            raise RuntimeError(f"{self.where}: allocate(num_pages) before the first step")
        sigs = {t.name: t for t in self.graph.inputs}
        reads, writes = self.pools.bindings()
        unexpected = sorted(set(feeds) & set(reads))
        if unexpected:
            raise tb.StepError(f"{self.where}: {unexpected} are cache pools, bound from the backend's own buffers, "
                               "never fed")
        inputs = {}
        for name, t in feeds.items():
            sig = sigs.get(name)
            if sig is not None and t.dtype != BY_NAME[sig.dtype].torch:
                raise tb.StepError(f"{self.where}: input {name} must be {sig.dtype}, got {t.dtype}")
            inputs[name] = t.to(self.device).contiguous()
        inputs.update(reads)
        shapes = {n: tuple(t.shape) for n, t in inputs.items()}
        dims = tb.step_dims(self.graph, shapes, self.where)
        profile = tb.select_profile(self.graph, self.profiles, shapes, self.where)
        out_shapes = tb.output_shapes(self.graph, dims, self.where)
        outputs = dict(writes)
        for name, buf in self._out.items():
            n = 1
            for d in out_shapes[name]:
                n *= d
            outputs[name] = buf[:n].view(out_shapes[name])
        spans = [(b.data_ptr(), b.numel() * b.element_size()) for b in self._out.values()]
        for name in feeds:  # a misaligned feed, or last step's output fed back: bind a copy
            t = inputs[name]
            if tb.needs_copy(t.data_ptr(), t.numel() * t.element_size(), spans):
                inputs[name] = t.clone()

        stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0
        ctx = self.context
        # ---- TensorRT calls
        if profile != self._active_profile:
            if not ctx.set_optimization_profile_async(profile, stream):
                raise RuntimeError(f"{self.where}: TensorRT refused optimisation profile {profile}")
            self._active_profile = profile
        for name, t in inputs.items():
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise tb.StepError(f"{self.where}: TensorRT refused shape {list(t.shape)} for input {name} "
                                   f"(profile {profile})")
            if not ctx.set_tensor_address(name, self._address(t)):
                raise RuntimeError(f"{self.where}: TensorRT refused the address of input {name}")
        for name, t in outputs.items():
            got = tuple(ctx.get_tensor_shape(name))
            if got != tuple(t.shape):
                raise ArtifactError(f"{self.where}: TensorRT gives output {name} shape {list(got)}, the graph's "
                                    f"signature {list(t.shape)} (the manifest does not describe this engine)")
            if not ctx.set_tensor_address(name, self._address(t)):
                raise RuntimeError(f"{self.where}: TensorRT refused the address of output {name}")
        if not ctx.execute_async_v3(stream):
            raise RuntimeError(f"{self.where}: TensorRT failed to enqueue the step (see its log above)")
        # ---- end of TensorRT calls
        self.pools.swap()  # stream-ordered: the next step's reads of the updated pools queue after this one
        self._keepalive = inputs  # copies made above live until the stream has used them (the next step)
        return {name: t for name, t in outputs.items() if name not in writes}


class TensorRTBackend(Backend):
    name = "tensorrt"

    def __init__(self, root: Path, meta: dict, artifact, trt, device: torch.device):
        self.root = root
        self.config = artifact.config
        self.required_page_size = artifact.page_size
        self.device = device
        self.graph_dtype = BY_NAME[artifact.manifest.dtype]
        main, mtp = engine_graphs(meta, artifact.manifest.mtp_modules, str(root))
        profiles = meta.get("profiles", {})
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))  # TensorRT

        def runner(name: str) -> EngineRunner:
            if name not in artifact.graphs:
                raise ArtifactError(f"{root}: engine {name!r} has no graph in the artifact {artifact.root}")
            path = check_engine_file(root, meta["engines"][name], name)
            return EngineRunner(trt, runtime, path, artifact.graphs[name], profiles.get(name, []), device)

        self._main = runner(main)
        self._mtp = [runner(name) for name in mtp]
        # a vision-language step graph takes media rows; this backend encodes none, so every step feeds zero rows
        self._no_media = {name: torch.zeros(shape, dtype=BY_NAME[dtype].torch, device=device)
                          for name, (shape, dtype) in tb.empty_media(artifact.graphs[main]).items()}

    @property
    def num_mtp_modules(self) -> int:
        return len(self._mtp)

    def page_bytes(self, page_size: int) -> int:
        if page_size != self.required_page_size:
            raise ValueError(f"the engines take pages of {self.required_page_size} tokens, not {page_size}")
        return sum(r.pool_page_bytes() for r in (self._main, *self._mtp))

    def allocate(self, num_pages: int, page_size: int) -> None:
        if page_size != self.required_page_size:
            raise ValueError(f"the engines take pages of {self.required_page_size} tokens, not {page_size}")
        for r in (self._main, *self._mtp):
            r.allocate(num_pages)

    @staticmethod
    def _feeds(batch: Batch, **extra: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**dict(zip(batch.input_names(), batch.inputs())), **extra}

    def forward(self, input_ids, batch: Batch, logits_indices):
        out = self._main.run(self._feeds(batch, input_ids=input_ids, logits_indices=logits_indices,
                                         **self._no_media))
        return out["logits"].float(), out["hidden"]

    def mtp_forward(self, module, input_ids, hidden, batch: Batch, logits_indices):
        out = self._mtp[module].run(self._feeds(batch, input_ids=input_ids, logits_indices=logits_indices,
                                                hidden=hidden.to(self.device, self.graph_dtype.torch)))
        return out["logits"].float(), out["hidden_out"]


def open_artifact(path: str | Path, device: str = "cuda") -> TensorRTBackend:
    """The TensorRT backend for an engine directory (``m3export build``'s output)."""
    trt = require_tensorrt()
    from m3export.build.engine import built_from, is_engine_dir, read_build
    from m3export.build.profiles import check_engine
    from m3export.export.artifact import load_artifact

    root = Path(path)
    if not is_engine_dir(root):
        raise BackendUnavailable(f"{path} holds no TensorRT engines: build them with 'm3export build {path} --out "
                                 "DIR' and pass DIR to the tensorrt backend")
    meta = read_build(root)
    dev = cuda_device(device)
    props = torch.cuda.get_device_properties(dev)
    check_engine(meta, trt.__version__, (props.major, props.minor), str(root))  # before any deserialization
    artifact = load_artifact(built_from(meta, root), verify_checksums=False)
    from m3export.plugins.tensorrt import plugins

    plugins.register()  # the m3 plugin creators, for engines whose nodes are not all AOT
    return TensorRTBackend(root, meta, artifact, trt, dev)
