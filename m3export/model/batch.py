"""The flattened, paged batch every forward runs on: a mix of prefill chunks and decode steps.

Tokens of all sequences are concatenated (no padding). ``query_start_loc`` marks where each sequence's new
tokens start, ``seq_lens`` is each sequence's context length after this step, and ``slot_mapping`` says where
each new token's K/V (and index key) goes in the pools: slot = page * page_size + row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    positions: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_pages] int32
    slot_mapping: torch.Tensor  # [T] int64

    @classmethod
    def contiguous(cls, batch: int, length: int, page: int, device: torch.device | str = "cpu") -> "Batch":
        """B sequences of ``length`` tokens from position 0, each on its own consecutive pages."""
        pages = -(-length // page)
        positions = torch.arange(length, device=device).repeat(batch)
        tables = torch.arange(batch * pages, dtype=torch.int32, device=device).view(batch, pages)
        slots = (torch.arange(batch, device=device)[:, None] * pages * page + torch.arange(length, device=device))
        return cls(
            positions=positions,
            query_start_loc=torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device),
            seq_lens=torch.full((batch,), length, dtype=torch.int32, device=device),
            block_tables=tables,
            slot_mapping=slots.reshape(-1),
        )


def write_pool(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, inplace: bool) -> torch.Tensor:
    """Store ``values`` [T, ...] at ``slots`` of ``pool`` [pages, page, ...].

    In place for the eager runtime (cost scales with T, not the pool); functional when exporting, where it
    becomes one ScatterND whose output ONNX Runtime can bind to the same buffer as its input.
    """
    page = pool.shape[1]
    index = (slots // page, slots % page)
    values = values.to(pool.dtype)
    if inplace:
        return pool.index_put_(index, values)
    return pool.index_put(index, values)
