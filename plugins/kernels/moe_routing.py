"""M3 routing on the device, and the token -> expert permutation the grouped MoE GEMMs read.

Not a kernel module (it is not in ``KERNEL_MODULES``): ``moe.py`` and ``moe_mxfp8.py`` share it. Nothing here waits
for the device (no ``.tolist()``, ``.item()``, ``nonzero`` or data-dependent shapes): every size follows from
``T``, ``top_k``, ``E`` and the row tile, so one decode batch shape is one set of launch shapes (CUDA-graph safe).

Routing (``docs/ops.md`` §5): fp32 logits ``float(x) @ float(router)^T`` (the reference's expression), then one
Triton program per block of tokens: sigmoid, + correction bias for the selection only, ``top_k`` rounds of
"largest value, lowest expert id among equals" (exactly the reference's stable descending sort), and the unbiased
scores of the chosen experts renormalised to sum 1. The routed scaling factor is applied where the expert outputs
are combined (``moe.py``).

At decode sizes (``T <= LOGITS_KERNEL_MAX_T``) the logits come from ``_router_logits``, which reads the 16-bit x
and the router weight as they are: the same fp32 products as ``x.float() @ router.float().t()`` (a product of two
bf16 values is exact in fp32; a bf16 x times an fp32 weight is rounded once, or fused into the add) summed in fp32
in another order. It replaces a cast of x, cuBLAS's fp32 GEMV (a dot kernel and a reduction kernel) with one
launch per MoE layer. Any fp32 summation of the H products (FMA or not, any order) is within
gamma_(H+1) * sum_h |x_h w_h| of the exact sum (gamma_n = n u / (1 - n u), u = 2^-24), cuBLAS's included, so the
two differ by at most twice that: the routing can differ only where two experts' scores are that close, which
the reference's own result on another device (another summation order) does as well. Every expert's logit is
summed in the same order, so experts with identical router rows tie exactly, as in the reference.

Prefill (``T > LOGITS_KERNEL_MAX_T``, 16-bit x, fp32 router): ``_router_logits_tc``, the same exact products on
tensor cores. At 16k tokens the reference's expression was a cast of x to fp32 (0.29 ms on the H200) and cuBLAS's
fp32 SIMT GEMM (0.50 ms) per layer. The fp32 weight is split once (``split_router_weight``, cached on the weight
tensor) into three bf16 parts w = w_hi + w_mid + w_lo, exactly:

* the split truncates (masks the low 16 bits of the fp32 pattern, which leaves a bf16 value): w_hi keeps the top 8
  of w's 24 significant bits, r = w - w_hi (exact in fp32: the bits of w below w_hi's, at most 16 of them, on w's
  own grid), w_mid the top 8 of r's, w_lo = r - w_mid the rest, at most 8 bits: a bf16 value if it lies on bf16's
  grid, i.e. if w is a multiple of 2^-133 (bf16's least subnormal). Every fp32 |w| >= 2^-110 is (its last bit is
  2^(e-23) >= 2^-133), and so is any smaller w whose bits below 2^-133 are zero; three bf16 values always sum to a
  multiple of 2^-133, so no split does better for the others, which lose their bits below 2^-133 (< 2^-133 per
  weight: ``SPLIT_FLOOR``, in the bound below). All three parts carry w's sign, so |w_hi| + |w_mid| + |w_lo| = |w|
  (on bf16's grid).
  Rounding to nearest instead (w_hi = bf16(w)) would also be exact, but rounds |w| >= 2^128 - 2^119 (fp32's top
  binade's last values, past bf16's largest) to infinity, and its parts' magnitudes sum past |w|.
* inf and NaN weights are w_hi alone (w_mid = w_lo = 0): their products, and so the logits, are inf or NaN where
  the reference's are.
* fp16 x (11 significant bits) is split the same way in the kernel into two bf16 parts (x_hi the top 8 bits, x_lo
  the other 3, exactly: fp16's range lies inside bf16's), six dots instead of three.

The products of two bf16 values (8 x 8 significant bits) are exact. The sums are not IEEE: NVIDIA's tensor cores add
a block of b products to the fp32 accumulator in one multi-term adder that aligns every addend to the largest and
truncates what falls below the accumulator's last bit, then normalises by truncation (round toward zero). Fasi,
Higham, Mikaitis, Pranesh, "Numerical behavior of NVIDIA tensor cores" (PeerJ CS 7:e330, 2021) measured this on
V100 / T4 / A100, Khattak and Mikaitis, "Accurate models of NVIDIA tensor cores" (arXiv:2512.07004) on H100 / B200;
the 13-14-bit accumulation reported for Hopper's FP8 wgmma (DeepSeek-V3's report, SageAttention2) is FP8's, not
bf16's. ``m3export/ops/index_score_bound.py`` derives what that costs for any block width 1 <= b <= n: one truncated
addend loses less than 2u times the largest addend, so a D-product dot on tensor cores is within
gamma_(2D+2)(2u) * sum |products| of the exact sum (u = 2^-24: RZ's unit is 2u, twice round-to-nearest's). No
measurement of the H200's adder enters it; ``tests/test_kernels_router_logits.py``'s GPU test checks it at the
``mini`` dims and 16k tokens. So, with A_big = sum_h |x_hi,h w_hi,h| (H products, accumulator ``big``) and A_small
the other parts' products (2H of them, 5H for fp16 x; about 2^-7 A_big, in the accumulator ``small``, so that the
large accumulator's roundings are counted over H products, not 3H), and one IEEE fp32 add big + small at the end:

    |logit - exact(x . w)| <= gamma_(2H+3)(2u) A_big + gamma_(2n+3)(2u) A_small + SPLIT_FLOOR * sum_h |x_h|

(n the small accumulator's products; each final-add rounding u |big + small| <= u (1 + gamma) (A_big + A_small) is
within the +1's). That is ``tc_logit_bound``, about 4 H u A: 4x the IEEE bound above (the routing's near-tie
rule, ``m3export/ops/routing_bound.fp32_score_bounds(..., tensor_cores=True)``, widens with it). Underflow is not
modelled, as above: it matters only where all of a logit's terms are below 2^-126, where the sigmoid is 1/2 in fp32
anyway. Every expert's column gets the same sequence of operations, so identical router rows still tie exactly.

Permutation (``group_by_expert``): two launches, per-chunk expert counts (``_chunk_counts``) and ``_group`` (a
program per expert and split of the ids, plus one for the unused tail) that pads, ranks and tags without a sort.
They replace 30 torch ops (a stable radix sort, scans, scatters, ``searchsorted``: ~45 device kernels, ~50 us on
the H200 at 16k tokens x top-4 over 128 experts), each dispatched from Python, and make the grouping two nodes
of a captured graph. (A 1.3 ms span of those kernels in one profiled eager call was mostly the profiler's own
per-op cost.) A single launch in which every expert's program counted all the ids took 73-82 us there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton import cdiv, next_power_of_2 as next_pow2
from . import _interpreter
from .mxfp8_linear import _INTERPRETED, dot_acc  # acc += a @ b, in fp32 under the interpreter (its bf16 dot is wrong)

_interpreter.apply()  # ``_group``'s loops have run-time bounds; see _interpreter.py


@triton.jit
def _route(
    logits_ptr, bias_ptr, ids_ptr, w_ptr, T, E, s_t,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    t_ok = t < T
    e_ok = e < E
    logits = tl.load(logits_ptr + t[:, None].to(tl.int64) * s_t + e[None, :], mask=t_ok[:, None] & e_ok[None, :],
                     other=0.0)
    scores = 1.0 / (1.0 + tl.exp(-logits))
    bias = tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)
    pick = tl.where(e_ok[None, :], scores + bias[None, :], float("-inf"))
    # Two passes over the same deterministic selection: the first sums the chosen scores, the second stores the
    # renormalised weights (a register list of top_k columns is not expressible, and this costs E compares).
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    sel = pick
    for _ in tl.static_range(TOP_K):
        best = tl.max(sel, axis=1)
        idx = tl.min(tl.where(sel == best[:, None], e[None, :], BLOCK_E), axis=1)
        hit = e[None, :] == idx[:, None]
        total += tl.sum(tl.where(hit, scores, 0.0), axis=1)
        sel = tl.where(hit, float("-inf"), sel)
    sel = pick
    for k in tl.static_range(TOP_K):
        best = tl.max(sel, axis=1)
        idx = tl.min(tl.where(sel == best[:, None], e[None, :], BLOCK_E), axis=1)
        hit = e[None, :] == idx[:, None]
        chosen = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        tl.store(ids_ptr + t * TOP_K + k, idx, mask=t_ok)
        tl.store(w_ptr + t * TOP_K + k, chosen / total, mask=t_ok)
        sel = tl.where(hit, float("-inf"), sel)


@triton.jit
def _router_logits(x_ptr, w_ptr, out_ptr, E, s_xt, s_we, s_ot, H: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    """logits[t, e-block] = sum_h fp32(x[t, h]) * fp32(w[e, h]): one token and BLOCK_E experts per program, fp32
    partial sums per lane over the H steps, then one fp32 reduction (the same order for every expert)."""
    t = tl.program_id(1)
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E
    acc = tl.zeros((BLOCK_E, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_ok = h < H
        xv = tl.load(x_ptr + t.to(tl.int64) * s_xt + h, mask=h_ok, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + e[:, None].to(tl.int64) * s_we + h[None, :], mask=e_ok[:, None] & h_ok[None, :],
                     other=0.0).to(tl.float32)
        acc += wv * xv[None, :]
    tl.store(out_ptr + t.to(tl.int64) * s_ot + e, tl.sum(acc, axis=1), mask=e_ok)


@triton.jit
def _router_logits_tc(x_ptr, w3_ptr, out_ptr, T, E, s_xt, s_ot, H: tl.constexpr, X_SPLIT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      INTERPRETED: tl.constexpr):
    """logits[t-block, e-block] = x @ (w_hi + w_mid + w_lo)^T from the bf16 parts w3 [3, E, H]: x times w_hi into
    ``big``, x times w_mid and w_lo (and, for fp16 x, x's low part times all three) into ``small``, big + small
    at the end (the module docstring's bound)."""
    t = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    e = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = t < T
    e_ok = e < E
    part = E * H  # elements per part (< 2^31 / 3 for any router)
    big = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    small = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < H
        x = tl.load(x_ptr + t[:, None].to(tl.int64) * s_xt + k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w_at = w3_ptr + e[None, :].to(tl.int64) * H + k[:, None]  # [BLOCK_K, BLOCK_N]: w^T's tile
        w_ok = k_ok[:, None] & e_ok[None, :]
        hi = tl.load(w_at, mask=w_ok, other=0.0)
        mid = tl.load(w_at + part, mask=w_ok, other=0.0)
        lo = tl.load(w_at + 2 * part, mask=w_ok, other=0.0)
        if X_SPLIT:  # fp16 x: its top 8 significant bits and the other 3, both bf16 exactly
            xf = x.to(tl.float32)
            xh = (xf.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
            x_hi = xh.to(tl.bfloat16)
            x_lo = (xf - xh).to(tl.bfloat16)
            small = dot_acc(x_lo, hi, small, INTERPRETED, "tf32")
            small = dot_acc(x_lo, mid, small, INTERPRETED, "tf32")
            small = dot_acc(x_lo, lo, small, INTERPRETED, "tf32")
        else:
            x_hi = x
        big = dot_acc(x_hi, hi, big, INTERPRETED, "tf32")
        small = dot_acc(x_hi, mid, small, INTERPRETED, "tf32")
        small = dot_acc(x_hi, lo, small, INTERPRETED, "tf32")
    tl.store(out_ptr + t[:, None].to(tl.int64) * s_ot + e[None, :], big + small, mask=t_ok[:, None] & e_ok[None, :])


LOGITS_KERNEL_MAX_T = 64  # the decode buckets (``_router_logits``); above, prefill's ``_router_logits_tc``
_LOGITS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TC_X_DTYPES = (torch.bfloat16, torch.float16)
SPLIT_FLOOR = 2.0 ** -133  # what the split may drop from one weight (below bf16's least subnormal); module docstring

# ``_router_logits_tc``'s launch: 128 x 128 output tiles (E = 128 experts in one tile: 128 programs at 16k tokens,
# one wave on the H200's 132 SMs), K steps of 64 (one stage: a 16 KB x tile and three 16 KB weight tiles), two
# 128 x 128 fp32 accumulators over 8 warps (64 registers each per thread). H200, 16384 x 6144 bf16 x over 128
# experts, do_bench medians: 0.130 ms against the reference expression's 0.788 ms (cast + cuBLAS fp32 GEMM); the
# VARIANTS 0.147 (K 32, 4 stages), 0.172 (64-row tiles), 0.223 (2 stages); every one's largest error 5.2e-4 of the
# docstring's bound (2.1e-3 of the IEEE one; cuBLAS 5.0e-4 of that). ``bench/moe.py --only prefill`` re-times them
# (its "router" entry).
LOGITS_TC = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
LOGITS_TC_VARIANTS = {
    "m128-k32-s4": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=4),
    "m64-k64-w4-s3": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3),
    "m128-k64-s2": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=2),
}


def split_router_weight(w: torch.Tensor) -> torch.Tensor:
    """fp32 router weight [E, H] -> bf16 [3, E, H]: w_hi, w_mid, w_lo with w_hi + w_mid + w_lo == w for every w on
    bf16's grid (every |w| >= 2^-110), each part truncated and of w's sign; inf / NaN in w_hi alone (module
    docstring)."""
    if w.dtype != torch.float32 or w.dim() != 2:
        raise ValueError(f"moe: router weight to split must be fp32 [E, H], got {w.dtype} {tuple(w.shape)}")
    w = w.contiguous()
    hi = (w.view(torch.int32) & -65536).view(torch.float32)  # the top 16 bits of the pattern: a bf16 value
    r = w - hi  # exact: w's bits below w_hi's
    mid = (r.view(torch.int32) & -65536).view(torch.float32)
    lo = r - mid  # exact: at most 8 significant bits
    finite = torch.isfinite(w)
    zero = torch.zeros((), dtype=torch.float32, device=w.device)
    parts = torch.stack([torch.where(finite, hi, w), torch.where(finite, mid, zero), torch.where(finite, lo, zero)])
    return parts.to(torch.bfloat16)  # exact for hi and mid (low 16 bits zero), and for lo on bf16's grid


def _split_cached(w: torch.Tensor) -> torch.Tensor:
    """``split_router_weight(w)``, kept on the weight tensor itself (a per-layer constant: 3 x 2 bytes x E x H,
    4.7 MB at E = 128, H = 6144) and recomputed when the tensor's storage, layout or version (an in-place update,
    e.g. ``load_state_dict``) changes. Not kept for inference tensors (no version counter: recomputed each call,
    a few element-wise kernels) or while a CUDA graph is being captured (the split would be a graph node, not a
    value yet)."""
    if w.is_inference():
        return split_router_weight(w)
    key = (w.data_ptr(), w._version, tuple(w.shape), w.stride(), w.device)
    hit = getattr(w, "_m3_router_split", None)
    if hit is not None and hit[0] == key:
        return hit[1]
    parts = split_router_weight(w)
    if not (w.is_cuda and torch.cuda.is_current_stream_capturing()):
        w._m3_router_split = (key, parts)
    return parts


def _logits_tc(x: torch.Tensor, router_weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """fp32 router logits [T, E] of 16-bit x and an fp32 router on tensor cores (``_router_logits_tc``); ``config``
    overrides ``LOGITS_TC``'s entries (``bench/moe.py``'s variants)."""
    cfg = dict(LOGITS_TC)
    unknown = set(config or {}) - set(cfg)
    if unknown:
        raise ValueError(f"moe_routing: unknown router-logits settings {sorted(unknown)}; known: {sorted(cfg)}")
    cfg.update(config or {})
    t, h = x.shape
    e = router_weight.shape[0]
    if router_weight.shape[1] != h:
        raise ValueError(f"moe: router weight {tuple(router_weight.shape)} does not match x's hidden size {h}")
    parts = _split_cached(router_weight)
    out = torch.empty((t, e), dtype=torch.float32, device=x.device)
    bn = min(cfg["BLOCK_N"], max(16, next_pow2(e)))
    grid = (cdiv(t, cfg["BLOCK_M"]), cdiv(e, bn))
    _router_logits_tc[grid](x, parts, out, t, e, x.stride(0), out.stride(0), H=h, X_SPLIT=x.dtype == torch.float16,
                            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"], INTERPRETED=_INTERPRETED,
                            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def _logits(x: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """fp32 router logits [T, E]: ``_router_logits`` at decode sizes, ``_router_logits_tc`` above them for 16-bit x
    and an fp32 router, else the reference's matmul."""
    t, h = x.shape
    e = router_weight.shape[0]
    if (t > LOGITS_KERNEL_MAX_T and x.dtype in _TC_X_DTYPES and router_weight.dtype == torch.float32
            and x.stride(-1) == 1):
        return _logits_tc(x, router_weight)
    if not (0 < t <= LOGITS_KERNEL_MAX_T and x.dtype in _LOGITS_DTYPES and router_weight.dtype in _LOGITS_DTYPES
            and x.stride(-1) == 1 and router_weight.stride(-1) == 1):
        return x.float() @ router_weight.float().t()
    out = torch.empty((t, e), dtype=torch.float32, device=x.device)
    # One expert row per program (E = 128 programs at T = 1, about one per SM): an fp32 row of the mini preset
    # (H = 6144) is 24 KB, read in three 8 KB steps of 16 values per thread; fewer, longer programs wait on
    # more dependent loads each.
    _router_logits[(e, t)](x, router_weight, out, e, x.stride(0), router_weight.stride(0), out.stride(0), H=h,
                           BLOCK_E=1, BLOCK_H=2048, num_warps=4)
    return out


def route(x: torch.Tensor, router_weight: torch.Tensor, bias: torch.Tensor, top_k: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (expert ids [T, top_k] int32 in selection order, weights [T, top_k] fp32 summing to 1 per token)."""
    t, e = x.shape[0], router_weight.shape[0]
    if not 1 <= top_k <= e:
        raise ValueError(f"moe: top_k={top_k} must be in [1, num_experts={e}]")
    if bias.shape != (e,):
        raise ValueError(f"moe: e_score_correction_bias has shape {tuple(bias.shape)}, expected ({e},)")
    logits = _logits(x, router_weight)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=x.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=x.device)
    if t:
        block_e = next_pow2(e)
        block_t = max(1, min(16, 4096 // block_e))
        _route[(cdiv(t, block_t),)](logits, bias, ids, weights, t, e, logits.stride(0),
                                    TOP_K=top_k, BLOCK_T=block_t, BLOCK_E=block_e, num_warps=4)
    return ids, weights


@dataclass
class ExpertBlocks:
    """Assignments (token, slot) grouped by expert into row blocks of ``block_m``, each block one expert's.

    ``rows[p]`` is the flat assignment ``token * top_k + slot`` at padded position ``p``, or ``num_assignments``
    for padding; ``block_expert[b]`` is the expert of rows ``[b * block_m, (b + 1) * block_m)``, or -1 for
    blocks past the last one in use (their programs return at once). Within an expert, assignments keep token
    order.
    """

    rows: torch.Tensor  # [num_blocks * block_m] int32
    block_expert: torch.Tensor  # [num_blocks] int32
    block_m: int
    num_assignments: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_blocks(num_assignments: int, num_experts: int, block_m: int) -> int:
    """Blocks that any routing of ``num_assignments`` over ``num_experts`` can need: every expert in use pads at most
    ``block_m - 1`` rows, at most min(E, n) experts are in use, and no expert has more blocks than rows."""
    used = min(num_experts, num_assignments)
    return max(1, min(num_assignments, cdiv(num_assignments + used * (block_m - 1), block_m)))


@triton.jit
def _chunk_counts(ids_ptr, counts_ptr, n, BLOCK_N: tl.constexpr, BINS: tl.constexpr):
    """counts[c, :] = assignments per expert among ids ``[c * BLOCK_N, (c + 1) * BLOCK_N)`` (``tl.histogram``)."""
    c = tl.program_id(0)
    i = c * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.histogram(tl.load(ids_ptr + i, mask=i < n, other=0).to(tl.int32), BINS, mask=i < n)
    tl.store(counts_ptr + c * BINS + tl.arange(0, BINS), h)


@triton.jit
def _group(ids_ptr, counts_ptr, rows_ptr, block_expert_ptr, n, E, num_blocks, num_chunks, chunks_per_split, SKIP,
           BLOCK_M: tl.constexpr, PAD: tl.constexpr, BLOCK_N: tl.constexpr, BINS: tl.constexpr,
           ROWS_C: tl.constexpr, BLOCK_B: tl.constexpr):
    """Program (e < E, s): expert e's assignments among chunks ``[s * chunks_per_split, (s + 1) * ...)`` of the
    ids, at e's padded start plus e's count in earlier chunks; split 0 also writes e's padding and its
    ``block_expert`` entries. Program (E, 0): the rows and blocks past the last expert's run (padding ``n``,
    expert -1).

    Every program sums the chunk counts (``_chunk_counts``; 16 KB at 16k tokens x top-4, from L2) for the padded
    starts, then ranks its own assignments chunk by chunk by a prefix count (``tl.cumsum``): increasing flat
    index within an expert, the stable sort's order.
    """
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    bins = tl.arange(0, BINS)
    c_lo = sid * chunks_per_split
    counts = tl.zeros((BINS,), dtype=tl.int32)
    before = tl.zeros((BINS,), dtype=tl.int32)  # per expert, in chunks before this split
    for c0 in range(0, num_chunks, ROWS_C):
        c = c0 + tl.arange(0, ROWS_C)
        tile = tl.load(counts_ptr + c[:, None] * BINS + bins[None, :], mask=(c < num_chunks)[:, None], other=0)
        counts += tl.sum(tile, axis=0)
        before += tl.sum(tl.where((c < c_lo)[:, None], tile, 0), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    first = tl.sum(tl.where(bins < pid, padded, 0), axis=0)  # padded start of this expert's run (program E: end)
    offs = tl.arange(0, BLOCK_N)
    if pid < E:
        done = first + tl.sum(tl.where(bins == pid, before, 0), axis=0)
        for c in range(c_lo, tl.minimum(c_lo + chunks_per_split, num_chunks)):
            i = c * BLOCK_N + offs
            hit = (tl.load(ids_ptr + i, mask=i < n, other=0).to(tl.int32) == pid) & (i < n)
            rank = tl.cumsum(hit.to(tl.int32), axis=0)
            tl.store(rows_ptr + done + rank - 1, i, mask=hit)
            done += tl.sum(hit.to(tl.int32), axis=0)
        if sid == 0:
            own = tl.sum(tl.where(bins == pid, counts, 0), axis=0)
            last = first + tl.sum(tl.where(bins == pid, padded, 0), axis=0)
            p = first + own + tl.arange(0, PAD)  # this expert's last block's padding (fewer than BLOCK_M rows)
            tl.store(rows_ptr + p, n, mask=p < last)
            tag = tl.where(pid == SKIP, -1, pid)
            for b0 in range(first // BLOCK_M, last // BLOCK_M, BLOCK_B):
                b = b0 + tl.arange(0, BLOCK_B)
                tl.store(block_expert_ptr + b, tl.zeros((BLOCK_B,), dtype=tl.int32) + tag, mask=b < last // BLOCK_M)
    elif sid == 0:
        rows_end = num_blocks * BLOCK_M
        for r0 in range(first, rows_end, BLOCK_N):
            r = r0 + offs
            tl.store(rows_ptr + r, tl.zeros((BLOCK_N,), dtype=tl.int32) + n, mask=r < rows_end)
        for b0 in range(first // BLOCK_M, num_blocks, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            tl.store(block_expert_ptr + b, tl.full((BLOCK_B,), -1, dtype=tl.int32), mask=b < num_blocks)


GROUP_SPLITS = 8  # id-range splits per expert in ``_group``: 1032 programs at 128 experts, ~8 per SM


def group_by_expert(ids: torch.Tensor, num_experts: int, block_m: int, skip: int | None = None) -> ExpertBlocks:
    """Stable sort of the assignments by expert, each expert's run padded to a multiple of ``block_m``: two
    launches, ``_chunk_counts`` (one program per chunk of ids) then ``_group`` (a program per expert and split of
    the ids, plus one for the unused tail), into uninitialised outputs, every entry written once.

    ``skip``: an expert whose blocks are tagged -1 in ``block_expert`` (their programs return at once) while its
    rows keep their place: expert parallelism's "not ours" expert (``moe.run_moe``). ``ids`` must lie in
    ``[0, num_experts)``; the result is that of the stable ``torch.sort`` of the flat ids (``tests``' reference)."""
    flat = ids.reshape(-1)
    n = flat.numel()
    device = flat.device
    nb = max_blocks(n, num_experts, block_m)
    # Chunks of up to 2048 ids (8 per thread at 8 warps), at least 256 (one per thread: no histogram input
    # replicated across threads). Bins: a power of two >= 32 (tl.histogram's warp-ballot lowering gives each lane
    # bins / 32 of them).
    block_n = min(2048, max(256, next_pow2(n)))
    bins = max(32, next_pow2(num_experts))
    num_chunks = max(1, cdiv(n, block_n))
    per_split = cdiv(num_chunks, GROUP_SPLITS)
    counts = torch.empty((num_chunks, bins), dtype=torch.int32, device=device)
    rows = torch.empty(nb * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=device)
    _chunk_counts[(num_chunks,)](flat, counts, n, BLOCK_N=block_n, BINS=bins, num_warps=8)
    _group[(num_experts + 1, cdiv(num_chunks, per_split))](
        flat, counts, rows, block_expert, n, num_experts, nb, num_chunks, per_split, -1 if skip is None else skip,
        BLOCK_M=block_m, PAD=next_pow2(block_m), BLOCK_N=block_n, BINS=bins, ROWS_C=32, BLOCK_B=128, num_warps=8)
    return ExpertBlocks(rows, block_expert, block_m, n)
