"""One copy of an artifact's weights, in the execution provider's memory, for every ONNX Runtime session of it.

The onnxruntime backend opens several sessions of one artifact: the general step graph, its decode-only forms (one
per MoE form), the MTP modules and their decode forms. Each graph names its weights as external data in the
artifact's ``weights.safetensors`` (file, offset, length), and left to itself every session loads its own copy
(~12 GB per session for the `mini` bf16 artifact on the CUDA EP; the step graph and two decode forms held three).

``SharedWeights`` reads each external initializer once, keyed by its bytes' place in the file (the MTP graphs name
the shared embedding and LM head too), into a torch tensor in the EP's memory, wraps it as an ``OrtValue`` over the
same memory (DLPack: no copy) and hands it to each session through ``SessionOptions.add_initializer``. ONNX Runtime
then uses that buffer in place wherever the session plans the initializer on the same device (its
``initializers_to_share_map`` path, onnxruntime PR 5092); where it plans it elsewhere (a node its EP left on the
CPU) it warns and loads its own copy, so the result is the same either way. Kernels that pre-pack a weight (the CPU
EP's MatMul) keep a packed copy per session; the CUDA EP's kernels read the weights as they are.

Not shared: a weight the graph only feeds to constant nodes (``folded_by_the_session``: a re-layout such as the
lowered MoE's gate / up interleave of ``w13``, a norm gain's ``1 + w``). ONNX Runtime folds such nodes at load into
a constant of the session's own, from the initializer it loaded itself; over a shared device buffer it did not,
and the nodes ran on every step (H200, 2026-12-01 13:37 UTC, `mini` bf16: the lowered decode graph's three
``w13`` interleaves, a ``Transpose`` of every expert's gate / up weights, 647 us each per step, 1.94 ms of a
5.3 ms step). The session then holds the folded result only (the original, read by nothing else, is dropped).

The tensors stay alive as long as this object (and every session given them: each holds the ``OrtValue``s, whose
DLPack capsules keep the torch memory): close the sessions first, then drop it.
"""

from __future__ import annotations

import mmap
import warnings
from pathlib import Path

import torch

from m3export.dtypes import BY_ONNX

_EXTERNAL = 1  # onnx.TensorProto.EXTERNAL


def ortvalue_over(t: torch.Tensor):
    """``t``'s memory as an ``onnxruntime.OrtValue`` (DLPack, no copy); onnxruntime's binding takes the capsule
    with or without the bool flag of older releases."""
    import onnxruntime
    from onnxruntime.capi import _pybind_state as C

    capsule = t.__dlpack__()
    try:
        value = C.OrtValue.from_dlpack(capsule, False)
    except TypeError:  # onnxruntime >= 1.32: from_dlpack(capsule)
        value = C.OrtValue.from_dlpack(capsule)
    return onnxruntime.OrtValue(value)


# ops whose output ONNX Runtime never constant-folds (non-deterministic)
_NOT_FOLDED = ("RandomUniform", "RandomNormal", "RandomUniformLike", "RandomNormalLike", "Multinomial")


def _folds(node, constant: set[str]) -> bool:
    """Whether ONNX Runtime folds ``node`` given the ``constant`` values: it reads constants only."""
    inputs = [i for i in node.input if i]
    return (node.op_type not in _NOT_FOLDED and not any(a.type in (a.GRAPH, a.GRAPHS) for a in node.attribute)
            and (node.op_type == "Constant" or (bool(inputs) and all(i in constant for i in inputs))))


def _readers_fold(nodes, names: set[str], constant: set[str], functions: dict, inner: dict) -> dict[str, list[bool]]:
    """One topological walk of ``nodes``: for each of ``names``, whether each of its readers folds (``constant``,
    updated with what folds, is what they may read). A call of a model-local function counts as its body's readers
    of the matching formal input (ONNX Runtime inlines the body before it folds; only that input known constant
    inside, conservative for the others; ``inner`` caches each (function, formal) verdict); a read from an If /
    Scan / Loop body (the outer scope) never folds."""
    reads: dict[str, list[bool]] = {}
    for node in nodes:
        folds = _folds(node, constant)
        if folds:
            constant.update(node.output)
        for name in _subgraph_reads(node) & names:
            reads.setdefault(name, []).append(False)
        key = (node.domain, node.op_type)
        body = functions.get(key)
        if folds or body is None:
            for name in node.input:
                if name in names:
                    reads.setdefault(name, []).append(folds)
            continue
        for formal, actual in zip(body.input, node.input):
            if actual in names:
                if (key, formal) not in inner:
                    inside = _readers_fold(body.node, {formal}, {formal}, functions, inner).get(formal, [])
                    inner[key, formal] = bool(inside) and all(inside)
                reads.setdefault(actual, []).append(inner[key, formal])
    return reads


def _subgraph_reads(node) -> set[str]:
    """The names a graph attribute of ``node`` (an If branch, a Scan / Loop body, nested) reads."""
    out: set[str] = set()
    for a in node.attribute:
        for g in ([a.g] if a.type == a.GRAPH else list(a.graphs) if a.type == a.GRAPHS else []):
            for inner in g.node:
                out.update(inner.input)
                out |= _subgraph_reads(inner)
    return out


def folded_by_the_session(model) -> set[str]:
    """The initializers of ``model`` (an ``onnx.ModelProto``) whose every reader is a node that reads constants
    only (initializers, ``Constant`` nodes, or such nodes' outputs), in the main graph or in the body of a
    model-local function it is passed to (e.g. the MoE body's fp32 transposed router weight): ONNX Runtime folds
    those nodes at load into constants of its own, and only from initializers the session loaded itself. One walk
    of the graph for all initializers (a session's start-up: thousands of weights at full size)."""
    functions = {(f.domain, f.name): f for f in model.functions}
    initializers = {i.name for i in model.graph.initializer}
    reads = _readers_fold(model.graph.node, initializers, set(initializers), functions, {})
    return {name for name, verdicts in reads.items() if verdicts and all(verdicts)}


class SharedWeights:
    """The external initializers of an artifact's graphs, one tensor each in ``device`` memory, added to every
    session's options (``add_to``)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._values: dict[tuple, tuple[torch.Tensor, object]] = {}  # bytes' place -> (tensor, OrtValue over it)
        self._files: dict[Path, mmap.mmap] = {}
        self.refused: dict[tuple, str] = {}  # weights onnxruntime could not wrap (each session loads its own): why

    @property
    def nbytes(self) -> int:
        """Bytes held: one copy of every distinct weight added so far."""
        return sum(t.numel() * t.element_size() for t, _ in self._values.values())

    def tensor(self, key: tuple) -> torch.Tensor:
        return self._values[key][0]

    def add_to(self, options, model, folder: Path) -> list[str]:
        """``options.add_initializer`` for each external initializer of ``model`` (an ``onnx.ModelProto``, loaded
        without its external data) whose data lies in ``folder``; each read once per (file, offset, length, type,
        dims), but for the initializers the session folds (``folded_by_the_session``: it loads those itself). -> the
        names added."""
        added = []
        folded = folded_by_the_session(model)
        for init in model.graph.initializer:
            if init.data_location != _EXTERNAL or init.data_type not in BY_ONNX or init.name in folded:
                continue
            ext = {e.key: e.value for e in init.external_data}
            if "location" not in ext:
                continue
            file = (Path(folder) / ext["location"]).resolve()
            offset, dims = int(ext.get("offset", 0)), tuple(int(d) for d in init.dims)
            dtype = BY_ONNX[init.data_type]
            length = int(ext["length"]) if "length" in ext else dtype.itemsize * int(torch.Size(dims).numel())
            key = (file, offset, length, init.data_type, dims)
            if key in self.refused:
                continue
            if key not in self._values:
                t = self._read(file, offset, length, init.name).view(dtype.torch).reshape(dims)
                try:
                    self._values[key] = (t, ortvalue_over(t))
                except (TypeError, RuntimeError, ValueError) as e:  # a dtype / device this onnxruntime's DLPack
                    # import lacks: the sessions load their own copies of it, as without sharing (said here)
                    self.refused[key] = f"{init.name}: {type(e).__name__}: {e}"[:300]
                    continue
            options.add_initializer(init.name, self._values[key][1])
            added.append(init.name)
        return added

    def _read(self, file: Path, offset: int, length: int, name: str) -> torch.Tensor:
        """``length`` bytes at ``offset`` of ``file`` as a uint8 tensor of its own in ``device`` memory."""
        mm = self._files.get(file)
        if mm is None:
            with open(file, "rb") as f:
                mm = self._files[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if offset + length > len(mm):
            raise ValueError(f"{file}: initializer {name} lies at bytes {offset}..{offset + length}, past the file's "
                             f"{len(mm)} bytes")
        with warnings.catch_warnings():  # a read-only map: torch warns that it cannot write it (nothing does)
            warnings.simplefilter("ignore", UserWarning)
            host = torch.frombuffer(mm, dtype=torch.uint8, count=length, offset=offset)
        return host.to(self.device, copy=True)

    def close(self) -> None:
        """Drop the tensors and the file maps (after the sessions that use them are closed)."""
        self._values = {}
        for mm in self._files.values():
            mm.close()
        self._files = {}
