"""Continuous batching: which requests run this step, how many tokens each, and who gives up pages.

Each step has a token budget (``max_num_batched_tokens``). Running requests go first, oldest first: a decoding
request asks for its last token plus its draft tokens, a request still in prefill for as much of its prompt as
the budget leaves (chunked prefill). Waiting requests are then admitted in arrival order while budget, sequence
slots and free pages last, each starting after the longest prefix of full pages already in the cache.

When a running request needs a page and none is free, it first verifies fewer of its drafts (a prefix: the rest
stay on the request for a later step); then the newest running request is preempted: its pages are released and
it goes back to the head of the queue to be recomputed from its tokens later (recompute rather than swap: the
pools live on one device and recomputation reuses whatever of its prefix is still cached). Preemption never
touches a page another request still references, and keeps the request's drafts.

A step that produces tokens is followed by the drafter, whose chain writes draft positions past the kept ones;
the scheduler reserves those pages with the step's own (``draft_reserve`` tokens past what the step computes), so
drafting never runs short of pages and never depends on what else holds the pool.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager, page_digest
from .request import Request, Status

#: Tokens per step when the engine is not told (``default_token_budget``): on the CPU, what the runtime benchmarks
#: run; on GPUs, vLLM's serving defaults (``EngineArgs.get_batch_defaults``, OpenAI server context): 8192 on GPUs
#: of at least 70 GiB other than the A100 (H100, H200, MI300), 2048 on the others.
CPU_TOKEN_BUDGET = 512
LARGE_GPU_TOKEN_BUDGET = 8192
GPU_TOKEN_BUDGET = 2048
LARGE_GPU_BYTES = 70 * 2**30


def default_token_budget(device) -> int:
    """``max_num_batched_tokens`` for an engine on ``device`` (a torch device, or None for the CPU) that was given
    none, whose backend streams prefill attention there (``Backend.default_max_num_batched_tokens``: the torch
    backend with the Triton kernels; other backends keep the CPU's). Why it follows the device: a prompt runs in
    chunks of the budget, and on a GPU a short chunk leaves the MoE GEMMs launch- and tile-bound (on the H200,
    ``mini``: a 16k-token prompt in chunks of 512 / 2048 / 8192, ``docs/performance.md``), while a decode step
    sharing the step with a chunk waits for all of it; vLLM takes the same trade with these numbers. On the CPU a
    step of 512 tokens already keeps the cores busy."""
    import torch

    device = torch.device("cpu" if device is None else device)
    if device.type != "cuda":
        return CPU_TOKEN_BUDGET
    props = torch.cuda.get_device_properties(device)
    if props.total_memory >= LARGE_GPU_BYTES and "a100" not in props.name.lower():
        return LARGE_GPU_TOKEN_BUDGET
    return GPU_TOKEN_BUDGET


@dataclass
class ScheduledRequest:
    """One request's share of a step, as planned (facts about the request before the step ran)."""

    request: Request
    num_new: int  # known tokens computed this step, from position request.num_computed
    num_drafts: int = 0  # the request's first drafts, verified after them (only when they reach the end)
    #: This run reaches the request's last known token, so the step produces its next token(s).
    samples: bool = field(init=False)
    #: A plain generation step: only the newest generated token (and drafts) goes through the model.
    is_decode: bool = field(init=False)

    def __post_init__(self) -> None:
        r = self.request
        self.samples = r.num_computed + self.num_new == r.num_tokens
        self.is_decode = self.samples and self.num_new == 1 and bool(r.output_token_ids)

    @property
    def drafts(self) -> list[int]:
        """The drafts' values (read from the device if the drafter left them there: the engine does not ask)."""
        return self.request.drafts[:self.num_drafts]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_prefill_tokens: int  # tokens of runs that are not decode steps (prompt chunks, recompute)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 page_lookahead: int = 0, draft_reserve: int = 0, max_model_len: int | None = None):
        """``page_lookahead``: how many tokens after a page its cached state depends on (1 with MTP, whose entry
        at position t is computed from token t + 1), so the prefix-cache identity of a page includes them.
        ``draft_reserve``: tokens past a producing step's last computed one that the drafter may write (k - 1 for
        k speculative tokens), reserved up to ``max_model_len``."""
        self.draft_reserve = draft_reserve
        self.max_model_len = max_model_len
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.page_lookahead = page_lookahead
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue changes
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        """Leave the scheduler (finished or aborted) and release every page."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.blocks.release(req.pages)
        req.pages = []
        req.status = Status.FINISHED

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.release(req.pages)
        req.pages, req.page_digests = [], []
        req.num_computed = req.num_mtp_computed = 0
        self.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ pages
    def ensure_pages(self, req: Request, num_tokens: int) -> bool:
        """Grow the request's block table to hold positions [0, num_tokens); False if the pool is short."""
        missing = self.blocks.pages_for(num_tokens) - len(req.pages)
        if missing <= 0:
            return True
        if missing > self.blocks.num_free:
            return False
        req.pages.extend(self.blocks.allocate(missing))
        return True

    def _step_tokens(self, req: Request, start: int, num_new: int, num_drafts: int) -> int:
        """Positions the request's pages must cover for a step of ``num_new`` known tokens from ``start`` and
        ``num_drafts`` drafts, including what the drafter writes after a step that produces tokens: at most
        (last computed + 1 emitted) + draft_reserve, never past max_model_len (where drafting stops)."""
        end = start + num_new + num_drafts
        if start + num_new < req.num_tokens or not self.draft_reserve:  # a prefill chunk: nothing is drafted
            return end
        reserve = end + self.draft_reserve
        return max(end, min(reserve, self.max_model_len)) if self.max_model_len else reserve

    def trim_pages(self, req: Request) -> None:
        """Release pages past the request's cached positions (rolled-back drafts leave them empty)."""
        keep = self.blocks.pages_for(req.num_computed)
        if len(req.pages) > keep:
            self.blocks.release(req.pages[keep:])
            del req.pages[keep:]

    def _digest(self, req: Request, i: int, parent: bytes | None) -> bytes:
        p = self.blocks.page_size
        lo, hi = i * p, (i + 1) * p + self.page_lookahead
        digest = page_digest(parent, req.tokens[lo:hi])
        if req.media is not None and (key := req.media.page_key(lo, hi)):
            # Placeholder ids are the same for every image: the page's identity must include what fills them.
            digest = hashlib.sha256(digest + key).digest()
        return digest

    def publish(self, req: Request, cached_len: int) -> None:
        """Offer the request's full, final pages (every position below ``cached_len``) to the prefix cache."""
        p = self.blocks.page_size
        limit = min(cached_len // p, (req.num_tokens - self.page_lookahead) // p, len(req.pages))
        for i in range(len(req.page_digests), limit):
            parent = req.page_digests[-1] if req.page_digests else None
            d = self._digest(req, i, parent)
            self.blocks.register(req.pages[i], d)
            req.page_digests.append(d)

    def _cached_prefix(self, req: Request) -> tuple[list[int], list[bytes]]:
        """Cached pages for the request's leading full pages; at least its last token is always recomputed, as
        the step that computes it is the one that produces the next token."""
        if not self.blocks.enable_prefix_caching:
            return [], []
        digests: list[bytes] = []
        for i in range((req.num_tokens - 1) // self.blocks.page_size):
            digests.append(self._digest(req, i, digests[-1] if digests else None))
        hits = self.blocks.lookup(digests)
        return hits, digests[:len(hits)]

    # ------------------------------------------------------------------ the step plan
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed
            num_new = min(remaining, budget)
            drafts = min(req.num_drafts, budget - num_new) if num_new == remaining else 0
            while not self.ensure_pages(req, self._step_tokens(req, req.num_computed, num_new, drafts)):
                if drafts:
                    drafts -= 1  # verify a shorter prefix; the rest waits on the request
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break
            scheduled.append(ScheduledRequest(req, num_new, drafts))
            budget -= num_new + drafts
            i += 1

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            hits, digests = self._cached_prefix(req)
            start = len(hits) * self.blocks.page_size
            num_new = min(req.num_tokens - start, budget)
            fresh = self.blocks.pages_for(self._step_tokens(req, start, num_new, 0)) - len(hits)
            revived = sum(1 for p in hits if self.blocks.refcount(p) == 0)
            if fresh > self.blocks.num_free - revived:
                break
            self.blocks.acquire(hits)
            req.pages = hits + self.blocks.allocate(fresh)
            req.page_digests = digests
            req.num_computed = req.num_mtp_computed = start
            req.status = Status.RUNNING
            self.waiting.popleft()
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new

        prefill = sum(s.num_new for s in scheduled if not s.is_decode)
        return SchedulerOutput(scheduled, prefill)
