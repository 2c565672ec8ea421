"""Draft tokens that stay where the drafter's logits are, and the engine's counted device-to-host reads.

Why: on a GPU every read of a device value on the host waits for the device to get there. A speculative round
used to read each draft as soon as it was proposed (the next MTP call's input token came from the host), so a
round of k drafts waited k + 1 times (k proposals, then the verify step's decision), and the host's work
between the calls (batches, bookkeeping) could not overlap the device's. Now the drafter writes a round's
drafts into one device tensor (``RoundDrafts``), every later consumer takes them from there
(``fill_tokens``: the next MTP call's input ids, the verify step's input ids and its draft column), and the one
read of a round is the verify step's decision (``acceptance.decide``), which brings the verified drafts back
with the tokens it decides. A request's drafts are known on the host only when someone asks for their values
(``Request.drafts``: penalties, tests); that read is counted like every other (``HOST_READS``).

On the CPU the same code runs, the reads are free, and the counts are what the tests check.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .sampling import to_device

#: Device-to-host reads on the engine's path, by what they read. Each waits for the device to finish the work
#: queued before it; ``to_host`` is the one way the engine, the drafter and ``acceptance.decide`` read device
#: values, so tests can count them per step (the counts, never times).
HOST_READS: collections.Counter = collections.Counter()


def to_host(t: torch.Tensor, what: str) -> list:
    """``t.tolist()``, counted under ``what``."""
    HOST_READS[what] += 1
    return t.tolist()


class RoundDrafts:
    """The drafts of one drafter run: [rows, k] int64 where the logits are, row i the drafts of the run's job i
    (column s: chain step s), written one column per chain step; the host copy is made once, when first asked."""

    def __init__(self, rows: int, k: int, device: torch.device):
        self.k = k
        self.tokens = torch.full((rows, k), -1, dtype=torch.int64, device=device)
        self._host: list[list[int]] | None = None

    @classmethod
    def of(cls, tokens: torch.Tensor) -> RoundDrafts:
        """A round whose [rows, k] drafts are already made (a replayed chain's own copy: nothing else writes it)."""
        rnd = cls.__new__(cls)
        rnd.k, rnd.tokens, rnd._host = tokens.shape[1], tokens, None
        return rnd

    def put(self, step: int, rows: Sequence[int], values: torch.Tensor) -> None:
        """Chain step ``step`` drafted ``values[b]`` for job ``rows[b]``."""
        col = self.tokens[:, step]
        if list(rows) == list(range(self.tokens.shape[0])):
            col.copy_(values)
        else:
            col.index_copy_(0, to_device(torch.tensor(list(rows), dtype=torch.int64), values.device), values)

    def flat(self, row: int, step: int) -> int:
        """Where draft ``step`` of job ``row`` is in ``tokens.view(-1)``."""
        return row * self.k + step

    def host(self) -> list[list[int]]:
        if self._host is None:
            self._host = to_host(self.tokens, "drafts")
        return self._host

    def keep_host(self, flat: list[int]) -> None:
        """The values of ``tokens`` (flattened), read back by someone else with their own read (a greedy verify
        step's decision): later ``host()`` calls are then free. Only for a round whose chain has finished."""
        self._host = [flat[i:i + self.k] for i in range(0, len(flat), self.k)]

    def host_flat(self, index: int) -> int:
        """The value at ``index`` of ``tokens.view(-1)`` (``flat``), from the host copy."""
        return self.host()[index // self.k][index % self.k]


@dataclass(frozen=True)
class PendingDrafts:
    """A request's drafts whose values are still only on the device: ``count`` of them, job ``row`` of ``round``
    from chain step ``start`` on."""

    round: RoundDrafts
    row: int
    start: int
    count: int

    def flat(self, j: int) -> int:
        return self.round.flat(self.row, self.start + j)

    def host(self) -> list[int]:
        """The values (the round's one device-to-host read, shared by its requests)."""
        return self.round.host()[self.row][self.start:self.start + self.count]

    def drop(self, n: int) -> PendingDrafts | None:
        """Without the first ``n``; None when none is left."""
        return None if n >= self.count else PendingDrafts(self.round, self.row, self.start + n, self.count - n)


def fill_tokens(ids: torch.Tensor, places: Sequence[tuple[int, RoundDrafts, int]]) -> torch.Tensor:
    """Token ids (host or device) with each (row, round, flat index) of ``places`` taking that draft's value,
    on the rounds' device, without reading anything back: host ids travel with the indices in one queued copy,
    and each round's values are gathered and scattered there. No places: ``ids`` as it is."""
    if not places:
        return ids
    device = places[0][1].tokens.device
    view = _all_from_one_round(ids, places)
    if view is not None:
        return view
    runs = draft_runs(places)
    if len(runs) <= MAX_COPIED_RUNS:  # ids sent as they are, each run of drafts copied over its rows there
        if ids.device.type == "cpu" and device.type != "cpu":
            out = to_device(ids.to(torch.int64), device)  # a new tensor there, queued
        else:
            out = ids.to(device, torch.int64, copy=True)  # never the caller's tensor
        for row, rnd, src, n in runs:
            out[row:row + n].copy_(rnd.tokens.view(-1)[src:src + n])
        return out
    rounds: dict[int, tuple[RoundDrafts, list[int], list[int]]] = {}
    for row, rnd, src in places:
        _, dst, srcs = rounds.setdefault(id(rnd), (rnd, [], []))
        dst.append(row)
        srcs.append(src)
    index = torch.tensor([i for _, dst, src in rounds.values() for i in (*dst, *src)], dtype=torch.int64)
    on_host = ids.device.type == "cpu"
    n = ids.numel() if on_host else 0
    packed = to_device(torch.cat([ids.reshape(-1).to(torch.int64), index]) if on_host else index, device)
    out, start = (packed[:n] if on_host else ids.to(device, torch.int64).clone()), n  # never the caller's tensor
    for rnd, dst, _ in rounds.values():
        k = len(dst)
        out[packed[start:start + k]] = rnd.tokens.view(-1)[packed[start + k:start + 2 * k]]
        start += 2 * k
    return out


#: Runs of consecutive drafts that ``fill_tokens`` copies one by one (a verify step of one request is one run);
#: more (a batch of requests, each its own run) go in one gather and one scatter with their indices sent over.
MAX_COPIED_RUNS = 4


def draft_runs(places: Sequence[tuple[int, RoundDrafts, int]]) -> list[tuple[int, RoundDrafts, int, int]]:
    """``places`` as (first row, round, first flat index, length) runs in which rows and flat indices both step
    by one (one request's drafts of one round, in chain order): what ``fill_tokens`` and a backend that stages its
    inputs (``Backend.stages_draft_tokens``) copy run by run."""
    runs: list[list] = []
    for row, rnd, src in places:
        last = runs[-1] if runs else None
        if last is not None and last[1] is rnd and row == last[0] + last[3] and src == last[2] + last[3]:
            last[3] += 1
        else:
            runs.append([row, rnd, src, 1])
    return [tuple(r) for r in runs]


def _all_from_one_round(ids: torch.Tensor, places: Sequence[tuple[int, RoundDrafts, int]]) -> torch.Tensor | None:
    """When every id is a draft of one round, in rows evenly spaced in its tensor (an MTP chain step: each drafting
    request's previous draft), those drafts as a view of the round's tensor: no copy, no index sent to the device,
    no gather (a chain step made all three, per MTP call). Else None. Consumers only read their ids."""
    rnd = places[0][1]
    n = ids.shape[0]
    if len(places) != n or any(p[1] is not rnd for p in places) or [p[0] for p in places] != list(range(n)):
        return None
    first = places[0][2]
    stride = places[1][2] - first if n > 1 else 1
    if stride <= 0 or any(p[2] != first + stride * j for j, p in enumerate(places)):
        return None
    return rnd.tokens.view(-1)[first:first + stride * (n - 1) + 1:stride]
