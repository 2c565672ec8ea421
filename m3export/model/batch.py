"""The flattened, paged batch every forward runs on: a mix of prefill chunks and decode steps.

Tokens of all sequences are concatenated (no padding). ``query_start_loc`` marks where each sequence's new
tokens start, ``seq_lens`` is each sequence's context length after this step, and ``slot_mapping`` says where
each new token's K/V (and index key) goes in the pools: slot = page * page_size + row.

This module is the one owner of that interface. ``Batch``'s fields are, in order, the graph inputs that carry
it (``Batch.input_names()``), each with its symbolic dimensions (``Batch.input_dims()``, from which the exporter
declares dynamic shapes by name); ``build_batch`` is its one producer from scheduled work (runtime and verify);
``Batch.feeds`` turns it into ONNX Runtime feeds and ``Batch.from_inputs`` back into a ``Batch`` inside a
traced graph. Adding a field is therefore: declare it here (type, dims), fill it in ``build_batch`` and
``Batch.contiguous``, and use it in the model; ``docs/batch.md`` walks through it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def dims(*names: str) -> dict:
    """Field metadata: the symbolic name of each dimension ("T" tokens, "B" sequences, "B+1", "max_pages")."""
    return {"dims": names}


@dataclass
class Batch:
    positions: torch.Tensor = dataclasses.field(metadata=dims("T"))  # [T] int64
    query_start_loc: torch.Tensor = dataclasses.field(metadata=dims("B+1"))  # [B + 1] int32
    seq_lens: torch.Tensor = dataclasses.field(metadata=dims("B"))  # [B] int32
    block_tables: torch.Tensor = dataclasses.field(metadata=dims("B", "max_pages"))  # [B, max_pages] int32
    slot_mapping: torch.Tensor = dataclasses.field(metadata=dims("T"))  # [T] int64

    # ------------------------------------------------------------------ the graph interface
    @classmethod
    def input_names(cls) -> tuple[str, ...]:
        """The graph inputs that carry a batch, in the order graphs take them."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def input_dims(cls) -> dict[str, tuple[str, ...]]:
        """Symbolic dimensions of each batch input, by name."""
        return {f.name: f.metadata["dims"] for f in dataclasses.fields(cls)}

    @classmethod
    def from_inputs(cls, args: Sequence[torch.Tensor]) -> tuple[Batch, tuple]:
        """A graph's positional inputs that start with the batch -> (Batch, the inputs after it)."""
        n = len(dataclasses.fields(cls))
        return cls(*args[:n]), tuple(args[n:])

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """The batch as graph inputs, in ``input_names()`` order."""
        return tuple(getattr(self, name) for name in self.input_names())

    def feeds(self, **extra: torch.Tensor) -> dict[str, np.ndarray]:
        """ONNX Runtime feeds: every batch input plus ``extra`` (``input_ids``, ``logits_indices``, ...), as host
        numpy arrays by graph input name."""
        named = {**dict(zip(self.input_names(), self.inputs())), **extra}
        return {name: t.detach().cpu().numpy() for name, t in named.items()}

    def to(self, device: torch.device | str) -> Batch:
        return dataclasses.replace(self, **{name: t.to(device) for name, t in zip(self.input_names(), self.inputs())})

    # ------------------------------------------------------------------ producers
    @classmethod
    def contiguous(cls, batch: int, length: int, page: int, device: torch.device | str = "cpu") -> Batch:
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


@dataclass
class Segment:
    """One request's run of consecutive new positions in a step."""

    pages: list[int]  # the request's block table; must cover positions [0, start + len(token_ids))
    start: int  # position of the first new token
    token_ids: list[int]  # the new tokens (for MTP: x_{t+1} at position t)


def build_batch(segments: list[Segment], page_size: int, device: torch.device | str = "cpu",
                min_table_width: int = 1) -> tuple[torch.Tensor, Batch]:
    """Scheduled work -> (input_ids [T] int64, Batch): the one way a batch is made from requests.

    Segments are concatenated in order. Block tables are right-padded with page 0 (at least
    ``min_table_width`` wide): entries past a sequence's last page are never read.
    """
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
    # numpy takes a Python list into a row about ten times faster than a torch.tensor per row (long contexts
    # have thousands of pages per sequence, at every decode step).
    tables = np.zeros((len(segments), max(width, min_table_width)), dtype=np.int32)
    for b, (seg, n) in enumerate(zip(segments, lens)):
        used = -(-n // page_size)
        tables[b, :used] = seg.pages[:used]
    batch = Batch(
        positions=torch.tensor(positions, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.from_numpy(tables),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )
    if str(device) != "cpu":
        batch = batch.to(device)
    return torch.tensor(ids, dtype=torch.int64, device=device), batch


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


def write_pool_fp8(pool: torch.Tensor, scale_pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor,
                   inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``write_pool`` for an FP8 (E4M3) pool: each row of ``values`` quantised with its own fp32 scale
    (``m3export.ops.kv_fp8``), the bytes into ``pool`` and the scale into ``scale_pool`` at the same slots.
    A ``uint8`` pool holds the E4M3 codes (the ONNX form of an FP8 pool): its rows come from the op
    ``m3::quantize_kv_rows`` (the same bytes), which an export traces as one node and translates to standard ONNX
    ops, so the exported write is a ScatterND of codes and one of scales, in place like every pool write."""
    import m3export.ops.kv_fp8 as kv_fp8

    if pool.dtype == torch.uint8:
        q, scale = torch.ops.m3.quantize_kv_rows(values)
    else:
        q, scale = kv_fp8.quantize_rows(values)
    return write_pool(pool, slots, q, inplace), write_pool(scale_pool, slots, scale, inplace)
