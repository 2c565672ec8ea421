"""``m3export verify`` on 16-bit artifacts: block selections equal up to near-tie swaps within the dtype's bound
(``m3export/export/selection_ties.py``), and the reference teacher-forced with the runtime's accepted swaps."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from m3export.export import selection_ties, verify
from m3export.export.artifact import load_torch_model
from m3export.export.selection_ties import SelectionAgreement, SelectionJudge, score_bound_factor
from m3export.model.batch import Segment, build_batch
from m3export.ops import kv_fp8
from m3export.ops.indexer import lightning_indexer_reference


def _cfg(block_size, topk, local, init, head_dim):
    return SimpleNamespace(index_block_size=block_size, index_topk_blocks=topk, index_local_blocks=local,
                           index_init_blocks=init, index_head_dim=head_dim)


def _select(cfg, q, pool, batch):
    return lightning_indexer_reference(q, pool, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                                       batch.positions, cfg.index_block_size, cfg.index_topk_blocks,
                                       cfg.index_local_blocks, cfg.index_init_blocks)


def _prefill(n: int, page: int, pages: list[int]):
    return build_batch([Segment(pages, 0, list(range(n)))], page)[1]


# One token at position 9, blocks of 2 (blocks 0..4, 4 its own and forced), one index head of one dimension whose
# query is 1, so a key's score is the key itself. Block maxima 1.0, 0.99, 0.999, 0.2: the reference keeps [4, 0, 2].
_SCORES = [1.0, 0.99, 0.999, 0.2, 0.1]


def _one_token_case():
    keys = torch.tensor([[m, m - 0.3] for m in _SCORES]).reshape(10, 1)
    pool = torch.zeros(1, 16, 1)
    pool[0, :10] = keys
    batch = build_batch([Segment([0], 9, [0])], 16)[1]
    return torch.ones(1, 1, 1), pool, batch


@pytest.mark.parametrize("got,bf16_ok,fp32_ok", [
    ([4, 0, 2], True, True),    # equal
    ([4, 2, 0], True, False),   # order of 1.0 / 0.999: 1e-3 apart, within bfloat16's bound (~0.06 x 1), not fp32's
    ([4, 0, 1], True, False),   # 0.99 kept for 0.999: 9e-3 from the k-th score
    ([4, 0, 3], False, False),  # 0.2 kept for 0.999: 0.8 away, outside any bound
    ([0, 2, 1], False, False),  # the forced own block left out
    ([4, 0, 0], False, False),  # a block twice
    ([4, 0, -1], False, False),  # padding where the reference has a block
    ([4, 0, 5], False, False),  # a block after the token's own
])
def test_near_tie_rule_on_a_crafted_row(got, bf16_ok, fp32_ok):
    q, pool, batch = _one_token_case()
    cfg = _cfg(2, 3, 1, 0, 1)
    own = _select(cfg, q, pool, batch)
    assert own[0, 0].tolist() == [4, 0, 2]  # the crafted scores select what the parametrisation assumes
    for dtype, ok in (("bfloat16", bf16_ok), ("float32", fp32_ok)):
        agreement = SelectionAgreement()
        accepted = SelectionJudge(cfg, dtype)(agreement, torch.tensor([[got]], dtype=torch.int32), own, q, pool,
                                              None, batch)
        assert bool(accepted[0, 0]) == ok and agreement.acceptable == ok, (dtype, agreement)
        assert agreement.near_ties == int(ok and got != [4, 0, 2]) and agreement.mismatched == int(not ok)
        assert (len(agreement.examples) == 1) != ok  # a mismatch is described


def test_bound_holds_for_operands_perturbed_as_the_derivation_assumes():
    """The derivation's claim, executed: operands each moved by up to rho = 2 R u of themselves, in the worst
    direction (every product grows), give a fp32 score within c * sum|q k| of the float64 one."""
    gen = torch.Generator().manual_seed(1)
    d = 128
    rho = 2 * selection_ties.ROUNDINGS * selection_ties.unit_roundoff("bfloat16")
    q, k = torch.randn(64, d, generator=gen, dtype=torch.float64), torch.randn(64, d, generator=gen,
                                                                                dtype=torch.float64)
    worst = torch.sign(q * k)  # q~ k~ = q k (1 + rho)^2 for every d: the largest possible change of the sum
    q2, k2 = (q * (1 + rho * worst)).float(), (k * (1 + rho)).float()
    err = ((q2 * k2).sum(-1).double() - (q * k).sum(-1)).abs()
    bound = score_bound_factor("bfloat16", d) * (q * k).abs().sum(-1)
    assert bool((err <= bound).all()) and bool((err > 0.5 * bound).any())  # tight to 2x in the worst direction


@pytest.mark.parametrize("fp8", [False, True])
def test_a_runtime_rounding_its_operands_to_bfloat16_is_accepted(fp8):
    """An indexer fed the reference's operands moved as a 16-bit runtime moves them (each element rounded to
    bfloat16 after a relative perturbation of up to ROUNDINGS - 1 units) selects differently in some rows; every
    such row is a near-tie under the bfloat16 bound, and not under the fp32 one. With an FP8 index-key pool both
    sides read the same codes and scales (only the queries move); the judge scores the dequantised keys."""
    gen = torch.Generator().manual_seed(0)
    cfg = _cfg(4, 8, 1, 1, 16)
    n, page = 256, 16
    batch = _prefill(n, page, torch.randperm(16, generator=gen).tolist())
    q = torch.randn(n, 4, 16, generator=gen)
    keys = torch.randn(n, 16, generator=gen)
    pool = torch.zeros(16, page, 16)
    pool.view(-1, 16)[batch.slot_mapping] = keys
    u = selection_ties.unit_roundoff("bfloat16")

    def as_runtime(x):
        noise = (torch.rand(x.shape, generator=gen) * 2 - 1) * (selection_ties.ROUNDINGS - 1) * u
        return (x * (1 + noise)).bfloat16().float()

    scale, pool2 = None, as_runtime(pool)
    if fp8:
        pool, scale = kv_fp8.quantize_rows(pool)
        pool2 = pool
    select = functools.partial(lightning_indexer_reference, block_tables=batch.block_tables,
                               query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
                               positions=batch.positions, block_size=4, topk_blocks=8, local_blocks=1,
                               init_blocks=1, index_k_scale=scale)
    own, got = select(q, pool), select(as_runtime(q), pool2)
    assert bool((got != own).any()), "no row differs: the case checks nothing"
    bf16, fp32 = SelectionAgreement(), SelectionAgreement()
    assert bool(SelectionJudge(cfg, "bfloat16")(bf16, got, own, q, pool, scale, batch).all()), bf16.examples
    assert bf16.near_ties > 0 and bf16.acceptable
    SelectionJudge(cfg, "float32")(fp32, got, own, q, pool, scale, batch)
    assert fp32.mismatched == bf16.near_ties and not fp32.acceptable


def test_choose_blocks_hook_is_what_sparse_attention_reads(tiny_artifact):
    """``step`` / ``mtp_step`` with a hook returning the layer's own selection are bit-identical to no hook; a hook
    returning another selection changes the output (the attention reads what the hook returns)."""
    model = load_torch_model(tiny_artifact)
    cfg = model.config
    n = 40
    ids, batch = build_batch([Segment([2, 0, 1], 0, list(range(3, 3 + n)))], 16)
    calls = []

    def same(layer):
        def hook(own, index_q, pool, scale):
            calls.append(layer)
            assert index_q.shape[:2] == own.shape[:2] and scale is None
            return own
        return hook

    def shifted(layer):  # every selected block id moved to block 0 where it is not forced: another valid choice
        return lambda own, *_: torch.where(own > 0, torch.zeros_like(own), own) if layer == 2 else own

    results = []
    with torch.no_grad():
        for choose in (None, same, shifted):
            caches = model.allocate_caches(4, 16, torch.float32, "cpu")
            mtp_caches = model.allocate_caches(4, 16, torch.float32, "cpu", layers="mtp")
            out = model.step(ids, batch, caches, choose_blocks=choose)
            mtp = model.mtp_step(0, ids, out.hidden, batch, mtp_caches[0],
                                 choose_blocks=None if choose is None else choose(99))
            results.append((out.logits, out.hidden, mtp[0], out.selections))
    sparse = [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_layer(i)]
    assert calls == sparse + [99]
    for a, b in zip(results[0][:3], results[1][:3]):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(results[0][3], results[1][3]))
    assert not torch.equal(results[0][0], results[2][0])  # layer 2 read other blocks


def _perturbed(scale: float):
    """load_torch_model for verify with the index projections' weights moved by up to ``scale`` of themselves: the
    reference's index queries and keys then differ from the graph's as a 16-bit runtime's do, and nothing else."""
    def load(art, *args, **kwargs):
        model = load_torch_model(art, *args, **kwargs)
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "index_q_proj" in name or "index_k_proj" in name:
                    p.mul_(1 + scale * (torch.rand(p.shape, generator=gen) * 2 - 1))
        return model
    return load


def test_verify_accepts_swaps_within_the_bound_and_fails_those_outside(tiny_artifact, monkeypatch):
    """The fp32 tiny artifact against a reference whose index projections are off by up to 3e-2 (index keys 2e-2
    relative: what a 16-bit runtime's operands look like): its selections swap in a few rows. Judged with
    bfloat16's bound (and tolerance) verify passes, counting the swaps, because the teacher-forced reference keeps
    logits and caches within the tolerance; without the forcing the same run fails on the logits (a swapped row's
    attention output moves every later layer); judged with the artifact's own fp32 bound the swaps are mismatches."""
    monkeypatch.setattr(verify, "load_torch_model", _perturbed(3e-2))
    run = functools.partial(verify.verify_artifact, tiny_artifact, decode_steps=2, progress=False,
                            hash_files=False, tolerance=verify.TOLERANCE["bfloat16"])
    fp32 = run()
    monkeypatch.setattr(selection_ties, "unit_roundoff", lambda dtype: 2.0 ** -8)
    bf16 = run()
    swaps = sum(a.near_ties for a in bf16.selections.values())
    assert swaps > 0, "no selection differs: the case checks nothing"
    assert bf16.passed, "\n".join(bf16.lines())
    assert any("near-tie swaps" in line for line in bf16.lines())
    assert not fp32.passed and sum(a.mismatched for a in fp32.selections.values()) > 0
    assert any(line.startswith("  not a near-tie:") for line in fp32.lines())

    teacher = verify._Comparison.teacher

    def judged_not_forced(self, *args):
        judge = teacher(self, *args)
        return lambda own, *rest: (judge(own, *rest), own)[1]

    monkeypatch.setattr(verify._Comparison, "teacher", judged_not_forced)
    unforced = run()
    assert sum(a.near_ties for a in unforced.selections.values()) > 0
    assert not unforced.passed and unforced.outputs["model:logits"].max_rel > verify.TOLERANCE["bfloat16"]
