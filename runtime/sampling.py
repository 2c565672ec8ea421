"""Logits -> next token, per request, with randomness that is a function of (seed, position, purpose).

Each random draw is one uniform number fed through the inverse CDF, and each uniform is a counter-based hash of
the request's seed, the absolute position of the token it decides and what it is for (a plain or bonus sample, a
draft, a draft's acceptance test, a residual resample). No draw depends on how many draws came before it, so
what a seeded request samples depends only on its own logits: not on the batch around it, not on drafts the
scheduler could not fit this step, not on preemption and recompute. The same filtered distribution
(penalties, temperature, min-p, top-k, then top-p) serves plain sampling, drafting and speculative verification,
which is what makes rejection sampling preserve it exactly.

Two forms of the same arithmetic live here. The one-row functions (``apply_penalties``, ``filtered_probs``,
``draw``, ``sample``, ``token_logprobs``) are the definition, on whatever device the row is. The ``*_rows``
functions do the same per-row operations batched over a step's rows where the logits are (the GPU), with no
Python loop over rows or the vocabulary and no host synchronisation: the engine runs those
(``acceptance.decide``) and only the chosen tokens and requested log-probabilities cross to the host. Each
batched operation is the one-row operation applied row-wise (the same float64 ops in the same order; filters a
row does not use are exact no-ops or selected away), so on one device both give the same tokens for the same
uniforms; the tests hold them to that.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .params import SamplingParams

_MASK64 = (1 << 64) - 1


class Purpose(enum.IntEnum):
    """What a uniform decides at its position; each purpose gets its own independent stream."""

    SAMPLE = 0  # a plain sample, or the bonus token after every draft was accepted
    DRAFT = 1  # the draft proposed for the position
    ACCEPT = 2  # the acceptance test of the position's draft
    RESIDUAL = 3  # the resample from the residual after the position's draft was rejected


def _splitmix64(x: int) -> int:
    """The SplitMix64 output function: a bijection of 64-bit words in which every input bit flips about half the
    output bits, so consecutive counters give unrelated words."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(frozen=True)
class PositionalRandom:
    """A request's random numbers, addressed by (position, purpose) instead of drawn in sequence.

    Why: the token at a position may be decided in different steps depending on the scheduler (drafts cut for
    lack of pages or budget, preemption and recompute); a sequential stream would then hand it a different
    number. Here the uniform for (position, purpose) is the same whenever and however often it is asked for.
    """

    seed: int

    def uniform(self, position: int, purpose: Purpose) -> float:
        """A float64 in [0, 1) with 53 random bits."""
        h = _splitmix64(self.seed & _MASK64)
        h = _splitmix64(h ^ (position & _MASK64))
        h = _splitmix64(h ^ int(purpose))
        return (h >> 11) * 2.0**-53


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int],
                    output: Sequence[int]) -> torch.Tensor:
    """logits [V] -> float32 logits after the request's penalties (vLLM's rules; see ``SamplingParams``).
    ``output``: the tokens generated before the position decided (drafts verified before it included)."""
    x = logits.float()
    if not params.penalised:
        return x
    counts = torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device)
    counts.index_put_((torch.tensor(list(output), dtype=torch.int64, device=x.device),),
                      torch.ones(len(output), device=x.device), accumulate=True)
    seen = counts > 0
    seen[torch.tensor(list(prompt), dtype=torch.int64, device=x.device)] = True
    rep, freq, pres = (torch.tensor(v, dtype=torch.float32, device=x.device)
                       for v in (params.repetition_penalty, params.frequency_penalty, params.presence_penalty))
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - counts * freq - (counts > 0).float() * pres


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] (penalties already applied) -> the distribution the request samples from [..., V]
    (float64; not for greedy)."""
    x = logits.double() / params.temperature
    if params.min_p > 0:  # p < min_p * p_max  <=>  x < max(x) + log(min_p)
        x = x.masked_fill(x < x.amax(-1, keepdim=True) + math.log(params.min_p), float("-inf"))
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))  # ties at the k-th value are all kept: deterministic
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p  # mass before it already reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, u: float) -> int:
    """One token from ``probs`` [V] (need not be normalised) for the uniform ``u`` in [0, 1) (inverse CDF)."""
    cdf = probs.double().cumsum(-1)
    target = torch.tensor([u * float(cdf[-1])], dtype=torch.float64, device=cdf.device)
    idx = int(torch.searchsorted(cdf, target, right=True))
    # u * total can round up to total; the last token with mass is then the right answer.
    return min(idx, int(torch.nonzero(probs).max()))


def sample(logits: torch.Tensor, params: SamplingParams, rng: PositionalRandom, position: int,
           prompt: Sequence[int] = (), output: Sequence[int] = ()) -> int:
    """logits [V] -> the token at ``position`` (argmax for temperature 0, first index on ties); ``prompt`` /
    ``output``: the request's tokens, for penalties."""
    logits = apply_penalties(logits, params, prompt, output)
    if params.greedy:
        return int(torch.argmax(logits))
    return draw(filtered_probs(logits, params), rng.uniform(position, Purpose.SAMPLE))


def token_logprobs(logits: torch.Tensor, token: int, top_n: int) -> dict[int, float]:
    """The sampled token's log-probability under the raw model distribution, then the ``top_n`` best."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = {token: float(lp[token])}
    if top_n:
        values, ids = torch.topk(lp, min(top_n, lp.shape[-1]))
        for v, i in zip(values.tolist(), ids.tolist()):
            out.setdefault(i, v)
    return out


# ---------------------------------------------------------------------------------------------- batched rows
def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device: a plain copy from pageable memory first
    synchronises the stream (the host would sit idle until the model's step finished, instead of queueing the
    sampling kernels behind it); from pinned memory the copy is queued like a kernel. The pinned buffer comes
    from torch's caching host allocator, which keeps it until the copy has run."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)  # already on a device (e.g. ids a graphed step left there): no host copy to pin
    # A pinned block of the caching allocator filled here, not ``t.pin_memory()``: that first asks the driver
    # whether ``t`` is pinned (``aten::is_pinned``), which took ~0.3 ms of every sampled step on the H200 while
    # the device was busy (docs/performance.md, thirteenth session).
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t).to(device, non_blocking=True)


class RowParams:
    """The sampling parameters of a step's rows as device tensors, plus what the host knows about them (which
    filters any row uses), so that no decision about the batch's shape reads the device. ``extra``: more
    float64 columns per row (a caller's per-row numbers) that ride along in the same single host-to-device copy,
    as ``self.extra``. Greedy rows get temperature 1 here (their filtered rows are computed and ignored)."""

    def __init__(self, params: Sequence[SamplingParams], device: torch.device,
                 extra: Sequence[Sequence[float]] | None = None):
        self.params = list(params)
        self.device = device
        table = [[p.temperature or 1.0, p.top_k, p.top_p, math.log(p.min_p) if p.min_p > 0 else -math.inf,
                  p.repetition_penalty, p.frequency_penalty, p.presence_penalty] + list(e)
                 for p, e in zip(self.params, extra or [()] * len(self.params))]
        t = to_device(torch.tensor(table, dtype=torch.float64), device)  # the one host-to-device copy
        self._table = t
        self.temperature, self.top_p, self.log_min_p = t[:, 0], t[:, 2], t[:, 3]
        self.extra = t[:, 7:]
        self.any_min_p = any(p.min_p > 0 for p in self.params)
        self.max_top_k = max((p.top_k for p in self.params), default=0)
        self.any_top_p = any(p.top_p < 1.0 for p in self.params)

    # Converted on first use: each conversion is a device operation (on a GPU a launch), and most steps use neither.
    @functools.cached_property
    def top_k(self) -> torch.Tensor:
        return self._table[:, 1].long()

    @functools.cached_property
    def penalties(self) -> torch.Tensor:
        """repetition, frequency, presence (float32 like the logits)."""
        return self._table[:, 4:7].float()


def penalise_rows(logits: torch.Tensor, rows: RowParams, prompts: Sequence[Sequence[int]],
                  outputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """logits [R, V] -> float32 logits after each row's penalties (``apply_penalties`` row-wise). The token
    counts are built on the device from the rows' token ids (one copy of them); rows without penalties are
    unchanged (their penalties are the identity: x / 1, x * 1, x - 0)."""
    x = logits.float()
    if not any(p.penalised for p in rows.params):
        return x
    r, v = x.shape
    out_rows = [i for i, o in enumerate(outputs) for _ in o]
    prompt_rows = [i for i, p in enumerate(prompts) for _ in p]
    ids = torch.tensor([out_rows, [t for o in outputs for t in o], ], dtype=torch.int64).reshape(2, -1)
    pids = torch.tensor([prompt_rows, [t for p in prompts for t in p]], dtype=torch.int64).reshape(2, -1)
    ids, pids = to_device(ids, x.device), to_device(pids, x.device)
    counts = torch.zeros(r, v, dtype=torch.float32, device=x.device)
    counts.index_put_((ids[0], ids[1]), torch.ones(ids.shape[1], device=x.device), accumulate=True)
    seen = counts > 0
    seen[pids[0], pids[1]] = True
    rep, freq, pres = (rows.penalties[:, i:i + 1] for i in range(3))
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - counts * freq - (counts > 0).float() * pres


def top_k_threshold(x: torch.Tensor, rows: RowParams, top: torch.Tensor | None = None) -> torch.Tensor | None:
    """Each row's k-th largest value of ``x`` [R, V] (-inf for a row without top-k: its mask keeps everything), or
    None when no row filters (known on the host: no operation). Ties at the k-th value are all kept. ``top``: the
    rows' largest values of ``x`` in decreasing order, taken already by the caller (``torch.topk``), used where at
    least as wide as the largest top-k."""
    v = x.shape[-1]
    if not (0 < min(rows.max_top_k, v) and any(0 < p.top_k < v for p in rows.params)):
        return None
    k = rows.top_k.clamp(max=v)
    if top is None or top.shape[-1] < min(rows.max_top_k, v):
        top = torch.topk(x, min(rows.max_top_k, v), dim=-1).values
    kth = top.gather(-1, (k - 1).clamp(min=0)[:, None])[:, 0]
    return torch.where((k > 0) & (k < v), kth, float("-inf"))


def filtered_probs_rows(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """logits [R, V] (penalised) -> each row's sampling distribution [R, V] float64 (``filtered_probs``
    row-wise). Filters a row does not use are no-ops for it: a -inf threshold, or the unfiltered row selected."""
    x = logits.double() / rows.temperature[:, None]
    if rows.any_min_p:
        x = x.masked_fill(x < x.amax(-1, keepdim=True) + rows.log_min_p[:, None], float("-inf"))
    kth = top_k_threshold(x, rows)
    if kth is not None:
        x = x.masked_fill(x < kth[:, None], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if rows.any_top_p:
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= rows.top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        kept = probs.masked_fill(drop, 0.0)
        kept = kept / kept.sum(-1, keepdim=True)
        probs = torch.where((rows.top_p < 1.0)[:, None], kept, probs)
    return probs


def kernel_draw_rows(x: torch.Tensor, rows: RowParams, u: torch.Tensor, candidates: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``draw_rows(filtered_probs_rows(x, rows), u)`` in two or three Triton launches (``plugins/kernels/sampling.py``;
    plus, where a row asks for top-k, one ``torch.topk`` of the logits for the thresholds, which also gives the
    top-p candidates where every top-p row has a top-k within ``candidates``): (token [R], redo [R] bool), ``redo``
    marking top-p rows whose nucleus the launches could not bound within ``candidates`` tokens (default
    ``sampling.CANDIDATES``; the caller draws those with the definitions). The same tokens up to float64 rounding
    (the kernel module's docstring)."""
    from m3export.plugins.kernels import sampling as kernel

    v = x.shape[-1]
    most = min(kernel.CANDIDATES if candidates is None else candidates, v)
    top_p_k = [p.top_k for p in rows.params if p.top_p < 1.0]
    # Top-p rows whose top-k bounds the nucleus take the top-k's tokens as candidates (one torch.topk also gives the
    # thresholds); otherwise (c = 0) the launches pick candidates by threshold.
    c = max(top_p_k) if top_p_k and all(0 < k <= most for k in top_p_k) else 0
    top = torch.topk(x, max(c, min(rows.max_top_k, v)), dim=-1) if c else None
    # on the float32 logits: the same tokens as on x / T (the kernel's docstring)
    kth = top_k_threshold(x, rows, None if top is None else top.values)
    if kth is None:
        kth = torch.full((x.shape[0],), float("-inf"), device=x.device)
    cand = top.indices[:, :c].sort(dim=-1).values if c else None
    return kernel.sample_rows(x, rows.temperature, kth, rows.log_min_p, rows.top_p, u, cand, rows.any_min_p,
                              rows.any_top_p, candidates)


def draw_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [R, V] (need not be normalised) for the uniforms ``u`` [R] float64
    (``draw`` row-wise) -> [R] int64 on the device."""
    cdf = probs.double().cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    ids = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, ids, -1).amax(-1)  # the last token with mass
    return torch.minimum(idx, last)


def propose_rows(logits: torch.Tensor, params: Sequence[SamplingParams], rngs: Sequence[PositionalRandom],
                 positions: Sequence[int], host: bool = True) -> tuple[list[int] | torch.Tensor, torch.Tensor | None]:
    """Draft tokens for a batch of rows where the logits are: row i drafts the token at ``positions[i]`` with
    request i's ``params`` (argmax when greedy, else drawn from ``filtered_probs`` with the DRAFT uniform at that
    position, as the drafter's one-row rule). Returns the tokens (one device-to-host copy; with ``host=False``
    an int64 tensor where the logits are, nothing read back: ``device_drafts``) and the rows' filtered
    distributions [R, V] float64 on the logits' device (what rejection sampling needs as p_d; rows of greedy
    requests are meaningless), or None when every row is greedy."""
    if logits.shape[0] != len(params):
        raise ValueError(f"propose_rows: {logits.shape[0]} logits rows for {len(params)} rows")
    if not params:
        return [], None
    token = logits.argmax(-1)
    if all(p.greedy for p in params):
        return (token.tolist() if host else token), None
    extra = [[not p.greedy, 0.0 if p.greedy else rng.uniform(pos, Purpose.DRAFT)]
             for p, rng, pos in zip(params, rngs, positions)]
    rows = RowParams(params, logits.device, extra)
    probs = filtered_probs_rows(logits.float(), rows)
    token = torch.where(rows.extra[:, 0] > 0, draw_rows(probs, rows.extra[:, 1]), token)
    return (token.tolist() if host else token), probs
