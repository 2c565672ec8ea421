"""Reading a paged pool back as one contiguous sequence: shared by every reference implementation.

Keys of sequence ``b`` at position ``j`` live in pool page ``block_tables[b, j // page]`` at row ``j % page``.
The references gather a sequence's pages once and then work on plain tensors; the kernels never do this.
"""

from __future__ import annotations

import torch


def accumulation_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype scores, softmax and weighted sums are computed in: fp32 for every contract dtype (fp32, fp16,
    bf16), float64 when an input is float64, which is how the conformance suite evaluates a reference as its
    float64 oracle (``m3export.ops.conformance``)."""
    out = torch.float32
    for t in tensors:
        if t.dtype != torch.float8_e4m3fn:  # FP8 cache pools are dequantised to fp32 (``ops/kv_fp8.py``)
            out = torch.promote_types(out, t.dtype)
    return out


def gather_sequence(pool: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """pool [num_pages, page, *rest], block_table [max_pages] -> [length, *rest]."""
    page = pool.shape[1]
    n_pages = -(-length // page)
    if n_pages > block_table.shape[0]:
        raise ValueError(f"sequence of {length} tokens needs {n_pages} pages; block table has {block_table.shape[0]}")
    pages = pool.index_select(0, block_table[:n_pages].long())
    return pages.reshape(n_pages * page, *pool.shape[2:])[:length]


def gather_rows(pool: torch.Tensor, scale: torch.Tensor | None, block_table: torch.Tensor, length: int,
                dtype: torch.dtype) -> torch.Tensor:
    """A sequence's rows of ``pool`` as ``dtype``; an FP8 pool is dequantised with its scale pool
    (``float(q) * scale``, ``ops/kv_fp8.py``)."""
    rows = gather_sequence(pool, block_table, length)
    if scale is None:
        return rows.to(dtype)
    from .kv_fp8 import dequantize_rows

    return dequantize_rows(rows, gather_sequence(scale, block_table, length), dtype)


def sequences(query_start_loc: torch.Tensor, seq_lens: torch.Tensor):
    """Yield (b, first_token, last_token_exclusive, context_length) for each sequence of a flattened batch."""
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if len(qsl) != len(lens) + 1:
        raise ValueError(f"query_start_loc has {len(qsl)} entries for {len(lens)} sequences (expected B + 1)")
    for b, (s, e, n) in enumerate(zip(qsl[:-1], qsl[1:], lens)):
        if e < s or n < e - s:
            raise ValueError(f"sequence {b}: {e - s} new tokens but context length {n}")
        yield b, s, e, n
