"""Draft proposers for speculative decoding, and the MTP one.

After every target step the engine hands the drafter, per request, the target's hidden states for the positions
that step computed and kept (accepted), and how many drafts it wants. The drafter must leave ``request.drafts``
(and, for sampling requests, ``request.draft_probs``: the distributions the drafts were drawn from). It is asked
for drafts only when the request holds none: drafts a step could not verify (pages or budget were short) stay on
the request and are verified by later steps, never redrafted. The scheduler reserves the pages that the chain
below writes before the step runs, so a drafter always delivers every draft it was asked for.

MTP drafting, per step and batched over requests. Which entries each module's cache must hold:
1. Catch-up: every module that ever drafts (module m drafts step s when s % num_modules == m, s < k) gets an
   entry at each newly kept position t, from token x_{t+1} and target hidden h_t, so its cache holds a
   well-defined entry for every position of the sequence. A module that attended to stale pool rows would draft
   differently depending on what other requests left there, and sampled drafts consume the request's random
   stream. At the last position (token = the token just produced) module 0's logits give draft 1.
2. Chain: draft s + 1 comes from module ``s % num_modules`` at the next position, fed draft s and the previous
   module output. These entries sit past the request's ``num_mtp_computed``: no later step reads them as
   context, and the next catch-up overwrites them, which is the rollback of the MTP caches. A module that a later
   chain step uses also gets an entry at every earlier chain position (same inputs as the module that drafted
   there), for the same reason as in 1.: its attention must never reach a row this request did not write.

Cost: a module call costs about the same whatever its (small) token count, so each module's pending entries (its
catch-up, then the chain positions since it last ran) are written by its next call, one run of positions per
request: a round of k drafts is at most k module calls, not one call per module per position (for k = 2 with two
modules: module 0 over the kept positions, module 1 over the kept positions plus the first chain position), and
a module that drafts nothing in a round writes its catch-up in one call at the end. A backend that replays
one-position steps from CUDA graphs (``Backend.replays_single_position_mtp_steps``) gets every entry as soon as it
is known instead, so each chain call has one position per request, the shape it replays. Greedy and sampled
drafts are decided for all rows at once where the logits are.

A backend that replays whole rounds (``Backend.replays_mtp_chains``: the graphed torch backend) gets a uniform
greedy round (every request drafting k after keeping q positions: always so at batch 1) as one call,
``Backend.mtp_chain``, with ``chain_plan``: the calls above for one request, as position ranges. One batch over
each request's q + k - 1 positions is built, and the backend runs the calls from it (on the H200 the calls one by
one, each with its own batch, fill and replay, made a round cost ~3.5 plain decode steps of host work).

Where the drafts stay: on a backend that takes token ids on its device (``Backend.takes_device_token_ids``: the
torch backends) a round's drafts never come to the host during the round: each chain step writes its drafts into
the round's device tensor (``device_drafts.RoundDrafts``), the next call's input ids take them from there, and
the request is left holding them there (``Request.pending_drafts``) for the verify step, whose decision reads
them back with the verified tokens. So a round waits for the device once, not once per draft. Other backends
read each step's drafts back (one copy per chain step). A sampled draft's distribution is kept as a row of the
step's [rows, V] probabilities (a view, no copy); the verify step stacks the rows it needs once.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from m3export.model.batch import Segment, build_batch

from .backends.base import Backend
from .device_drafts import PendingDrafts, RoundDrafts, fill_tokens, to_host
from .request import Request
from .sampling import propose_rows, to_device


@dataclass
class DraftJob:
    request: Request
    start: int  # first position the target step computed and kept
    hidden: torch.Tensor  # [n, H] target hidden (final-normed) at positions start .. start + n - 1
    num_drafts: int  # 0: only keep the drafter's state up to date (prefill chunk, last token of a request)


class Drafter(ABC):
    #: Tokens after a page that the drafter's cached state for the page depends on (part of its cache identity).
    page_lookahead: int = 0

    def cached_len(self, req: Request) -> int:
        """Positions whose drafter state is final; a page is shareable only below this."""
        return req.num_computed

    @abstractmethod
    def run(self, jobs: list[DraftJob]) -> None:
        """Update drafter state for each job and set ``request.drafts`` / ``request.draft_probs``."""


@dataclass(frozen=True)
class _Drafted:
    """An input token that is the round's draft of chain step ``step`` (its value is in the round's tensor)."""

    step: int


@dataclass
class _Run:
    """Entries one module still has to write for one request: consecutive positions from ``start``."""

    start: int
    tokens: list[int | _Drafted] = field(default_factory=list)  # x_{t+1} (or the draft) at each position t
    hidden: list[torch.Tensor] = field(default_factory=list)  # [n_i, H] pieces, h_t (or a module output)

    def extend(self, tokens: list[int], hidden: torch.Tensor) -> None:
        self.tokens.extend(tokens)
        self.hidden.append(hidden)


class MTPDrafter(Drafter):
    page_lookahead = 1

    def __init__(self, backend: Backend, page_size: int, ensure_pages: Callable[[Request, int], bool],
                 num_speculative_tokens: int | None = None):
        """``num_speculative_tokens``: the most drafts any job asks for (the engine's k); modules that no chain
        of that length uses (module 1 when k = 1) are never run. None: every module is kept up to date."""
        if backend.num_mtp_modules < 1:
            raise ValueError("MTPDrafter needs a backend with at least one MTP module")
        self.backend = backend
        self.page_size = page_size
        self.ensure_pages = ensure_pages
        self.num_modules = backend.num_mtp_modules
        self.max_drafts = num_speculative_tokens
        self.modules_used = modules_used(self.num_modules, num_speculative_tokens)

    def cached_len(self, req: Request) -> int:
        return req.num_mtp_computed

    def run(self, jobs: list[DraftJob]) -> None:
        for j in jobs:
            r = j.request
            if r.num_mtp_computed != j.start:
                raise RuntimeError(f"request {r.request_id}: MTP cache covers {r.num_mtp_computed} positions but "
                                   f"the target step started at {j.start}")
            if self.max_drafts is not None and j.num_drafts > self.max_drafts:
                raise ValueError(f"request {r.request_id}: {j.num_drafts} drafts asked of an MTP drafter built "
                                 f"for at most {self.max_drafts}")
        kept = [i for i, j in enumerate(jobs) if len(j.hidden)]
        for j in jobs:
            j.request.num_mtp_computed = j.start + len(j.hidden)
        if not kept:
            return
        drafting = [i for i in kept if jobs[i].num_drafts > 0]
        for i in drafting:
            jobs[i].request.clear_drafts()
        # A replayed round first: it needs none of the per-module bookkeeping below (a greedy round at batch 1
        # always replays, and that bookkeeping was a sizeable share of its host work).
        if self._replay_chain(jobs, drafting):
            return
        # pending[m][i]: what module m must still write for job i, first its catch-up.
        pending: list[dict[int, _Run]] = [{} for _ in range(self.modules_used)]
        for i in kept:
            j = jobs[i]
            for runs in pending:
                runs[i] = _Run(j.start)
                runs[i].extend(j.request.tokens[j.start + 1:j.start + len(j.hidden) + 1], j.hidden)
        # A backend that replays one-position steps from graphs gets each module's entries as soon as they are
        # known (every chain call then has one position per request); any other gets them merged (see above).
        single = self.backend.replays_single_position_mtp_steps
        on_device = self.backend.takes_device_token_ids
        rnd: RoundDrafts | None = None  # made at the first proposal, where the logits are
        drafted: dict[int, int] = {}  # job -> drafts proposed this round
        probs_rows: dict[int, list[torch.Tensor]] = {}  # job -> its sampled drafts' distributions ([V] views)
        module, step = 0, 0
        while True:
            logits, out = self._write(module, jobs, pending[module], drafting, rnd)
            if single:
                for m, runs in enumerate(pending):
                    if runs:
                        self._write(m, jobs, runs, [], rnd)
            rnd = self._propose(jobs, drafting, step, logits, rnd, on_device, probs_rows)
            drafted.update((i, step + 1) for i in drafting)
            chain_hidden = dict(zip(drafting, out))
            step += 1
            # Draft step s runs at position (last kept) + s, which needs a page.
            drafting = [i for i in drafting if jobs[i].num_drafts > step
                        and self.ensure_pages(jobs[i].request, jobs[i].request.num_mtp_computed + step)]
            if not drafting:
                break
            module = step % self.num_modules
            for i in drafting:
                r = jobs[i].request
                pos, entry = r.num_mtp_computed - 1 + step, chain_hidden[i][None]
                token = _Drafted(step - 1) if on_device else r.drafts[-1]
                for m, runs in enumerate(pending):
                    if m == module or any(s % self.num_modules == m for s in range(step + 1, jobs[i].num_drafts)):
                        runs.setdefault(i, _Run(pos)).extend([token], entry)
        for i, n in drafted.items():
            r = jobs[i].request
            if on_device:
                r.set_pending_drafts(PendingDrafts(rnd, i, 0, n))
            r.draft_probs = probs_rows.get(i)
        # Modules that draft nothing more this round still owe their catch-up; chain entries that no later step
        # reads are dropped.
        for m, runs in enumerate(pending):
            for i, run in list(runs.items()):
                keep = jobs[i].request.num_mtp_computed - run.start
                if keep <= 0:
                    del runs[i]
                elif keep < len(run.tokens):
                    runs[i] = _Run(run.start, run.tokens[:keep], [torch.cat(run.hidden)[:keep]])
            if runs:
                self._write(m, jobs, runs, [], rnd)

    def _replay_chain(self, jobs: list[DraftJob], drafting: list[int]) -> bool:
        """The whole round as one backend call when the backend replays MTP chains (``Backend.mtp_chain``) and the
        round is uniform: every job drafts, greedily, the same number k of drafts after the same number q of kept
        positions (every request decoding at batch 1; a batch whose requests accepted alike). The calls of the
        round (``chain_plan``) then run on one batch over each request's q + k - 1 positions, built once, the
        drafts staying on the device; what each call writes and proposes is what the calls below make one by one
        (the same positions, tokens and hidden states). False (nothing done) when the round is not uniform, the
        pool is short of pages for its chain, or the backend declines the shape."""
        if not self.backend.replays_mtp_chains or not self.backend.takes_device_token_ids or \
                len(drafting) != len(jobs):
            return False
        q, k = len(jobs[0].hidden), jobs[0].num_drafts
        if any(len(j.hidden) != q or j.num_drafts != k or not j.request.params.greedy for j in jobs):
            return False
        if not all(self.ensure_pages(j.request, j.request.num_mtp_computed + k - 1) for j in jobs):
            return False
        segments = [Segment(j.request.pages, j.start, j.request.tokens[j.start + 1:j.start + q + 1] + [0] * (k - 1))
                    for j in jobs]
        ids, batch = build_batch(segments, self.page_size, self.backend.batch_device)
        hidden = jobs[0].hidden if len(jobs) == 1 else torch.cat([j.hidden for j in jobs])
        plan = chain_plan(q, k, self.num_modules, self.modules_used)
        drafts = self.backend.mtp_chain(plan, ids, hidden, batch)
        if drafts is None:
            return False
        rnd = RoundDrafts.of(drafts)
        for i, j in enumerate(jobs):
            j.request.set_pending_drafts(PendingDrafts(rnd, i, 0, k))
            j.request.draft_probs = None
        return True

    @staticmethod
    def _propose(jobs: list[DraftJob], drafting: list[int], step: int, logits: torch.Tensor,
                 rnd: RoundDrafts | None, on_device: bool, probs_rows: dict[int, list[torch.Tensor]]
                 ) -> RoundDrafts | None:
        """Chain step ``step``'s draft of each job in ``drafting`` (logits row b is job drafting[b]'s), all rows at
        once where the logits are (``sampling.propose_rows``: argmax for greedy requests, else a draw from the
        filtered distribution with the uniform of the position drafted, so a position redrafted from the same
        context gets the same draft), written into the round's tensor (made here at the first step) and, when the
        backend needs them on the host, read back and appended to the requests' drafts. A sampled request's
        distribution row is kept for ``draft_probs``. Returns the round."""
        if not drafting:  # a call that only kept the modules' caches current
            return rnd
        reqs = [jobs[i].request for i in drafting]
        tokens, probs = propose_rows(logits, [r.params for r in reqs], [r.rng for r in reqs],
                                     [r.num_tokens + step for r in reqs], host=False)
        if rnd is None:
            rnd = RoundDrafts(len(jobs), max(j.num_drafts for j in jobs), tokens.device)
        rnd.put(step, drafting, tokens)
        if not on_device:
            for r, tok in zip(reqs, to_host(tokens, "propose")):
                r.drafts.append(tok)
        for b, (i, r) in enumerate(zip(drafting, reqs)):
            if not r.params.greedy:
                probs_rows.setdefault(i, []).append(probs[b])
        return rnd

    def _write(self, module: int, jobs: list[DraftJob], runs: dict[int, _Run], want: list[int],
               rnd: RoundDrafts | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One call of ``module`` over every pending run (which it then clears); returns its logits and output
        hidden at the last entry of each job in ``want`` (in that order). Input tokens that are this round's
        drafts (``_Drafted``) are taken from ``rnd`` where they are."""
        order = sorted(runs)
        places, offset, end = [], 0, {}  # end[i]: job i's last entry's row
        for i in order:
            for j, tok in enumerate(runs[i].tokens):
                if isinstance(tok, _Drafted):
                    places.append((offset + j, rnd, rnd.flat(i, tok.step)))
            offset += len(runs[i].tokens)
            end[i] = offset - 1
        segments = [Segment(jobs[i].request.pages, runs[i].start,
                            [0 if isinstance(t, _Drafted) else t for t in runs[i].tokens]) for i in order]
        ids, batch = build_batch(segments, self.page_size, self.backend.batch_device)
        ids = fill_tokens(ids, places)
        pieces = [h for i in order for h in runs[i].hidden]
        # One piece (one request's catch-up or chain entry) goes as it is: the backend only reads it.
        hidden = pieces[0] if len(pieces) == 1 else torch.cat([p.to(pieces[0].dtype) for p in pieces])
        rows = [end[i] for i in want]
        last = torch.tensor(rows, dtype=torch.int64)
        if batch.query_start_loc.device.type != "cpu":  # a backend that takes its batches on the device
            last = to_device(last, batch.query_start_loc.device)
        logits, out = self.backend.mtp_forward(module, ids, hidden, batch, last)
        runs.clear()
        return logits, _rows(out, rows, last)


class ChainPlan(NamedTuple):
    """The module calls of a round (``chain_plan``): ``calls`` = (module, first, end) position ranges relative to
    the first kept position; the first ``k`` calls propose drafts 1 .. k from their last position, any after them
    only write catch-up entries that a module drafting nothing more this round still owes."""

    q: int
    k: int
    calls: tuple[tuple[int, int, int], ...]


def modules_used(num_modules: int, num_speculative_tokens: int | None) -> int:
    """How many of ``num_modules`` MTP modules a drafter of ``num_speculative_tokens`` drafts runs: all of them
    when None, else one per draft, at least one and at most all (the drafter, and the graphs captured for it)."""
    return num_modules if num_speculative_tokens is None else max(1, min(num_modules, num_speculative_tokens))


@functools.lru_cache(maxsize=256)  # a pure function of four small ints, asked once per round
def chain_plan(q: int, k: int, num_modules: int, modules_used: int) -> ChainPlan:
    """The module calls ``MTPDrafter.run`` makes for one request that kept q positions and drafts k: module 0 over
    the kept positions, then each chain step's module over what it still owes (its catch-up, then the chain
    positions since it last ran), then the catch-up of any module that drafted nothing (k < ``modules_used``).
    Position q + s - 1 (s >= 1) takes draft s and the previous call's output at its last position; below q, the
    kept tokens and the target's hidden states. The same bookkeeping as ``run`` (whose calls on one request are
    these), for a backend that replays the whole round (``Backend.mtp_chain``)."""
    if q < 1 or k < 1:
        raise ValueError(f"chain_plan: q={q} kept positions and k={k} drafts must both be >= 1")
    owed = {m: [0, q] for m in range(modules_used)}  # module -> [first, end) of the positions it still owes
    calls = []
    for step in range(k):
        first, end = owed.pop(step % num_modules)
        calls.append((step % num_modules, first, end))
        nxt = step + 1
        if nxt == k:
            break
        pos = q - 1 + nxt  # chain step nxt's position
        for m in range(modules_used):
            if m == nxt % num_modules or any(s % num_modules == m for s in range(nxt + 1, k)):
                run = owed.setdefault(m, [pos, pos])
                if run[1] != pos:
                    raise AssertionError(f"chain_plan: module {m} owes {run} and then position {pos}")
                run[1] = pos + 1
    # what ``run`` writes after its chain: entries below the kept length (chain entries past it are dropped)
    calls += [(m, first, min(end, q)) for m, (first, end) in sorted(owed.items()) if first < q]
    return ChainPlan(q, k, tuple(calls))


def _rows(x: torch.Tensor, rows: list[int], index: torch.Tensor) -> torch.Tensor:
    """``x[rows]`` (``index``: the same rows as a tensor): a view when the rows are evenly spaced (one job, or a
    chain step's one position per job), else one gather queued where ``x`` is. A speculative round of one request
    asks this of every MTP call, and the gather's index copy to the device plus its kernel were two more
    operations per call for what a slice gives."""
    n = len(rows)
    if n == 0:
        return x[:0]
    first, stride = rows[0], rows[1] - rows[0] if n > 1 else 1
    if stride > 0 and rows == list(range(first, first + stride * n, stride)):
        return x[first:first + stride * (n - 1) + 1:stride]
    return x.index_select(0, to_device(index, x.device))  # queued: no wait for the device
