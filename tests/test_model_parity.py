"""Logits and block selections against the independent ``transformers`` implementation, from the same checkpoint."""

from __future__ import annotations

import pytest
import torch

import m3export
from m3export.checkpoint.writer import write_checkpoint
from m3export.config import preset

from .hf_oracle import canonical_selection, hf_forward, hf_model

CONFIGS = {
    # name: (overrides of the tiny preset, sequence length)
    "tiny": ({}, 40),
    "no-dense-layers": (dict(layer_types=["minimax_m3_sparse"] * 4, mlp_layer_types=["sparse"] * 4), 37),
    "mqa-two-local": (dict(num_key_value_heads=1, index_n_heads=1, index_local_blocks=2, index_topk_blocks=4,
                           index_block_size=3), 45),
    "wide-groups": (dict(num_attention_heads=8, num_key_value_heads=4, index_n_heads=4, head_dim=16, rotary_dim=8,
                         index_head_dim=16, index_block_size=8, index_topk_blocks=2, num_experts_per_tok=3), 50),
}


def _config(name):
    overrides, length = CONFIGS[name]
    return preset("tiny").replace(num_mtp_modules=0, **overrides), length


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_selections_match_transformers(name, tmp_path):
    cfg, length = _config(name)
    ref = hf_model(cfg, seed=len(name))
    ref.save_pretrained(tmp_path / "hf")
    ours = m3export.load_model(tmp_path / "hf", progress=False)
    assert ours.checkpoint_info["layout"] == "hf"

    write_checkpoint(tmp_path / "orig", ours.config, "original", "fp32", model=ours, progress=False)
    converted = m3export.load_model(tmp_path / "orig", progress=False)
    assert converted.checkpoint_info["layout"] == "original"
    for (n1, p1), (n2, p2) in zip(ours.named_parameters(), converted.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2), n1

    ids = torch.randint(0, cfg.vocab_size, (2, length), generator=torch.Generator().manual_seed(7))
    want, want_sel = hf_forward(ref, ids)
    with torch.no_grad():
        got, got_sel = converted(ids, return_selections=True)
    assert _rel(got, want) <= 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert len(got_sel) == len(want_sel) == sum(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))
    k = cfg.index_topk_blocks
    for g, w in zip(got_sel, want_sel, strict=True):
        assert torch.equal(canonical_selection(g, k), canonical_selection(w, k))
    # The config must make selection matter: some query sees more blocks than it may keep.
    assert (length - 1) // cfg.index_block_size + 1 > k
