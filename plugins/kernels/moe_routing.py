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


LOGITS_KERNEL_MAX_T = 64  # the decode buckets; a prefill's logits are a GEMM (cuBLAS)
_LOGITS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _logits(x: torch.Tensor, router_weight: torch.Tensor) -> torch.Tensor:
    """fp32 router logits [T, E]: ``_router_logits`` at decode sizes, else the reference's matmul."""
    t, h = x.shape
    e = router_weight.shape[0]
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
