"""What the TensorRT backend binds where, decided in plain Python (no TensorRT, no GPU: tested on the CPU).

``tensorrt_backend.py`` only translates these decisions into TensorRT calls. Per engine (one artifact graph):

* :func:`check_engine_io`: the engine's I/O tensors are exactly the graph signature of ``manifest.json`` (names,
  input / output, dtypes, static dimensions), so the batches, pools and outputs sized from the signature fit it.
* :func:`step_dims`: one step's feeds against the signature (every input present, ranks, static dimensions, one
  value per named dimension: ``T``, ``B``, ``B + 1`` ...), the errors naming the tensor.
* :func:`select_profile`: the optimisation profile for the step, the first (smallest, see
  ``m3export/build/profiles.py``) whose [min, max] holds every input shape; a step beyond every profile is refused
  with the ``m3export build`` option that would admit it.
* :func:`output_shapes` and :func:`dim_bounds`: each output's shape for a step, and its largest over the engine's
  profiles, so outputs are written into buffers allocated once (a step binds views of them).
* :class:`PoolPair`: the cache pools. Each cache write of the graph is an ONNX ``ScatterND`` whose output the
  manifest aliases to its input; ONNX Runtime writes it in place, but TensorRT runs ``ScatterND`` out of place and
  we found no promise in its documentation that an output may share an input's address. So every pool has two
  device buffers: a step reads the current one and writes the whole updated pool into the other, then they swap
  (twice the pool memory and a pool copy per step, until an aliased cache-write plugin replaces ``ScatterND``).
* :func:`empty_media`: a vision-language step graph's media inputs on a text step (no media row): this backend
  runs no vision encoder and refuses media (``Backend.encode_media``), yet the graph takes the inputs.
* :func:`needs_copy`: a feed TensorRT may not be given by address: one not aligned to 256 bytes (TensorRT's
  requirement for I/O addresses) or one that overlaps an output buffer of the same step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from m3export.build.profiles import split_dim
from m3export.errors import ArtifactError

Shape = tuple[int, ...]
#: Alignment TensorRT asks of every I/O tensor address (IExecutionContext::setTensorAddress).
ALIGNMENT = 256
#: The ``m3export build`` option that raises each named dimension's bound.
BUILD_OPTION = {"T": "--max-num-tokens", "N": "--max-num-tokens", "M": "--max-num-tokens", "B": "--max-batch",
                "max_pages": "--max-model-len", "pages": "--num-pages"}


class StepError(ValueError):
    """A step's feeds do not fit the graph or the engine's profiles; the message names the tensor and the limit."""


@dataclass(frozen=True)
class EngineTensor:
    """One I/O tensor as the engine declares it (``-1`` for a dynamic dimension)."""

    name: str
    is_input: bool
    dtype: str  # an m3export.dtypes name
    shape: Shape


def check_engine_io(graph, tensors: Sequence[EngineTensor], where: str) -> None:
    """The engine's I/O tensors against the graph signature (a manifest ``GraphInfo``): ArtifactError naming the
    first tensor that differs (the engine was not built from this artifact's graph)."""
    have = {t.name: t for t in tensors}
    for is_input, sigs in ((True, graph.inputs), (False, graph.outputs)):
        kind = "input" if is_input else "output"
        for sig in sigs:
            t = have.pop(sig.name, None)
            if t is None:
                raise ArtifactError(f"{where}: the engine has no {kind} {sig.name!r}, which {graph.file} declares "
                                    "(rebuild the engines from this artifact with 'm3export build')")
            if t.is_input != is_input:
                raise ArtifactError(f"{where}: {sig.name!r} is an {'input' if t.is_input else 'output'} of the "
                                    f"engine, an {kind} of {graph.file}")
            if t.dtype != sig.dtype:
                raise ArtifactError(f"{where}: {kind} {sig.name!r} is {t.dtype} in the engine, {sig.dtype} in "
                                    f"{graph.file}")
            if len(t.shape) != len(sig.shape) or any(
                    isinstance(d, int) and e != d for d, e in zip(sig.shape, t.shape)):
                raise ArtifactError(f"{where}: {kind} {sig.name!r} has shape {list(t.shape)} in the engine, "
                                    f"{list(sig.shape)} in {graph.file}")
    if have:
        raise ArtifactError(f"{where}: the engine has tensors {sorted(have)} that {graph.file} does not declare")


def step_dims(graph, shapes: Mapping[str, Shape], where: str) -> dict[str, int]:
    """The value of every named dimension in one step, from the shapes of all inputs (feeds and pools); StepError
    naming the input that is missing, unexpected, of the wrong rank or inconsistent with the others."""
    declared = {t.name: t for t in graph.inputs}
    missing = sorted(set(declared) - set(shapes))
    unknown = sorted(set(shapes) - set(declared))
    if missing or unknown:
        raise StepError(f"{where}: missing inputs {missing}, unexpected inputs {unknown}")
    dims: dict[str, int] = {}
    for sig in graph.inputs:
        shape = tuple(int(n) for n in shapes[sig.name])
        if len(shape) != len(sig.shape):
            raise StepError(f"{where}: input {sig.name} has rank {len(shape)} (shape {list(shape)}), the graph "
                            f"takes {list(sig.shape)}")
        for d, n in zip(sig.shape, shape):
            name, k = split_dim(d)
            if name is None:
                if n != k:
                    raise StepError(f"{where}: input {sig.name} has shape {list(shape)}, the graph takes "
                                    f"{list(sig.shape)}")
                continue
            value = n - k
            if dims.setdefault(name, value) != value:
                raise StepError(f"{where}: input {sig.name} dim {d!r} is {n}, so {name} = {value}, but another "
                                f"input has {name} = {dims[name]}")
    return dims


def resolve(shape: Sequence, dims: Mapping[str, int], where: str) -> Shape:
    out = []
    for d in shape:
        name, k = split_dim(d)
        if name is not None and name not in dims:
            raise StepError(f"{where}: dimension {d!r} is set by no input")
        out.append(k if name is None else dims[name] + k)
    return tuple(out)


def output_shapes(graph, dims: Mapping[str, int], where: str) -> dict[str, Shape]:
    """Every output's shape in a step whose named dimensions are ``dims``."""
    return {t.name: resolve(t.shape, dims, f"{where}: output {t.name}") for t in graph.outputs}


Ranges = Mapping[str, Sequence[Sequence[int]]]  # input -> (min shape, opt shape, max shape)


def select_profile(graph, profiles: Sequence[Ranges], shapes: Mapping[str, Shape], where: str) -> int:
    """Index of the first profile whose [min, max] holds every input shape of the step. Profiles come smallest
    first (decode steps, then every step up to ``max_num_tokens``), so a decode step runs the decode-tuned one."""
    if not profiles:
        raise ArtifactError(f"{where}: the engine has no optimisation profile")
    for i, ranges in enumerate(profiles):
        if all(all(lo <= n <= hi for n, lo, hi in zip(shapes[name], r[0], r[2])) for name, r in ranges.items()):
            return i
    widest = {name: (tuple(min(p[name][0][j] for p in profiles) for j in range(len(r[0]))),
                     tuple(max(p[name][2][j] for p in profiles) for j in range(len(r[2]))))
              for name, r in profiles[-1].items()}
    sigs = {t.name: t for t in graph.inputs}
    for name, (lo, hi) in widest.items():
        for j, (n, a, b) in enumerate(zip(shapes[name], lo, hi)):
            if not a <= n <= b:
                dim = split_dim(sigs[name].shape[j])[0] if name in sigs else None
                hint = f" (raise it with 'm3export build ... {BUILD_OPTION[dim]}')" if dim in BUILD_OPTION else ""
                raise StepError(f"{where}: input {name} has shape {list(shapes[name])}; dimension {j} "
                                f"({sigs[name].shape[j] if name in sigs else j}) is {n}, the engine was built for "
                                f"{a}..{b}{hint}")
    # every dimension is within the union of the profiles, but no single profile holds them all
    raise StepError(f"{where}: no optimisation profile holds this step's shapes together "
                    f"({ {n: list(s) for n, s in shapes.items() if n in widest} })")


def dim_bounds(graph, profiles: Sequence[Ranges], where: str) -> dict[str, int]:
    """The largest value each named dimension takes in any profile (for buffers allocated once)."""
    bounds: dict[str, int] = {}
    for ranges in profiles:
        for sig in graph.inputs:
            if sig.name not in ranges:
                raise ArtifactError(f"{where}: the engine's profiles give no shapes for input {sig.name}")
            for d, hi in zip(sig.shape, ranges[sig.name][2]):
                name, k = split_dim(d)
                if name is not None:
                    bounds[name] = max(bounds.get(name, hi - k), hi - k)
    return bounds


def check_profiles(engine_profiles: Sequence[Ranges], recorded: Sequence[Ranges], where: str) -> None:
    """The engine's own profiles (read from the deserialized engine) against those ``build.json`` records."""
    norm = [{n: [list(map(int, s)) for s in r] for n, r in p.items()} for p in engine_profiles]
    want = [{n: [list(map(int, s)) for s in r] for n, r in p.items()} for p in recorded]
    if norm != want:
        raise ArtifactError(f"{where}: the engine's optimisation profiles are not the ones build.json records "
                            "(the directory mixes builds: rebuild it with 'm3export build')")


def empty_media(graph) -> dict[str, tuple[Shape, str]]:
    """(shape, dtype) of each media input with no media row: the inputs of dimension ``M`` (a vision-language step
    graph's ``media_rows`` [M] / ``media_embeds`` [M, hidden], ``m3export.export.graphs.MEDIA_INPUTS``) at M = 0,
    what a text step feeds. Empty for graphs without media inputs (text models, MTP modules)."""
    return {t.name: (resolve(t.shape, {"M": 0}, f"{graph.file}: input {t.name}"), t.dtype)
            for t in graph.inputs if any(split_dim(d)[0] == "M" for d in t.shape)}


def pool_pairs(graph) -> list[tuple[str, str]]:
    """(cache input, its updated output) of every pool, in the order the graph lists the outputs."""
    return [(graph.aliases[o.name], o.name) for o in graph.outputs if o.name in graph.aliases]


def pool_shape(graph, name: str, num_pages: int) -> Shape:
    sig = next(t for t in graph.inputs if t.name == name)
    shape = tuple(num_pages if d == "pages" else d for d in sig.shape)
    if not all(isinstance(d, int) for d in shape):
        raise ArtifactError(f"{graph.file}: cannot size pool {name} of dims {list(sig.shape)} (only 'pages' is free)")
    return shape


class PoolPair:
    """Two buffers per cache pool: the step reads ``current`` and TensorRT writes the updated pool into ``spare``;
    :meth:`swap` after the step makes it current (see the module docstring for why not in place)."""

    def __init__(self, graph, num_pages: int, allocate: Callable[[str, Shape, str], Any]):
        """``allocate(name, shape, dtype)`` makes one zeroed buffer."""
        dtypes = {t.name: t.dtype for t in graph.inputs}
        self.pairs = pool_pairs(graph)
        self._buffers = {inp: [allocate(inp, pool_shape(graph, inp, num_pages), dtypes[inp]) for _ in range(2)]
                         for inp, _ in self.pairs}
        self._current = 0

    def current(self, name: str):
        return self._buffers[name][self._current]

    def spare(self, name: str):
        return self._buffers[name][1 - self._current]

    def bindings(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(cache input -> the buffer it reads, updated output -> the buffer it writes) for the next step."""
        return ({inp: self.current(inp) for inp, _ in self.pairs}, {out: self.spare(inp) for inp, out in self.pairs})

    def swap(self) -> None:
        self._current = 1 - self._current


def needs_copy(address: int, nbytes: int, outputs: Sequence[tuple[int, int]]) -> bool:
    """Whether a feed at ``address`` (``nbytes`` long) must be copied before it is bound: misaligned for TensorRT,
    or overlapping one of the step's output buffers (``(address, nbytes)`` each), which TensorRT may write while it
    still reads the feed (an output of the previous step fed back, e.g. an MTP module's hidden state)."""
    if nbytes == 0:
        return False
    if address % ALIGNMENT:
        return True
    return any(a < address + nbytes and address < a + n for a, n in outputs if n)
