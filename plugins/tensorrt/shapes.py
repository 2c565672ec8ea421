"""Output shapes and types of every TensorRT plugin, as plain functions that need neither TensorRT nor torch.

TensorRT asks a plugin for its outputs' shapes as symbolic expressions of its inputs' dimensions
(``tensorrt.plugin.ShapeExpr``, which supports ``+ - * //``), and for their types given the inputs' types. The
functions here take dimensions as anything with that arithmetic (Python ints in the tests, ``ShapeExpr`` under
TensorRT), so the logic that ``plugins.py`` hands TensorRT is the logic the CPU tests check against the reference
ops' outputs. Type names are ``m3export.dtypes`` names (``float32``, ``bfloat16``, ``int32`` ...).

Two kinds of plugin exist (``plugins/tensorrt/__init__.py`` and ``steps.py`` say why):

* one per op of ``docs/ops.md`` (``OP_PLUGINS``), whose node the TensorRT flavour of a graph keeps as it is, and
* the kernel steps an op is cut into when it needs more than one kernel launch (``STEP_PLUGINS``): an AOT plugin
  launches exactly one kernel, so ``LightningIndexer`` becomes ``LightningIndexerScan`` (per-block maxima) then
  ``LightningIndexerTopK``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

FLOATS = ("float32", "float16", "bfloat16")
E4M3, UE8M0 = "float8_e4m3fn", "uint8"

Shape = tuple  # of ints or symbolic dimension expressions


class PluginShapeError(ValueError):
    """An input of a plugin node has a shape or type the op's contract does not allow; the message names it."""


def cdiv(a: Any, b: Any) -> Any:
    """ceil(a / b) with only ``+ - //`` (what TensorRT's symbolic dimensions offer)."""
    return (a + b - 1) // b


@dataclass(frozen=True)
class TensorInfo:
    """One plugin input or output: dimensions (ints or symbolic expressions) and a dtype name."""

    shape: Shape
    dtype: str

    @property
    def rank(self) -> int:
        return len(self.shape)


def _known(d: Any) -> int | None:
    """The value of a dimension when it is a plain int (symbolic TensorRT expressions are checked at run time)."""
    return d if isinstance(d, int) else None


def _need(op: str, name: str, t: TensorInfo, rank: int | None = None, dtypes: Sequence[str] | None = None) -> None:
    if rank is not None and t.rank != rank:
        raise PluginShapeError(f"{op}: input {name} has rank {t.rank} (shape {tuple(t.shape)}), expected {rank}")
    if dtypes is not None and t.dtype not in dtypes:
        raise PluginShapeError(f"{op}: input {name} is {t.dtype}, expected one of {tuple(dtypes)}")


def _same(op: str, what: str, a: Any, b: Any) -> None:
    if _known(a) is not None and _known(b) is not None and a != b:
        raise PluginShapeError(f"{op}: {what} differ ({a} vs {b})")


def _paged(op: str, block_tables: TensorInfo, qsl: TensorInfo, seq_lens: TensorInfo | None,
           positions: TensorInfo) -> None:
    _need(op, "block_tables", block_tables, 2, ("int32",))
    _need(op, "query_start_loc", qsl, 1, ("int32",))
    if seq_lens is not None:
        _need(op, "seq_lens", seq_lens, 1, ("int32",))
    _need(op, "positions", positions, 1, ("int64",))


# --------------------------------------------------------------------------------------------- the op plugins
def lightning_indexer(index_q: TensorInfo, index_k_cache: TensorInfo, block_tables: TensorInfo,
                      query_start_loc: TensorInfo, seq_lens: TensorInfo, positions: TensorInfo, *, block_size: int,
                      topk_blocks: int, local_blocks: int, init_blocks: int) -> list[TensorInfo]:
    op = "LightningIndexer"
    _need(op, "index_q", index_q, 3, FLOATS)
    _need(op, "index_k_cache", index_k_cache, 3, (index_q.dtype,))
    _same(op, "index_q and index_k_cache head dims", index_q.shape[2], index_k_cache.shape[2])
    _paged(op, block_tables, query_start_loc, seq_lens, positions)
    _attrs(op, block_size=block_size, topk_blocks=topk_blocks, local_blocks=local_blocks, init_blocks=init_blocks)
    return [TensorInfo((index_q.shape[0], index_q.shape[1], topk_blocks), "int32")]


def paged_attention(q: TensorInfo, k_cache: TensorInfo, v_cache: TensorInfo, block_tables: TensorInfo,
                    query_start_loc: TensorInfo, seq_lens: TensorInfo, positions: TensorInfo, *, scale: float
                    ) -> list[TensorInfo]:
    _attention("PagedAttention", q, k_cache, v_cache)
    _paged("PagedAttention", block_tables, query_start_loc, seq_lens, positions)
    return [TensorInfo((q.shape[0], q.shape[1], v_cache.shape[3]), q.dtype)]


def sparse_paged_attention(q: TensorInfo, k_cache: TensorInfo, v_cache: TensorInfo, block_tables: TensorInfo,
                           query_start_loc: TensorInfo, seq_lens: TensorInfo, positions: TensorInfo,
                           block_idx: TensorInfo, *, block_size: int, scale: float) -> list[TensorInfo]:
    op = "SparsePagedAttention"
    _attention(op, q, k_cache, v_cache)
    _paged(op, block_tables, query_start_loc, seq_lens, positions)
    _need(op, "block_idx", block_idx, 3, ("int32",))
    _same(op, "block_idx tokens and q tokens", block_idx.shape[0], q.shape[0])
    _same(op, "block_idx groups and KV heads", block_idx.shape[1], k_cache.shape[2])
    _attrs(op, block_size=block_size)
    return [TensorInfo((q.shape[0], q.shape[1], v_cache.shape[3]), q.dtype)]


def moe(x: TensorInfo, router_weight: TensorInfo, e_score_correction_bias: TensorInfo, w13: TensorInfo,
        w2: TensorInfo, shared_w13: TensorInfo, shared_w2: TensorInfo, *, top_k: int, routed_scaling_factor: float,
        swiglu_alpha: float, swiglu_limit: float) -> list[TensorInfo]:
    op = "MoE"
    _moe(op, x, router_weight, e_score_correction_bias, w13, w2, shared_w13, shared_w2, top_k, FLOATS)
    return [TensorInfo(tuple(x.shape), x.dtype)]


def moe_mxfp8(x: TensorInfo, router_weight: TensorInfo, e_score_correction_bias: TensorInfo, w13: TensorInfo,
              w13_scale: TensorInfo, w2: TensorInfo, w2_scale: TensorInfo, shared_w13: TensorInfo,
              shared_w13_scale: TensorInfo, shared_w2: TensorInfo, shared_w2_scale: TensorInfo, *, top_k: int,
              routed_scaling_factor: float, swiglu_alpha: float, swiglu_limit: float) -> list[TensorInfo]:
    op = "MoEMXFP8"
    _moe(op, x, router_weight, e_score_correction_bias, w13, w2, shared_w13, shared_w2, top_k, (E4M3,))
    for name, w, s in (("w13_scale", w13, w13_scale), ("w2_scale", w2, w2_scale),
                       ("shared_w13_scale", shared_w13, shared_w13_scale), ("shared_w2_scale", shared_w2,
                                                                            shared_w2_scale)):
        _scale(op, name, w, s)
    return [TensorInfo(tuple(x.shape), x.dtype)]


def mxfp8_linear(x: TensorInfo, weight: TensorInfo, weight_scale: TensorInfo) -> list[TensorInfo]:
    op = "MXFP8Linear"
    if x.rank < 1:
        raise PluginShapeError(f"{op}: input x must have at least one dimension")
    _need(op, "x", x, None, FLOATS)
    _need(op, "weight", weight, 2, (E4M3,))
    _same(op, "x features and weight columns", x.shape[-1], weight.shape[1])
    _scale(op, "weight_scale", weight, weight_scale)
    return [TensorInfo((*x.shape[:-1], weight.shape[0]), x.dtype)]


# ------------------------------------------------------------------------------------------ the kernel steps
def lightning_indexer_scan(index_q: TensorInfo, index_k_cache: TensorInfo, block_tables: TensorInfo,
                           query_start_loc: TensorInfo, positions: TensorInfo, *, block_size: int
                           ) -> list[TensorInfo]:
    """Step 1 of LightningIndexer: fp32 causal block maxima ``[T, H, NB]``, NB = ceil(max_pages * page / block)
    (every block any sequence of the batch can have; blocks after a token's own are left unwritten)."""
    op = "LightningIndexerScan"
    _need(op, "index_q", index_q, 3, FLOATS)
    _need(op, "index_k_cache", index_k_cache, 3, (index_q.dtype,))
    _paged(op, block_tables, query_start_loc, None, positions)
    _attrs(op, block_size=block_size)
    nb = cdiv(block_tables.shape[1] * index_k_cache.shape[1], block_size)
    return [TensorInfo((index_q.shape[0], index_q.shape[1], nb), "float32")]


def lightning_indexer_topk(scores: TensorInfo, positions: TensorInfo, *, block_size: int, topk_blocks: int,
                           local_blocks: int, init_blocks: int, max_blocks: int) -> list[TensorInfo]:
    """Step 2: the ordered top-k of step 1's maxima, exactly docs/ops.md §2 (forced first, ties to lower ids).
    ``max_blocks`` bounds NB at build time (the kernel's block axis is a compile-time size)."""
    op = "LightningIndexerTopK"
    _need(op, "scores", scores, 3, ("float32",))
    _need(op, "positions", positions, 1, ("int64",))
    _attrs(op, block_size=block_size, topk_blocks=topk_blocks, local_blocks=local_blocks, init_blocks=init_blocks,
           max_blocks=max_blocks)
    if _known(scores.shape[2]) is not None and scores.shape[2] > max_blocks:
        raise PluginShapeError(f"{op}: scores hold {scores.shape[2]} blocks, more than max_blocks={max_blocks}")
    return [TensorInfo((scores.shape[0], scores.shape[1], topk_blocks), "int32")]


# ---------------------------------------------------------------------------------- MoE kernel steps (GEMV)
def moe_route(logits: TensorInfo, bias: TensorInfo, *, top_k: int) -> list[TensorInfo]:
    """Step 1 of MoE: sigmoid scores, top-k of scores + bias (ties to the lower id), renormalised weights."""
    op = "MoERoute"
    _need(op, "router_logits", logits, 2, ("float32",))
    _need(op, "e_score_correction_bias", bias, 1, FLOATS)
    _same(op, "router_logits experts and bias length", logits.shape[1], bias.shape[0])
    _attrs(op, top_k=top_k)
    t = logits.shape[0]
    return [TensorInfo((t, top_k), "int32"), TensorInfo((t, top_k), "float32")]


def _moe_weight(op: str, name: str, w: TensorInfo, scale: TensorInfo | None, rank: int) -> None:
    _need(op, name, w, rank, (E4M3,) if scale is not None else FLOATS)
    if scale is not None:
        _scale(op, f"{name}_scale", w, scale)


def moe_gate_up(x: TensorInfo, w13: TensorInfo, *rest: TensorInfo, top_k: int, swiglu_alpha: float,
                swiglu_limit: float) -> list[TensorInfo]:
    """Routed experts' SwiGLU-OAI activations, one row per (token, slot): ``[T * top_k, I]``. ``rest`` is
    (ids,) or (w13_scale, ids)."""
    scale, ids = (rest[0], rest[1]) if len(rest) == 2 else (None, rest[0])
    op = "MoEGateUp" + ("MXFP8" if scale is not None else "")
    _need(op, "x", x, 2, FLOATS)
    _moe_weight(op, "w13", w13, scale, 3)
    _need(op, "expert_ids", ids, 2, ("int32",))
    _same(op, "x hidden and w13 columns", x.shape[1], w13.shape[2])
    _attrs(op, top_k=top_k)
    return [TensorInfo((x.shape[0] * top_k, w13.shape[1] // 2), x.dtype)]


def moe_shared_gate_up(x: TensorInfo, w13: TensorInfo, *rest: TensorInfo, swiglu_alpha: float,
                       swiglu_limit: float) -> list[TensorInfo]:
    scale = rest[0] if rest else None
    op = "MoESharedGateUp" + ("MXFP8" if scale is not None else "")
    _need(op, "x", x, 2, FLOATS)
    _moe_weight(op, "shared_w13", w13, scale, 2)
    _same(op, "x hidden and shared_w13 columns", x.shape[1], w13.shape[1])
    return [TensorInfo((x.shape[0], w13.shape[0] // 2), x.dtype)]


def moe_down(act: TensorInfo, w2: TensorInfo, *rest: TensorInfo, top_k: int) -> list[TensorInfo]:
    """Routed experts' outputs times their routing weights into slots 0..top_k-1 of ``y [T, top_k + 1, H]`` (the
    last slot is the shared expert's). ``rest`` is (ids, weights) or (w2_scale, ids, weights)."""
    scale, ids, weights = (rest[0], rest[1], rest[2]) if len(rest) == 3 else (None, rest[0], rest[1])
    op = "MoEDown" + ("MXFP8" if scale is not None else "")
    _need(op, "act", act, 2, FLOATS)
    _moe_weight(op, "w2", w2, scale, 3)
    _need(op, "expert_ids", ids, 2, ("int32",))
    _need(op, "expert_weights", weights, 2, ("float32",))
    _same(op, "act columns and w2 columns", act.shape[1], w2.shape[2])
    _attrs(op, top_k=top_k)
    return [TensorInfo((ids.shape[0], top_k + 1, w2.shape[1]), act.dtype)]


def moe_shared_down(act: TensorInfo, w2: TensorInfo, *rest: TensorInfo, top_k: int) -> list[TensorInfo]:
    """The shared expert's output into the last slot of ``y``, in place (the output aliases input ``y``)."""
    scale, y = (rest[0], rest[1]) if len(rest) == 2 else (None, rest[0])
    op = "MoESharedDown" + ("MXFP8" if scale is not None else "")
    _need(op, "act", act, 2, FLOATS)
    _moe_weight(op, "shared_w2", w2, scale, 2)
    _need(op, "y", y, 3, (act.dtype,))
    _same(op, "act columns and shared_w2 columns", act.shape[1], w2.shape[1])
    _attrs(op, top_k=top_k)
    return [TensorInfo(tuple(y.shape), y.dtype)]


def moe_combine(y: TensorInfo, *, top_k: int, routed_scaling_factor: float) -> list[TensorInfo]:
    op = "MoECombine"
    _need(op, "y", y, 3, FLOATS)
    _attrs(op, top_k=top_k)
    return [TensorInfo((y.shape[0], y.shape[2]), y.dtype)]


# ------------------------------------------------------------------------------------------------- helpers
def _attrs(op: str, **values: int) -> None:
    for name, v in values.items():
        positive = name in ("block_size", "topk_blocks", "max_blocks")
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if positive else 0):
            raise PluginShapeError(f"{op}: attribute {name}={v!r} must be an integer >= {1 if positive else 0}")


def _attention(op: str, q: TensorInfo, k: TensorInfo, v: TensorInfo) -> None:
    _need(op, "q", q, 3, FLOATS)
    _need(op, "k_cache", k, 4, (q.dtype,))
    _need(op, "v_cache", v, 4, (q.dtype,))
    _same(op, "q and k_cache head dims", q.shape[2], k.shape[3])
    for i, what in ((0, "pages"), (1, "page sizes"), (2, "KV heads")):
        _same(op, f"k_cache and v_cache {what}", k.shape[i], v.shape[i])
    hq, hkv = _known(q.shape[1]), _known(k.shape[2])
    if hq is not None and hkv is not None and (hkv == 0 or hq % hkv):
        raise PluginShapeError(f"{op}: {hq} query heads are not a multiple of {hkv} KV heads")


def _moe(op, x, router, bias, w13, w2, sw13, sw2, top_k, weight_types) -> None:
    _need(op, "x", x, 2, FLOATS)
    _need(op, "router_weight", router, 2, FLOATS)
    _need(op, "e_score_correction_bias", bias, 1, FLOATS)
    _need(op, "w13", w13, 3, weight_types)
    _need(op, "w2", w2, 3, weight_types)
    _need(op, "shared_w13", sw13, 2, weight_types)
    _need(op, "shared_w2", sw2, 2, weight_types)
    h, e = x.shape[1], router.shape[0]
    _same(op, "x hidden and router_weight columns", h, router.shape[1])
    _same(op, "router experts and bias length", e, bias.shape[0])
    _same(op, "router experts and w13 experts", e, w13.shape[0])
    _same(op, "w13 and w2 experts", w13.shape[0], w2.shape[0])
    _same(op, "x hidden and w13 columns", h, w13.shape[2])
    _same(op, "x hidden and w2 rows", h, w2.shape[1])
    _same(op, "w13 rows and 2 x w2 columns", w13.shape[1], 2 * w2.shape[2] if _known(w2.shape[2]) else w13.shape[1])
    _same(op, "shared_w13 rows and 2 x shared_w2 columns", sw13.shape[0],
          2 * sw2.shape[1] if _known(sw2.shape[1]) else sw13.shape[0])
    _same(op, "x hidden and shared_w2 rows", h, sw2.shape[0])
    _attrs(op, top_k=top_k)
    if top_k < 1 or (_known(e) is not None and top_k > e):
        raise PluginShapeError(f"{op}: top_k={top_k} must be in [1, num_experts={e}]")


def _scale(op: str, name: str, w: TensorInfo, s: TensorInfo) -> None:
    _need(op, name, s, w.rank, (UE8M0,))
    k = _known(w.shape[-1])
    if k is not None and k % 32:
        raise PluginShapeError(f"{op}: {name[:-6] or 'weight'} has K={k}, not a multiple of 32")
    want = (*w.shape[:-1], w.shape[-1] // 32)
    for a, b in zip(s.shape, want):
        _same(op, f"{name} shape {tuple(s.shape)} and {tuple(want)}", a, b)


@dataclass(frozen=True)
class PluginDef:
    """One plugin: its name (the ONNX op type and TensorRT plugin name), its inputs, attributes and outputs."""

    name: str
    inputs: tuple[str, ...]
    attributes: tuple[str, ...]
    outputs: tuple[str, ...]
    shapes: Callable[..., list[TensorInfo]]
    aliases: tuple[tuple[int, int], ...] = ()  # (output, input) pairs written in place (TensorRT: aliased())

    def infer(self, inputs: Sequence[TensorInfo], attrs: dict) -> list[TensorInfo]:
        if len(inputs) != len(self.inputs):
            raise PluginShapeError(f"{self.name}: {len(inputs)} inputs, expected {len(self.inputs)} "
                                   f"({', '.join(self.inputs)})")
        missing = [a for a in self.attributes if a not in attrs]
        if missing:
            raise PluginShapeError(f"{self.name}: missing attributes {missing}")
        return self.shapes(*inputs, **{a: attrs[a] for a in self.attributes})


_PAGED_IN = ("block_tables", "query_start_loc", "seq_lens", "positions")
_MOE_ATTRS = ("top_k", "routed_scaling_factor", "swiglu_alpha", "swiglu_limit")

OP_PLUGINS: dict[str, PluginDef] = {p.name: p for p in (
    PluginDef("LightningIndexer", ("index_q", "index_k_cache", *_PAGED_IN),
              ("block_size", "topk_blocks", "local_blocks", "init_blocks"), ("selected_blocks",), lightning_indexer),
    PluginDef("PagedAttention", ("q", "k_cache", "v_cache", *_PAGED_IN), ("scale",), ("out",), paged_attention),
    PluginDef("SparsePagedAttention", ("q", "k_cache", "v_cache", *_PAGED_IN, "block_idx"), ("block_size", "scale"),
              ("out",), sparse_paged_attention),
    PluginDef("MoE", ("x", "router_weight", "e_score_correction_bias", "w13", "w2", "shared_w13", "shared_w2"),
              _MOE_ATTRS, ("y",), moe),
    PluginDef("MoEMXFP8", ("x", "router_weight", "e_score_correction_bias", "w13", "w13_scale", "w2", "w2_scale",
                           "shared_w13", "shared_w13_scale", "shared_w2", "shared_w2_scale"), _MOE_ATTRS, ("y",),
              moe_mxfp8),
    PluginDef("MXFP8Linear", ("x", "weight", "weight_scale"), (), ("y",), mxfp8_linear),
)}

STEP_PLUGINS: dict[str, PluginDef] = {p.name: p for p in (
    PluginDef("LightningIndexerScan", ("index_q", "index_k_cache", "block_tables", "query_start_loc", "positions"),
              ("block_size",), ("block_scores",), lightning_indexer_scan),
    PluginDef("LightningIndexerTopK", ("block_scores", "positions"),
              ("block_size", "topk_blocks", "local_blocks", "init_blocks", "max_blocks"), ("selected_blocks",),
              lightning_indexer_topk),
    PluginDef("MoERoute", ("router_logits", "e_score_correction_bias"), ("top_k",), ("expert_ids", "expert_weights"),
              moe_route),
    PluginDef("MoECombine", ("y",), ("top_k", "routed_scaling_factor"), ("out",), moe_combine),
    *(PluginDef(f"MoEGateUp{mx}", ("x", "w13", *(("w13_scale",) if mx else ()), "expert_ids"),
                ("top_k", "swiglu_alpha", "swiglu_limit"), ("act",), moe_gate_up) for mx in ("", "MXFP8")),
    *(PluginDef(f"MoESharedGateUp{mx}", ("x", "shared_w13", *(("shared_w13_scale",) if mx else ())),
                ("swiglu_alpha", "swiglu_limit"), ("act",), moe_shared_gate_up) for mx in ("", "MXFP8")),
    *(PluginDef(f"MoEDown{mx}", ("act", "w2", *(("w2_scale",) if mx else ()), "expert_ids", "expert_weights"),
                ("top_k",), ("y",), moe_down) for mx in ("", "MXFP8")),
    *(PluginDef(f"MoESharedDown{mx}", ("act", "shared_w2", *(("shared_w2_scale",) if mx else ()), "y"),
                ("top_k",), ("y_out",), moe_shared_down, aliases=((0, 3 if mx else 2),)) for mx in ("", "MXFP8")),
)}

PLUGINS: dict[str, PluginDef] = {**OP_PLUGINS, **STEP_PLUGINS}


class Symbol:
    """A named dimension that records the arithmetic done on it: the formula TensorRT's ShapeExpr would hold.
    Used to describe a plugin's symbolic extents (grids, extra arguments, output shapes) in reports and manifests
    and to check that the shape logic uses nothing but ``+ - * //``."""

    def __init__(self, text: str):
        self.text = text

    def _op(self, other: Any, sym: str, swap: bool = False) -> "Symbol":
        o = other.text if isinstance(other, Symbol) else str(other)
        return Symbol(f"({o}{sym}{self.text})" if swap else f"({self.text}{sym}{o})")

    def __add__(self, o): return self._op(o, "+")  # noqa: E704
    def __radd__(self, o): return self._op(o, "+", True)  # noqa: E704
    def __sub__(self, o): return self._op(o, "-")  # noqa: E704
    def __rsub__(self, o): return self._op(o, "-", True)  # noqa: E704
    def __mul__(self, o): return self._op(o, "*")  # noqa: E704
    def __rmul__(self, o): return self._op(o, "*", True)  # noqa: E704
    def __floordiv__(self, o): return self._op(o, "//")  # noqa: E704
    def __rfloordiv__(self, o): return self._op(o, "//", True)  # noqa: E704

    def __repr__(self) -> str:
        return self.text


def describe(value: Any) -> Any:
    """A Symbol or int (or a tuple of them) as JSON: formulas as strings, ints as ints."""
    if isinstance(value, (tuple, list)):
        return [describe(v) for v in value]
    return value.text if isinstance(value, Symbol) else value
