"""Op conformance: every implementation of every ``m3`` op, run on the same cases, against one float64 oracle.

Kernel and plugin authors import this module; ``tests/test_op_conformance.py`` parametrizes it over
implementation x case x dtype. The pieces:

* :data:`CASES`: named input builders tagged ``small`` (a few dozen tokens, tiny heads), ``m3-shape`` (the
  release's attributes: head dim 128, 64 query / 4 KV heads, blocks of 128, top-16, pages of 16 and 64, contexts
  of 2.1k-2.3k, where top-16 of 128-token blocks must choose), ``long`` (16k contexts, 2k-token MoE batches) and
  ``adversarial`` (NaN in the unused tail of a sequence's last page and in unowned pages, sequences with 0 new tokens, pages shared between sequences, more
  forced blocks than top-k, exact score and routing ties, E4M3 NaN / subnormal codes and scales 0 / 255, many
  sequences in one batch). A case builds its floating inputs in fp32; the activation inputs (type ``T`` or ``W``
  in the ONNX schema) are then rounded to the dtype under test.
* :data:`IMPLEMENTATIONS`: ``reference`` (the PyTorch references on the CPU), ``onnx-cpu`` (one ``m3::`` node
  whose model-local function body ONNX Runtime's CPU provider runs), ``triton-interpret`` (every launcher of
  ``m3export.plugins.kernels.kernels()`` on CPU tensors under ``TRITON_INTERPRET=1``, a tiny subset),
  ``cuda`` (whatever ``torch.ops.m3.*`` dispatches to on CUDA after the kernels registered themselves) and
  ``tensorrt`` (no engine per case yet). An unavailable combination says why (:meth:`Implementation.unavailable`).
* :func:`oracle`: the reference ``m3export.ops.<module>.<op>_reference`` evaluated on float64 upcasts of the very
  inputs the implementation received (the references accumulate in float64 for float64 inputs, see
  ``ops.paged.accumulation_dtype``).
* :func:`compare`: floating outputs within :data:`TOLERANCES` (per op and dtype, relative to the oracle output's
  largest magnitude, every bound with its reason); non-finite values where and only where the oracle has them;
  integer outputs (block selections) exact, except rows whose float64 margin is below what the contract's fp32
  score arithmetic can resolve: the near-tie rule of ``docs/ops.md`` §2, made executable. Those rows, and MoE
  tokens whose expert choice is such a near-tie, are reported (:class:`Verdict.near_ties`), not failed.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import OPS, index_score_bound, kv_fp8, mxfp8, routing_bound
from .indexer import lightning_indexer_reference
from .paged import gather_sequence, sequences

TAGS = ("small", "m3-shape", "long", "adversarial")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# ----------------------------------------------------------------------------------------------- references
def reference_function(op: str) -> Callable:
    """``m3export.ops.<module>.<name>_reference`` for an ONNX op name (``OPS`` maps it to ``m3::<name>``)."""
    name = OPS[op].split("::")[1]
    for module in ("attention", "indexer", "moe"):
        fn = getattr(importlib.import_module(f"{__package__}.{module}"), f"{name}_reference", None)
        if fn is not None:
            return fn
    raise LookupError(f"no reference function {name}_reference in m3export.ops for {op}")


def activation_inputs(op: str) -> tuple[bool, ...]:
    """Per input (the scale pools aside): does it take the dtype under test (schema type ``T``, ``W`` or ``P``, a cache pool,
    quantised after that rounding in FP8 cases)? Router tensors (``R``) stay fp32 as M3 stores them; integer,
    fp8 and scale inputs keep their own type."""
    from ..export.schemas import SPEC_BY_NAME

    return tuple(p.type_var in ("T", "W", "P") for p in SPEC_BY_NAME[op].inputs)


# ----------------------------------------------------------------------------------------------- paged batches
class PagedBatch:
    """A ragged paged batch: sequence b has ``ctx[b]`` tokens after the step, the last ``new[b]`` of them new.

    Pages are shuffled (never page 0, so an implementation that read slot 0 for real data is caught), tables
    are padded with an out-of-range page id, every page no sequence owns is NaN. ``share_pages``: every sequence
    reads its first pages (up to that many, full ones only) from sequence 0's, as prefix caching does.
    ``nan_tails``: the rows past a sequence's length in its last page are NaN too (never visible).
    """

    def __init__(self, ctx: list[int], new: list[int], page: int, gen: torch.Generator, *, spare: int = 3,
                 share_pages: int = 0, nan_tails: bool = False):
        if len(ctx) != len(new) or any(q > n for n, q in zip(ctx, new)):
            raise ValueError(f"bad batch: ctx {ctx}, new {new}")
        need = [-(-n // page) for n in ctx]
        if share_pages and ctx[0] < share_pages * page:
            raise ValueError("sequence 0 must fill the shared pages")
        shared = [0] + [min(share_pages, n // page) for n in ctx[1:]]
        self.num_pages = sum(k - s for k, s in zip(need, shared)) + spare + 1
        perm = (torch.randperm(self.num_pages - 1, generator=gen) + 1).tolist()
        self.block_tables = torch.full((len(ctx), max(need) + 2), self.num_pages + 7, dtype=torch.int32)
        owned, i = set(), 0
        for b, k in enumerate(need):
            s = shared[b]
            self.block_tables[b, :s] = self.block_tables[0, :s]
            own = perm[i:i + k - s]
            self.block_tables[b, s:k] = torch.tensor(own, dtype=torch.int32)
            owned.update(own)
            i += k - s
        self.unowned = [p for p in range(self.num_pages) if p not in owned]
        self.tails = [(int(self.block_tables[b, n // page]), n % page) for b, n in enumerate(ctx) if n % page]
        self.nan_tails = nan_tails
        self.page = page
        self.ctx, self.new = list(ctx), list(new)
        self.positions = torch.cat([torch.arange(n - q, n) for n, q in zip(ctx, new)])
        self.query_start_loc = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
        self.seq_lens = torch.tensor(ctx, dtype=torch.int32)
        self.gen = gen

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @property
    def args(self) -> list[torch.Tensor]:
        return [self.block_tables, self.query_start_loc, self.seq_lens, self.positions]

    def pool(self, *rest: int, fill: torch.Tensor | None = None) -> torch.Tensor:
        """[pages, page, *rest] fp32 random (or ``fill`` broadcast), with the invisible slots set to NaN."""
        p = torch.randn(self.num_pages, self.page, *rest, generator=self.gen) if fill is None else \
            fill.expand(self.num_pages, self.page, *rest).clone()
        p[self.unowned] = float("nan")
        if self.nan_tails:
            for page, row in self.tails:
                p[page, row:] = float("nan")
        return p


# ----------------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """``build(gen)`` -> (inputs in the op's order, floating ones in fp32; attributes in schema order)."""

    name: str
    op: str  # ONNX op name, a key of m3export.ops.OPS
    tags: frozenset[str]
    build: Callable[[torch.Generator], tuple[list[torch.Tensor], dict]] = field(repr=False, compare=False)
    cpu: bool = True  # False: too large for the CPU implementations (runs on cuda only)
    interpret: bool = False  # in the Triton interpreter's subset (a few tiny cases per op; it is ~1000x slower)
    fp8: bool = False  # the cache pools as E4M3 + per-row scales (FP8_POOLS), quantised from the T-rounded pools

    @property
    def id(self) -> str:
        return f"{self.op}/{self.name}"

    def inputs(self, dtype: torch.dtype, device: str | torch.device = "cpu") -> tuple[list[torch.Tensor], dict]:
        """The case's inputs with the activation inputs in ``dtype``, on ``device``. FP8 cases: each cache pool
        quantised (``ops/kv_fp8.quantize_rows``) after that rounding, as the model's cache write does, and its
        scale pool passed after the attributes (the ops' trailing optional inputs, in signature order)."""
        base, attrs = _built(self)
        cast = activation_inputs(self.op)
        inputs = [(t.to(dtype) if c else t) for t, c in zip(base, cast, strict=True)]
        if self.fp8:
            attrs = dict(attrs)
            for i, name in FP8_POOLS[self.op].items():
                inputs[i], attrs[name] = kv_fp8.quantize_rows(inputs[i])
            attrs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in attrs.items()}
        return [t.to(device) for t in inputs], attrs


# Per op reading cache pools: input index of each pool -> the name of its scale input (FP8 cases).
FP8_POOLS = {
    "LightningIndexer": {1: "index_k_scale"},
    "PagedAttention": {1: "k_scale", 2: "v_scale"},
    "SparsePagedAttention": {1: "k_scale", 2: "v_scale"},
}


def scalar_attributes(attrs: dict) -> dict:
    """The ONNX node attributes of a case (its scale pools are tensors, not attributes)."""
    return {k: v for k, v in attrs.items() if not isinstance(v, torch.Tensor)}


@functools.lru_cache(maxsize=4)
def _built(case: Case):
    """Build once per process (cases are seeded by name, so every implementation sees the same data)."""
    gen = torch.Generator().manual_seed(_seed(case.id))
    return case.build(gen)


def _seed(name: str) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(name)) % (2**31)


def _indexer_case(ctx, new, page, attrs, h=2, d=16, **paged):
    def build(gen):
        b = PagedBatch(ctx, new, page, gen, **paged)
        return [torch.randn(b.num_tokens, h, d, generator=gen), b.pool(d), *b.args], dict(attrs)
    return build


def _tie_indexer_case(ctx, new, page, attrs, h=2, d=8):
    """Every page holds the same rows (pages = blocks), so every full block scores the same: exact ties."""
    def build(gen):
        b = PagedBatch(ctx, new, page, gen)
        rows = torch.randn(page, d, generator=gen)
        return [torch.randn(b.num_tokens, h, d, generator=gen), b.pool(d, fill=rows), *b.args], dict(attrs)
    return build


def _attention_case(ctx, new, page, hq=4, hkv=2, d=16, **paged):
    def build(gen):
        b = PagedBatch(ctx, new, page, gen, **paged)
        q = torch.randn(b.num_tokens, hq, d, generator=gen)
        return [q, b.pool(hkv, d), b.pool(hkv, d), *b.args], dict(scale=d**-0.5)
    return build


def _sparse_case(ctx, new, page, attrs, selection, hq=4, hkv=2, d=16, **paged):
    """``selection``: ``indexer`` (the reference indexer on its own random index data) or ``random`` (any order,
    duplicates, -1 and ids past the sequence, plus the own block so that no row is empty)."""
    def build(gen):
        b = PagedBatch(ctx, new, page, gen, **paged)
        t = b.num_tokens
        q = torch.randn(t, hq, d, generator=gen)
        k, v = b.pool(hkv, d), b.pool(hkv, d)
        if selection == "indexer":
            sel = lightning_indexer_reference(torch.randn(t, hkv, d, generator=gen), b.pool(d), *b.args,
                                              *attrs.values())
        else:
            own = (b.positions // attrs["block_size"]).to(torch.int32)
            noise = torch.randint(-1, 12, (t, hkv, 3), generator=gen, dtype=torch.int32)
            sel = torch.cat([noise, own.view(t, 1, 1).expand(t, hkv, 1)], dim=-1)
        return [q, k, v, *b.args, sel], dict(block_size=attrs["block_size"], scale=d**-0.5)
    return build


MOE_ATTRS = dict(routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0)  # M3's


def _moe_tensors(gen, t, h, e, i, shared, tie=False):
    x = torch.randn(t, h, generator=gen) * 2  # large enough that the SwiGLU clamps engage
    ws = 0.3 * 64**0.5 / h**0.5  # keeps pre-activations O(1..10) at every width
    rw, bias = torch.randn(e, h, generator=gen) * ws, torch.randn(e, generator=gen) * 0.3
    if tie:  # experts 1, 4 and 6 route identically and always win: top-2 must take 1 and 4 (lower ids)
        rw[4] = rw[6] = rw[1]
        bias[[1, 4, 6]] = 10.0
    w13, w2 = torch.randn(e, 2 * i, h, generator=gen) * ws, torch.randn(e, h, i, generator=gen) * 0.3 * (32 / i)**0.5
    s13 = torch.randn(2 * shared, h, generator=gen) * ws
    s2 = torch.randn(h, shared, generator=gen) * 0.3 * (64 / shared)**0.5
    return x, rw, bias, w13, w2, s13, s2


def _moe_case(top_k, t, h=64, e=8, i=32, shared=64, tie=False):
    def build(gen):
        return list(_moe_tensors(gen, t, h, e, i, shared, tie)), dict(top_k=top_k, **MOE_ATTRS)
    return build


def _moe_mxfp8_case(top_k, t, h=64, e=8, i=32, shared=64, edge=False):
    """``edge``: E4M3 NaN codes and a scale of 255 (+inf) in an expert no token reaches (a kernel must not touch
    the weights of unrouted experts), subnormal codes, scales of 0 and the largest code in routed and shared
    weights (dequantised exactly, tiny or not)."""
    def build(gen):
        x, rw, bias, *weights = _moe_tensors(gen, t, h, e, i, shared)
        q = [part for w in weights for part in mxfp8.quantize(w)]
        if edge:
            bias[e - 1] = -100.0  # never routed
            w13, w13_s, w2, w2_s, s13, s13_s = q[0], q[1], q[2], q[3], q[4], q[5]
            for w, s in ((w13, w13_s), (w2, w2_s)):
                codes = w.view(torch.uint8)
                codes[e - 1, 0, :4] = torch.tensor([0x7F, 0xFF, 0x7F, 0x00], dtype=torch.uint8)  # NaN codes
                s[e - 1, 1, 0] = 255
                codes[:, 2, 1:8] = torch.arange(1, 8, dtype=torch.uint8)  # subnormal codes (2^-9 .. 7 * 2^-9)
                codes[:, 3, :2] = torch.tensor([0x7E, 0xFE], dtype=torch.uint8)  # +-448
                s[:, 4, 0] = 0  # 2^-127: products underflow to subnormal fp32 / zero in 16 bit
            s13.view(torch.uint8)[0, :7] = torch.arange(1, 8, dtype=torch.uint8)
            s13_s[1, 0] = 0
        return [x, rw, bias, *q], dict(top_k=top_k, **MOE_ATTRS)
    return build


def _mxfp8_linear_case(lead, n, k, edge=False):
    """``edge``: a NaN code (its output column is NaN), a scale of 255 over codes of both signs and zero
    (+inf, -inf, NaN products), subnormal codes and a scale of 0."""
    def build(gen):
        w, s = mxfp8.quantize(torch.randn(n, k, generator=gen))
        s[0, 0], s[1, min(1, k // 32 - 1)] = 100, 131  # far-from-one scales; 448 * 2^4 still fits fp16
        if edge:
            codes = w.view(torch.uint8)
            codes[2, 5] = 0x7F
            s[3, 0] = 255
            codes[3, :3] = torch.tensor([0x38, 0xB8, 0x00], dtype=torch.uint8)  # 1, -1, 0 times +inf
            codes[4, :8] = torch.arange(1, 9, dtype=torch.uint8)
            s[5, 0] = 0
            codes[6, :2] = torch.tensor([0x7E, 0xFE], dtype=torch.uint8)
        return [torch.randn(*lead, k, generator=gen), w, s], {}
    return build


def _zero_rows(build, pools):
    """Every third row of the given pool inputs all zero: scale 0 in an FP8 cache, which must read back as 0
    (a zero key scores 0, a zero value adds nothing), never 0/0."""
    def zeroed(gen):
        inputs, attrs = build(gen)
        for i in pools:
            flat = inputs[i].view(-1, *inputs[i].shape[2:])
            flat[::3] = 0.0
        return inputs, attrs
    return zeroed


# (context lengths, new tokens, page size, block size, top-k, local blocks, init blocks): the small paged shapes
SMALL_SHAPES = {
    "prefill-selects": ([37], [37], 8, 4, 3, 1, 0),
    "decode-batch": ([37, 5, 20], [1, 1, 1], 8, 4, 3, 1, 0),
    "verify-multi-token": ([29, 21], [4, 3], 8, 4, 3, 1, 0),
    "mixed-prefill-decode": ([30, 19, 12], [30, 1, 5], 5, 4, 4, 2, 1),
    "page-smaller-than-block": ([26, 9], [6, 9], 3, 4, 2, 1, 1),
    "no-forced-blocks": ([33, 14], [33, 2], 7, 2, 5, 0, 0),
    "wide-blocks": ([40, 3], [2, 3], 4, 16, 2, 1, 0),
}
# Nine sequences: two with 0 new tokens, every one reading sequence 0's first two pages, NaN page tails.
ADVERSARIAL_BATCH = dict(ctx=[26, 21, 21, 9, 14, 9, 30, 12, 5], new=[3, 0, 21, 1, 0, 1, 4, 12, 2], page=4,
                         share_pages=2, nan_tails=True)
M3_INDEX = dict(block_size=128, topk_blocks=16, local_blocks=1, init_blocks=0)
M3_HEADS = dict(hq=64, hkv=4, d=128)
# Release-shaped batches: decodes and multi-token verify steps past 2048 tokens (so the indexer must choose),
# with pages of 16 and of 64.
M3_SHAPES = {
    "page16": ([2100, 2300, 700], [1, 4, 3], 16),
    "page64": ([2200, 129], [2, 1], 64),
}
LONG_SHAPE = ([16384, 9000, 12000], [1, 4, 256], 64)  # decode at 16k, verify, a 256-token prefill chunk at 12k
# The same kind of batch at tiny dims (heads of 8, blocks of 16, top-4), so the CPU implementations run long
# contexts too: a decode at 6k (375 blocks to choose from), a verify step at 2.5k, a 40-token prefill chunk at 3k.
LONG_TINY_SHAPE = ([6000, 2500, 3100], [1, 4, 40], 16)
LONG_TINY_INDEX = dict(block_size=16, topk_blocks=4, local_blocks=1, init_blocks=1)
LONG_TINY_HEADS = dict(hq=4, hkv=2, d=8)


def _attrs(block_size, topk, local, init):
    return dict(block_size=block_size, topk_blocks=topk, local_blocks=local, init_blocks=init)


def _build_cases() -> dict[str, Case]:
    out: list[Case] = []

    def add(name, op, tags, build, cpu=True, fp8=False):
        out.append(Case(name, op, frozenset(tags), build, cpu, fp8=fp8))

    for name, (ctx, new, page, bs, topk, local, init) in SMALL_SHAPES.items():
        attrs = _attrs(bs, topk, local, init)
        add(name, "LightningIndexer", {"small"}, _indexer_case(ctx, new, page, attrs))
        add(name, "PagedAttention", {"small"}, _attention_case(ctx, new, page))
        for sel in ("indexer", "random"):
            add(f"{name}-{sel}", "SparsePagedAttention", {"small"}, _sparse_case(ctx, new, page, attrs, sel))

    adv = dict(ADVERSARIAL_BATCH)
    ctx, new, page = adv.pop("ctx"), adv.pop("new"), adv.pop("page")
    adv_attrs = _attrs(4, 3, 1, 1)
    small_adv = {"small", "adversarial"}
    add("nan-tails-empty-shared-batch", "LightningIndexer", small_adv, _indexer_case(ctx, new, page, adv_attrs, **adv))
    add("nan-tails-empty-shared-batch", "PagedAttention", small_adv, _attention_case(ctx, new, page, **adv))
    for sel in ("indexer", "random"):
        add(f"nan-tails-empty-shared-batch-{sel}", "SparsePagedAttention", small_adv,
            _sparse_case(ctx, new, page, adv_attrs, sel, **adv))
    add("forced-beyond-topk", "LightningIndexer", small_adv,
        _indexer_case([41, 23], [41, 2], 4, _attrs(4, 3, 3, 2)))
    add("score-ties", "LightningIndexer", small_adv, _tie_indexer_case([23, 18, 6], [23, 3, 6], 4, _attrs(4, 4, 2, 1)))
    add("score-ties-no-forced", "LightningIndexer", small_adv,
        _tie_indexer_case([27, 9], [5, 9], 4, _attrs(4, 3, 0, 0)))

    for name, (ctx, new, page) in M3_SHAPES.items():
        add(name, "LightningIndexer", {"m3-shape"}, _indexer_case(ctx, new, page, M3_INDEX, h=4, d=128))
        add(name, "PagedAttention", {"m3-shape"}, _attention_case(ctx, new, page, **M3_HEADS))
        add(f"{name}-indexer", "SparsePagedAttention", {"m3-shape"},
            _sparse_case(ctx, new, page, M3_INDEX, "indexer", **M3_HEADS))
    ctx, new, page = LONG_SHAPE
    add("16k", "LightningIndexer", {"long", "m3-shape"}, _indexer_case(ctx, new, page, M3_INDEX, h=4, d=128), cpu=False)
    add("16k", "PagedAttention", {"long", "m3-shape"}, _attention_case(ctx, new, page, **M3_HEADS), cpu=False)
    add("16k-indexer", "SparsePagedAttention", {"long", "m3-shape"},
        _sparse_case(ctx, new, page, M3_INDEX, "indexer", **M3_HEADS), cpu=False)
    ctx, new, page = LONG_TINY_SHAPE
    add("6k-tiny-dims", "LightningIndexer", {"long"}, _indexer_case(ctx, new, page, LONG_TINY_INDEX, h=2, d=8))
    add("6k-tiny-dims", "PagedAttention", {"long"}, _attention_case(ctx, new, page, **LONG_TINY_HEADS))
    for sel in ("indexer", "random"):
        add(f"6k-tiny-dims-{sel}", "SparsePagedAttention", {"long"},
            _sparse_case(ctx, new, page, LONG_TINY_INDEX, sel, **LONG_TINY_HEADS))

    # FP8 caches (E4M3 + per-row scales): the same shapes and data kinds, pools quantised by Case.inputs
    for name in ("decode-batch", "verify-multi-token", "mixed-prefill-decode"):
        ctx, new, page, bs, topk, local, init = SMALL_SHAPES[name]
        attrs = _attrs(bs, topk, local, init)
        add(f"fp8-{name}", "LightningIndexer", {"small"}, _indexer_case(ctx, new, page, attrs), fp8=True)
        add(f"fp8-{name}", "PagedAttention", {"small"}, _attention_case(ctx, new, page), fp8=True)
        add(f"fp8-{name}-indexer", "SparsePagedAttention", {"small"},
            _sparse_case(ctx, new, page, attrs, "indexer"), fp8=True)
    ctx, new, page = ADVERSARIAL_BATCH["ctx"], ADVERSARIAL_BATCH["new"], ADVERSARIAL_BATCH["page"]
    add("fp8-zero-rows-nan-tails", "LightningIndexer", small_adv,
        _zero_rows(_indexer_case(ctx, new, page, adv_attrs, **adv), (1,)), fp8=True)
    add("fp8-zero-rows-nan-tails", "PagedAttention", small_adv,
        _zero_rows(_attention_case(ctx, new, page, **adv), (1, 2)), fp8=True)
    add("fp8-zero-rows-nan-tails-random", "SparsePagedAttention", small_adv,
        _zero_rows(_sparse_case(ctx, new, page, adv_attrs, "random", **adv), (1, 2)), fp8=True)
    ctx, new, page = M3_SHAPES["page16"]
    add("fp8-page16", "LightningIndexer", {"m3-shape"}, _indexer_case(ctx, new, page, M3_INDEX, h=4, d=128),
        fp8=True)
    add("fp8-page16", "PagedAttention", {"m3-shape"}, _attention_case(ctx, new, page, **M3_HEADS), fp8=True)
    add("fp8-page16-indexer", "SparsePagedAttention", {"m3-shape"},
        _sparse_case(ctx, new, page, M3_INDEX, "indexer", **M3_HEADS), fp8=True)

    # (2, 4) and (4, 2): T * top_k <= E, the decode-sized steps the ONNX body computes per assignment
    for top_k, t in ((2, 9), (1, 1), (8, 5), (2, 4), (4, 2)):
        add(f"top{top_k}-{t}tok", "MoE", {"small"}, _moe_case(top_k, t))
    add("routing-ties", "MoE", small_adv, _moe_case(2, 16, tie=True))
    m3_moe = dict(h=6144, e=8, i=3072, shared=3072)  # release widths, 8 of the 128 experts
    add("release-widths", "MoE", {"m3-shape"}, _moe_case(4, 5, **m3_moe), cpu=False)
    add("2k-tokens", "MoE", {"long"}, _moe_case(4, 2048, h=256, e=16, i=128, shared=128))

    add("top2-9tok", "MoEMXFP8", {"small"}, _moe_mxfp8_case(2, 9))
    add("e4m3-edge-codes", "MoEMXFP8", small_adv, _moe_mxfp8_case(2, 12, edge=True))
    add("release-widths", "MoEMXFP8", {"m3-shape"}, _moe_mxfp8_case(4, 5, **m3_moe), cpu=False)
    add("2k-tokens", "MoEMXFP8", {"long"}, _moe_mxfp8_case(4, 2048, h=256, e=16, i=128, shared=128))

    add("rows7", "MXFP8Linear", {"small"}, _mxfp8_linear_case((7,), 48, 96))
    add("lead2x3", "MXFP8Linear", {"small"}, _mxfp8_linear_case((2, 3), 48, 96))
    add("e4m3-edge-codes", "MXFP8Linear", small_adv, _mxfp8_linear_case((5,), 48, 96, edge=True))
    add("release-k", "MXFP8Linear", {"m3-shape"}, _mxfp8_linear_case((4,), 1024, 6144))
    add("4k-tokens", "MXFP8Linear", {"long"}, _mxfp8_linear_case((4096,), 256, 512))

    cases = {c.id: c for c in out}
    if len(cases) != len(out):
        raise RuntimeError("duplicate conformance case names")
    for cid in INTERPRET_CASES:
        cases[cid] = dataclasses.replace(cases[cid], interpret=True)
    return cases


# What the Triton interpreter runs in CPU CI: per op, decodes / a verify step and the adversarial data, chosen
# for few programs (a 37-token prefill of sparse attention takes ~30 s interpreted); the gpu tier runs every case.
INTERPRET_CASES = (
    "LightningIndexer/decode-batch", "LightningIndexer/verify-multi-token", "LightningIndexer/forced-beyond-topk",
    "LightningIndexer/score-ties-no-forced", "LightningIndexer/nan-tails-empty-shared-batch",
    "PagedAttention/decode-batch", "PagedAttention/verify-multi-token", "PagedAttention/nan-tails-empty-shared-batch",
    "SparsePagedAttention/decode-batch-random", "SparsePagedAttention/verify-multi-token-indexer",
    "MoE/top1-1tok", "MoE/routing-ties", "MoEMXFP8/e4m3-edge-codes",
    "MXFP8Linear/rows7", "MXFP8Linear/e4m3-edge-codes",
    "LightningIndexer/fp8-decode-batch", "LightningIndexer/fp8-zero-rows-nan-tails",
    "PagedAttention/fp8-verify-multi-token", "PagedAttention/fp8-zero-rows-nan-tails",
    "SparsePagedAttention/fp8-decode-batch-indexer",
)


CASES: dict[str, Case] = _build_cases()


def cases_for(op: str, tag: str | None = None) -> list[Case]:
    return [c for c in CASES.values() if c.op == op and (tag is None or tag in c.tags)]


# ----------------------------------------------------------------------------------------------- oracle
def oracle(case: Case, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """The reference on float64 upcasts of exactly the inputs an implementation gets for ``dtype``."""
    return _oracle(case, dtype, str(device))


@functools.lru_cache(maxsize=8)
def _oracle(case: Case, dtype: torch.dtype, device: str) -> torch.Tensor:
    inputs, attrs = case.inputs(dtype, device)
    return reference_function(case.op)(*upcast(inputs), *attrs.values())


def upcast(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.double() if t.is_floating_point() and t.dtype != torch.float8_e4m3fn else t for t in inputs]


# ----------------------------------------------------------------------------------------------- tolerances
@dataclass(frozen=True)
class Tolerance:
    rel: float  # max |got - oracle| over max |oracle| (finite entries)
    why: str


_ATTN = {
    torch.float32: Tolerance(1e-5, "fp32 scores, softmax and sums in another order (tiles, split-K merges, "
                                   "online softmax) differ by a few ulp (1.2e-7) of the largest term per sum; "
                                   "1e-5 is ~80 ulp. Measured: the CPU reference <= 1e-6 on every case."),
    torch.float16: Tolerance(2e-3, "one rounding of the output to fp16 (<= 2^-11 = 4.9e-4 of an element), plus "
                                   "P rounded to fp16 for a tensor-core PV product as flash kernels do (another "
                                   "<= 4.9e-4, averaging out); 2e-3 = 2 ulp of the largest output."),
    torch.bfloat16: Tolerance(1.6e-2, "the same two roundings in bf16 (<= 2^-8 = 3.9e-3 each); 1.6e-2 = 2 ulp."),
}
_MOE = {
    torch.float32: Tolerance(1e-5, "fp32 matmuls over H <= 6144 in another order and one routed sum: a few ulp "
                                   "of the largest partial sums. Measured: the CPU reference <= 2e-6."),
    torch.float16: Tolerance(4e-3, "the contract computes in T: gate/up product, SwiGLU (3 roundings), down "
                                   "product, routing weight and top_k accumulations and the shared expert are each "
                                   "rounded to fp16 (2^-11 each, partly cancelling); 4e-3 = 4 ulp. Measured: the "
                                   "CPU fp16 reference <= 1.3e-3."),
    torch.bfloat16: Tolerance(3.2e-2, "the same roundings in bf16 (2^-8 each); 3.2e-2 = 4 ulp. Measured: the CPU "
                                      "bf16 reference <= 1e-2."),
}
_LINEAR = {
    torch.float32: Tolerance(1e-5, "one fp32 dot of K <= 6144 terms in another order; the dequantised weight is "
                                   "exact. Measured: the CPU reference <= 1e-6."),
    torch.float16: Tolerance(2e-3, "one rounding of the output to fp16 (2^-11) and of fp32 partial sums in "
                                   "split-K kernels; 2e-3 = 2 ulp."),
    torch.bfloat16: Tolerance(1.6e-2, "one rounding of the output to bf16 (2^-8); 1.6e-2 = 2 ulp."),
}
TOLERANCES: dict[tuple[str, torch.dtype], Tolerance] = {
    **{("PagedAttention", d): t for d, t in _ATTN.items()},
    **{("SparsePagedAttention", d): t for d, t in _ATTN.items()},
    **{("MoE", d): t for d, t in _MOE.items()},
    **{("MoEMXFP8", d): t for d, t in _MOE.items()},
    **{("MXFP8Linear", d): t for d, t in _LINEAR.items()},
}
"""Floating outputs. ``LightningIndexer`` returns block ids: exact, with the near-tie rule of :func:`compare`."""


# ----------------------------------------------------------------------------------------------- comparison
@dataclass
class Verdict:
    failures: list[str] = field(default_factory=list)
    near_ties: list[str] = field(default_factory=list)
    max_rel_error: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures


def compare(case: Case, dtype: torch.dtype, got: torch.Tensor, inputs: list[torch.Tensor], attrs: dict,
            want: torch.Tensor | None = None) -> Verdict:
    """``got`` from an implementation run on ``inputs`` (as :meth:`Case.inputs` gave them) against the oracle."""
    want = oracle(case, dtype, inputs[0].device) if want is None else want
    got = got.to(want.device)
    v = Verdict()
    if tuple(got.shape) != tuple(want.shape):
        v.failures.append(f"shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        return v
    if case.op == "LightningIndexer":
        if got.dtype != torch.int32:
            v.failures.append(f"dtype {got.dtype}, expected torch.int32")
            return v
        inputs64 = upcast(inputs)
        if case.fp8:  # the near-tie rule on the scores of the keys as read: dequantised, exactly, in float64
            inputs64[1] = kv_fp8.dequantize_rows(inputs[1], attrs["index_k_scale"], torch.float64)
        _compare_selection(got, want, inputs64, scalar_attributes(attrs), v,
                           ieee_fp32=index_score_bound.ieee_operands(inputs[0].dtype, inputs[1].dtype))
        return v
    if got.dtype != dtype:
        v.failures.append(f"dtype {got.dtype}, expected {dtype}")
        return v
    rows = torch.ones(got.shape[0], dtype=torch.bool, device=got.device)
    if case.op in ("MoE", "MoEMXFP8"):
        tensor_cores = inputs[0].dtype in (torch.bfloat16, torch.float16) and inputs[1].dtype == torch.float32
        rows = ~_routing_near_ties(upcast(inputs), attrs, v, tensor_cores)
    _compare_float(got[rows], want[rows], TOLERANCES[case.op, dtype], v)
    return v


def _compare_float(got: torch.Tensor, want: torch.Tensor, tol: Tolerance, v: Verdict) -> None:
    g = got.double()
    finite = torch.isfinite(want)
    same_nonfinite = (torch.isnan(g) == torch.isnan(want)) & (torch.isinf(want) <= (g == want))
    if not bool(same_nonfinite.all()) or not bool(torch.isfinite(g[finite]).all()):
        bad = (~same_nonfinite | (finite & ~torch.isfinite(g))).nonzero()[:3].tolist()
        v.failures.append(f"non-finite values differ from the oracle's at {bad} "
                          f"(got {[g[tuple(i)].item() for i in bad]}, want {[want[tuple(i)].item() for i in bad]})")
        return
    if not bool(finite.any()):
        return
    scale = want[finite].abs().max().item()
    err = (g[finite] - want[finite]).abs().max().item()
    v.max_rel_error = err / scale if scale else err
    if err > tol.rel * scale:
        v.failures.append(f"max abs error {err:.3e} = {v.max_rel_error:.2e} of the output scale {scale:.3e}; "
                          f"tolerance {tol.rel:.1e} ({tol.why})")


def _routing_near_ties(inputs64: list[torch.Tensor], attrs: dict, v: Verdict, tensor_cores: bool = False
                       ) -> torch.Tensor:
    """Tokens where an fp32 routing may keep another expert set than the float64 one: some kept expert a and dropped
    c with 0 < S_a - S_c <= beta_a + beta_c (``routing_bound``: the bound ``m3export verify`` applies too). Exact
    ties (margin 0) are not near ties: they must go to the lower expert id in every implementation."""
    x, router, bias = inputs64[0], inputs64[1], inputs64[2]
    k = attrs["top_k"]
    if k >= router.shape[0]:
        return torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    beta = routing_bound.fp32_score_bounds(x, router, bias, tensor_cores)  # 16-bit x, fp32 router: GPU prefill
    kept, rest, gap, bound = routing_bound.swap_pairs(torch.sigmoid(x @ router.t()) + bias, beta, k)
    swappable = (gap > 0) & (gap <= bound)
    near = swappable.flatten(1).any(-1)
    for t in near.nonzero().flatten().tolist():
        a, c = divmod(int(torch.where(swappable[t], gap[t] / bound[t], torch.inf).argmin()), rest.shape[1])
        v.near_ties.append(f"token {t}: experts {int(kept[t, a])} / {int(rest[t, c])} differ by "
                           f"{gap[t, a, c].item():.2e} (fp32 resolves {bound[t, a, c].item():.2e})")
    return near


def block_scores64(inputs64: list[torch.Tensor], attrs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 block scores M [T, H, NB] (-inf for blocks a token cannot see) and, per block, the largest
    sum_d |q_d k_d| of its visible keys (0 where none): what ``index_score_bound.dot_error_factor`` scales into the
    block score's rounding bound."""
    q, pool, tables, qsl, seq_lens, positions = inputs64[:6]
    bs = attrs["block_size"]
    t, h, d = q.shape
    nb_max = max([-(-int(n) // bs) for n in seq_lens.tolist()] + [1])
    scores = torch.full((t, h, nb_max), float("-inf"), dtype=torch.float64, device=q.device)
    bound = torch.zeros((t, h, nb_max), dtype=torch.float64, device=q.device)
    for b, s, e, n in sequences(qsl, seq_lens):
        if e == s:
            continue
        keys = gather_sequence(pool, tables[b], n)
        sc = torch.einsum("thd,nd->thn", q[s:e], keys)
        mag = torch.einsum("thd,nd->thn", q[s:e].abs(), keys.abs())
        future = torch.arange(n, device=q.device).view(1, 1, n) > positions[s:e].view(-1, 1, 1)
        sc, mag = sc.masked_fill(future, float("-inf")), mag.masked_fill(future, 0.0)
        nb = -(-n // bs)
        pad = nb * bs - n
        sc = torch.nn.functional.pad(sc, (0, pad), value=float("-inf")).view(e - s, h, nb, bs)
        mag = torch.nn.functional.pad(mag, (0, pad)).view(e - s, h, nb, bs)
        scores[s:e, :, :nb] = sc.amax(-1)
        bound[s:e, :, :nb] = mag.amax(-1)
    return scores, bound


def _compare_selection(got: torch.Tensor, want: torch.Tensor, inputs64: list[torch.Tensor], attrs: dict,
                       v: Verdict, ieee_fp32: bool = False) -> None:
    """Exact, except rows where every differing slot holds two blocks whose float64 scores differ by more than 0
    and by at most the sum of their scores' rounding bounds (``index_score_bound``: ``ieee_fp32`` for fp32 queries
    and keys, else the tensor-core bound of 16-bit / FP8 operands); the i-th best of perturbed scores is within one
    bound of the i-th best of the exact ones, so a correct implementation passes this check."""
    diff = (got != want).any(-1).nonzero().tolist()
    if not diff:
        return
    scores, abs_dot = block_scores64(inputs64, attrs)
    bound = index_score_bound.dot_error_factor(inputs64[0].shape[-1], ieee_fp32) * abs_dot
    nb = scores.shape[-1]
    positions = inputs64[5].tolist()
    bs, local, init = attrs["block_size"], attrs["local_blocks"], attrs["init_blocks"]

    def forced(t: int, c: int) -> bool:
        own = positions[t] // bs
        return c <= own and (c > own - local or c < init)

    for t, h in diff:
        g, w = got[t, h].tolist(), want[t, h].tolist()
        row = f"token {t}, head {h}: got {g}, oracle {w}"
        valid = len(set(g)) == len(g) - g.count(-1) + min(1, g.count(-1)) and all(-1 <= x < nb for x in g)
        ok = valid and all((a == -1) == (b == -1) for a, b in zip(g, w))
        if ok:
            for a, b in zip(g, w):
                if a == b:
                    continue
                if forced(t, a) or forced(t, b):  # forced blocks rank above every score: no tie possible
                    ok = False
                    break
                gap = abs(scores[t, h, a] - scores[t, h, b]).item()
                slack = (bound[t, h, a] + bound[t, h, b]).item()
                if not (0 < gap <= slack) or not math.isfinite(gap):
                    ok = False
                    break
        if ok:
            v.near_ties.append(row)
        else:
            v.failures.append(row)
        if len(v.failures) >= 5:
            v.failures.append("...")
            return


# ----------------------------------------------------------------------------------------------- implementations
class Implementation:
    """One way of running the ops. ``dispatch_key``: the torch.library device type whose registered ``m3``
    kernels this implementation exercises (the completeness test requires one for every registered key)."""

    name: str = ""
    device: str = "cpu"
    dispatch_key: str | None = None
    gpu: bool = False  # pytest marks its cases ``gpu``

    def unavailable(self, case: Case, dtype: torch.dtype) -> str | None:
        """None when this implementation can run ``case`` in ``dtype`` here, else the reason it cannot."""
        if not case.cpu and self.device == "cpu":
            return "case too large for the CPU implementations (the cuda implementation runs it)"
        return None

    def run(self, op: str, inputs: list[torch.Tensor], attrs: dict) -> torch.Tensor:
        raise NotImplementedError


class Reference(Implementation):
    name = "reference"

    def run(self, op, inputs, attrs):
        return reference_function(op)(*inputs, *attrs.values())


class OnnxCpu(Implementation):
    """One ``m3::`` node with its model-local function body (``m3export/export/functions.py``), shape-inferred
    and checked by ``onnx``, run by ONNX Runtime's CPU execution provider."""

    name = "onnx-cpu"

    def unavailable(self, case, dtype):
        if dtype == torch.bfloat16:
            return "ONNX Runtime's CPU execution provider has no bfloat16 MatMul/Gemm kernels (docs/ops.md §9)"
        return super().unavailable(case, dtype)

    def run(self, op, inputs, attrs):
        """FP8 pools go in as their uint8 codes and their scale pools as the trailing inputs (the exported
        form: no ONNX opset gathers float8, ``m3export/export/kv_fp8_onnx.py``)."""
        out_dtype = torch.int32 if op == "LightningIndexer" else inputs[0].dtype
        scales = [v for v in attrs.values() if isinstance(v, torch.Tensor)]
        pools = FP8_POOLS.get(op, {}) if scales else {}
        codes = [t.view(torch.uint8) if i in pools else t for i, t in enumerate(inputs)]
        return run_onnx(op, codes + scales, scalar_attributes(attrs), out_dtype, kv_fp8=bool(scales))


def _onnx_type(dtype: torch.dtype) -> int:
    from onnx import TensorProto

    return {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16, torch.bfloat16: TensorProto.BFLOAT16,
            torch.int32: TensorProto.INT32, torch.int64: TensorProto.INT64, torch.uint8: TensorProto.UINT8,
            torch.float8_e4m3fn: TensorProto.FLOAT8E4M3FN}[dtype]


def run_onnx(op: str, inputs: list[torch.Tensor], attrs: dict, out_dtype: torch.dtype,
             kv_fp8: bool = False, providers: list | None = None, decode=None) -> torch.Tensor:
    """Build, shape-infer, check and run a one-node model of ``m3::op`` in ONNX Runtime on the CPU (``kv_fp8``:
    the body reading uint8 E4M3 pools with their scale pools, given as the trailing inputs; ``providers``: ORT's
    session providers instead, e.g. the CUDA EP for the GPU tests; ``decode``: the decode-only body built with
    these ``functions.DecodeSizes``, for decode steps only)."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    from ..export.functions import body
    from ..export.schemas import SPEC_BY_NAME, opset_imports, register_schemas

    register_schemas()
    spec = SPEC_BY_NAME[op]
    names = [p.name for p in (*spec.inputs, *spec.optional_inputs)][:len(inputs)]
    out_name = spec.outputs[0].name
    graph = helper.make_graph(
        [helper.make_node(op, names, [out_name], domain="m3", **attrs)], op,
        [helper.make_tensor_value_info(n, _onnx_type(t.dtype), [f"{n}_{i}" for i in range(t.dim())])
         for n, t in zip(names, inputs, strict=True)],
        [helper.make_tensor_value_info(out_name, _onnx_type(out_dtype), None)],
    )
    model = helper.make_model(graph, opset_imports=opset_imports(), functions=[body(op, kv_fp8, decode)])
    model.ir_version = 10
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    out_type = inferred.graph.output[0].type.tensor_type
    if out_type.elem_type != _onnx_type(out_dtype):
        raise AssertionError(f"{op}: shape inference gives element type {out_type.elem_type}")
    onnx.checker.check_model(inferred, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=providers or ["CPUExecutionProvider"])

    def value(t: torch.Tensor):
        t = t.contiguous()
        raw = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
        if t.dtype == torch.bfloat16:
            raw = t.view(torch.int16)
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(raw.numpy(), _onnx_type(t.dtype))

    (out,) = sess.run_with_ort_values(None, {n: value(t) for n, t in zip(names, inputs)})
    return torch.from_numpy(out.numpy())


def _kernels() -> dict[str, Callable]:
    from ..plugins.kernels import kernels

    return kernels()


class TritonInterpret(Implementation):
    """Every Triton launcher on CPU tensors through Triton's interpreter. ``TRITON_INTERPRET=1`` must be set
    before the kernel modules are imported (``scripts/test.sh`` and ``tests/conftest.py`` do on machines without
    CUDA); the interpreter is slow, so it runs only :data:`INTERPRET_CASES`, in fp32 and bf16."""

    name = "triton-interpret"

    def unavailable(self, case, dtype):
        from ..plugins.kernels import triton_available

        if not triton_available():
            return "triton is not installed (pip install 'm3export[gpu]')"
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "TRITON_INTERPRET=1 is not set (kernels would compile for a GPU)"
        if not case.interpret:
            return "not in the Triton interpreter's tiny subset (INTERPRET_CASES; the gpu tier runs every case)"
        if dtype == torch.float16:
            return "the Triton interpreter runs fp32 and bf16 (fp16 runs compiled in the gpu tier)"
        if OPS[case.op] not in _kernels():
            return f"no Triton kernel for {OPS[case.op]} yet (m3export.plugins.kernels.KERNEL_MODULES)"
        return super().unavailable(case, dtype)

    def run(self, op, inputs, attrs):
        return _kernels()[OPS[op]](*inputs, *attrs.values())


class Cuda(Implementation):
    """``torch.ops.m3.*`` on CUDA tensors after ``m3export.plugins.kernels.register()``: the registered Triton
    kernel where one exists, else the reference running on the GPU."""

    name = "cuda"
    device = "cuda"
    dispatch_key = "cuda"
    gpu = True

    def unavailable(self, case, dtype):
        if not torch.cuda.is_available():
            return "no CUDA device"
        if os.environ.get("TRITON_INTERPRET") == "1":
            return "TRITON_INTERPRET=1: the Triton kernels run in the interpreter, not on the GPU"
        return None

    def run(self, op, inputs, attrs):
        from ..plugins.kernels import register, triton_available

        if triton_available():
            register()
        fn = getattr(torch.ops.m3, OPS[op].split("::")[1])
        return fn(*inputs, *attrs.values())


class TensorRT(Implementation):
    name = "tensorrt"
    device = "cuda"
    gpu = True

    def unavailable(self, case, dtype):
        import importlib.util

        if importlib.util.find_spec("tensorrt") is None:
            return "tensorrt is not installed"
        return ("no TensorRT engine is built per case yet; the plugins' AOT kernels, launched with TensorRT's "
                "arguments, are checked by tests/test_tensorrt_plugins*.py")


IMPLEMENTATIONS: dict[str, Implementation] = {
    i.name: i for i in (Reference(), OnnxCpu(), TritonInterpret(), Cuda(), TensorRT())
}


def registered_dispatch_keys(op: str) -> set[str]:
    """Device types with a kernel registered for ``m3::<op>`` beyond the reference (``torch.library``)."""
    from torch._library.custom_ops import _maybe_get_opdef

    opdef = _maybe_get_opdef(OPS[op])
    keys = {k for k in (opdef._backend_fns if opdef is not None else {}) if k is not None}
    for key in ("CPU", "CUDA", "HIP", "XPU", "MPS"):
        if torch._C._dispatch_has_kernel_for_dispatch_key(OPS[op], key):
            keys.add(key.lower())
    return keys


def run_case(impl: Implementation, case: Case, dtype: torch.dtype) -> Verdict:
    """Run one combination and judge it (the caller checks ``impl.unavailable`` first)."""
    inputs, attrs = case.inputs(dtype, impl.device)
    with torch.no_grad():
        got = impl.run(case.op, inputs, attrs)
    return compare(case, dtype, got, inputs, attrs)
