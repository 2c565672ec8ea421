"""A step's plain sampled rows in two launches: what ``runtime.acceptance.decide`` runs on a GPU for rows that
verify no draft, in the steps where it measured faster (``acceptance.sampling_kernel``). Not an ``m3`` op (no model
graph samples).

Why: the batched float64 definitions (``runtime.sampling.filtered_probs_rows`` + ``draw_rows``) are 30-110 PyTorch
operations per step, and on the H200 their launches set the sampled pass's time at small batches (0.5-1.1 ms at
one row against 0.1 ms greedy) while at 64 rows the device's vocabulary sort and long-row scans took 0.9-3.8 ms
(``docs/performance.md``, thirteenth session). A first form of this module ran one program per row over the whole
vocabulary: fast at 64 rows, but at one row a single program read 200,064 logits three times (351 us of device
time, slower than the definitions). So each row is split into ``BLOCK``-token slices:

1. ``_partials``, one program per (row, slice): the slice's largest logit ``m_s`` and its filtered weights' total
   relative to it, ``l_s = sum exp(x / T - m_s / T)`` in float64 over the tokens that survive top-k (``x >= kth``,
   the k-th largest logit, a threshold the caller takes with ``torch.topk``: dividing by a positive temperature keeps
   the logits' order and keeps distinct float32 values distinct in float64) and min-p (``x / T >= max / T +
   log(min_p)``, the row's maximum taken before the launch only when a row asks for min-p);
2. ``_draw``, one program per row: the row's maximum ``M`` (the largest ``m_s``; it always survives top-k and
   min-p, so it is the filtered row's maximum too) and each slice's weight ``l_s exp(m_s / T - M / T)``, their total
   in slice order (deterministic: no atomics). Without top-p: the slice where the cumulative weight passes ``u`` x
   total, then the first token of that slice whose cumulative weight (the slices before it plus its own running
   sum of ``exp(x / T - M / T)``) passes it. With top-p: over the row's ``C`` candidates (the ``C`` largest logits,
   in token-id order, from the caller), each candidate's probability mass before it in the reference's order
   (probability descending, ties by token id: ``filtered_probs``' stable sort) as a sum over the candidates, the
   nucleus (mass before < top_p), and the inverse CDF over the nucleus in token-id order. The nucleus is exact
   when every kept candidate's probability is above the smallest candidate's (nothing outside the candidates can
   then belong to it or sit between its members); a row where that fails (a nucleus of more than ``C`` tokens, or a
   tie reaching the last candidate) is flagged and the caller redoes it with the definitions.

The token is ``runtime.sampling.sample``'s for the same uniform up to float64 rounding: the sums run in another
order (and the slice totals are rescaled from their own maxima), so a token can differ only where the uniform lands
within ~1e-16 of a step of the CDF or a top-p cut moves by rounding (``tests/test_kernels_sampling.py``: tokens
against ``sample`` under the interpreter and on the GPU). A drawn token always has positive weight (a target that
rounding puts past the end of its slice takes the slice's last such token).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._batch import next_pow2

#: Tokens per slice of a row (one program of ``_partials`` each): 98 slices of M3's 200,064-token vocabulary, so a
#: one-row step spreads over most of the H200's 132 multiprocessors, and ``_draw`` reads at most one slice.
BLOCK = 2048
#: Top-p candidates per row (a nucleus of at most this many tokens, the usual case at top-p <= 0.95 on a trained
#: model, is found in the launch; a larger one is flagged), and candidates per step of the mass-before sum. 2048
#: rather than 1024: on the H200 (``bench/sampling.py``, 64 rows of 300-900-token nuclei) 4 rows a step were redone
#: with 1024 (1738 us of device time) and none with 2048 (909 us); a one-row step's device time 72 against 64 us.
CANDIDATES = 2048
CANDIDATE_STEP = 16
#: The threshold candidates' edges, in ``d = max / T - x / T`` (a token's log-probability below the row's largest):
#: a top-p row without a top-k within ``CANDIDATES`` takes as candidates the kept tokens of the smallest edge whose
#: weight passes top_p, so that its nucleus is among them (``_compact``). Steps of 0.25-0.5 up to 10: where the
#: tokens thicken with d (N(0, 16) logits at temperature 0.8: 300-700-token nuclei), the next edge must not hold
#: more than ``CANDIDATES`` (with steps of 2 and 1024 candidates, a third of such rows were redone on the H200).
EDGES = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 6.5, 7.0, 7.5, 8.0, 8.5,
         9.0, 9.5, 10.0, 11.0, 12.0, 13.0, 14.0, 16.0, 18.0, 20.0, 24.0)


@triton.jit
def _filtered(x, kth, temp, x_max_t, log_min_p, MIN_P: tl.constexpr):
    """float32 logits -> (x / T in float64, whether the token survives top-k and min-p). A -inf logit never
    survives (its weight is 0 in the definitions; kept, a slice of them would give -inf - -inf)."""
    xd = x.to(tl.float64) / temp
    keep = (x >= kth) & (x > float("-inf"))
    if MIN_P:
        keep = keep & (xd >= x_max_t + log_min_p)
    return xd, keep


@triton.jit
def _partials(x_ptr, sx, V, kth_ptr, temp_ptr, log_min_p_ptr, row_max_ptr, m_ptr, l_ptr, S, edges_ptr, cnt_ptr,
              mass_ptr, BLOCK: tl.constexpr, MIN_P: tl.constexpr, ROW_MAX: tl.constexpr, HIST: tl.constexpr,
              J: tl.constexpr):
    """Program (row, slice): the slice's kept tokens' weights relative to a reference logit, and that reference: the
    slice's largest logit, or with ``ROW_MAX`` the row's (taken before the launch). With ``HIST`` also, for each
    edge e_j, how many kept tokens have ``d = max / T - x / T <= e_j`` and their weight (the threshold candidates)."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    offs = s * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    x = tl.load(x_ptr + r.to(tl.int64) * sx + offs, mask=ok, other=float("-inf"))
    temp = tl.load(temp_ptr + r)
    if ROW_MAX:
        m = tl.load(row_max_ptr + r)
    else:
        m = tl.max(x, 0)
    x_max_t = m.to(tl.float64) / temp  # the row's maximum where it is used (min-p, the histogram)
    xd, keep = _filtered(x, tl.load(kth_ptr + r), temp, x_max_t, tl.load(log_min_p_ptr + r), MIN_P)
    ref = tl.where(m > float("-inf"), m, 0.0).to(tl.float64) / temp  # a slice of -inf logits: l = 0, not NaN
    w = tl.where(keep, tl.exp(xd - ref), 0.0)
    tl.store(m_ptr + r * S + s, m)
    tl.store(l_ptr + r * S + s, tl.sum(w, 0))
    if HIST:  # one edge at a time (a [BLOCK, J] float64 tile would spill)
        d = x_max_t - xd
        for j in tl.static_range(J):
            inside = keep & (d <= tl.load(edges_ptr + j))
            tl.store(cnt_ptr + (r * S + s) * J + j, tl.sum(inside.to(tl.int32), 0))
            tl.store(mass_ptr + (r * S + s) * J + j, tl.sum(tl.where(inside, w, 0.0), 0))


@triton.jit
def _compact(x_ptr, sx, V, kth_ptr, temp_ptr, log_min_p_ptr, top_p_ptr, m_ptr, l_ptr, S, edges_ptr, cnt_ptr,
             mass_ptr, cand_ptr, sc, ncand_ptr, C, BLOCK: tl.constexpr, SB: tl.constexpr, J: tl.constexpr,
             MIN_P: tl.constexpr):
    """Program (row, slice) of a top-p row: the smallest edge whose candidates (kept tokens with d <= edge) hold
    more than ``top_p`` of the row's weight (with a margin of 1e-9 over float64 rounding), and, if there are at
    most ``C`` of them, this slice's candidates written in token-id order at their place in the row's list
    (``ncand``: their number, -1 where no edge qualifies within ``C`` candidates: the row is redone)."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    top_p = tl.load(top_p_ptr + r)
    if top_p < 1.0:
        so = tl.arange(0, SB)
        s_ok = so < S
        total = tl.sum(tl.load(l_ptr + r * S + so, mask=s_ok, other=0.0), 0)  # one reference per row (ROW_MAX)
        jo = tl.arange(0, J)
        at = (r * S + so[:, None]) * J + jo[None, :]
        cnt = tl.load(cnt_ptr + at, mask=s_ok[:, None], other=0)
        mass = tl.sum(tl.load(mass_ptr + at, mask=s_ok[:, None], other=0.0), 0)
        j = tl.min(tl.where(mass >= top_p * total * (1.0 + 1e-9), jo, J), 0)
        n = tl.sum(tl.sum(tl.where(jo[None, :] == j, cnt, 0), 1), 0)
        fits = (j < J) & (n <= C)
        if s == 0:
            tl.store(ncand_ptr + r, tl.where(fits, n, -1))
        mine = tl.sum(tl.sum(tl.where((jo[None, :] == j) & (so[:, None] == s), cnt, 0), 1), 0)
        if fits & (mine > 0):
            before = tl.sum(tl.sum(tl.where((jo[None, :] == j) & (so[:, None] < s), cnt, 0), 1), 0)
            edge = tl.sum(tl.where(jo == j, tl.load(edges_ptr + jo), 0.0), 0)
            offs = s * BLOCK + tl.arange(0, BLOCK)
            ok = offs < V
            temp = tl.load(temp_ptr + r)
            x_max_t = tl.load(m_ptr + r * S).to(tl.float64) / temp
            xd, keep = _filtered(tl.load(x_ptr + r.to(tl.int64) * sx + offs, mask=ok, other=float("-inf")),
                                 tl.load(kth_ptr + r), temp, x_max_t, tl.load(log_min_p_ptr + r), MIN_P)
            inside = keep & ok & (x_max_t - xd <= edge)
            place = before + tl.cumsum(inside.to(tl.int32), 0) - 1
            tl.store(cand_ptr + r.to(tl.int64) * sc + place, offs.to(tl.int64), mask=inside)


@triton.jit
def _draw(x_ptr, sx, V, kth_ptr, temp_ptr, log_min_p_ptr, top_p_ptr, u_ptr, m_ptr, l_ptr, S, cand_ptr, sc, C,
          ncand_ptr, token_ptr, redo_ptr, BLOCK: tl.constexpr, SB: tl.constexpr, CB: tl.constexpr,
          STEP: tl.constexpr, MIN_P: tl.constexpr, HIST: tl.constexpr):
    """Program (row): the total from the slices' partials, then the token (the module docstring)."""
    r = tl.program_id(0)
    row = x_ptr + r.to(tl.int64) * sx
    temp = tl.load(temp_ptr + r)
    kth = tl.load(kth_ptr + r)
    log_min_p = tl.load(log_min_p_ptr + r)
    top_p = tl.load(top_p_ptr + r)
    u = tl.load(u_ptr + r)
    so = tl.arange(0, SB)
    s_ok = so < S
    m = tl.load(m_ptr + r * S + so, mask=s_ok, other=float("-inf"))
    l = tl.load(l_ptr + r * S + so, mask=s_ok, other=0.0)
    x_max_t = tl.max(m, 0).to(tl.float64) / temp
    w = tl.where(l > 0, l * tl.exp(m.to(tl.float64) / temp - x_max_t), 0.0)  # each slice's share of the total
    total_w = tl.sum(w, 0)
    if top_p < 1.0:
        n = C
        if HIST:  # the threshold candidates of ``_compact``: a nucleus within them by construction, or none
            n = tl.load(ncand_ptr + r)
        c_offs = tl.arange(0, CB)
        c_ok = c_offs < n
        ids = tl.load(cand_ptr + r.to(tl.int64) * sc + c_offs, mask=c_ok, other=0)
        xd, keep = _filtered(tl.load(row + ids, mask=c_ok, other=float("-inf")), kth, temp, x_max_t, log_min_p,
                             MIN_P)
        p = tl.where(keep & c_ok, tl.exp(xd - x_max_t), 0.0) / total_w
        before = tl.zeros([CB], tl.float64)
        for i0 in range(0, n, STEP):
            i_offs = i0 + tl.arange(0, STEP)
            i_ok = i_offs < n
            i_ids = tl.load(cand_ptr + r.to(tl.int64) * sc + i_offs, mask=i_ok, other=0)
            xi, keep_i = _filtered(tl.load(row + i_ids, mask=i_ok, other=float("-inf")), kth, temp, x_max_t,
                                   log_min_p, MIN_P)
            pi = tl.where(keep_i & i_ok, tl.exp(xi - x_max_t), 0.0) / total_w
            first = (pi[:, None] > p[None, :]) | ((pi[:, None] == p[None, :]) & (i_offs[:, None] < c_offs[None, :]))
            before += tl.sum(tl.where(first, pi[:, None], 0.0), 0)
        kept = c_ok & (before < top_p)
        if HIST:
            exact = n >= 0
        else:  # the C largest logits: exact unless the nucleus reaches the smallest of them
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
        cum = tl.cumsum(w, 0)
        at = tl.min(tl.where((cum > target) & (w > 0), so, SB), 0)
        at = tl.where(at < SB, at, tl.max(tl.where(w > 0, so, -1), 0))  # rounding past the end: the last slice
        run = tl.sum(tl.where(so < at, w, 0.0), 0)
        offs = at * BLOCK + tl.arange(0, BLOCK)
        ok = offs < V
        xs, keep_s = _filtered(tl.load(row + offs, mask=ok, other=float("-inf")), kth, temp, x_max_t, log_min_p,
                               MIN_P)  # (names apart from the other branch's: Triton types each name once)
        wt = tl.where(keep_s & ok, tl.exp(xs - x_max_t), 0.0)
        cdf_s = run + tl.cumsum(wt, 0)
        found = tl.min(tl.where((cdf_s > target) & (wt > 0), offs, V), 0)
        last = tl.max(tl.where(wt > 0, offs, -1), 0)
        tl.store(token_ptr + r, tl.where(found < V, found, last).to(tl.int64))
        tl.store(redo_ptr + r, tl.zeros([], tl.int8))


@functools.lru_cache(maxsize=None)
def _edges(device: torch.device, edges: tuple[float, ...]) -> torch.Tensor:
    """``EDGES`` on ``device``, copied there once."""
    return torch.tensor(edges, dtype=torch.float64, device=device)


def sample_rows(x: torch.Tensor, temperature: torch.Tensor, kth: torch.Tensor, log_min_p: torch.Tensor,
                top_p: torch.Tensor, u: torch.Tensor, candidates: torch.Tensor | None, any_min_p: bool,
                any_top_p: bool = False, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, V] float32 (penalised logits) and per row: temperature, kth (float32; -inf: no top-k), log(min_p)
    (-inf: none), top_p, the SAMPLE uniform u (float64) -> (token [R] int64, redo [R] bool) where x is; ``redo``:
    a top-p row whose nucleus the launches could not bound within ``CANDIDATES`` tokens. Top-p rows take their
    candidates from ``candidates`` [R, C] int64 where given (each row's C largest logits' token ids in increasing
    order: the caller's ``torch.topk`` when every top-p row has a top-k within them), else, where ``any_top_p``, by
    threshold (``EDGES``: one more launch, ``_compact``). ``any_min_p`` (known on the host): whether the rows'
    maxima are taken first for min-p; ``limit``: the threshold candidates' most (default ``CANDIDATES``). Rows of
    greedy requests get meaningless tokens (temperature 1)."""
    r, v = x.shape
    x = x.contiguous()
    token = torch.empty(r, dtype=torch.int64, device=x.device)
    redo = torch.empty(r, dtype=torch.int8, device=x.device)
    if r == 0:
        return token, redo.bool()
    hist = any_top_p and candidates is None
    s, j = -(-v // BLOCK), len(EDGES)
    if j != next_pow2(j):
        raise ValueError(f"sampling.EDGES: {j} edges; a power of two is needed (one program reads them as a block)")
    m = torch.empty(r, s, dtype=torch.float32, device=x.device)
    l = torch.empty(r, s, dtype=torch.float64, device=x.device)
    temperature, kth, log_min_p = temperature.double().contiguous(), kth.float().contiguous(), \
        log_min_p.double().contiguous()
    top_p = top_p.double().contiguous()
    row_max = x.amax(-1) if any_min_p or hist else m
    edges = cnt = mass = ncand = m
    if hist:
        edges = _edges(x.device, EDGES)
        cnt = torch.empty(r, s, j, dtype=torch.int32, device=x.device)
        mass = torch.empty(r, s, j, dtype=torch.float64, device=x.device)
        candidates = torch.empty(r, min(CANDIDATES if limit is None else limit, v), dtype=torch.int64,
                                 device=x.device)
        ncand = torch.empty(r, dtype=torch.int32, device=x.device)
    _partials[(r, s)](x, x.stride(0), v, kth, temperature, log_min_p, row_max, m, l, s, edges, cnt, mass,
                      BLOCK=BLOCK, MIN_P=any_min_p, ROW_MAX=any_min_p or hist, HIST=hist, J=j, num_warps=4)
    if hist:
        _compact[(r, s)](x, x.stride(0), v, kth, temperature, log_min_p, top_p, m, l, s, edges, cnt, mass,
                         candidates, candidates.stride(0), ncand, candidates.shape[1], BLOCK=BLOCK, SB=next_pow2(s),
                         J=j, MIN_P=any_min_p, num_warps=4)
    cand = token.view(r, 1) if candidates is None else candidates
    c = 1 if candidates is None else candidates.shape[1]
    _draw[(r,)](x, x.stride(0), v, kth, temperature, log_min_p, top_p, u.double().contiguous(), m, l, s, cand,
                cand.stride(0), c, ncand, token, redo, BLOCK=BLOCK, SB=next_pow2(s), CB=next_pow2(c),
                STEP=CANDIDATE_STEP, MIN_P=any_min_p, HIST=hist, num_warps=8)
    return token, redo.bool()
