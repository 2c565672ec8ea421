"""What the ONNX function bodies cost, read from the tensors they materialise (no timings).

Each body is inlined into a one-node model whose every intermediate becomes a graph output; ONNX Runtime's CPU
provider then reports the shape of everything the body builds. The sparse attention body must gather only the
selected blocks (nothing of the keys' size grows with the context, only a block bookkeeping of ints), and the
indexer body must read its sequence's index keys once per step: no ``[T, L, D]`` per-token copy of the context.
The bodies' values are the conformance suite's business (``tests/test_op_conformance.py``, long tiny-dim cases included).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from m3export.ops import conformance as conf
from tests.onnx_body_values import run_every_value


def intermediate_sizes(op: str, inputs: list[torch.Tensor], attrs: dict) -> dict[str, int]:
    """Element count of every tensor the inlined body of ``m3::op`` computes on ``inputs`` (fp32 inputs)."""
    model, values = run_every_value(op, inputs, attrs)
    outs = [o for node in model.graph.node for o in node.output if o in values]
    assert len(outs) > 20, "shape inference typed too few intermediates for this check to mean anything"
    return {o: int(np.prod(values[o].shape)) for o in outs}


INDEX = dict(block_size=16, topk_blocks=4, local_blocks=1, init_blocks=1)
HEADS = dict(hq=4, hkv=2, d=8)


def _sparse(ctx: int):
    """A decode, a 4-token verify step and a 6-token prefill chunk, the first sequence at context ``ctx``."""
    gen = torch.Generator().manual_seed(0)
    return conf._sparse_case([ctx, 300, 200], [1, 4, 6], 16, INDEX, "indexer", **HEADS)(gen)


@pytest.mark.parametrize("ctx", [1000, 8000])
def test_sparse_attention_body_gathers_only_the_selected_blocks(ctx):
    """Keys, values and scores are gathered per (sequence, KV head) over the blocks its tokens selected, N <=
    min(tokens * K, blocks of its context): their size does not depend on the context of a decoding sequence. What
    does grow with it is the block bookkeeping, one int per (token slot, KV head, block of the context, +1), with no
    head-dim factor: a [T, L, D] per-token context copy or a [B, L, Hkv, D] dense gather exceeds both bounds
    (704000 and 384000 elements here at 8000 against 27648 and 18036)."""
    new, page, bs = [1, 4, 6], 16, INDEX["block_size"]
    inputs, attrs = _sparse(ctx)
    sizes = intermediate_sizes("SparsePagedAttention", inputs, attrs)
    views = {t.numel() for t in inputs}  # reshapes of the inputs (pools, block tables) are views, not reads
    b, tmax, k = len(new), max(new), INDEX["topk_blocks"]
    hkv, groups, d = HEADS["hkv"], HEADS["hq"] // HEADS["hkv"], HEADS["d"]
    nb = (ctx - 1) // bs + 1  # blocks of the longest context in the step
    n = max(min(q * k, -(-c // bs)) for q, c in zip(new, [ctx, 300, 200]))  # most blocks one sequence selects
    selected = b * hkv * n * bs * max(d, tmax * groups)  # gathered keys [B, Hkv, N*bs, D] / scores [.., Tmax*G, N*bs]
    bookkeeping = b * tmax * hkv * (nb + 1)
    over = {name: size for name, size in sizes.items() if size not in views and size > max(selected, bookkeeping)}
    assert not over, f"tensors beyond the selected blocks and the block bookkeeping: {over}"
    assert max(selected, bookkeeping) < min(sum(new) * ctx * d, b * ctx * hkv * d)  # the bounds mean something


@pytest.mark.parametrize("new", [[40, 1, 1], [1, 1, 1]], ids=["prefill-chunk", "decode"])
def test_indexer_body_reads_each_sequence_context_once(new):
    ctx, page, h, d = [3000, 2500, 1200], 16, 2, 8
    gen = torch.Generator().manual_seed(1)
    inputs, attrs = conf._indexer_case(ctx, new, page, INDEX, h=h, d=d)(gen)
    sizes = intermediate_sizes("LightningIndexer", inputs, attrs)
    t, length, bs = sum(new), 3000, INDEX["block_size"]
    # the scores, [B, Tmax, H, L] (tokens regrouped by sequence, shorter sequences padded) or [T, H, L] padded
    # to whole blocks: the op computes T x H x L of them; the padding rows are the body's documented waste
    scores = max(len(ctx) * max(new) * h * length, t * h * -(-length // bs) * bs)
    context_once = len(ctx) * length * d  # every sequence's index keys, [B, L, D]
    assert max(sizes.values()) <= max(scores, context_once)
    assert context_once in sizes.values()
    if t > len(ctx):  # a prefill chunk: a per-token copy of the context would be [T, L, D]
        assert max(sizes.values()) < t * length * d


def test_dense_attention_body_reads_each_sequence_context_once():
    """A 40-token prefill chunk at 3000 context beside two decodes: no [T, L, Hkv, D] per-token context copy; the
    largest tensors are the [B, L, Hkv, D] contexts and the [B, Hkv, Tmax, G, L] scores."""
    ctx, new, page = [3000, 2500, 1200], [40, 1, 1], 16
    gen = torch.Generator().manual_seed(2)
    inputs, attrs = conf._attention_case(ctx, new, page, **HEADS)(gen)
    sizes = intermediate_sizes("PagedAttention", inputs, attrs)
    views = {t.numel() for t in inputs}
    t, length, b = sum(new), 3000, len(ctx)
    context_once = b * length * HEADS["hkv"] * HEADS["d"]
    scores = b * max(new) * HEADS["hq"] * length
    assert max(n for n in sizes.values() if n not in views) <= max(context_once, scores)
    assert context_once in sizes.values()
    assert max(sizes.values()) < t * length * HEADS["hkv"] * HEADS["d"]  # what a per-token gather would hold
