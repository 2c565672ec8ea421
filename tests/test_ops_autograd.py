"""Gradients of the m3 ops (m3export/ops/autograd.py) against finite differences, in float64.

``torch.autograd.gradcheck`` compares the analytic backward with central differences of the op's own forward,
an oracle independent of how the backward is written. Inputs are float64, but the references compute softmax
and routing scores in float32 (by contract), so the forward carries ~1e-7 relative rounding: with a step of
1e-3 that is ~1e-4 of error in a difference quotient, and the O(step^2) truncation is ~1e-6; atol 1e-3 /
rtol 1e-2 sit ten times above both and far below the size of a wrong gradient (O(0.1) entries here).
"""

import torch

from m3export.model import Batch

D64 = torch.float64
CHECK = dict(eps=1e-3, atol=1e-3, rtol=1e-2)


def _two_sequences(page=4):
    """Two sequences (7 and 5 tokens) laid on their own pages: exercises the per-sequence loop and paging."""
    lens = [7, 5]
    pages = [-(-n // page) for n in lens]
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lens])
    slots = torch.cat([tables[b, torch.arange(n) // page].long() * page + torch.arange(n) % page
                       for b, n in enumerate(lens)])
    qsl = torch.tensor([0, 7, 12], dtype=torch.int32)
    return Batch(positions, qsl, torch.tensor(lens, dtype=torch.int32), tables, slots), sum(pages), page


def _pool(values, batch, n_pages, page):
    pool = torch.zeros(n_pages, page, *values.shape[1:], dtype=values.dtype)
    return pool.index_put((batch.slot_mapping // page, batch.slot_mapping % page), values)


def test_paged_attention_gradient():
    batch, n_pages, page = _two_sequences()
    q = torch.randn(12, 4, 8, dtype=D64, requires_grad=True)
    k = torch.randn(12, 2, 8, dtype=D64, requires_grad=True)
    v = torch.randn(12, 2, 8, dtype=D64, requires_grad=True)

    def f(q, k, v):
        return torch.ops.m3.paged_attention(q, _pool(k, batch, n_pages, page), _pool(v, batch, n_pages, page),
                                            batch.block_tables, batch.query_start_loc, batch.seq_lens,
                                            batch.positions, 0.3)

    assert torch.autograd.gradcheck(f, (q, k, v), **CHECK)


def test_sparse_paged_attention_gradient():
    batch, n_pages, page = _two_sequences()
    q = torch.randn(12, 4, 8, dtype=D64, requires_grad=True)
    k = torch.randn(12, 2, 8, dtype=D64, requires_grad=True)
    v = torch.randn(12, 2, 8, dtype=D64, requires_grad=True)
    # Token 6 of sequence 0 sees only its own block (1) on KV head 0: a selection that really removes keys.
    sel = torch.full((12, 2, 2), -1, dtype=torch.int32)
    sel[:, :, 0] = (batch.positions // page).to(torch.int32)[:, None]
    sel[:7, 1, 1] = 0

    def f(q, k, v):
        return torch.ops.m3.sparse_paged_attention(
            q, _pool(k, batch, n_pages, page), _pool(v, batch, n_pages, page), batch.block_tables,
            batch.query_start_loc, batch.seq_lens, batch.positions, sel, page, 0.3)

    assert torch.autograd.gradcheck(f, (q, k, v), **CHECK)


def test_moe_gradient_reaches_router_and_every_weight():
    t, h, e, i = 6, 8, 4, 6
    x = torch.randn(t, h, dtype=D64, requires_grad=True)
    router = torch.randn(e, h, dtype=D64, requires_grad=True)
    bias = torch.zeros(e, dtype=D64)
    w13 = (torch.randn(e, 2 * i, h, dtype=D64) * 0.5).requires_grad_()
    w2 = (torch.randn(e, h, i, dtype=D64) * 0.5).requires_grad_()
    s13 = (torch.randn(2 * i, h, dtype=D64) * 0.5).requires_grad_()
    s2 = (torch.randn(h, i, dtype=D64) * 0.5).requires_grad_()

    def f(x, router, w13, w2, s13, s2):
        return torch.ops.m3.moe(x, router, bias, w13, w2, s13, s2, 2, 2.0, 1.702, 7.0)

    # Finite differences never cross a routing boundary: the top-2 of 4 random sigmoid scores are separated by
    # far more than the step (1e-3) moves them (checked by the fixed seed: a crossing
    # would show as a jump far outside the tolerance).
    assert torch.autograd.gradcheck(f, (x, router, w13, w2, s13, s2), **CHECK)
    f(x, router, w13, w2, s13, s2).sum().backward()
    assert router.grad.abs().sum() > 0 and w13.grad.abs().sum() > 0
