"""bench/prefill_selections.py: the FLOPs sparse prefill is credited with, and the overlap it reports.

The FLOP rate of ``bench/attention.py`` and its sweep counts the work the op must do (each token's distinct usable
selected keys, causally), so the count is checked against a plain loop; the overlap statistics printed beside each
rate against a selection whose overlap is known by construction; and the two selection sources against their
claim (the model's neighbours share more blocks than random ones do), on the reference indexer at small sizes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import prefill_selections as P  # noqa: E402

from m3export.ops.indexer import lightning_indexer_reference  # noqa: E402


def test_selected_keys_counts_each_tokens_distinct_usable_keys_causally():
    gen = torch.Generator().manual_seed(3)
    bs, positions = 4, torch.arange(5, 31)
    sel = torch.randint(-1, 9, (positions.numel(), 3, 5), generator=gen, dtype=torch.int32)
    want = 0
    for t, p in enumerate(positions.tolist()):
        for h in range(3):
            for c in set(sel[t, h].tolist()):  # repeats once, -1 and blocks after the token's own never
                if 0 <= c <= p // bs:
                    want += min(bs, p - c * bs + 1)  # the own block only up to the token
    assert (sel == -1).any() and (sel > positions.view(-1, 1, 1) // bs).any()
    assert P.selected_keys(sel, positions, bs) == want


def test_overlap_stats_on_a_selection_of_known_overlap():
    """16 tokens at positions 8..23 (blocks of 4, top-2), each choosing its own block and block 0: neighbours in
    one block share both blocks, the 3 pairs across a block boundary share one (27 of 30); tiles of 4 tokens sit in
    one block (2 distinct blocks = top-k), of 8 span two (3 blocks), of 16 four (5 blocks)."""
    bs, positions = 4, torch.arange(8, 24)
    own = (positions // bs).to(torch.int32)
    sel = torch.stack([own, torch.zeros_like(own)], dim=-1).view(-1, 1, 2)
    qsl = torch.tensor([0, 16], dtype=torch.int32)
    stats = P.overlap_stats(sel, positions, qsl, bs)
    assert stats["adjacent_overlap"] == pytest.approx(27 / 30)
    assert stats["union_over_topk_t4"] == pytest.approx(1.0)
    assert stats["union_over_topk_t8"] == pytest.approx(1.5)
    assert stats["union_over_topk_t16"] == pytest.approx(2.5)


def test_model_selections_overlap_more_than_random_ones():
    def stats(source):
        sel, (qsl, _, pos) = P.prefill_selection(lightning_indexer_reference, source, 1024, 2, 32, 32, 32, 8, 1, 0,
                                                 torch.device("cpu"), seed=5)
        return P.overlap_stats(sel, pos, qsl, 32)

    model, rand = stats("model"), stats("random")
    assert model["adjacent_overlap"] > rand["adjacent_overlap"] + 0.2
    assert model["union_over_topk_t8"] < rand["union_over_topk_t8"]
    with pytest.raises(ValueError, match="source 'real'"):
        P.prefill_selection(lightning_indexer_reference, "real", 64, 2, 32, 32, 32, 8, 1, 0, torch.device("cpu"))
