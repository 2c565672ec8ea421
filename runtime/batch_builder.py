"""Scheduled work -> the flattened ``Batch`` tensors every backend consumes.

A segment is one request's run of consecutive new positions; segments are concatenated in order. Block tables
are right-padded with page 0: entries past a sequence's last page are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.batch import Batch


@dataclass
class Segment:
    pages: list[int]  # the request's block table; must cover positions [0, start + len(token_ids))
    start: int  # position of the first new token
    token_ids: list[int]  # the new tokens (for MTP: x_{t+1} at position t)


def build_batch(segments: list[Segment], page_size: int, device: torch.device | str = "cpu"
                ) -> tuple[torch.Tensor, Batch]:
    """-> (input_ids [T] int64, Batch)."""
    ids, positions, slots, qsl, lens = [], [], [], [0], []
    for seg in segments:
        end = seg.start + len(seg.token_ids)
        if len(seg.pages) * page_size < end:
            raise RuntimeError(f"block table of {len(seg.pages)} pages cannot hold {end} tokens")
        ids.extend(seg.token_ids)
        for pos in range(seg.start, end):
            positions.append(pos)
            slots.append(seg.pages[pos // page_size] * page_size + pos % page_size)
        qsl.append(qsl[-1] + len(seg.token_ids))
        lens.append(end)
    width = max((-(-n // page_size) for n in lens), default=1)
    tables = torch.zeros((len(segments), width), dtype=torch.int32)
    for b, (seg, n) in enumerate(zip(segments, lens)):
        used = -(-n // page_size)
        tables[b, :used] = torch.tensor(seg.pages[:used], dtype=torch.int32)
    batch = Batch(
        positions=torch.tensor(positions, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )
    if str(device) != "cpu":
        batch = Batch(**{k: v.to(device) for k, v in vars(batch).items()})
    return torch.tensor(ids, dtype=torch.int64, device=device), batch
