"""Speculative verification: which draft tokens the target model accepts, and the token that follows them.

Greedy requests accept drafts while they equal the target's argmax. Sampling requests use rejection sampling:
accept draft d with probability min(1, p_t(d) / p_d(d)); on the first rejection emit a token drawn from
norm(max(0, p_t - p_d)). Every emitted token is then distributed exactly as p_t, whatever the drafter proposed.
A draft drawn greedily counts as a one-hot p_d.

A step need not verify every draft. Its rows are the target's distributions at the position after the last
known token and after each draft it computed: with j of the k drafts computed there are j + 1 rows, which verify
drafts 1 .. j + 1. Only when all k drafts were computed (k + 1 rows) and accepted does the last row give a bonus
token; otherwise the drafts past the rows stay for the next step. The rule per position is unchanged (the target
distribution at a position is the same whichever step computes it), so the output distribution is still p_t;
with no drafts at all the one row is a plain sample.

Each uniform is addressed by (seed, position, purpose) (``sampling.PositionalRandom``): the draft, its acceptance
test and its residual resample at a position use three independent numbers, none of which depends on the tokens
before the position, so the acceptance test is independent of the draft and of the context as the proof needs.

``accept`` is the definition, one request at a time. ``decide`` is what the engine runs: every row of a step at
once where the logits are, each row's candidates (its greedy or sampled token, whether its draft passes, its
residual resample, and their log-probabilities) computed on the device and brought to the host in one copy;
``emitted`` then walks a request's rows on the host exactly as ``accept`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .device_drafts import RoundDrafts, fill_tokens, to_host
from .params import SamplingParams
from .sampling import (PositionalRandom, Purpose, RowParams, apply_penalties, draw, draw_rows, filtered_probs,
                       filtered_probs_rows, kernel_draw_rows, penalise_rows, to_device)


def accept_greedy(target_logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """target_logits [n, V] at the last token and the first n - 1 drafts -> emitted tokens: drafts[:n] verified,
    then (only when n > len(drafts) and all were accepted) the bonus argmax."""
    best = torch.argmax(target_logits, dim=-1).tolist()
    out = []
    for i, b in enumerate(best):
        out.append(b)
        if i == len(drafts) or drafts[i] != b:
            break
    return out


def accept_sampled(target_probs: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                   rng: PositionalRandom, position: int) -> list[int]:
    """target_probs [n, V], row i the target's distribution for the token at ``position + i``; draft_probs
    [len(drafts), V] the distributions the drafts were drawn from (None: one-hot). Verifies drafts[:n]; the
    bonus is drawn only from a row past the last draft."""
    out = []
    for i in range(len(target_probs)):
        p_t, pos = target_probs[i], position + i
        if i == len(drafts):
            out.append(draw(p_t, rng.uniform(pos, Purpose.SAMPLE)))
            break
        d = drafts[i]
        p_d_of_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if rng.uniform(pos, Purpose.ACCEPT) * p_d_of_d < float(p_t[d]):
            out.append(d)
            continue
        if draft_probs is None:
            residual = p_t.clone()
            residual[d] = 0.0
        else:
            residual = (p_t - draft_probs[i].to(p_t.dtype)).clamp(min=0.0)
        # A zero residual means p_t <= p_d everywhere, i.e. p_t == p_d, where rejection has probability 0;
        # only rounding gets here, and p_t itself is then the right distribution.
        out.append(draw(residual if residual.sum() > 0 else p_t, rng.uniform(pos, Purpose.RESIDUAL)))
        break
    return out


def accept(target_logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
           params: SamplingParams, rng: PositionalRandom, position: int, prompt: Sequence[int] = (),
           output: Sequence[int] = ()) -> list[int]:
    """``position``: where the token decided by the first row goes (the request's length before the step);
    ``prompt`` / ``output``: the request's tokens before the step, for penalties (row i also counts drafts[:i])."""
    if params.penalised:
        output = list(output)
        target_logits = torch.stack([apply_penalties(target_logits[i], params, prompt, output + drafts[:i])
                                     for i in range(len(target_logits))])
    if params.greedy:
        return accept_greedy(target_logits, drafts)
    return accept_sampled(filtered_probs(target_logits, params), drafts, draft_probs, rng, position)


# ---------------------------------------------------------------------------------------------- batched rows
@dataclass(frozen=True)
class Row:
    """One logits row of a step: it decides the token at ``position`` of its request, verifying ``draft`` when
    there is one (None: a plain sample, or the bonus after the last draft)."""

    params: SamplingParams
    rng: PositionalRandom
    position: int
    draft: int | None = None  # None: no draft, or one whose value ``decide`` takes from its ``draft_places``
    draft_probs: torch.Tensor | None = None  # [V] the distribution ``draft`` was drawn from; None: one-hot
    prompt: Sequence[int] = ()  # for penalties: the prompt ...
    output: Sequence[int] = ()  # ... and the tokens generated before ``position`` (earlier drafts included)


@dataclass(frozen=True)
class RowResult:
    """A row's candidates, on the host. ``token``: the argmax (greedy) or the plain sample; ``accepted``: the
    draft passes (greedy: it is the argmax); ``residual``: the resample if it does not (sampling only).
    ``logprobs``: the raw model log-probability of each candidate and the row's best tokens, when asked for."""

    token: int
    accepted: bool
    residual: int
    candidate_logprobs: dict[int, float] | None = None
    top: list[tuple[int, float]] | None = None
    log_probs: torch.Tensor | None = None  # [V] the row's log-probabilities, where the logits are
    draft: int | None = None  # the draft the row verified (its value read back with the row's candidates)

    def logprobs(self, token: int, top_n: int) -> dict[int, float]:
        """``sampling.token_logprobs`` of the emitted ``token``: one of this row's candidates, read from the host
        copy; any other token (an engine that forces its tokens) costs one read of the device row."""
        lp = self.candidate_logprobs.get(token)
        out = {token: float(self.log_probs[token]) if lp is None else lp}
        for i, v in self.top[:top_n]:
            out.setdefault(i, v)
        return out


def decide(logits: torch.Tensor, rows: Sequence[Row], draft_places: Sequence[tuple[int, RoundDrafts, int]] = ()
           ) -> list[RowResult]:
    """logits [R, V] (any device) -> each row's candidates: all rows in one batched pass where the logits are, one
    host-to-device copy of the rows' parameters and uniforms (plus the drafts' distributions and, with penalties, the
    token ids) and one device-to-host copy of [R, 4 + 3 + 2 * top-N] numbers. ``draft_places``: (row, round, flat index)
    of each row whose draft is still on the device (``device_drafts``; that row's own ``draft`` field is then ignored);
    the drafts come back with the candidates, in the same one copy, as each result's ``draft``. Rows that are all
    greedy, without penalties or logprobs (greedy speculation), take a shorter pass (``_decide_greedy``): their argmax
    and the drafts' rounds in one copy, compared on the host. A step whose rows verify no draft takes ``_decide_plain``:
    its samples only (no residual resample, no acceptance test). Same tokens as ``accept`` for the same uniforms (the
    batched functions are the one-row ones row-wise). In a batch that mixes greedy and sampled rows every row goes
    through the sampled path too (its results ignored for greedy rows), which keeps the pass free of index copies."""
    r = len(rows)
    if logits.shape[0] != r:
        raise ValueError(f"decide: {logits.shape[0]} logits rows for {r} rows")
    if r == 0:
        return []
    if all(w.params.greedy and not w.params.penalised and w.params.logprobs is None for w in rows):
        return _decide_greedy(logits, rows, draft_places)
    if not draft_places and all(w.draft is None for w in rows):
        return _decide_plain(logits, rows)
    draft_ids = None
    if draft_places:  # every row's draft (-1: none) where the logits are, the device-held ones filled in there
        draft_ids = fill_tokens(torch.tensor([-1 if w.draft is None else w.draft for w in rows]), draft_places)
    dev = logits.device
    purposes = (Purpose.SAMPLE, Purpose.ACCEPT, Purpose.RESIDUAL)
    extra = [[-1 if w.draft is None else w.draft, not w.params.greedy, w.draft_probs is not None]
             + ([0.0] * 3 if w.params.greedy else [w.rng.uniform(w.position, p) for p in purposes]) for w in rows]
    params = RowParams([w.params for w in rows], dev, extra)
    drafts, sampled, has_pd = params.extra[:, 0].long(), params.extra[:, 1] > 0, params.extra[:, 2] > 0
    if draft_ids is not None:
        drafts = draft_ids
    u = params.extra[:, 3:6]
    x = logits.float()
    if any(w.params.penalised for w in rows):
        x = penalise_rows(x, params, [w.prompt for w in rows], [w.output for w in rows])
    token = x.argmax(-1)  # greedy rows; first index on ties, as torch.argmax
    accepted = token == drafts
    residual = torch.zeros_like(token)
    if any(not w.params.greedy for w in rows):
        probs = filtered_probs_rows(x, params)
        has = drafts >= 0
        d = drafts.clamp(min=0)[:, None]
        resid = probs.scatter(-1, d, 0.0)  # a one-hot draft: p_t without the draft
        p_d_of_d = torch.ones_like(u[:, 0])
        if any(w.draft_probs is not None for w in rows):  # residual max(0, p_t - p_d) where p_d is known
            zero = torch.zeros_like(probs[0])  # the drafts' rows are copied once, here, into one [R, V]
            p_d = torch.stack([zero if w.draft_probs is None else w.draft_probs.to(dev, probs.dtype) for w in rows])
            p_d_of_d = torch.where(has_pd, p_d.gather(-1, d)[:, 0], p_d_of_d)
            resid = torch.where(has_pd[:, None], (probs - p_d).clamp(min=0.0), resid)
        # A zero residual means p_t == p_d up to rounding (rejection has probability 0): p_t is then right.
        resid = torch.where((resid.sum(-1) > 0)[:, None], resid, probs)
        token = torch.where(sampled, draw_rows(probs, u[:, 0]), token)
        accepted = torch.where(sampled, has & (u[:, 1] * p_d_of_d < probs.gather(-1, d)[:, 0]), accepted)
        residual = draw_rows(resid, u[:, 2])
    cols = [token.double(), accepted.double(), residual.double(), drafts.double()]
    top_n = max((w.params.logprobs or 0 for w in rows), default=0)
    if any(w.params.logprobs is not None for w in rows):
        lp = torch.log_softmax(logits.float(), dim=-1)  # the raw model distribution, as token_logprobs
        cand = torch.stack([token, drafts.clamp(min=0), residual], dim=-1)
        cols += list(lp.gather(-1, cand).double().unbind(-1))
        if top_n:
            values, ids = torch.topk(lp, min(top_n, lp.shape[-1]))
            cols += list(ids.double().unbind(-1)) + list(values.double().unbind(-1))
    host = to_host(torch.stack(cols, dim=-1), "decide")  # the step's one device-to-host copy
    out = []
    for i, (w, h) in enumerate(zip(rows, host)):
        tok, acc, res, draft = int(h[0]), bool(h[1]), int(h[2]), (int(h[3]) if h[3] >= 0 else None)
        cand_lp = top = None
        if w.params.logprobs is not None:
            cand_lp = {res: h[6], **({draft: h[5]} if draft is not None else {}), tok: h[4]}
            n = len(h) - 7
            top = [(int(i), v) for i, v in zip(h[7:7 + n // 2], h[7 + n // 2:])]
        out.append(RowResult(tok, acc, res, cand_lp, top, None if cand_lp is None else lp[i], draft))
    return out


def _decide_plain(logits: torch.Tensor, rows: Sequence[Row]) -> list[RowResult]:
    """``decide`` for a step whose rows verify no draft: each row's token (its argmax, or its sample from
    ``filtered_probs_rows`` + ``draw_rows``, on a GPU from the sampling kernels, ``kernel_draw_rows``, whose flagged
    top-p rows are redone here with the definitions) and, where asked, its logprobs; greedy rows without penalties
    upload no sampling parameters. The general pass's draft,
    acceptance and residual columns are constants here (none, no, 0) and are not computed: on the GPU each
    operation is a launch of some 10 us of host time, and a one-row sampled step was launch-bound
    (``docs/performance.md``, thirteenth session). Same tokens as the general pass."""
    dev = logits.device
    sampled = [not w.params.greedy for w in rows]
    penalised = any(w.params.penalised for w in rows)
    params = None  # greedy rows with logprobs only: no parameters to upload
    if any(sampled) or penalised:
        uniforms = [[s, w.rng.uniform(w.position, Purpose.SAMPLE) if s else 0.0] for s, w in zip(sampled, rows)]
        params = RowParams([w.params for w in rows], dev, uniforms)
    raw = x = logits.float()
    if penalised:
        x = penalise_rows(x, params, [w.prompt for w in rows], [w.output for w in rows])
    redo = None
    if any(sampled):
        if sampling_kernel(dev, [w.params for w in rows]):
            token, redo = kernel_draw_rows(x, params, params.extra[:, 1])
        else:
            token = draw_rows(filtered_probs_rows(x, params), params.extra[:, 1])
        if not all(sampled):  # greedy rows: the argmax, first index on ties
            token = torch.where(params.extra[:, 0] > 0, token, x.argmax(-1))
    else:
        token = x.argmax(-1)
    cols = [token.double()]
    if redo is not None:
        cols.append(redo.double())
    top_n = max((w.params.logprobs or 0 for w in rows), default=0)
    lp = None
    if any(w.params.logprobs is not None for w in rows):
        lp = torch.log_softmax(raw, dim=-1)  # the raw model distribution, as token_logprobs
        cols.append(lp.gather(-1, token[:, None])[:, 0].double())
        if top_n:
            values, ids = torch.topk(lp, min(top_n, lp.shape[-1]))
            cols += [ids.double(), values.double()]
    host = to_host(torch.cat([c if c.dim() == 2 else c[:, None] for c in cols], dim=-1), "decide")
    flagged = [i for i, h in enumerate(host) if redo is not None and h[1]]
    redone = _redo(x, rows, flagged)
    out = []
    for i, (w, h) in enumerate(zip(rows, host)):
        tok = redone.get(i, int(h[0]))
        cand_lp = top = None
        if w.params.logprobs is not None:
            at = 2 if redo is not None else 1
            # a redone row's token is not the one whose log-probability came back: RowResult.logprobs reads it
            cand_lp = {} if i in redone else {tok: h[at]}
            top = [(int(t), v) for t, v in zip(h[at + 1:at + 1 + top_n], h[at + 1 + top_n:])]
        out.append(RowResult(tok, False, 0, cand_lp, top, None if cand_lp is None else lp[i], None))
    return out


def sampling_kernel(device: torch.device, params: Sequence[SamplingParams]) -> bool:
    """Whether ``decide`` draws a step's plain sampled rows with the sampling kernels (``sampling.kernel_draw_rows``)
    rather than with the batched definitions: on a GPU, always. Measured on the H200 (``bench/sampling.py``,
    ``docs/performance.md``, fourteenth session) as fast as the definitions or faster in every mode from one row
    to 64 (1.0x with temperature alone at one row, 1.4-3x elsewhere), except rows whose top-p nucleus passes the
    kernels' 2048 candidates: those are redone with the definitions (0.4-0.8x of the definitions alone; a trained
    model's nucleus at top-p <= 0.95 is mostly far smaller). On the CPU never (the definitions are exact to the bit
    there, as the tests hold ``accept``)."""
    if device.type != "cuda":
        return False
    from m3export.plugins.kernels import triton_available

    return triton_available()


def _redo(x: torch.Tensor, rows: Sequence[Row], flagged: list[int]) -> dict[int, int]:
    """The tokens of the rows the sampling kernel flagged (a top-p nucleus beyond its candidates), drawn with the
    batched definitions in one pass over those rows: one more device-to-host copy, in steps that have such rows."""
    if not flagged:
        return {}
    sub = [rows[i] for i in flagged]
    params = RowParams([w.params for w in sub], x.device, [[w.rng.uniform(w.position, Purpose.SAMPLE)] for w in sub])
    token = draw_rows(filtered_probs_rows(x[to_device(torch.tensor(flagged), x.device)], params), params.extra[:, 0])
    return dict(zip(flagged, to_host(token, "decide (top-p rows past the kernel's candidates)")))


def _decide_greedy(logits: torch.Tensor, rows: Sequence[Row], draft_places: Sequence[tuple[int, RoundDrafts, int]]
                   ) -> list[RowResult]:
    """``decide`` for rows that are all greedy, without penalties or logprobs: a row's candidates are its argmax and
    whether that equals its draft, so nothing goes to the device (no sampling parameters, no draft column) and
    what comes back is the argmax of every row plus the whole token tensor of each round that holds one of the
    rows' drafts, in one copy; the comparisons are made on the host. Each round's host copy is kept
    (``RoundDrafts.host``): the round is complete by the time its drafts are verified, and a later read of its
    values (``Request.drafts``) is then free. The general pass made about twenty device operations and two
    host-to-device copies here, for the same tokens (the argmax with the same first-index tie rule)."""
    token = logits.argmax(-1)  # 16-bit logits widen to fp32 exactly: the same argmax without an fp32 copy
    rounds: dict[int, RoundDrafts] = {}
    for _, rnd, _ in draft_places:
        rounds.setdefault(id(rnd), rnd)
    parts = [token] + [rnd.tokens.view(-1) for rnd in rounds.values()]
    host = to_host(torch.cat(parts) if len(parts) > 1 else token, "decide")  # the step's one device read
    r, at = len(rows), len(rows)
    for rnd in rounds.values():
        n = rnd.tokens.numel()
        rnd.keep_host(host[at:at + n])
        at += n
    drafts = [w.draft for w in rows]
    for row, rnd, flat in draft_places:
        drafts[row] = rnd.host_flat(flat)
    return [RowResult(host[i], drafts[i] is not None and host[i] == drafts[i], 0, draft=drafts[i]) for i in range(r)]


def emitted(rows: Sequence[Row], results: Sequence[RowResult]) -> list[int]:
    """One request's rows (in order) -> the tokens they emit: ``accept``'s walk over the rows' candidates."""
    out = []
    for w, res in zip(rows, results):
        if res.draft is None:
            out.append(res.token)
            break
        if res.accepted:
            out.append(res.draft)
            continue
        out.append(res.token if w.params.greedy else res.residual)
        break
    return out
