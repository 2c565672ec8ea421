"""ONNX function bodies for every ``m3`` op, built from standard ops (the portable fallback).

A model that carries these ``FunctionProto``s runs on any ONNX runtime: ONNX Runtime inlines the body of a node
whose (domain, name) matches a model-local function. The bodies follow the reference implementations in
``m3export.ops`` step by step (same fp32 accumulation points, same tie-breaking), and cost what the op costs
where standard ops allow it:

* sparse attention gathers only the selected blocks, per sequence and KV head ``[B, Hkv, N * block_size, ...]``
  (N: most blocks one sequence's tokens select), flat in context for decode, no more than dense for a prefill;
* the indexer and dense attention read each sequence's context once per step (``SequenceLayout``), not once
  per token;
* the MoE runs a ``Scan`` over experts, each step computing only the tokens routed to that expert.

The cache readers come in two forms, chosen per artifact (``kv_fp8``): float pools, or FP8 pools carried as
uint8 E4M3 codes with their fp32 scale pools as the trailing optional inputs, decoded right after the gather
(``kv_fp8_onnx.decode_rows``: exactly ``m3export/ops/kv_fp8.dequantize_rows``).

Fast paths (Triton kernels, TensorRT plugins) replace the node, never the semantics. See docs/ops.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import FunctionProto, TensorProto, helper

from ..ops import DOMAIN
from .kv_fp8_onnx import decode_rows
from .onnx_builder import Builder, Ref
from .schemas import FLOAT, INT, ONNX_OPSET, SPEC_BY_NAME

I64 = TensorProto.INT64
F32 = TensorProto.FLOAT
INF = float("inf")
# What a ``TopK`` input holds where there is nothing to rank (a block no key of the token can see, a list slot no
# block fills): finite and above float32's lowest value, never -inf. ONNX Runtime's CUDA ``TopK`` (its bitonic
# path, axes up to 256 wide) pads the axis to a power of two with ``lowest()`` = -3.40e38 at ids past the axis,
# and that padding outranks a real -inf: a top k reaching into -inf entries came back with padding ids (>= the
# axis length) and values -3.40e38 (the H200: 85 % of the tiny model's selections, 54 % of `mini`'s, equal to
# the reference). With this value the real entries outrank the padding, and ``_unranked`` catches both.
NOTHING = -3.0e38


def _unranked(b: Builder, values: str) -> str:
    """Which top-k slots hold no ranked entry: ``NOTHING`` or a provider's padding below it."""
    return b.LessOrEqual(values, b.const(NOTHING, np.float32))


# ---------------------------------------------------------------------------------------------- shared pieces
def _dim(b: Builder, x: str, axis: int) -> str:
    """Size of one axis as a rank-0 int64."""
    return b.Squeeze(b.Shape(x, start=axis, end=axis + 1), b.const([0]))


# Ranks of the cache readers' pool inputs (docs/ops.md §2-4): [pages, page_size, (Hkv,) D], scales one axis less.
POOL_RANKS = {"k_cache": 4, "v_cache": 4, "index_k_cache": 3, "k_scale": 3, "v_scale": 3, "index_k_scale": 2}


def _page_rows(b: Builder, pool: str, axes: int) -> str:
    """``pool`` with its first ``axes`` axes merged into one, the rest kept: the rows a gather indexes. With the
    rank known from the input's name (``POOL_RANKS``), a pool with one trailing axis takes a ``Flatten`` and one
    with none a ``Reshape`` to ``[-1]``: no ``Shape`` / ``Concat`` per pool and layer (ONNX Runtime does not fold a
    pool's static trailing dims, its page count being dynamic)."""
    rank = POOL_RANKS[pool]
    if rank == axes + 1:
        return b.Flatten(pool, axis=axes)
    if rank == axes:
        return b.Reshape(pool, b.const([-1]))
    return b.Reshape(pool, b.Concat(b.const([-1]), b.Shape(pool, start=axes), axis=0))


def _vec(b: Builder, scalar: str) -> str:
    return b.Reshape(scalar, b.const([1]))


def _swiglu(b: Builder, gate_up: str, alpha: str, limit: str, axis: int = -1) -> str:
    """Uninterleaved SwiGLU-OAI with clamp, in gate_up's dtype (as m3export.ops.moe.swiglu_oai); ``axis``: the
    gate / up halves' axis (the feature axis).

    The clamp runs in fp32 on exact casts (the value or the bound comes back, both of gate_up's dtype): ONNX
    Runtime has no bfloat16 ``Clip`` kernel on the CUDA or CPU EP, and the ``Less`` its function body expands to
    has none either, so a bf16 ``Clip`` made the step graph unloadable (tests/test_ort_cuda_kernel_types.py)."""
    gate, up = b.Split(gate_up, axis=axis, num_outputs=2, n_out=2)
    limit = b.CastLike(limit, gate_up)
    bound = b.Cast(limit, to=F32)  # gate_up's rounding of the limit, as before

    def clamp(x: str, low: str | None) -> str:
        return b.CastLike(b.Clip(b.Cast(x, to=F32), low, bound), gate_up)

    gate = clamp(gate, None)
    up = clamp(up, b.Neg(bound))
    sig = b.Mul(gate, b.Sigmoid(b.Mul(gate, b.CastLike(alpha, gate_up))))
    return b.Mul(b.Add(up, b.CastLike(b.const(1.0, np.float32), gate_up)), sig)


def _linear(b: Builder, x: str, w: str) -> str:
    """``x @ w^T`` for a 2-D weight ``w`` [N, K] as it lies (``Gemm`` with ``transB``): a ``Transpose`` of a weight
    initializer is folded by ONNX Runtime into a transposed copy of its own in every session (so the weight is held
    twice and no session can share it), and one of a computed weight is a copy per step."""
    return b.Gemm(x, w, transB=1)


def _dequant(b: Builder, weight: str, scale: str) -> str:
    """E4M3 [..., N, K] and UE8M0 [..., N, K/32] -> fp32 W = w * 2^(s - 127) (exact)."""
    blocks = b.Concat(b.Shape(scale), b.const([32]), axis=0)
    exps = b.Sub(b.Cast(scale, to=F32), b.const(127.0, np.float32))
    factor = b.Unsqueeze(b.Pow(b.const(2.0, np.float32), exps), b.const([-1]))
    flat = b.Concat(b.Shape(scale, end=-1), b.const([-1]), axis=0)  # (ORT has no Shape kernel for fp8 inputs)
    return b.Reshape(b.Mul(b.Reshape(b.Cast(weight, to=F32), blocks), factor), flat)


def _function(name: str, b: Builder, outputs: list[str], kv_fp8: bool = False) -> FunctionProto:
    """The body's FunctionProto; without ``kv_fp8`` it declares no scale inputs (a float-pool body reads none)."""
    spec = SPEC_BY_NAME[name]
    renamed = dict(zip(outputs, (p.name for p in spec.outputs)))
    for node in b.nodes:
        node.output[:] = [renamed.get(o, o) for o in node.output]
    inputs = [p.name for p in (*spec.inputs, *(spec.optional_inputs if kv_fp8 else ()))]
    return helper.make_function(
        DOMAIN, name, inputs, [p.name for p in spec.outputs], b.nodes,
        [helper.make_opsetid("", ONNX_OPSET)], attributes=[a.name for a in spec.attributes], doc_string=spec.doc,
    )


# ---------------------------------------------------------------------------------------------- indexer
class TokenGroups:
    """Tokens regrouped by sequence: ``seq[t]`` is token t's sequence and ``col[t]`` its rank among that sequence's
    new tokens; a ``[T, ...]`` tensor gathered to ``[B, Tmax, ...]`` (Tmax = most new tokens of one sequence) can
    then meet a ``[B, ...]`` one in a batched MatMul, and ``GatherND`` with ``index`` brings the ``[B, Tmax, ...]``
    result back to tokens. Padded rows compute on zeros and are dropped: the waste is ``B * Tmax - T`` rows, none
    for pure decode or uniform verify batches and for a lone prefill.

    The regrouping is a ``Gather`` of the tensor with one zero row appended by ``rows`` ``[B, Tmax]`` (token ids, T
    for padding), which depends on the step's inputs only: ONNX Runtime computes it once per step for every layer.
    No per-layer shape mixes ``Tmax`` (a value read from the device) with a layer's own ``Shape``: on a GPU
    provider each such shape was a host <-> device copy pair per use and layer (the H200 profile's 31 + 30)."""

    def __init__(self, b: Builder, query_start_loc: str, positions: str, seq_lens: str):
        self.b = b
        qsl = b.Cast(query_start_loc, to=I64)
        starts = b.Slice(qsl, b.const([0]), b.const([-1]))
        ends = b.Slice(qsl, b.const([1]), b.const([np.iinfo(np.int64).max]))
        num_tokens = _dim(b, positions, 0)
        tokens = b.Range(b.const(0), num_tokens, b.const(1))
        started = b.LessOrEqual(b.Unsqueeze(ends, b.const([0])), b.Unsqueeze(tokens, b.const([1])))  # [T, B]
        self.seq = b.ReduceSum(b.Cast(started, to=I64), b.const([1]), keepdims=0)  # [T]
        col = b.Sub(tokens, b.Gather(starts, self.seq, axis=0))
        self.index = b.Concat(b.Unsqueeze(self.seq, b.const([1])), b.Unsqueeze(col, b.const([1])), axis=1)  # [T, 2]
        self.num_seqs = _dim(b, seq_lens, 0)
        lengths = b.Sub(ends, starts)  # [B] new tokens per sequence
        self.tmax = b.ReduceMax(lengths, keepdims=0)
        cols = b.Unsqueeze(b.Range(b.const(0), self.tmax, b.const(1)), b.const([0]))  # [1, Tmax]
        self.rows = b.Where(b.Less(cols, b.Unsqueeze(lengths, b.const([1]))),
                            b.Add(b.Unsqueeze(starts, b.const([1])), cols), num_tokens)  # [B, Tmax]; T: padding

    def padded(self, x: str, rank: int = 3) -> str:
        """[T, *rest] (``rank`` axes; a float type ONNX Runtime's CUDA ``Pad`` takes) -> [B, Tmax, *rest], zeros
        where a sequence has fewer new tokens."""
        b = self.b
        with_zero_row = b.Pad(x, b.const([0] * rank + [1] + [0] * (rank - 1)), b.CastLike(b.const(0.0, np.float32), x))
        return b.Gather(with_zero_row, self.rows, axis=0)

    def positions(self, positions: str) -> str:
        """[B, Tmax] positions of the regrouped tokens, -1 on padding rows."""
        b = self.b
        return b.Gather(b.Concat(positions, b.const([-1]), axis=0), self.rows, axis=0)


class SequenceLayout(TokenGroups):
    """``TokenGroups`` plus every sequence's context, so that per-sequence data (an index-key context) is read once
    per step: ``gather`` gives ``[B, L, ...]``, L = max(positions) + 1."""

    def __init__(self, b: Builder, block_tables: str, query_start_loc: str, seq_lens: str, positions: str,
                 pool: str):
        super().__init__(b, query_start_loc, positions, seq_lens)
        # Keys 0 .. L-1 of every sequence, L = max(positions) + 1
        self.length = b.Add(b.ReduceMax(positions, keepdims=0), b.const(1))
        self.key_pos, self.slots, self.visible = _contexts(b, block_tables, seq_lens, positions, self.length,
                                                           _dim(b, pool, 1))

    def gather(self, pool: str, scale: str | None = None) -> str:
        """pool [pages, page, *rest] -> fp32 [B, L, *rest]: every sequence's context, read once. With ``scale``
        (the pool's [pages, page, *rest[:-1]] fp32 scales) the pool holds uint8 E4M3 codes, decoded after the
        gather."""
        return _gather_slots(self.b, self.slots, pool, scale)

    def num_blocks(self, block_size: str) -> str:
        b = self.b
        return b.Div(b.Add(self.length, b.Sub(block_size, b.const(1))), block_size)


@dataclass(frozen=True)
class DecodeSizes:
    """The artifact's static sizes a decode-only body is built with: as constants they cost nothing on any
    provider, where a size read from a pool's ``Shape`` (which ONNX Runtime does not fold: the page count is
    dynamic) and used as data is a host -> device copy per use and layer on a GPU provider. ``moe``: the MoE's
    routed sum, ``per-assignment`` (each token's top_k experts gathered: T * top_k expert weights) or
    ``all-experts`` (every expert on every token, each weight read once where it lies: for batches whose
    assignments outnumber the experts, ``decode_graph.MOE_FORMS``)."""

    page_size: int
    kv_heads: int
    moe: str = "per-assignment"


class DecodeContext:
    """A decode step's contexts, for the decode-only bodies (``model.decode.onnx``, ``decode_graph.py``): every
    sequence has exactly one new token, so token t is sequence t and no regrouping is needed (``TokenGroups``' data-
    dependent ``Tmax``). Keys 0 .. L-1 of every sequence, L = the block-table width x the page size: a size read from
    shapes only, never from the step's values (``max(positions) + 1`` is a device -> host copy on a GPU provider,
    and a captured CUDA graph would freeze it); keys past a sequence's own are masked as in the general body, so the
    result is the same whatever the table width (the engine's tables are as wide as the step's longest sequence, a
    CUDA-graph runtime's as its bucket). ``slots`` [B, L], ``visible`` [T, L].

    Slots past a sequence's length point at the token's own row (``own_slots``: the row this step wrote, at its
    position), not at pool row 0: every row a decode body gathers is then a row of the sequence's context, never
    an unwritten one (which may hold anything, NaN included), so a value row that no probability weighs adds an
    exact zero (finite x 0) and the bodies need no zeroing pass over the gathered values (``[T, Hkv, L, D]``: one
    more read and write of the context per layer and step). On a decode step a key is visible exactly when it is
    inside the sequence (``position = seq_len - 1``)."""

    def __init__(self, b: Builder, block_tables: str, seq_lens: str, positions: str, sizes: DecodeSizes,
                 chunk_pages: int | None = None):
        """``chunk_pages``: L rounded up to a whole number of chunks of that many pages (the keys past the table
        are past every sequence's length: the token's own row, masked)."""
        self.b = b
        page = b.const(sizes.page_size)
        width = _dim(b, block_tables, 1)
        table_keys = b.Mul(width, page)  # shape arithmetic, on the host
        page_of = None
        if chunk_pages is None:
            self.length = table_keys
        else:
            m = b.const(chunk_pages)
            self.length = b.Mul(b.Mul(b.Div(b.Add(width, b.Sub(m, b.const(1))), m), m), page)
            # each key's column of the table: j // page inside it, 0 past it (a valid column, its slot replaced)
            page_of = b.Concat(b.Div(b.Range(b.const(0), table_keys, b.const(1)), page),
                               b.Mul(b.Range(table_keys, self.length, b.const(1)), b.const(0)), axis=0)
        self.own = own_slots(b, block_tables, positions, sizes.page_size)  # [T, 1]
        self.key_pos, self.slots, self.visible = _contexts(b, block_tables, seq_lens, positions, self.length, page,
                                                           outside=self.own, page_of=page_of)

    def gather(self, pool: str, scale: str | None = None) -> str:
        """pool [pages, page, *rest] -> fp32 [B, L, *rest] (``SequenceLayout.gather``)."""
        return _gather_slots(self.b, self.slots, pool, scale)


def _contexts(b: Builder, block_tables: str, seq_lens: str, positions: str, length: str, page: str,
              outside: str | None = None, page_of: str | None = None) -> tuple[str, str, str]:
    """Keys 0 .. ``length``-1 of every sequence (``page``: the page size as a value) -> key positions [L], pool
    slots [B, L] and which keys each token sees [T, L]. Slots past a sequence's length (their pages may hold
    anything, even ids outside the pool) point at slot 0, or at ``outside`` [B, 1] (a decode step: each sequence's
    own row, ``own_slots``), and are masked per token later. ``page_of``: each key's table column [L], where
    ``length`` runs past the table (default ``key_pos // page``)."""
    key_pos = b.Range(b.const(0), length, b.const(1))  # [L]
    pages = b.Gather(b.Cast(block_tables, to=I64), b.Div(key_pos, page) if page_of is None else page_of,
                     axis=1)  # [B, L]
    inside = b.Less(b.Unsqueeze(key_pos, b.const([0])), b.Unsqueeze(b.Cast(seq_lens, to=I64), b.const([1])))
    slots = b.Where(inside, b.Add(b.Mul(pages, page), b.Mod(key_pos, page)),
                    b.const(0) if outside is None else outside)  # [B, L]
    visible = b.LessOrEqual(b.Unsqueeze(key_pos, b.const([0])), b.Unsqueeze(positions, b.const([1])))  # [T, L]
    return key_pos, slots, visible


def own_slots(b: Builder, block_tables: str, positions: str, page_size: int) -> str:
    """[T, 1] int64: the pool slot of each token's own position (``block_tables[t, p // page] * page + p % page``,
    token t of a decode step being sequence t): the row the step's cache write filled before any reader runs, so
    it always holds a value of the sequence (a CUDA-graph runtime's padding rows decode at position 0 of a scratch
    page, so theirs is that page's first row)."""
    page = b.const(page_size)
    pos = b.Unsqueeze(positions, b.const([1]))  # [T, 1]
    page_id = b.GatherElements(b.Cast(block_tables, to=I64), b.Div(pos, page), axis=1)  # [T, 1]
    return b.Add(b.Mul(page_id, page), b.Mod(pos, page))


def _gather_slots(b: Builder, slots: str, pool: str, scale: str | None) -> str:
    """The rows ``slots`` [B, L] of ``pool`` [pages, page, *rest] -> fp32 [B, L, *rest]. With ``scale`` (the pool's
    [pages, page, *rest[:-1]] fp32 scales) the pool holds uint8 E4M3 codes, decoded after the gather."""

    def rows(p: str) -> str:
        return b.Gather(_page_rows(b, p, 2), slots, axis=0)

    return b.Cast(rows(pool), to=F32) if scale is None else decode_rows(b, rows(pool), rows(scale))


def _lowest_ids_first(b: Builder, scores: str, values: str, topk_ids: str, k: str, n: str) -> str:
    """The ids of ``TopK(scores)``'s ``values`` [..., k] (last axis) with ties given to the lower id, whatever
    ``TopK`` did.

    ONNX specifies that ``TopK`` puts the lower index first among equal values, but not every provider keeps
    that rule (TensorRT's TopK promises no order among ties; ORT's CUDA kernels do keep it: the H200's 85 % was
    the padding ``NOTHING`` guards against), and forced blocks tie at +inf on every token. The values of a top k
    are the same whatever the tie rule, so only the ids are re-derived from them: slot j's id is the r-th lowest id c with ``scores[c] == values[j]``, r = #{j' < j :
    values[j'] == values[j]} (a ``CumSum`` of the equality mask ranks each candidate). Cost ``[..., k, NB]``:
    for the indexer below its ``[T, H, L]`` score matrix whenever ``k < block_size``. A slot whose value equals
    no score (NaN) keeps ``TopK``'s id.

    ``k`` and ``n`` (rank-0 int64: the slots, the candidates) come from the caller, from attributes or from values
    every layer shares, not from ``Shape`` nodes on the layer's own tensors: ONNX Runtime then folds the
    ``[k, k]`` order mask and the id range to constants (the MoE's ``top_k`` and ``E``) or computes them once per
    step for all layers (its common-subexpression pass, the indexer's), instead of ~10 nodes per layer."""
    kk = b.Range(b.const(0), k, b.const(1))
    earlier = b.Less(b.Unsqueeze(kk, b.const([0])), b.Unsqueeze(kk, b.const([1])))  # [k (j), k (j')]: j' < j
    same = b.Equal(b.Unsqueeze(values, b.const([-2])), b.Unsqueeze(values, b.const([-1])))  # [..., k (j), k (j')]
    rank = b.ReduceSum(b.Cast(b.And(same, earlier), to=TensorProto.INT32), b.const([-1]), keepdims=1)  # [..., k, 1]
    equal = b.Equal(b.Unsqueeze(scores, b.const([-2])), b.Unsqueeze(values, b.const([-1])))  # [..., k, NB]
    nth = b.CumSum(b.Cast(equal, to=TensorProto.INT32), b.const(-1))  # 1-based rank of each equal candidate
    hit = b.And(equal, b.Equal(nth, b.Add(rank, b.const(1, np.int32))))  # exactly one per slot (or none: NaN)
    ids = b.Range(b.const(1), b.Add(n, b.const(1)), b.const(1))  # 1-based: 0 means no hit
    found = b.ReduceSum(b.Where(hit, ids, b.const(0)), b.const([-1]), keepdims=0)  # [..., k]
    return b.Where(b.Greater(found, b.const(0)), b.Sub(found, b.const(1)), topk_ids)


def lightning_indexer(kv_fp8: bool = False) -> FunctionProto:
    """Scores of every token against its sequence's index keys, which are gathered once per sequence per step
    (``[B, L, D]``), not once per token: a prefill chunk of T tokens reads its context once, and the only
    ``[T, ...]``-by-context tensor is the score matrix the op must compute anyway."""
    b = Builder("")
    seqs = SequenceLayout(b, "block_tables", "query_start_loc", "seq_lens", "positions", "index_k_cache")
    keys = seqs.gather("index_k_cache", "index_k_scale" if kv_fp8 else None)  # [B, L, D]
    q = seqs.padded(b.Cast("index_q", to=F32))  # [B, Tmax, H, D]
    scores = b.MatMul(q, b.Unsqueeze(b.Transpose(keys, perm=[0, 2, 1]), b.const([1])))  # [B, Tmax, H, L]
    scores = b.GatherND(scores, seqs.index)  # [T, H, L]
    scores = b.Where(b.Unsqueeze(seqs.visible, b.const([1])), scores, b.const(-INF, np.float32))
    return _function("LightningIndexer", b, [_select_blocks(b, scores, seqs.length)], kv_fp8)


def lightning_indexer_decode(sizes: DecodeSizes, kv_fp8: bool = False) -> FunctionProto:
    """``lightning_indexer`` for decode steps only (``DecodeContext``: token t is sequence t): the scores
    ``[T, H, L]`` of each token against its own sequence's keys, L from shapes; the selection as the general body's."""
    b = Builder("")
    ctx = DecodeContext(b, "block_tables", "seq_lens", "positions", sizes)
    keys = ctx.gather("index_k_cache", "index_k_scale" if kv_fp8 else None)  # [T, L, D]
    # keys [T, L, D] x q^T [T, D, H]: the long axis L is the product's rows (cuBLAS's n, as ONNX Runtime hands a
    # row-major product to it), the H = 4 index heads its columns; then [T, H, L]
    q_t = b.Transpose(b.Cast("index_q", to=F32), perm=[0, 2, 1])  # [T, D, H]
    scores = b.Transpose(b.MatMul(keys, q_t), perm=[0, 2, 1])  # [T, H, L]
    scores = b.Where(b.Unsqueeze(ctx.visible, b.const([1])), scores, b.const(-INF, np.float32))
    return _function("LightningIndexer", b, [_select_blocks(b, scores, ctx.length)], kv_fp8)


# The widest axis the indexer's ranking ``TopK`` is given. ONNX Runtime's CUDA ``TopK`` sorts a row of up to 256
# entries (padded to a power of two) with a bitonic network in one thread block and a longer one with a radix
# select several times slower: on the H200 (onnxruntime-gpu 1.31.1, decode, batch 1) ~31 us per layer at 32k
# context (257-321 blocks of 128) against ~6.5 us at 4k (docs/performance.md, "Fourth call (14:05 UTC)").
CHUNK = 256


def _chunked_topk(b: Builder, row: str, n: str, k: str) -> tuple[str, str, str, str]:
    """``TopK(row, k)`` (largest, sorted, ties to the lower index) of ``row`` [T, H, n] (float32, no -inf: at
    least ``NOTHING``) with the row padded with ``NOTHING`` columns, ranked so that no ``TopK`` sees more than
    ``CHUNK`` entries along its axis. ``n``, ``k``: rank-0 int64, the blocks (step inputs) and the top-k (an
    attribute). Returns (values [T, H, k], ids [T, H, k] int64, the padded row [T, H, W], W).

    Padding: to W >= max(n, k) columns, so that ``TopK`` always takes k (a constant K: no K computed from the step
    and copied to the host per layer), and the slots past the blocks there are come out ``NOTHING`` (unranked, -1),
    like the blocks no key of the token can see. One ``Pad`` of the float row, before any int64 id exists (ORT's
    CUDA EP has no int64 Pad: one on the ids would run on the CPU EP, a device -> host -> device copy).

    Chunks: N' = max(n, k) columns in C = ceil(N' / max(CHUNK, k)) chunks of equal width w = max(ceil(N' / C), k),
    W = C * w (N' <= CHUNK: one chunk of N'; 257-321 blocks: two of 129-161, padding < C columns when k <= 128,
    so ``_lowest_ids_first``'s ``[.., k, W]`` costs what its ``[.., k, N']`` did). Each chunk's top k (``TopK`` on
    [T, H, C, w]), its ids plus the chunk's offset c * w, then the top k of those C * k candidates (``TopK`` on
    [T, H, C * k]) and the global ids gathered with the merge's indices. All sizes come from ``n`` and ``k``
    (shapes or step inputs, computed once per step for every layer), none from this layer's values.

    Exact, the same values and ids as one ``TopK(row, k)``: every entry of the row's top k is in its own chunk's
    top k (fewer than k entries of the chunk can outrank it, w >= k); within a chunk, equal values come out lower
    id first (ONNX ``TopK``'s rule) and the chunks are laid out in id order, so among equal candidates the
    merge's position order is global id order, and its lower-index-first rule gives the lower global id. A
    provider that breaks ties otherwise gives the same values (a top k's values do not depend on the tie rule),
    and ``_lowest_ids_first`` re-derives the ids from them against the whole padded row, as for one ``TopK``
    (its padding columns hold ``NOTHING``: they match only unranked slots, -1 either way).

    Width: with k <= CHUNK every chunk is at most CHUNK wide; the merge sees C * k <= CHUNK candidates up to
    CHUNK^2 / k columns (4096 blocks at the indexer's top-16: 512k keys of 128, past any context the model serves).
    With k > CHUNK the chunks are k wide: still exact, no ``TopK`` shorter than k (past ORT's bitonic path either
    way). NaN block maxima have no order: there, as for one ``TopK``, the ids are the provider's."""
    chunk_cap = b.Max(k, b.const(CHUNK))
    wide = b.Max(n, k)  # N'
    chunks = b.Div(b.Add(wide, b.Sub(chunk_cap, b.const(1))), chunk_cap)  # C
    w = b.Max(b.Div(b.Add(wide, b.Sub(chunks, b.const(1))), chunks), k)
    width = b.Mul(chunks, w)  # W
    row = b.Pad(row, b.Concat(b.const([0, 0, 0, 0, 0]), _vec(b, b.Sub(width, n)), axis=0),
                b.const(NOTHING, np.float32))  # [T, H, W]
    kv = _vec(b, k)
    values, idx = b.TopK(b.Reshape(row, b.Concat(b.const([0, 0]), _vec(b, chunks), _vec(b, w), axis=0)), kv,
                         axis=-1, largest=1, sorted=1, n_out=2)  # [T, H, C, k]
    offsets = b.Unsqueeze(b.Range(b.const(0), width, w), b.const([1]))  # [C, 1]: each chunk's first id
    candidates = b.Concat(b.const([0, 0]), _vec(b, b.Mul(chunks, k)), axis=0)  # [T, H, C * k]
    values, pick = b.TopK(b.Reshape(values, candidates), kv, axis=-1, largest=1, sorted=1, n_out=2)
    idx = b.GatherElements(b.Reshape(b.Add(idx, offsets), candidates), pick, axis=-1)
    return values, idx, row, width


def _select_blocks(b: Builder, scores: str, length: str) -> str:
    """Masked scores ``[T, H, L]`` (-inf where the token sees no key), L = ``length`` -> int32 ``[T, H, topk]``
    block ids: block maxima, forced blocks at +inf, top-k with ties to the lower id (ranked in chunks of at most
    ``CHUNK`` blocks, ``_chunked_topk``), -1 where nothing ranks."""
    neg = b.const(-INF, np.float32)
    bs = b.attr(Ref("block_size", INT))
    nb = b.Div(b.Add(length, b.Sub(bs, b.const(1))), bs)
    pad = b.Sub(b.Mul(nb, bs), length)
    scores = b.Pad(scores, b.Concat(b.const([0, 0, 0, 0, 0]), _vec(b, pad), axis=0), neg)
    blocked = b.Reshape(scores, b.Concat(b.const([0, 0]), _vec(b, nb), _vec(b, bs), axis=0))
    block_max = b.ReduceMax(blocked, b.const([3]), keepdims=0)  # [T, H, NB]; -inf where nothing is visible

    ids = b.Range(b.const(0), nb, b.const(1))
    own = b.Unsqueeze(b.Div("positions", bs), b.const([1, 2]))  # [T, 1, 1]
    visible = b.LessOrEqual(ids, own)
    local = b.Greater(ids, b.Sub(own, b.attr(Ref("local_blocks", INT))))
    init = b.Less(ids, b.attr(Ref("init_blocks", INT)))
    forced = b.And(visible, b.Or(local, init))
    block_max = b.Where(forced, b.const(INF, np.float32), block_max)

    topk = b.attr(Ref("topk_blocks", INT))
    block_max = b.Max(block_max, b.const(NOTHING, np.float32))  # blocks nothing sees: -inf -> NOTHING
    values, idx, ranked, width = _chunked_topk(b, block_max, nb, topk)
    idx = _lowest_ids_first(b, ranked, values, idx, topk, width)
    idx = b.Where(_unranked(b, values), b.const(-1), idx)
    return b.Cast(idx, to=TensorProto.INT32)


# ---------------------------------------------------------------------------------------------- attention
def paged_attention(kv_fp8: bool = False) -> FunctionProto:
    """Each sequence's keys and values are gathered once per step (``[B, L, Hkv, D]``, ``SequenceLayout``) and
    its new tokens' queries meet them in one batched MatMul, ``[B, Hkv, Tmax * G, L]`` scores: a prefill chunk of
    T tokens reads its context once, never a ``[T, L, ...]`` per-token copy."""
    b = Builder("")
    seqs = SequenceLayout(b, "block_tables", "query_start_loc", "seq_lens", "positions", "k_cache")
    keys = seqs.gather("k_cache", "k_scale" if kv_fp8 else None)  # [B, L, Hkv, D]
    values = seqs.gather("v_cache", "v_scale" if kv_fp8 else None)
    hkv, d = b.Shape("k_cache", start=2, end=3), b.Shape("q", start=2)
    q = seqs.padded(b.Cast("q", to=F32))  # [B, Tmax, Hq, D]
    q = b.Reshape(q, b.Concat(b.const([0, 0]), hkv, b.const([-1]), d, axis=0))  # [B, Tmax, Hkv, G, D]
    q = b.Transpose(q, perm=[0, 2, 1, 3, 4])  # [B, Hkv, Tmax, G, D]
    scores = b.MatMul(q, b.Unsqueeze(b.Transpose(keys, perm=[0, 2, 3, 1]), b.const([2])))  # [B, Hkv, Tmax, G, L]
    scores = b.Mul(scores, b.attr(Ref("scale", FLOAT)))
    pos = seqs.positions("positions")  # [B, Tmax]; -1: padding rows
    visible = b.LessOrEqual(b.Unsqueeze(seqs.key_pos, b.const([0, 1])), b.Unsqueeze(pos, b.const([2])))  # [B,Tmax,L]
    probs = b.Softmax(b.Where(b.Unsqueeze(visible, b.const([1, 3])), scores, b.const(-INF, np.float32)), axis=-1)
    # Values no token of the sequence can see are zeroed: their slots may hold anything (even NaN), 0 * NaN leaks.
    last = b.ReduceMax(pos, b.const([1]), keepdims=1)  # [B, 1]
    seen = b.LessOrEqual(b.Unsqueeze(seqs.key_pos, b.const([0])), last)  # [B, L]
    values = b.Where(b.Unsqueeze(seen, b.const([2, 3])), values, b.const(0.0, np.float32))
    out = b.MatMul(probs, b.Unsqueeze(b.Transpose(values, perm=[0, 2, 1, 3]), b.const([2])))  # [B,Hkv,Tmax,G,Dv]
    out = b.GatherND(b.Transpose(out, perm=[0, 2, 1, 3, 4]), seqs.index)  # [T, Hkv, G, Dv]
    out = b.Reshape(out, b.Concat(b.const([0, -1]), b.Shape("v_cache", start=3), axis=0))
    return _function("PagedAttention", b, [b.CastLike(out, "q")], kv_fp8)


# Keys per partial product of the dense decode body's value sum (``_partial_value_sums``), rounded to whole pages:
# one cuBLAS thread block per (token, KV head, chunk), each reading 256 x Dv fp32 values
VALUE_CHUNK_KEYS = 256


def paged_attention_decode(sizes: DecodeSizes, kv_fp8: bool = False) -> FunctionProto:
    """``paged_attention`` for decode steps only (``DecodeContext``): token t attends to its own sequence's keys
    0 .. L-1 (L from shapes), masked past its position, in one batched ``[T, Hkv, G, L]`` product; the
    probability-weighted sum of the values in partial sums over chunks of ``VALUE_CHUNK_KEYS`` keys
    (``_partial_value_sums``), L rounded up to whole chunks (the keys past the table: masked, the token's own row)."""
    b = Builder("")
    chunk_pages = max(1, VALUE_CHUNK_KEYS // sizes.page_size)
    chunk = chunk_pages * sizes.page_size
    ctx = DecodeContext(b, "block_tables", "seq_lens", "positions", sizes, chunk_pages=chunk_pages)
    # keys and values gathered head-major, [T, Hkv, L, D] (pool rows slot * Hkv + head, as the sparse body reads
    # them): the products take them as they come (the scores' transpose of the last two axes fuses into the
    # MatMul), where a [T, L, Hkv, D] gather needed a transposed copy of each per step
    heads = b.const(np.arange(sizes.kv_heads).reshape(1, -1, 1))  # [1, Hkv, 1]
    index = b.Add(b.Mul(b.Unsqueeze(ctx.slots, b.const([1])), b.const(sizes.kv_heads)), heads)  # [T, Hkv, L]
    # the values' rows as [L / chunk, T, Hkv, chunk] (chunk-major: ``_partial_value_sums``; L whole chunks)
    value_index = b.Transpose(b.Reshape(index, b.const([0, 0, -1, chunk])), perm=[2, 0, 1, 3])

    def gather(pool: str, scale: str | None, rows: str) -> str:  # -> fp32 [*rows' shape, D]
        return _masked_rows(b, b.Gather(_page_rows(b, pool, 3), rows, axis=0),
                            None if scale is None else b.Gather(_page_rows(b, scale, 3), rows, axis=0), None)

    keys = gather("k_cache", "k_scale" if kv_fp8 else None, index)  # [T, Hkv, L, D]
    # no zeroing of the values: every slot is a row of the sequence (``DecodeContext``), and the keys a token does
    # not see get probability exactly 0 (softmax of -inf), so their rows add exact zeros
    values = gather("v_cache", "v_scale" if kv_fp8 else None, value_index)  # [L / chunk, T, Hkv, chunk, Dv]
    hkv, d = b.Shape("k_cache", start=2, end=3), b.Shape("q", start=2)
    q = b.Reshape(b.Cast("q", to=F32), b.Concat(b.const([0]), hkv, b.const([-1]), d, axis=0))  # [T, Hkv, G, D]
    scores = b.MatMul(q, b.Transpose(keys, perm=[0, 1, 3, 2]))  # [T, Hkv, G, L]
    scores = b.Mul(scores, b.attr(Ref("scale", FLOAT)))
    probs = b.Softmax(b.Where(b.Unsqueeze(ctx.visible, b.const([1, 2])), scores, b.const(-INF, np.float32)), axis=-1)
    out = _partial_value_sums(b, probs, values, b.const([-1, chunk]))  # [T, Hkv, G, Dv]
    out = b.Reshape(out, b.Concat(b.const([0, -1]), b.Shape("v_cache", start=3), axis=0))
    return _function("PagedAttention", b, [b.CastLike(out, "q")], kv_fp8)


def _partial_value_sums(b: Builder, probs: str, values: str, chunks: str) -> str:
    """``probs @ values`` for probs [T, Hkv, G, S] and values [C, T, Hkv, S / C, Dv] (``chunks``: int64 [2], (C,
    S / C) with one of them -1): the sum over the S keys as C partial sums of S / C consecutive keys each (one
    batched product, ``[C, T, Hkv, G, Dv]``), then their sum in fp32, in chunk order. The chunk axis leads, so
    the sum reduces a leading axis (ONNX Runtime's CUDA ``ReduceSum`` has one-kernel paths for leading or trailing
    axes; a middle one went through cuDNN, several kernels: 26.5 us a step for the three sparse layers' at batch 1
    on the H200, 14:05 UTC).

    Why: one ``[G, S] @ [S, Dv]`` product per (token, KV head) is a GEMM of M = G (16), N = Dv (128) and a long K
    = S: cuBLAS gives it one thread block per batch entry, 4 at batch 1 of M3's 4 KV heads, each reading S x Dv
    values alone (H200, `mini` bf16, 2026-12-01 11:13 UTC, ``bench/ort_kernels.py``: 133 us for the dense layer's
    4k keys, 67 us for each sparse layer's 2048: the fp32 values at ~60 GB/s; at 32k keys ~1 ms), where the
    chunks give it C x as many. The same products and the same fp32 accumulation; only the summation grouping
    differs from one product over S (a few fp32 ulps). The probabilities' layout change is one transposed copy of
    ``[T, Hkv, G, S]`` (the values, G x larger per key, are gathered in the chunked layout directly)."""
    per_chunk = b.Reshape(probs, b.Concat(b.const([0, 0, 0]), chunks, axis=0))
    per_chunk = b.Transpose(per_chunk, perm=[3, 0, 1, 2, 4])  # [C, T, Hkv, G, S / C]
    return b.ReduceSum(b.MatMul(per_chunk, values), b.const([0]), keepdims=0)  # [T, Hkv, G, Dv]


def _masked_rows(b: Builder, rows: str, scale_rows: str | None, keep: str | None) -> str:
    """Gathered pool rows -> fp32 (uint8 E4M3 codes decoded with ``scale_rows``), zeroed where ``keep`` is false:
    in the pool's own dtype before the widening cast (half the bytes of a zeroing after it, and the same values:
    a 16-bit zero widens to +0)."""
    if scale_rows is not None:
        rows = decode_rows(b, rows, scale_rows)
        return rows if keep is None else b.Where(keep, rows, b.const(0.0, np.float32))
    if keep is not None:
        rows = b.Where(keep, rows, b.CastLike(b.const(0.0, np.float32), rows))
    return b.Cast(rows, to=F32)


def sparse_paged_attention(kv_fp8: bool = False) -> FunctionProto:
    """Gathers, per sequence and KV head, only the blocks its tokens selected: ``[B, Hkv, N * block_size]`` keys
    and values, N = most distinct blocks one (sequence, head) selected in the step. A decode step has N <= K
    whatever the context (cost flat in context); a verify step N <= tokens * K; a prefill chunk N <= the blocks
    of its context, so it costs what dense attention over that context costs, where a per-token gather
    (``[T, Hkv, K * block_size, D]``) grew with T * K * block_size: 4.7e9 elements for the `mini` verify's
    4480-token prefill step, past the 2^31 elements ONNX Runtime's CUDA element-wise kernels index (the first
    H200 run: an illegal memory access at the Cast after that gather).

    Key ``j`` is allowed for (token t, group g) iff its block is one of ``block_idx[t, g]`` that counts (``0 <= id
    <= position // block_size``; duplicates and order do not matter) and ``j <= positions[t]``. Keys not stored
    (unused list slots, keys past a sequence's length) are redirected to pool row 0 and masked, their values
    zeroed, so ids of any value, padding in ``block_tables`` and whatever unused pool rows hold never reach the
    result; every gather index is in range by construction.
    """
    b = Builder("")
    bs = b.attr(Ref("block_size", INT))
    tok = TokenGroups(b, "query_start_loc", "positions", "seq_lens")
    blk = b.Cast("block_idx", to=I64)  # [T, Hkv, K]
    counted = b.And(b.GreaterOrEqual(blk, b.const(0)),
                    b.LessOrEqual(blk, b.Div(b.Unsqueeze("positions", b.const([1, 2])), bs)))  # [T, Hkv, K]
    nb = b.Add(b.Div(b.ReduceMax("positions", keepdims=0), bs), b.const(1))  # blocks of the step's longest context
    # chosen[t, g, c] = 1 iff token t's group g reads block c (ids that do not count go to column nb, dropped); fp32
    # 0 / 1 (exact, counts below 2^24), a type ONNX Runtime's CUDA Pad takes for the regrouping
    # zeros [T, Hkv, nb + 1] as [T, Hkv, 1] + [nb + 1]: a shape made of this layer's Shape and the step's nb would be
    # a host <-> device copy pair per layer on a GPU provider; the [nb + 1] row is the same for every layer
    columns = b.Range(b.const(0), b.Add(nb, b.const(1)), b.const(1))
    column_zeros = b.Mul(b.Cast(columns, to=F32), b.const(0.0, np.float32))
    head_zeros = b.Expand(b.const(0.0, np.float32), b.Concat(b.Shape("block_idx", end=2), b.const([1]), axis=0))
    ones = b.Expand(b.const(1.0, np.float32), b.Shape("block_idx"))
    chosen = b.ScatterElements(b.Add(head_zeros, column_zeros), b.Where(counted, blk, nb), ones, axis=2)
    chosen = b.Transpose(tok.padded(b.Slice(chosen, b.const([0]), _vec(b, nb), b.const([2]))),
                         perm=[0, 2, 1, 3])  # [B, Hkv, Tmax, NB]
    used = b.ReduceMax(chosen, b.const([2]), keepdims=0)  # [B, Hkv, NB]: blocks any token of the sequence reads
    n = b.Max(b.ReduceMax(b.ReduceSum(used, b.const([2]), keepdims=0), keepdims=0), b.const(1.0, np.float32))
    # used ids ascending (distinct finite keys -id: no TopK tie matters), then unused slots (NOTHING, masked)
    key = b.Where(b.Cast(used, to=TensorProto.BOOL), b.Neg(b.Cast(b.Range(b.const(0), nb, b.const(1)), to=F32)),
                  b.const(NOTHING, np.float32))
    top, lst = b.TopK(key, _vec(b, b.Cast(n, to=I64)), axis=-1, largest=1, sorted=1, n_out=2)  # [B, Hkv, N]
    filled = b.Not(_unranked(b, top))  # [B, Hkv, N]
    lst = b.Where(filled, lst, b.const(0))  # a provider's padding id (past the axis) never indexes `chosen`

    keys_pos = b.Add(b.Unsqueeze(b.Mul(lst, bs), b.const([3])), b.Range(b.const(0), bs, b.const(1)))  # [B,Hkv,N,bs]
    stored = b.And(b.Unsqueeze(filled, b.const([3])),
                   b.Less(keys_pos, b.Unsqueeze(b.Cast("seq_lens", to=I64), b.const([1, 2, 3]))))
    keys_pos = b.Where(stored, keys_pos, b.const(0))
    page = _dim(b, "k_cache", 1)
    max_pages = _dim(b, "block_tables", 1)
    rows = b.Reshape(b.Cast("block_tables", to=I64), b.const([-1]))  # [B * max_pages]
    row_of = b.Unsqueeze(b.Mul(b.Range(b.const(0), tok.num_seqs, b.const(1)), max_pages), b.const([1, 2, 3]))
    pages = b.Gather(rows, b.Add(row_of, b.Div(keys_pos, page)), axis=0)
    slots = b.Where(stored, b.Add(b.Mul(pages, page), b.Mod(keys_pos, page)), b.const(0))  # [B, Hkv, N, bs]
    hkv = _dim(b, "k_cache", 2)
    heads = b.Unsqueeze(b.Range(b.const(0), hkv, b.const(1)), b.const([0, 2, 3]))  # [1, Hkv, 1, 1]
    flat_shape = b.Concat(b.Shape(lst, end=2), b.const([-1]), axis=0)  # [B, Hkv, N * bs]
    index = b.Reshape(b.Add(b.Mul(slots, hkv), heads), flat_shape)

    def rows_of(pool: str) -> str:  # [pages, page, Hkv, *rest] -> [B, Hkv, N * bs, *rest]
        return b.Gather(_page_rows(b, pool, 3), index, axis=0)

    def gather(pool: str, scale: str) -> str:  # -> fp32 [B, Hkv, N * bs, D]
        return decode_rows(b, rows_of(pool), rows_of(scale)) if kv_fp8 else b.Cast(rows_of(pool), to=F32)

    keys, values = gather("k_cache", "k_scale"), gather("v_cache", "v_scale")
    # allowed [B, Hkv, Tmax, N, bs]: the token's own blocks, keys up to its position (padding rows: none)
    lists = b.Expand(b.Unsqueeze(lst, b.const([2])), b.Concat(b.Shape(chosen, end=3), b.Shape(lst, start=2), axis=0))
    member = b.GatherElements(chosen, lists, axis=3)  # [B, Hkv, Tmax, N]: slot n's block is one of the token's
    pos = b.Unsqueeze(tok.positions("positions"), b.const([1, 3, 4]))  # [B, 1, Tmax, 1, 1]
    allowed = b.And(b.And(b.Unsqueeze(b.Cast(member, to=TensorProto.BOOL), b.const([4])),
                          b.Unsqueeze(stored, b.const([2]))),
                    b.LessOrEqual(b.Unsqueeze(keys_pos, b.const([2])), pos))
    allowed = b.Reshape(allowed, b.Concat(b.Shape(allowed, end=3), b.const([1, -1]), axis=0))  # [B,Hkv,Tmax,1,S]

    q = tok.padded(b.Cast("q", to=F32))  # [B, Tmax, Hq, D]
    q = b.Reshape(q, b.Concat(b.const([0, 0]), b.Shape("k_cache", start=2, end=3), b.const([-1]),
                              b.Shape("q", start=2), axis=0))  # [B, Tmax, Hkv, G, D]
    q = b.Transpose(q, perm=[0, 2, 1, 3, 4])  # [B, Hkv, Tmax, G, D]
    scores = b.MatMul(q, b.Unsqueeze(b.Transpose(keys, perm=[0, 1, 3, 2]), b.const([2])))  # [B, Hkv, Tmax, G, S]
    scores = b.Mul(scores, b.attr(Ref("scale", FLOAT)))
    probs = b.Softmax(b.Where(allowed, scores, b.const(-INF, np.float32)), axis=-1)
    values = b.Where(b.Unsqueeze(b.Reshape(stored, flat_shape), b.const([3])), values, b.const(0.0, np.float32))
    out = b.MatMul(probs, b.Unsqueeze(values, b.const([2])))  # [B, Hkv, Tmax, G, Dv]
    out = b.GatherND(b.Transpose(out, perm=[0, 2, 1, 3, 4]), tok.index)  # [T, Hkv, G, Dv]
    out = b.Reshape(out, b.Concat(b.const([0, -1]), b.Shape("v_cache", start=3), axis=0))
    return _function("SparsePagedAttention", b, [b.CastLike(out, "q")], kv_fp8)


def sparse_paged_attention_decode(sizes: DecodeSizes, kv_fp8: bool = False) -> FunctionProto:
    """``sparse_paged_attention`` for decode steps only (``DecodeContext``: token t is sequence t): each token
    gathers its own K selected blocks, ``[T, Hkv, K * block_size]`` keys and values, K the list's static width,
    so no size depends on the step's values (the general body's union width N is data-dependent: a device -> host
    copy per layer on a GPU provider). A block listed twice counts once (the op's contract), and the token's
    blocks are laid out in ascending id order, unused slots last, as the general body lays out a lone token's
    union: the same keys in the same order, so the scores' sums run in the same order; the values' weighted sum
    runs as one partial sum per selected block, then their sum (``_partial_value_sums``: the same products, another
    summation grouping).
    """
    b = Builder("")
    bs = b.attr(Ref("block_size", INT))
    blk = b.Cast("block_idx", to=I64)  # [T, Hkv, K]
    counted = b.And(b.GreaterOrEqual(blk, b.const(0)),
                    b.LessOrEqual(blk, b.Div(b.Unsqueeze("positions", b.const([1, 2])), bs)))  # [T, Hkv, K]
    k = b.Shape("block_idx", start=2)  # [1]: the list's width (static)
    slot = b.Range(b.const(0), b.Squeeze(k, b.const([0])), b.const(1))
    earlier = b.Less(b.Unsqueeze(slot, b.const([0])), b.Unsqueeze(slot, b.const([1])))  # [K (j), K (j')]: j' < j
    same = b.Equal(b.Unsqueeze(blk, b.const([-1])), b.Unsqueeze(blk, b.const([-2])))  # [T, Hkv, K (j), K (j')]
    repeated = b.Greater(b.ReduceSum(b.Cast(b.And(same, earlier), to=TensorProto.INT32), b.const([-1]),
                                     keepdims=0), b.const(0, np.int32))  # an earlier slot lists the same block
    # counted ids ascending (distinct finite keys -id: no TopK tie matters), then unused slots (NOTHING, masked)
    key = b.Where(b.And(counted, b.Not(repeated)), b.Neg(b.Cast(blk, to=F32)), b.const(NOTHING, np.float32))
    top = b.TopK(key, k, axis=-1, largest=1, sorted=1, n_out=2)[0]  # [T, Hkv, K]
    filled = b.Not(_unranked(b, top))
    ids = b.Where(filled, b.Cast(b.Neg(top), to=I64), b.const(0))  # exact: ids < 2^24

    keys_pos = b.Add(b.Unsqueeze(b.Mul(ids, bs), b.const([3])), b.Range(b.const(0), bs, b.const(1)))  # [T,Hkv,K,bs]
    stored = b.And(b.Unsqueeze(filled, b.const([3])),
                   b.Less(keys_pos, b.Unsqueeze(b.Cast("seq_lens", to=I64), b.const([1, 2, 3]))))
    keys_pos = b.Where(stored, keys_pos, b.const(0))
    page = b.const(sizes.page_size)
    # each token's pages from its own block-table row (GatherElements: no row offset t * width, whose width, a
    # shape, would have to be copied to the device)
    flat = b.Reshape(b.Div(keys_pos, page), b.const([0, -1]))  # [T, Hkv * K * bs]
    pages = b.Reshape(b.GatherElements(b.Cast("block_tables", to=I64), flat, axis=1), b.Shape(keys_pos))
    # slots no block fills (unused list slots, keys past the sequence's length) read the token's own row, which the
    # step wrote (``own_slots``): never an unwritten row (it may hold anything, 0 * NaN leaks), so the values need
    # no zeroing pass; their keys are masked, their probabilities exactly 0
    own = b.Unsqueeze(own_slots(b, "block_tables", "positions", sizes.page_size), b.const([2, 3]))  # [T, 1, 1, 1]
    slots = b.Where(stored, b.Add(b.Mul(pages, page), b.Mod(keys_pos, page)), own)  # [T, Hkv, K, bs]
    hkv = b.const(sizes.kv_heads)
    heads = b.const(np.arange(sizes.kv_heads).reshape(1, -1, 1, 1))  # [1, Hkv, 1, 1]
    blocks = b.Add(b.Mul(slots, hkv), heads)  # [T, Hkv, K, bs]: pool rows, per selected block
    index = b.Reshape(blocks, b.const([0, 0, -1]))  # [T, Hkv, K * bs]

    def gather(pool: str, scale: str, rows: str) -> str:  # -> fp32 [*rows' shape, D]
        scales = b.Gather(_page_rows(b, scale, 3), rows, axis=0) if kv_fp8 else None
        return _masked_rows(b, b.Gather(_page_rows(b, pool, 3), rows, axis=0), scales, None)

    keys = gather("k_cache", "k_scale", index)  # [T, Hkv, K * bs, D]
    # [K, T, Hkv, bs, Dv]: one partial sum per block, chunk-major (``_partial_value_sums``)
    values = gather("v_cache", "v_scale", b.Transpose(blocks, perm=[2, 0, 1, 3]))
    allowed = b.And(stored, b.LessOrEqual(keys_pos, b.Unsqueeze("positions", b.const([1, 2, 3]))))
    allowed = b.Reshape(allowed, b.const([0, 0, 1, -1]))  # [T, Hkv, 1, S]
    q = b.Reshape(b.Cast("q", to=F32), b.Concat(b.const([0]), b.Shape("k_cache", start=2, end=3), b.const([-1]),
                                                b.Shape("q", start=2), axis=0))  # [T, Hkv, G, D]
    scores = b.MatMul(q, b.Transpose(keys, perm=[0, 1, 3, 2]))  # [T, Hkv, G, S]
    scores = b.Mul(scores, b.attr(Ref("scale", FLOAT)))
    probs = b.Softmax(b.Where(allowed, scores, b.const(-INF, np.float32)), axis=-1)
    out = _partial_value_sums(b, probs, values, b.Concat(k, b.const([-1]), axis=0))  # [T, Hkv, G, Dv]
    out = b.Reshape(out, b.Concat(b.const([0, -1]), b.Shape("v_cache", start=3), axis=0))
    return _function("SparsePagedAttention", b, [b.CastLike(out, "q")], kv_fp8)


# ---------------------------------------------------------------------------------------------- MoE
def _moe(name: str, mxfp8: bool, decode: bool = False, all_experts: bool = False) -> FunctionProto:
    """``decode``: the body of the decode-only graphs (``decode_graph.py``), which may hold no control flow: the
    routed sum always per assignment (``_gathered_sum``), never the per-expert ``Scan``; MXFP8 experts have no
    such form (ONNX Runtime's CUDA EP has no float8 ``Gather``)."""
    if decode and mxfp8:
        raise ValueError(f"{name}: no decode-only body for MXFP8 experts: ONNX Runtime's CUDA EP has no float8 "
                         "Gather, so the per-assignment routed sum cannot gather E4M3 expert weights, and the "
                         "per-expert Scan is control flow, which a captured CUDA graph cannot hold")
    b = Builder("")
    alpha, limit = b.attr(Ref("swiglu_alpha", FLOAT)), b.attr(Ref("swiglu_limit", FLOAT))

    def weight(bld: Builder, w: str, scale: str) -> str:
        """An expert weight in the activation dtype (MXFP8: dequantised exactly first; ``scale`` unused else)."""
        return bld.CastLike(_dequant(bld, w, scale) if mxfp8 else w, "x")

    # Router: fp32 sigmoid scores; the bias only ranks; weights renormalised over the chosen experts.
    logits = b.MatMul(b.Cast("x", to=F32), b.Transpose(b.Cast("router_weight", to=F32), perm=[1, 0]))
    scores = b.Sigmoid(logits)  # [T, E]
    biased = b.Add(scores, b.Cast("e_score_correction_bias", to=F32))
    top_k, num_experts = b.attr(Ref("top_k", INT)), _dim(b, "router_weight", 0)  # constants once ORT folds them
    top, idx = b.TopK(biased, _vec(b, top_k), axis=-1, largest=1, sorted=1, n_out=2)
    idx = _lowest_ids_first(b, biased, top, idx, top_k, num_experts)  # exact ties to the lower expert id on every EP
    w = b.GatherElements(scores, idx, axis=1)
    w = b.Div(w, b.ReduceSum(w, b.const([1]), keepdims=1))  # [T, k]

    # Routed experts: one Scan step per expert, in ascending id order (the reference's accumulation order).
    s = Builder("e_")
    hit = s.Equal(idx, "expert")  # [T, k]
    gain = s.ReduceSum(s.Mul(w, s.Cast(hit, to=F32)), s.const([1]), keepdims=0)  # [T]
    rows = s.Transpose(s.NonZero(s.ReduceMax(s.Cast(hit, to=TensorProto.INT32), s.const([1]), keepdims=0)))
    xr = s.GatherND("x", rows)  # [R, H]
    w13, w2 = weight(s, "w13_e", "w13_scale_e"), weight(s, "w2_e", "w2_scale_e")
    y = _linear(s, _swiglu(s, _linear(s, xr, w13), alpha, limit), w2)
    y = s.CastLike(s.Mul(s.Cast(y, to=F32), s.Unsqueeze(s.GatherND(gain, rows), s.const([1]))), "x")
    # rows are distinct within one expert, so a plain scatter of acc[rows] + y is the add (and unlike
    # ScatterND(reduction="add") it has ORT CPU kernels for every float type)
    acc_out = s.ScatterND("acc", rows, s.Add(s.GatherND("acc", rows), y))
    scanned = ["w13_e", "w13_scale_e", "w2_e", "w2_scale_e"] if mxfp8 else ["w13_e", "w2_e"]
    body = s.graph("expert_step", ["acc", "expert", *scanned], [acc_out])

    experts = b.Range(b.const(0), num_experts, b.const(1))
    scan_in = ["w13", "w13_scale", "w2", "w2_scale"] if mxfp8 else ["w13", "w2"]
    if mxfp8:
        routed = b.Scan(_zeros_like_x(b), experts, *scan_in, num_scan_inputs=1 + len(scan_in), body=body)
    elif decode and all_experts:
        routed = _all_experts_sum(b, alpha, limit, idx, w)
    elif decode:  # the If's per-assignment branch, unconditionally (a decode step's T * top_k <= E or not)
        routed = _gathered_sum(b, alpha, limit, idx, w)
    else:
        # Decode-sized steps (T * top_k <= E: the chosen experts' weights, gathered per assignment, are at most
        # the whole weight once) take a gather + batched product instead: no Scan over every expert and no
        # NonZero, each of which makes a GPU provider wait for the device (one wait per expert, per MoE layer,
        # per step). The condition is computed from shapes, on the host, so the If itself waits for nothing.
        # MXFP8 weights keep the Scan: ONNX Runtime's CUDA EP has no Gather kernel for float8 tensors, and a
        # Gather on the CPU EP would copy the whole expert table to the host every step.
        per_assignment = b.LessOrEqual(b.Mul(_dim(b, "x", 0), top_k), num_experts)
        routed = b.If(per_assignment, then_branch=_moe_gathered(alpha, limit, idx, w),
                      else_branch=_moe_scanned(experts, scan_in, body))

    shared_w13, shared_w2 = weight(b, "shared_w13", "shared_w13_scale"), weight(b, "shared_w2", "shared_w2_scale")
    shared = _linear(b, _swiglu(b, _linear(b, "x", shared_w13), alpha, limit), shared_w2)
    scaled = b.Mul(routed, b.CastLike(b.attr(Ref("routed_scaling_factor", FLOAT)), "x"))
    return _function(name, b, [b.Add(scaled, shared)])


def _moe_gathered(alpha: str, limit: str, idx: str, w: str):
    """If branch: ``_gathered_sum`` as a subgraph."""
    g = Builder("g_")
    return g.graph("moe_gathered", [], [_gathered_sum(g, alpha, limit, idx, w)])


def _gathered_sum(g: Builder, alpha: str, limit: str, idx: str, w: str) -> str:
    """The routed sum from each assignment's own expert weights, gathered ([T, k, 2I, H] and [T, k, H, I]) and
    applied as a batch of T * k products. Each assignment's output is rounded to the activation dtype after its
    routing weight, as in the Scan; the k of a token are then summed in fp32 and rounded once (the Scan rounds
    after each add: the two differ by rounding only, as the GPU kernels' fp32 sum does)."""
    w13 = g.CastLike(g.Gather("w13", idx, axis=0), "x")  # [T, k, 2I, H]
    w2 = g.CastLike(g.Gather("w2", idx, axis=0), "x")  # [T, k, H, I]
    xe = g.Unsqueeze("x", g.const([1, 3]))  # [T, 1, H, 1]
    # each gathered weight as the left factor, as it lies ([N, K] rows): no transposed copy of it per step
    act = _swiglu(g, g.MatMul(w13, xe), alpha, limit, axis=-2)  # [T, k, I, 1]
    y = g.Squeeze(g.MatMul(w2, act), g.const([3]))  # [T, k, H]
    y = g.CastLike(g.Mul(g.Cast(y, to=F32), g.Unsqueeze(w, g.const([2]))), "x")
    return g.CastLike(g.ReduceSum(g.Cast(y, to=F32), g.const([1]), keepdims=0), "x")


def _zeros_like_x(b: Builder) -> str:
    """The Scan's initial accumulator: zeros shaped and typed as ``x``."""
    return b.Expand(b.CastLike(b.const(0.0, np.float32), "x"), b.Shape("x"))


def _moe_scanned(experts: str, scan_in: list[str], body):
    """If branch: the per-expert Scan, its zeros made inside the branch (a value the If reads from outside is
    computed whichever branch runs; ``experts`` is a constant once folded)."""
    g = Builder("s_")
    routed = g.Scan(_zeros_like_x(g), experts, *scan_in, num_scan_inputs=1 + len(scan_in), body=body)
    return g.graph("moe_scanned", [], [routed])


def _all_experts_sum(b: Builder, alpha: str, limit: str, idx: str, w: str) -> str:
    """The routed sum computing every expert on every token (``[E, 2I, T]`` and ``[E, H, T]`` batched products of
    each weight where it lies against ``x``: no copy of a weight), each token keeping its own top_k: an
    assignment's output is rounded to the activation dtype after its routing weight as in ``_gathered_sum`` (the
    same values), the others are exact zeros (``Where``: an expert's output on a token it was not chosen for may be
    inf), and the sum over experts runs in fp32 in ascending expert order, rounded once (``_gathered_sum`` sums in
    top-k order: the two differ by rounding only)."""
    # the weights as the left factors, as they lie ([E, N, K]: no transposed copy of them, neither per step nor
    # folded into a session's own initializer), against x^T [H, T]: token-last activations, one small transpose
    act = _swiglu(b, b.MatMul("w13", b.Transpose("x", perm=[1, 0])), alpha, limit, axis=1)  # [E, I, T]
    y = b.MatMul("w2", act)  # [E, H, T]
    zeros = b.Expand(b.const(0.0, np.float32), b.Concat(b.Shape("x", end=1), b.Shape("router_weight", end=1), axis=0))
    gain = b.Transpose(b.ScatterElements(zeros, idx, w, axis=1), perm=[1, 0])  # [E, T]: w where chosen, else 0
    chosen = b.Transpose(b.Cast(b.ScatterElements(zeros, idx, b.Expand(b.const(1.0, np.float32), b.Shape(idx)),
                                                  axis=1), to=TensorProto.BOOL), perm=[1, 0])  # [E, T]
    y = b.CastLike(b.Mul(b.Cast(y, to=F32), b.Unsqueeze(gain, b.const([1]))), "x")
    y = b.Where(b.Unsqueeze(chosen, b.const([1])), b.Cast(y, to=F32), b.const(0.0, np.float32))
    return b.CastLike(b.Transpose(b.ReduceSum(y, b.const([0]), keepdims=0), perm=[1, 0]), "x")  # [T, H]


def moe(decode: bool = False, all_experts: bool = False) -> FunctionProto:
    return _moe("MoE", mxfp8=False, decode=decode, all_experts=all_experts)


def moe_mxfp8(decode: bool = False, all_experts: bool = False) -> FunctionProto:
    return _moe("MoEMXFP8", mxfp8=True, decode=decode, all_experts=all_experts)


def mxfp8_linear() -> FunctionProto:
    b = Builder("")
    w = b.CastLike(_dequant(b, "weight", "weight_scale"), "x")
    return _function("MXFP8Linear", b, [b.MatMul("x", b.Transpose(w, perm=[1, 0]))])


CACHE_READERS = ("LightningIndexer", "PagedAttention", "SparsePagedAttention")  # the bodies with a kv_fp8 form
BUILDERS = {
    "LightningIndexer": lightning_indexer,
    "PagedAttention": paged_attention,
    "SparsePagedAttention": sparse_paged_attention,
    "MoE": moe,
    "MoEMXFP8": moe_mxfp8,
    "MXFP8Linear": mxfp8_linear,
}
# The decode-only bodies (``decode_graph.py``: steps where every sequence has one new token), where they differ
DECODE_READERS = {
    "LightningIndexer": lightning_indexer_decode,
    "PagedAttention": paged_attention_decode,
    "SparsePagedAttention": sparse_paged_attention_decode,
}


def body(name: str, kv_fp8: bool = False, decode: DecodeSizes | None = None) -> FunctionProto:
    """One op's body; ``kv_fp8``: the cache readers' form on uint8 E4M3 pools with scale pools; ``decode`` (the
    artifact's sizes): the decode-only form (no control flow, no size computed from the step's values), the same
    op for decode steps."""
    if decode is not None and name in DECODE_READERS:
        return DECODE_READERS[name](decode, kv_fp8=kv_fp8)
    if decode is not None and name in ("MoE", "MoEMXFP8"):
        return BUILDERS[name](decode=True, all_experts=decode.moe == "all-experts")
    return BUILDERS[name](kv_fp8=True) if kv_fp8 and name in CACHE_READERS else BUILDERS[name]()


def functions_for(op_types: set[str], kv_fp8: bool = False, decode: DecodeSizes | None = None
                  ) -> list[FunctionProto]:
    """The bodies of the given m3 ops, in a fixed order (so exports are byte-identical)."""
    return [body(name, kv_fp8, decode) for name in sorted(op_types)]
