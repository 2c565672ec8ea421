"""A step's plain sampled rows in one launch: what ``runtime.acceptance.decide`` runs on a GPU for rows that verify
no draft, in the steps where it measured faster (``acceptance.KERNEL_LEAST_ROWS``). Not an ``m3`` op (no model
graph samples).

Why: the batched float64 definitions (``runtime.sampling.filtered_probs_rows`` + ``draw_rows``) are 30-110 PyTorch
operations per step, and on the H200 their launches set the sampled pass's time at small batches (0.5-1.1 ms at
one row against 0.1 ms greedy) while at 64 rows the device's vocabulary sort and long-row scans took 0.9-3.8 ms
(``docs/performance.md``, thirteenth session). Here one program per row reads the row's float32 logits (penalised)
three times:

1. the row's largest logit (it always survives top-k and min-p, so it is the filtered row's maximum too);
2. the filtered weights' total, ``sum exp(x / T - max / T)`` over the tokens that survive top-k (``x >= kth``,
   the k-th largest logit, a threshold the caller takes with ``torch.topk``: dividing by a positive temperature keeps
   the logits' order and keeps distinct float32 values distinct in float64) and min-p (``x / T >= max / T +
   log(min_p)``), all in float64 as ``filtered_probs``;
3. without top-p: the inverse CDF, the first token whose cumulative weight passes ``u`` x total, by blocks (each
   block's cumulative sum plus the blocks before it). With top-p: over the row's ``C`` candidates (the ``C``
   largest logits, in token-id order, from the caller), each candidate's probability mass before it in the
   reference's order (probability descending, ties by token id: ``filtered_probs``' stable sort) as a sum over the
   candidates, the nucleus (mass before < top_p), and the inverse CDF over the nucleus in token-id order. The
   nucleus is exact when every kept candidate's probability is above the smallest candidate's (nothing outside the
   candidates can then belong to it or sit between its members); a row where that fails (a nucleus of more than
   ``C`` tokens, or a tie reaching the last candidate) is flagged and the caller redoes it with the definitions.

The token is ``runtime.sampling.sample``'s for the same uniform up to float64 rounding: the sums run in another
order, so a token can differ only where the uniform lands within ~1e-16 of a step of the CDF or a top-p cut moves
by rounding (``tests/test_kernels_sampling.py``: tokens against ``sample`` under the interpreter and on the GPU).
A drawn token always has positive weight (a target that rounding puts past the end takes the last such token).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._batch import next_pow2

#: Tokens per block of the full-row passes.
BLOCK = 2048
#: Top-p candidates per row (a nucleus of at most this many tokens, the usual case at top-p <= 0.95 on a trained
#: model, is found in the launch; a larger one is flagged), and candidates per step of the mass-before sum.
CANDIDATES = 1024
CANDIDATE_STEP = 16


@triton.jit
def _filtered(x, kth, temp, x_max_t, log_min_p):
    """float32 logits -> (x / T in float64, whether the token survives top-k and min-p)."""
    xd = x.to(tl.float64) / temp
    return xd, (x >= kth) & (xd >= x_max_t + log_min_p)


@triton.jit
def _sample_rows(x_ptr, sx, V, kth_ptr, temp_ptr, log_min_p_ptr, top_p_ptr, u_ptr, cand_ptr, sc, C,
                 token_ptr, redo_ptr, BLOCK: tl.constexpr, CB: tl.constexpr, STEP: tl.constexpr):
    r = tl.program_id(0)
    row = x_ptr + r.to(tl.int64) * sx
    temp = tl.load(temp_ptr + r)
    kth = tl.load(kth_ptr + r)
    log_min_p = tl.load(log_min_p_ptr + r)
    top_p = tl.load(top_p_ptr + r)
    u = tl.load(u_ptr + r)
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        m = tl.maximum(m, tl.load(row + start + offs, mask=start + offs < V, other=float("-inf")))
    x_max_t = tl.max(m, 0).to(tl.float64) / temp
    total = tl.zeros([BLOCK], tl.float64)
    for start in range(0, V, BLOCK):
        ok = start + offs < V
        xd, keep = _filtered(tl.load(row + start + offs, mask=ok, other=float("-inf")), kth, temp, x_max_t,
                             log_min_p)
        total += tl.where(keep & ok, tl.exp(xd - x_max_t), 0.0)
    total_w = tl.sum(total, 0)
    if top_p < 1.0:
        c_offs = tl.arange(0, CB)
        c_ok = c_offs < C
        ids = tl.load(cand_ptr + r.to(tl.int64) * sc + c_offs, mask=c_ok, other=0)
        xd, keep = _filtered(tl.load(row + ids, mask=c_ok, other=float("-inf")), kth, temp, x_max_t, log_min_p)
        p = tl.where(keep & c_ok, tl.exp(xd - x_max_t), 0.0) / total_w
        before = tl.zeros([CB], tl.float64)
        for i0 in range(0, C, STEP):
            i_offs = i0 + tl.arange(0, STEP)
            i_ok = i_offs < C
            i_ids = tl.load(cand_ptr + r.to(tl.int64) * sc + i_offs, mask=i_ok, other=0)
            xi, keep_i = _filtered(tl.load(row + i_ids, mask=i_ok, other=float("-inf")), kth, temp, x_max_t,
                                   log_min_p)
            pi = tl.where(keep_i & i_ok, tl.exp(xi - x_max_t), 0.0) / total_w
            first = (pi[:, None] > p[None, :]) | ((pi[:, None] == p[None, :]) & (i_offs[:, None] < c_offs[None, :]))
            before += tl.sum(tl.where(first, pi[:, None], 0.0), 0)
        kept = c_ok & (before < top_p)
        smallest = tl.min(tl.where(c_ok, p, float("inf")), 0)
        exact = (C >= V) | (tl.min(tl.where(kept, p, float("inf")), 0) > smallest)
        nucleus = tl.where(kept, p, 0.0)
        cdf = tl.cumsum(nucleus, 0)
        target = u * tl.max(cdf, 0)
        at = tl.min(tl.where((cdf > target) & (nucleus > 0), c_offs, CB), 0)
        last = tl.max(tl.where(nucleus > 0, c_offs, -1), 0)
        at = tl.where(at < CB, at, last)
        tl.store(token_ptr + r, tl.sum(tl.where(c_offs == at, ids, 0), 0).to(tl.int64))
        tl.store(redo_ptr + r, (~exact).to(tl.int8))
    else:
        target = u * total_w
        run = total_w * 0.0
        found = V
        last = -1
        for start in range(0, V, BLOCK):
            ok = start + offs < V
            xd, keep = _filtered(tl.load(row + start + offs, mask=ok, other=float("-inf")), kth, temp, x_max_t,
                                 log_min_p)
            w = tl.where(keep & ok, tl.exp(xd - x_max_t), 0.0)
            cdf = run + tl.cumsum(w, 0)
            found = tl.minimum(found, tl.min(tl.where((cdf > target) & (w > 0), start + offs, V), 0))
            last = tl.maximum(last, tl.max(tl.where(w > 0, start + offs, -1), 0))
            run += tl.sum(w, 0)
        tl.store(token_ptr + r, tl.where(found < V, found, last).to(tl.int64))
        tl.store(redo_ptr + r, tl.zeros([], tl.int8))


def sample_rows(x: torch.Tensor, temperature: torch.Tensor, kth: torch.Tensor, log_min_p: torch.Tensor,
                top_p: torch.Tensor, u: torch.Tensor, any_top_p: bool, candidates: int = CANDIDATES
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, V] float32 (penalised logits) and per row: temperature, kth (float32; -inf: no top-k), log(min_p)
    (-inf: none), top_p, the SAMPLE uniform u (float64) -> (token [R] int64, redo [R] bool) where x is; ``redo``:
    a top-p row whose nucleus is not among the ``candidates`` largest logits. ``any_top_p`` (known on the host):
    whether to take the candidates at all. Rows of greedy requests get meaningless tokens (temperature 1)."""
    r, v = x.shape
    x = x.contiguous()
    token = torch.empty(r, dtype=torch.int64, device=x.device)
    redo = torch.empty(r, dtype=torch.int8, device=x.device)
    if r == 0:
        return token, redo.bool()
    c = min(candidates, v) if any_top_p else 1
    cand = torch.topk(x, c, dim=-1).indices.sort(dim=-1).values if any_top_p else token.view(r, 1)
    _sample_rows[(r,)](x, x.stride(0), v, kth.float().contiguous(), temperature.double().contiguous(),
                       log_min_p.double().contiguous(), top_p.double().contiguous(), u.double().contiguous(),
                       cand, cand.stride(0), c, token, redo, BLOCK=BLOCK, CB=next_pow2(c), STEP=CANDIDATE_STEP,
                       num_warps=8)
    return token, redo.bool()
