"""Projection fusion on a tensor-parallel rank (``m3export.parallel.load_model_shard`` -> ``fusion.serve_on``): a
rank's model gets the same fused q / k / v (+ index q, index k) buffer a single-GPU load gets, and that is exact.

On the CPU ``serve_on`` does nothing (the kernels serve CUDA only), so the loader's call is observed by standing in
for it with what it does where the kernels serve (``model.fuse_projections()``). Exactness on a rank: each member
holds whole output rows of the global weight (``parallel/sharding.py`` splits them along N), so after fusing every
member is still a view holding exactly its shard, and the fused product's columns are the members' own products
(the same rows dotted with the same input; a BLAS may block K differently for another N, hence the summation-order
bound of ``tests/test_projection_fusion.py``: 2 K u of sum |x w|).
"""

from __future__ import annotations

import pytest
import torch

import m3export
from m3export.config import preset
from m3export.model import fusion
from m3export.ops import mxfp8
from m3export.parallel import ParallelConfig, load_model_shard, shard_of
from m3export.parallel.loading import _fill_random, build_shard


def _attentions(model):
    layers = [*model.model.layers, *(m.transformer_layer for m in model.mtp)]
    return [(f"{prefix}.self_attn", layer.self_attn) for prefix, layer in zip(
        [f"model.layers.{i}" for i in range(len(model.model.layers))]
        + [f"mtp.{k}.transformer_layer" for k in range(len(model.mtp))], layers, strict=True)]


def _serving_fuses(monkeypatch) -> list:
    """``fusion.serve_on`` as where the kernels serve (CUDA): it fuses the model's projections. Returns the calls."""
    calls = []

    def serve_on(model, device):
        calls.append((model, str(device)))
        model.fuse_projections()
        return True

    monkeypatch.setattr(fusion, "serve_on", serve_on)
    return calls


@pytest.mark.parametrize("tp", [1, 2, 4], ids=["tp1", "tp2", "tp4-kv-replicated"])
def test_rank_loader_fuses_each_layer_and_members_keep_their_shards(monkeypatch, tp):
    """Every rank's load calls the one owner (``serve_on``) once; afterwards each attention layer is fused, every
    member parameter is a view into its layer's buffer holding exactly the rank's shard of the global weight
    (tiny has 2 KV heads: at TP = 4 each is replicated on two ranks), and the fused products equal the members'."""
    full = dict(m3export.load_model("tiny", progress=False).named_parameters())  # CPU: not fused
    calls = _serving_fuses(monkeypatch)
    cfg = preset("tiny")
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    for rank in range(tp):
        model = load_model_shard("tiny", ParallelConfig(tp), rank)
        assert [c[0] for c in calls[-1:]] == [model]
        for prefix, attn in _attentions(model):
            fused = attn.fused_projections
            assert fused is not None and fused.intact(), prefix
            [buffer] = fused.buffers
            names = ["q_proj", "k_proj", "v_proj"] + (["indexer.index_q_proj", "indexer.index_k_proj"]
                                                      if attn.indexer is not None else [])
            for name, lin, (lo, hi) in zip(names, fused.linears, fused.bounds, strict=True):
                pname = f"{prefix}.{name}.weight"
                want = shard_of(pname, cfg, ParallelConfig(tp), rank).take(full[pname])
                assert torch.equal(lin.weight, want), (rank, pname)
                assert lin.weight.data_ptr() == buffer[lo:hi].data_ptr() and lin.weight.shape == buffer[lo:hi].shape
            parts = fused(x)
            for lin, got in zip(fused.linears, parts, strict=True):
                bound = 2 * x.shape[1] * 2.0**-24 * float((x.abs() @ lin.weight.abs().t()).max())
                torch.testing.assert_close(got, lin(x), rtol=0, atol=bound)
    assert len(calls) == tp


def test_mxfp8_rank_fuses_weights_and_scales_of_its_shard():
    """An MXFP8 rank (``tiny`` widened so that TP = 2 slices hold whole 32-value scale blocks): the fused E4M3 buffer
    and the fused UE8M0 scale buffer hold, member by member, the rank's shard of the single-model quantised
    weight and of its scales (the same rows of both), as views."""
    cfg = preset("tiny").replace(intermediate_size=64, shared_intermediate_size=64, dense_intermediate_size=128)
    par = ParallelConfig(2)
    whole = build_shard(cfg, ParallelConfig(1), 0, torch.float32, "cpu", mxfp8=True)
    _fill_random(whole, cfg, ParallelConfig(1), 0, 0, torch.float32, True)
    full = dict(whole.named_parameters())
    for rank in range(2):
        model = build_shard(cfg, par, rank, torch.float32, "cpu", mxfp8=True)
        _fill_random(model, cfg, par, rank, 0, torch.float32, True)
        model.fuse_projections()
        for prefix, attn in _attentions(model):
            fused = attn.fused_projections
            assert fused.mxfp8 and fused.intact()
            for lin in fused.linears:
                pname = next(n for n, p in model.named_parameters() if p is lin.weight)
                for p, name in ((lin.weight, pname), (lin.weight_scale_inv, pname + "_scale_inv")):
                    want = shard_of(name, cfg, par, rank).take(full[name])
                    assert torch.equal(p.view(torch.uint8), want.view(torch.uint8)), (rank, name)
                    assert any(p.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                               for b in fused.buffers), name
            x = torch.randn(3, cfg.hidden_size)
            for lin, got in zip(fused.linears, fused(x), strict=True):
                w = mxfp8.dequantize(lin.weight, lin.weight_scale_inv, torch.float32)
                bound = 2 * x.shape[1] * 2.0**-24 * float((x.abs() @ w.abs().t()).max())
                torch.testing.assert_close(got, lin(x), rtol=0, atol=bound)
