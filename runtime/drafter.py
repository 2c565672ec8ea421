"""Draft proposers for speculative decoding, and the MTP one.

After every target step the engine hands the drafter, per request, the target's hidden states for the positions
that step computed and kept (accepted), and how many drafts it wants. The drafter must leave ``request.drafts``
(and, for sampling requests, ``request.draft_probs``: the distributions the drafts were drawn from). It is asked
for drafts only when the request holds none: drafts a step could not verify (pages or budget were short) stay on
the request and are verified by later steps, never redrafted. The scheduler reserves the pages that the chain
below writes before the step runs, so a drafter always delivers every draft it was asked for.

MTP drafting, per step and batched over requests:
1. Catch-up: every MTP module runs over the newly kept positions t with token x_{t+1} and target hidden h_t,
   so each module's own cache holds a well-defined entry for every position of the sequence. Running all
   modules (not only the first) matters for seeded sampling: a module that attended to stale pool rows would
   draft differently depending on what other requests left there, and drafts consume the request's random
   stream. At the last position (token = the token just produced) module 0's logits give draft 1.
2. Chain: draft s + 1 comes from module ``s % num_modules`` at the next position, fed draft s and the previous
   module output. These entries sit past the request's ``num_mtp_computed``: no later step reads them as
   context, and the next catch-up overwrites them, which is the rollback of the MTP caches. With several
   modules, a module that a later chain step uses is also run at the earlier chain positions, for the same
   reason as in 1.: its attention must never reach a row this request did not write in this round.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from m3export.model.batch import Segment, build_batch

from .backends.base import Backend
from .request import Request
from .sampling import Purpose, draw, filtered_probs


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


def _propose(req: Request, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """The next draft token (argmax for greedy requests, else drawn from the filtered distribution) and its p_d.
    Its uniform is the one for the position it drafts (after the request's tokens and drafts so far), so a
    position redrafted from the same context gets the same draft. On the CPU, like target sampling."""
    logits = logits.float().cpu()
    if req.params.greedy:
        return int(torch.argmax(logits)), None
    probs = filtered_probs(logits, req.params)
    return draw(probs, req.rng.uniform(req.num_tokens + len(req.drafts), Purpose.DRAFT)), probs


class MTPDrafter(Drafter):
    page_lookahead = 1

    def __init__(self, backend: Backend, page_size: int, ensure_pages: Callable[[Request, int], bool]):
        if backend.num_mtp_modules < 1:
            raise ValueError("MTPDrafter needs a backend with at least one MTP module")
        self.backend = backend
        self.page_size = page_size
        self.ensure_pages = ensure_pages
        self.device = backend.device

    def cached_len(self, req: Request) -> int:
        return req.num_mtp_computed

    def run(self, jobs: list[DraftJob]) -> None:
        if not jobs:
            return
        for j in jobs:
            if j.request.num_mtp_computed != j.start:
                raise RuntimeError(f"request {j.request.request_id}: MTP cache covers {j.request.num_mtp_computed} "
                                   f"positions but the target step started at {j.start}")
        last_logits, last_hidden = self._catch_up(jobs)
        drafting = [(j, last_logits[i], last_hidden[i]) for i, j in enumerate(jobs) if j.num_drafts > 0]
        for j, logits, _ in drafting:
            j.request.drafts = []
            tok, probs = _propose(j.request, logits)
            j.request.drafts = [tok]
            j.request.draft_probs = None if probs is None else probs[None]
        self._chain([(j, h) for j, _, h in drafting])

    def _catch_up(self, jobs: list[DraftJob]) -> tuple[torch.Tensor, torch.Tensor]:
        """All modules over the kept positions; returns module 0's logits and output at each job's last one."""
        segments = []
        for j in jobs:
            r, n = j.request, len(j.hidden)
            segments.append(Segment(r.pages, j.start, r.tokens[j.start + 1:j.start + n + 1]))
        ids, batch = build_batch(segments, self.page_size, self.device)
        hidden = torch.cat([j.hidden for j in jobs])
        last = batch.query_start_loc[1:].long() - 1
        logits = out = None
        for m in range(self.backend.num_mtp_modules):
            index = last if m == 0 else last[:0]
            lg, o = self.backend.mtp_forward(m, ids, hidden, batch, index)
            if m == 0:
                logits, out = lg, o.index_select(0, last)
        for j in jobs:
            j.request.num_mtp_computed = j.start + len(j.hidden)
        return logits, out

    def _chain(self, active: list[tuple[DraftJob, torch.Tensor]]) -> None:
        modules = self.backend.num_mtp_modules
        step = 1
        while True:
            # Draft step s runs at position (last kept) + s, which needs a page.
            active = [(j, h) for j, h in active if j.num_drafts > step
                      and self.ensure_pages(j.request, j.request.num_mtp_computed + step)]
            if not active:
                return
            segments = [Segment(j.request.pages, j.request.num_mtp_computed - 1 + step, [j.request.drafts[-1]])
                        for j, _ in active]
            ids, batch = build_batch(segments, self.page_size, self.device)
            hidden = torch.stack([h for _, h in active])
            rows = torch.arange(len(active), device=ids.device)
            logits, out = self.backend.mtp_forward(step % modules, ids, hidden, batch, rows)
            self._fill_gaps(step, active, ids, hidden, batch)
            for i, (j, _) in enumerate(active):
                r = j.request
                tok, probs = _propose(r, logits[i])
                r.drafts.append(tok)
                if probs is not None:
                    r.draft_probs = torch.cat([r.draft_probs, probs[None]])
            active = [(j, out[i]) for i, (j, _) in enumerate(active)]
            step += 1

    def _fill_gaps(self, step: int, active, ids, hidden, batch) -> None:
        """With several modules, a module used at a later chain step attends over this step's position too:
        write its entry there as well, so it never reads a row another request (or another round) left."""
        modules = self.backend.num_mtp_modules
        if modules == 1:
            return
        empty = torch.zeros(0, dtype=torch.int64, device=ids.device)
        for m in range(modules):
            if m == step % modules:
                continue
            if any(s % modules == m for j, _ in active for s in range(step + 1, j.num_drafts)):
                # Every active row is written (rows that never use module m again get a harmless entry past
                # their cached length): one batched call instead of a sub-batch per module.
                self.backend.mtp_forward(m, ids, hidden, batch, empty)
