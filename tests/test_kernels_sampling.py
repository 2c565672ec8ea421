"""The kernel-drawn sampled rows (``plugins/kernels/sampling.py``, through ``runtime.sampling.kernel_draw_rows``)
against the one-row definition ``runtime.sampling.sample``: same uniforms, same tokens.

Both compute the same float64 quantities with sums in another order, so a token may differ only where a uniform
lands within ~1e-16 of a CDF step or a top-p cut moves by rounding: with random logits that has probability
~1e-12 over these rows, so any mismatch is a bug. Exact ties (equal logits) are covered where the definition's tie
rule (token id order) decides: the kernel must follow it or flag the row. Under the interpreter at small
vocabularies (rows in slices of 64 tokens as well as in one slice, so that the slices' partial totals, the slice
that holds the target and its neighbours' boundaries are all exercised); on the GPU at M3's.
"""

from __future__ import annotations

import pytest
import torch

from m3export.plugins.kernels import sampling as kernel
from m3export.runtime import SamplingParams
from m3export.runtime.sampling import PositionalRandom, Purpose, RowParams, kernel_draw_rows, sample

PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05),
    SamplingParams(min_p=0.2),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
    SamplingParams(temperature=1.5, top_p=0.3),
    SamplingParams(temperature=0.6, top_p=0.999),
    SamplingParams(temperature=2.0, top_k=3, top_p=0.5),
    SamplingParams(temperature=0.5, top_k=1000),
]


def _check(logits, params, want_redo=None, seed=0):
    """Every sampled row's token is sample()'s, except rows the kernel flags; returns the flags."""
    rngs = [PositionalRandom(31 + i + 100 * seed) for i in range(len(params))]
    positions = [7 * i + 3 for i in range(len(params))]
    u = torch.tensor([rng.uniform(pos, Purpose.SAMPLE) for rng, pos in zip(rngs, positions)], dtype=torch.float64)
    token, redo = kernel_draw_rows(logits, RowParams(params, logits.device), u.to(logits.device))
    ref = logits.cpu()
    for i, p in enumerate(params):
        if not redo[i] and not p.greedy:
            assert int(token[i]) == sample(ref[i], p, rngs[i], positions[i]), (i, p)
    if want_redo is not None:
        assert redo.tolist() == want_redo
    return redo


@pytest.mark.parametrize("v, candidates, block", [(97, 64, 2048), (97, 128, 32), (3000, 256, 256), (2500, 2048, 2048),
                                               (2500, 2048, 512)])
def test_tokens_are_the_one_row_definitions(monkeypatch, v, candidates, block):
    """Rows in one slice with every threshold edge; in several slices with eight edges (the interpreter runs each
    program's edges one by one: the slices' logic is the same with fewer)."""
    monkeypatch.setattr(kernel, "CANDIDATES", candidates)
    monkeypatch.setattr(kernel, "BLOCK", block)
    if block < v:
        monkeypatch.setattr(kernel, "EDGES", (0.5, 1.0, 2.0, 3.0, 4.0, 8.0, 12.0, 16.0))
    bounded = [p for p in PARAMS if p.top_p == 1.0 or 0 < p.top_k <= candidates]  # top-p candidates from top-k
    by_threshold = 0  # top-p rows drawn from threshold candidates (not redone): the path must be exercised
    for seed in range(3):
        logits = torch.randn(len(PARAMS), v, generator=torch.Generator().manual_seed(seed)) * (0.5, 3.0, 1.5)[seed]
        redo = _check(logits, PARAMS, seed=seed)
        by_threshold += sum(not redo[i] and p.top_p < 1.0 for i, p in enumerate(PARAMS))
        _check(logits[:len(bounded)], bounded, seed=seed)
    assert by_threshold >= 6


def test_a_nucleus_past_the_candidates_is_flagged(monkeypatch):
    """Flat logits and top-p 0.9: a nucleus of most of the vocabulary does not fit 16 candidates (flagged); top-k 8
    under it does, and rows without top-p never are."""
    monkeypatch.setattr(kernel, "CANDIDATES", 16)
    params = [SamplingParams(top_p=0.9), SamplingParams(), SamplingParams(top_p=0.9, top_k=8),
              SamplingParams(temperature=0.5, min_p=0.5)]
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 0.1
    _check(logits, params, want_redo=[True, False, False, False])


def test_ties_follow_the_token_id_order_or_are_flagged(monkeypatch):
    """Equal logits: the definition keeps the lowest token ids of a tie at the top-p cut, and the kernel must too.
    Threshold candidates (top-p rows without a top-k) hold a tie whole or not at all: a flat row fits 64 candidates
    and not 16 (flagged); ties in groups of 8 fit 8. Top-k candidates (every top-p row with a top-k) are the top-k's
    tokens (12 here, the largest top-k): a nucleus that reaches the last of them is flagged (tied tokens past the
    list could have lower ids), one that ends before is not."""
    v = 64
    flat = torch.zeros(3, v)
    steps = torch.arange(v, dtype=torch.float32).div(8).floor().neg().expand(3, v).clone()  # ties in groups of 8
    params = [SamplingParams(top_p=0.5), SamplingParams(top_p=0.3, temperature=0.5), SamplingParams(top_p=0.05)]
    for c, logits, want in [(64, flat, [False] * 3), (64, steps, [False] * 3), (16, flat, [True] * 3),
                            (16, steps, [False] * 3), (8, steps, [False] * 3)]:
        monkeypatch.setattr(kernel, "CANDIDATES", c)
        _check(logits, params, want_redo=want)
    monkeypatch.setattr(kernel, "CANDIDATES", 64)
    with_k = [SamplingParams(top_p=0.5, top_k=12), SamplingParams(top_p=0.3, temperature=0.5, top_k=8),
              SamplingParams(top_p=0.05, top_k=4)]
    _check(flat, with_k, want_redo=[True] * 3)  # top-k keeps all 64 tied tokens (ties at the k-th): past the list
    _check(steps, with_k, want_redo=[False] * 3)  # top-k keeps the first group of 8 whole: within the 12 candidates
    _check(flat, [SamplingParams(), SamplingParams(top_k=5), SamplingParams(min_p=1.0)])  # ties without top-p


def test_masked_slices_and_min_p_across_slices(monkeypatch):
    """Slices of 16 tokens: whole slices of -inf logits (banned tokens: no weight, never drawn, no NaN from a slice
    whose maximum is -inf), min-p against the row's maximum in another slice, top-k whose survivors sit in a few
    slices, and each row's draw at many uniforms (targets in every slice)."""
    monkeypatch.setattr(kernel, "BLOCK", 16)
    monkeypatch.setattr(kernel, "EDGES", (0.5, 1.0, 2.0, 3.0, 4.0, 8.0, 12.0, 16.0))
    v = 160
    base = torch.randn(v, generator=torch.Generator().manual_seed(5)) * 2.0
    base[16:48] = float("-inf")
    base[150:] = float("-inf")
    params = [SamplingParams(), SamplingParams(min_p=0.05), SamplingParams(top_k=7, temperature=0.6),
              SamplingParams(top_p=0.7, min_p=0.01)]
    logits = base.expand(len(params), v).contiguous()
    for seed in range(6):
        _check(logits, params, seed=seed)


def test_a_drawn_token_has_weight():
    """u close to 1 (the target at the end of the CDF) and masked tokens after the last kept one: the token is the
    last one with weight, never a masked one."""
    logits = torch.tensor([[5.0, 4.0, 3.0] + [-20.0] * 61] * 2)
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.5, top_k=3)]
    u = torch.tensor([1.0 - 2.0**-53] * 2, dtype=torch.float64)
    token, redo = kernel_draw_rows(logits, RowParams(params, logits.device), u)
    assert token.tolist() == [1, 0] and not redo.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("v", [200064, 4099])
def test_gpu_tokens_are_the_host_definitions(v):
    """On the GPU at M3's vocabulary (and an odd size), against sample() on the CPU."""
    logits = torch.randn(len(PARAMS) * 4, v, generator=torch.Generator().manual_seed(12)) * 2.0
    flags = _check(logits.cuda(), PARAMS * 4)
    assert not flags[[i for i, p in enumerate(PARAMS * 4) if p.top_k and p.top_k <= 50]].any()


def test_decide_draws_plain_rows_with_it_and_redoes_flagged_rows(monkeypatch):
    """decide with the kernel (as on a GPU): plain rows' tokens are accept()'s, a flagged top-p row is redone with
    the definitions (then its logprobs are the new token's), and a step with a draft keeps the definitions."""
    from m3export.runtime import acceptance
    from m3export.runtime.acceptance import Row, decide

    calls = []
    real = acceptance.kernel_draw_rows
    monkeypatch.setattr(acceptance, "sampling_kernel", lambda device, params: True)
    monkeypatch.setattr(acceptance, "kernel_draw_rows", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(kernel, "CANDIDATES", 8)
    redone = []
    real_redo = acceptance._redo
    monkeypatch.setattr(acceptance, "_redo", lambda x, rows, flagged: redone.extend(flagged) or real_redo(x, rows,
                                                                                                       flagged))
    params = PARAMS + [SamplingParams(temperature=0), SamplingParams(top_p=0.9, logprobs=2)]
    logits = torch.randn(len(params), 300, generator=torch.Generator().manual_seed(4)) * 0.2  # flat: big nuclei
    rngs = [PositionalRandom(i) for i in range(len(params))]
    got = decide(logits, [Row(p, rng, 9) for p, rng in zip(params, rngs)])
    assert calls == [1] and len(params) - 1 in redone and 0 not in redone  # flagged: top-p rows only
    assert [r.token for r in got] == [sample(logits[i], p, rngs[i], 9) for i, p in enumerate(params)]
    tok = got[-1].token
    assert abs(got[-1].logprobs(tok, 2)[tok] - float(torch.log_softmax(logits[-1], -1)[tok])) < 1e-6
    rows = [Row(p, rng, 9, draft=3 if i == 0 else None) for i, (p, rng) in enumerate(zip(params, rngs))]
    decide(logits, rows)
    assert calls == [1]


def test_the_kernel_serves_every_gpu_step_and_no_cpu_step(monkeypatch):
    """On a GPU with Triton, whatever the rows (measured as fast or faster from one row up); never on the CPU."""
    from m3export.runtime import acceptance

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for params in ([SamplingParams(top_k=50, top_p=0.95)] * 3 + [SamplingParams(temperature=0)], [SamplingParams()],
                   [SamplingParams(top_p=0.9)], [SamplingParams(top_k=kernel.CANDIDATES + 1)]):
        assert acceptance.sampling_kernel(cuda, params)
        assert not acceptance.sampling_kernel(cpu, params)
    monkeypatch.setattr("m3export.plugins.kernels.triton_available", lambda: False)
    assert not acceptance.sampling_kernel(cuda, [SamplingParams()])
