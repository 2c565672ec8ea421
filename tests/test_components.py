"""Each building block against its formula written out independently in float64."""

from __future__ import annotations

import math

import pytest
import torch

import m3export.ops  # noqa: F401
from m3export.model.norm import RMSNorm
from m3export.model.rope import Rotary, apply_rope
from m3export.ops import mxfp8
from m3export.ops.moe import route

G = torch.Generator().manual_seed(1)


def rnd(*shape, scale=1.0):
    return torch.randn(shape, generator=G, dtype=torch.float64) * scale


def rel(a, b):
    return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_gemma_rmsnorm():
    x, w = rnd(5, 48), rnd(48, scale=0.3)
    norm = RMSNorm(48, 1e-6)
    norm.weight.data = w.float()
    norm.requires_grad_(False)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    assert rel(norm(x.float()), want) < 1e-6


def test_partial_neox_rope():
    t, h, d, r, theta = 7, 3, 32, 16, 5e6
    x, pos = rnd(t, h, d), torch.tensor([0, 1, 5, 127, 128, 4095, 70000])
    rot = Rotary(r, theta)
    cos, sin = rot(pos, torch.float32)
    got = apply_rope(x.float(), cos, sin)
    want = x.clone()
    inv = torch.tensor([theta ** (-2 * i / r) for i in range(r // 2)], dtype=torch.float64)
    assert rel(rot.inv_freq, inv) < 1e-6
    for i in range(r // 2):
        # angles are formed in fp32 (as the reference implementations do); the rotation is checked in float64
        ang = (pos.float() * rot.inv_freq[i]).double()
        c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
        want[..., i] = x[..., i] * c - x[..., i + r // 2] * s
        want[..., i + r // 2] = x[..., i + r // 2] * c + x[..., i] * s
    assert torch.equal(got[..., r:], x[..., r:].float())  # pass-through dims untouched
    assert rel(got, want) < 1e-6


def swiglu64(g, u, alpha=1.702, limit=7.0):
    g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return g / (1 + torch.exp(-alpha * g)) * (u + 1)


def test_moe_op_against_formula():
    t, h, i, e, k = 9, 32, 16, 6, 2
    x, rw, bias = rnd(t, h, scale=3.0), rnd(e, h, scale=0.3), rnd(e, scale=0.1)
    w13, w2, s13, s2 = rnd(e, 2 * i, h, scale=0.3), rnd(e, h, i, scale=0.3), rnd(2 * i, h, scale=0.3), rnd(h, i, scale=0.3)
    got = torch.ops.m3.moe(x.float(), rw.float(), bias.float(), w13.float(), w2.float(), s13.float(), s2.float(),
                           k, 2.0, 1.702, 7.0)
    want = torch.zeros(t, h, dtype=torch.float64)
    for row in range(t):
        s = 1 / (1 + torch.exp(-(x[row] @ rw.T)))
        chosen = sorted(range(e), key=lambda j: -(s[j] + bias[j]).item())[:k]
        wsum = sum(s[j] for j in chosen)
        for j in chosen:
            gu = w13[j] @ x[row]
            want[row] += 2.0 * (s[j] / wsum) * (w2[j] @ swiglu64(gu[:i], gu[i:]))
        gu = s13 @ x[row]
        want[row] += s2 @ swiglu64(gu[:i], gu[i:])
    assert rel(got, want) < 1e-5
    # the clamp is active for these inputs, so the formula's limits are really exercised
    assert (w13.float() @ x.float().T).abs().max() > 7


def test_bias_only_selects():
    x, rw = rnd(4, 8), rnd(5, 8)
    bias = torch.tensor([0, 0, 0, 0, 100.0], dtype=torch.float64)
    idx, w = route(x.float(), rw.float(), bias.float(), 2)
    assert (idx[:, 0] == 4).all()  # the bias forces expert 4 in ...
    s = torch.sigmoid(x @ rw.T)
    want = s.gather(1, idx) / s.gather(1, idx).sum(-1, keepdim=True)
    assert rel(w, want) < 1e-6  # ... but its weight comes from the unbiased score


def test_mxfp8_round_trip_exact():
    # random E4M3 codes (finite ones) and UE8M0 scales: dequantise -> quantise -> dequantise is exact
    codes = torch.randint(0, 256, (64, 128), generator=G, dtype=torch.uint8)
    codes = torch.where((codes & 0x7F) == 0x7F, torch.zeros_like(codes), codes)  # drop NaN encodings
    q = codes.view(torch.float8_e4m3fn)
    s = torch.randint(100, 150, (64, 4), generator=G, dtype=torch.uint8)
    w = mxfp8.dequantize(q, s)
    q2, s2 = mxfp8.quantize(w)
    assert torch.equal(mxfp8.dequantize(q2, s2), w)
    want = q.to(torch.float64) * torch.pow(2.0, s.double() - 127).repeat_interleave(32, -1)
    assert torch.equal(w.double(), want)


def test_mxfp8_quantize_error_bound():
    w = rnd(16, 64).float()
    q, s = mxfp8.quantize(w)
    back = mxfp8.dequantize(q, s)
    blocks = w.view(16, 2, 32).abs().amax(-1).repeat_interleave(32, -1)
    assert ((back - w).abs() <= blocks * 2**-3 + 1e-30).all()  # 3 mantissa bits, no saturation


def test_mxfp8_linear_op():
    x, w = rnd(3, 64).float(), rnd(10, 64).float()
    q, s = mxfp8.quantize(w)
    got = torch.ops.m3.mxfp8_linear(x, q, s)
    assert rel(got, x.double() @ mxfp8.dequantize(q, s).double().T) < 1e-6


def _paged(seqs_k, page, n_pages, dims, g):
    """Scatter per-sequence keys into a pool through shuffled block tables (pages not in order)."""
    pool = torch.zeros((n_pages, page, *dims), dtype=torch.float64)
    perm = torch.randperm(n_pages, generator=g)
    max_pages = max(-(-len(k) // page) for k in seqs_k)
    tables, used = torch.full((len(seqs_k), max_pages), -7, dtype=torch.int32), 0
    for b, keys in enumerate(seqs_k):
        for j in range(len(keys)):
            if j % page == 0:
                tables[b, j // page] = perm[used]
                used += 1
            pool[tables[b, j // page], j % page] = keys[j]
    return pool, tables


@pytest.mark.parametrize("page, local, init", [(4, 1, 0), (3, 2, 1), (8, 1, 2)])
def test_indexer_and_sparse_attention_against_formula(page, local, init):
    g = torch.Generator().manual_seed(page * 10 + local)
    bs, topk, hkv, group, d = 4, 4, 2, 2, 16
    lens, new = [37, 9, 22], [5, 1, 3]  # a prefill chunk, a decode step, a 3-token verify
    ik = [rnd(n, d) for n in lens]
    kk = [rnd(n, hkv, d) for n in lens]
    vv = [rnd(n, hkv, d) for n in lens]
    n_pages = sum(-(-n // page) for n in lens) + 3
    ik_pool, tables = _paged(ik, page, n_pages, (d,), g)
    g2 = torch.Generator().manual_seed(page * 10 + local)
    k_pool, _ = _paged(kk, page, n_pages, (hkv, d), g2)
    g3 = torch.Generator().manual_seed(page * 10 + local)
    v_pool, _ = _paged(vv, page, n_pages, (hkv, d), g3)
    qsl = torch.tensor([0, 5, 6, 9], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(lens, new, strict=True)])
    iq = rnd(9, hkv, d)
    q = rnd(9, hkv * group, d)
    sel = torch.ops.m3.lightning_indexer(iq.float(), ik_pool.float(), tables, qsl, seq_lens, positions,
                                         bs, topk, local, init)
    out = torch.ops.m3.sparse_paged_attention(q.float(), k_pool.float(), v_pool.float(), tables, qsl, seq_lens,
                                              positions, sel, bs, d**-0.5)
    seq_of = [0] * 5 + [1] + [2] * 3
    for t in range(9):
        b, p = seq_of[t], int(positions[t])
        nb = p // bs + 1
        for r in range(hkv):
            scores = {blk: max(float(iq[t, r] @ ik[b][j]) for j in range(blk * bs, min(p + 1, blk * bs + bs)))
                      for blk in range(nb)}
            forced = {blk for blk in range(nb) if blk >= nb - local or blk < init}
            ranked = sorted(forced) + sorted(set(scores) - forced, key=lambda blk: (-scores[blk], blk))
            want = ranked[:topk] + [-1] * (topk - min(topk, nb))
            assert sel[t, r].tolist() == want, (t, r)
            keys = [j for j in range(p + 1) if j // bs in set(want)]
            for hh in range(r * group, (r + 1) * group):
                logits = torch.stack([q[t, hh] @ kk[b][j, r] for j in keys]) / math.sqrt(d)
                pr = torch.softmax(logits, 0)
                ref = sum(pr[n] * vv[b][j, r] for n, j in enumerate(keys))
                assert rel(out[t, hh], ref) < 1e-5


@pytest.mark.parametrize("page", [4, 3])
def test_paged_attention_against_formula(page):
    """Dense paged attention on its own float64 formula (not through the sparse op, which shares its code): per
    token t of sequence b and query head h, softmax over keys j <= position(t) of q.k_j / sqrt(D) against the KV
    head h // group, gathered through shuffled block tables; unowned pool slots hold NaN and must not matter.
    fp32 op on float64-exact inputs: 1e-5 relative covers its fp32 dot, softmax and sum (D = 16, <= 37 keys)."""
    hkv, group, d = 2, 2, 16
    lens, new = [37, 9, 22], [5, 1, 3]  # a prefill chunk, a decode step, a 3-token verify
    kk = [rnd(n, hkv, d) for n in lens]
    vv = [rnd(n, hkv, d) for n in lens]
    n_pages = sum(-(-n // page) for n in lens) + 3
    k_pool, tables = _paged(kk, page, n_pages, (hkv, d), torch.Generator().manual_seed(page))
    v_pool, _ = _paged(vv, page, n_pages, (hkv, d), torch.Generator().manual_seed(page))
    owned = torch.zeros(n_pages, page, dtype=torch.bool)
    for b, n in enumerate(lens):
        for j in range(n):
            owned[tables[b, j // page], j % page] = True
    k_pool[~owned], v_pool[~owned] = float("nan"), float("nan")
    qsl = torch.tensor([0, 5, 6, 9], dtype=torch.int32)
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(lens, new, strict=True)])
    q = rnd(9, hkv * group, d)
    out = torch.ops.m3.paged_attention(q.float(), k_pool.float(), v_pool.float(), tables, qsl,
                                       torch.tensor(lens, dtype=torch.int32), positions, d**-0.5)
    assert torch.isfinite(out).all()
    seq_of = [0] * 5 + [1] + [2] * 3
    for t in range(9):
        b, p = seq_of[t], int(positions[t])
        for hh in range(hkv * group):
            r = hh // group
            logits = torch.stack([q[t, hh] @ kk[b][j, r] for j in range(p + 1)]) / math.sqrt(d)
            pr = torch.softmax(logits, 0)
            ref = sum(pr[j] * vv[b][j, r] for j in range(p + 1))
            assert rel(out[t, hh], ref) < 1e-5, (t, hh)


def test_dense_attention_is_sparse_with_everything_selected():
    g = torch.Generator().manual_seed(3)
    t, hq, hkv, d, page = 6, 4, 2, 8, 4
    k = torch.randn(2, page, hkv, d, generator=g)
    v = torch.randn(2, page, hkv, d, generator=g)
    q = torch.randn(t, hq, d, generator=g)
    args = (q, k, v, torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([0, t], dtype=torch.int32),
            torch.tensor([8], dtype=torch.int32), torch.arange(2, 8))
    dense = torch.ops.m3.paged_attention(*args, 0.3)
    every = torch.tensor([[0, 1]], dtype=torch.int32).expand(t, hkv, 2).contiguous()
    assert torch.allclose(torch.ops.m3.sparse_paged_attention(*args, every, page, 0.3), dense, atol=1e-6)
