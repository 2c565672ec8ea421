"""EXPERIMENTAL: lower ``m3`` nodes to ONNX Runtime's own ``com.microsoft`` kernels where they express the op.

A graph pass with onnx-graphsurgeon (no hand-edited protobuf); ``m3export export --flavour ort-contrib`` writes
each graph lowered as ``<graph>.ort.onnx`` beside it, recorded in the manifest's ``flavours``. Each lowering is kept only once the H200 shows
that the lowered graph matches the reference (block selections and greedy tokens exactly, logits within the
bound verify uses); until then every lowering here is **unverified on GPU**. What each one does:

* ``MoE`` (bf16 / fp16 / fp32 experts) -> ``com.microsoft.MoE`` twice: the routed experts (SwiGLU with M3's
  alpha, beta = 1 (the ``up + 1``), limit; gate/up rows interleaved by a Reshape/Transpose of ``w13`` that ORT
  folds at load) and the shared expert as a one-expert MoE. ORT's MoE softmaxes ``router_probs`` over its top-k,
  so M3's routing is passed as ``log(s)`` at the ``top_k`` experts chosen in fp32 by ``s + bias`` (the selection
  stays fp32: rounding it to 16 bits flips choices) and -10000 elsewhere: the weights come out as
  ``s / sum(s)`` over the chosen experts, as M3's. ``routed_scaling_factor`` is a separate Mul. Checked here on
  the CPU provider in fp32 against the conformance oracle (``tests/test_lowering.py``).
* ``MXFP8Linear`` -> ``com.microsoft.MatMulBlockQuantizedFp8Weight`` (``block_size`` 32): the E4M3 weight as
  is, the UE8M0 scales expanded to fp32 ``2^(s - 127)`` by nodes ORT folds at load (exact). The op takes fp16 /
  bf16 activations only, so fp32 graphs keep the ``m3`` node. ORT's CPU provider has no kernel for it: checked
  structurally only.

Not lowered, and why: ``MoEMXFP8`` (``QMoE``'s fp8 path is not built into the PyPI wheel and its fp8 scales are
square tiles, not MXFP8's 1x32), ``LightningIndexer`` and ``SparsePagedAttention`` (ORT's sparse ops share one
selection across KV heads and mean-pool blocks: not M3's semantics), ``PagedAttention`` (ORT's op applies the
RoPE and QK norm itself and writes the cache, so the lowering must rewire the attention block from the
projections onward; not written yet).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

MS = "com.microsoft"
LOWERABLE = ("MoE", "MXFP8Linear")
NEG = -10000.0  # router logit of an expert M3 did not choose: exp(-10000 - max) is 0 in every float type


def _gs():
    try:
        import onnx_graphsurgeon as gs
    except ImportError as e:
        from ..errors import BackendUnavailable

        raise BackendUnavailable("the lowering pass needs onnx-graphsurgeon: pip install onnx-graphsurgeon") from e
    return gs


class _Emit:
    """Nodes appended to a graphsurgeon graph, each output a fresh Variable named after the lowered node."""

    def __init__(self, graph, prefix: str):
        self.gs, self.graph, self.prefix, self.count = _gs(), graph, prefix, 0

    def __call__(self, op: str, *inputs, domain: str = "", n_out: int = 1, **attrs):
        self.count += 1
        name = f"{self.prefix}/{op}_{self.count}"
        outs = [self.gs.Variable(f"{name}:{i}") for i in range(n_out)]
        ins = [self.gs.Variable.empty() if i is None else i for i in inputs]
        self.graph.nodes.append(self.gs.Node(op, name, attrs, ins, outs, domain=domain))
        return outs[0] if n_out == 1 else outs

    def const(self, value, dtype=np.int64):
        self.count += 1
        return self.gs.Constant(f"{self.prefix}/c{self.count}", np.asarray(value, dtype=dtype))


def _interleave(e: _Emit, w13):
    """[E, 2I, H] gate rows then up rows -> [E, 2I, H] rows gate0, up0, gate1, up1, ... (``swiglu_fusion=1``)."""
    hidden = e("Shape", w13, start=2)
    split = e("Reshape", w13, e("Concat", e.const([0, 2, -1]), hidden, axis=0))  # [E, 2, I, H]
    swapped = e("Transpose", split, perm=[0, 2, 1, 3])  # [E, I, 2, H]
    return e("Reshape", swapped, e("Concat", e.const([0, -1]), hidden, axis=0))


def _lower_moe(graph, node) -> None:
    x, router, bias, w13, w2, s13, s2 = node.inputs
    (y,) = node.outputs
    a = node.attrs
    e = _Emit(graph, node.name or "moe")
    f32 = onnx.TensorProto.FLOAT
    logits = e("MatMul", e("Cast", x, to=f32), e("Transpose", e("Cast", router, to=f32), perm=[1, 0]))
    s = e("Sigmoid", logits)
    _, idx = e("TopK", e("Add", s, e("Cast", bias, to=f32)), e.const([a["top_k"]]), axis=-1, largest=1, sorted=1,
               n_out=2)
    ones = e("Expand", e.const(1.0, np.float32), e("Shape", idx))
    chosen = e("ScatterElements", e("Mul", s, e.const(0.0, np.float32)), idx, ones, axis=1)
    probs = e("Where", e("Greater", chosen, e.const(0.0, np.float32)), e("Log", s), e.const(NEG, np.float32))
    swiglu = dict(activation_type="swiglu", activation_alpha=float(a["swiglu_alpha"]), activation_beta=1.0,
                  swiglu_limit=float(a["swiglu_limit"]), swiglu_fusion=1, normalize_routing_weights=1)
    routed = e("MoE", x, e("CastLike", probs, x), _interleave(e, w13), None, w2, domain=MS, k=int(a["top_k"]),
               **swiglu)
    # the shared expert: a one-expert MoE (any router value gives it weight 1)
    single = e("CastLike", e("ConstantOfShape", e("Concat", e("Shape", x, end=1), e.const([1]), axis=0)), x)
    shared = e("MoE", x, single, _interleave(e, e("Unsqueeze", s13, e.const([0]))), None,
               e("Unsqueeze", s2, e.const([0])), domain=MS, k=1, **swiglu)
    scaled = e("Mul", routed, e("CastLike", e.const(float(a["routed_scaling_factor"]), np.float32), x))
    graph.nodes.append(e.gs.Node("Add", f"{e.prefix}/out", {}, [scaled, shared], [y]))
    node.outputs.clear()


def _lower_mxfp8_linear(graph, node) -> bool:
    x, weight, scale = node.inputs
    if x.dtype is not None and np.dtype(x.dtype) == np.float32:
        return False  # the ORT op takes fp16 / bf16 activations only
    (y,) = node.outputs
    e = _Emit(graph, node.name or "mxfp8_linear")
    f32 = onnx.TensorProto.FLOAT
    b_scale = e("Pow", e.const(2.0, np.float32), e("Sub", e("Cast", scale, to=f32), e.const(127.0, np.float32)))
    graph.nodes.append(e.gs.Node("MatMulBlockQuantizedFp8Weight", f"{e.prefix}/ms", {"block_size": 32},
                                 [x, weight, b_scale], [y], domain=MS))
    node.outputs.clear()
    return True


def lower(model: onnx.ModelProto, ops: tuple[str, ...] = LOWERABLE) -> tuple[onnx.ModelProto, dict[str, int]]:
    """``model`` with its ``m3`` nodes of the given op types lowered (see the module docstring); returns the new
    model and how many nodes of each op type were lowered. Functions no node uses any more are dropped."""
    gs = _gs()
    unknown = sorted(set(ops) - set(LOWERABLE))
    if unknown:
        raise ValueError(f"cannot lower {unknown}: lowerable m3 ops are {list(LOWERABLE)}")
    graph = gs.import_onnx(model)
    done = dict.fromkeys(ops, 0)
    for node in list(graph.nodes):
        if node.domain != "m3" or node.op not in ops:
            continue
        if node.op == "MoE":
            _lower_moe(graph, node)
            done["MoE"] += 1
        elif node.op == "MXFP8Linear" and _lower_mxfp8_linear(graph, node):
            done["MXFP8Linear"] += 1
    graph.cleanup().toposort()
    out = gs.export_onnx(graph)
    used = {(n.domain, n.op_type) for n in out.graph.node}
    kept = [f for f in model.functions if (f.domain, f.name) in used]
    del out.functions[:]
    out.functions.extend(kept)
    del out.opset_import[:]
    out.opset_import.extend(model.opset_import)
    if any(n.domain == MS for n in out.graph.node):
        out.opset_import.append(onnx.helper.make_opsetid(MS, 1))
    out.ir_version = model.ir_version
    return out, done


FLAVOUR = "ort-contrib"
STATUS = "experimental: unverified on GPU (kept only once the H200 shows it matches the reference)"


def flavour_file(graph: str) -> str:
    return f"{graph}.ort.onnx"


def write_flavour_files(directory: Path, graphs: dict, ops: tuple[str, ...] = LOWERABLE) -> dict:
    """Write ``<graph>.ort.onnx`` (the graph lowered by :func:`lower`) beside each graph file of ``graphs`` (name ->
    manifest ``GraphInfo``; not the vision graph) in ``directory``, where the external data resolves. Inputs and
    outputs are the graph's own, so the manifest's signatures describe the flavour too. Returns the manifest's
    ``flavours["ort-contrib"]`` record: per graph, the file, its source and how many nodes of each op were
    lowered."""
    directory = Path(directory)
    record = {}
    for name in (g for g in graphs if g != "vision"):
        src = directory / graphs[name].file
        lowered, done = lower(onnx.load(str(src), load_external_data=False), ops)
        file = flavour_file(name)
        (directory / file).write_bytes(lowered.SerializeToString(deterministic=True))
        record[name] = {"file": file, "source": src.name, "lowered": done, "status": STATUS}
    return record
