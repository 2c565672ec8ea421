"""A split export (groups of layers per graph) chains to exactly what the whole graph computes."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from m3export.errors import ArtifactError
from m3export.export.artifact import load_artifact
from m3export.export.exporter import export_artifact


@pytest.fixture(scope="module")
def split_artifact(tmp_path_factory):
    """The tiny model without its MTP module (the MTP graph is no part of the split; one trace fewer), split into
    parts of 3 layers: [0, 3) and [3, 4), the second shorter than the first."""
    from m3export.checkpoint.writer import write_checkpoint
    from m3export.config import preset

    tmp = tmp_path_factory.mktemp("split")
    write_checkpoint(tmp / "ckpt", preset("tiny").replace(num_mtp_modules=0), "original", "fp32", progress=False)
    export_artifact(str(tmp / "ckpt"), tmp / "art", split_layers=3, progress=False)
    return tmp / "art"


def _feeds(art, rng):
    cfg, page = art.config, art.page_size
    lens = [37, 21]
    tables = np.array([[5, 0, 3], [1, 4, 2]], dtype=np.int32)
    positions = np.concatenate([np.arange(n) for n in lens])
    slots = np.concatenate([tables[b, np.arange(n) // page] * page + np.arange(n) % page for b, n in enumerate(lens)])
    feeds = {
        "input_ids": rng.integers(0, cfg.vocab_size, positions.size).astype(np.int64),
        "positions": positions.astype(np.int64),
        "query_start_loc": np.array([0, lens[0], sum(lens)], dtype=np.int32),
        "seq_lens": np.array(lens, dtype=np.int32),
        "block_tables": tables,
        "slot_mapping": slots.astype(np.int64),
        "logits_indices": np.array([lens[0] - 1, sum(lens) - 1], dtype=np.int64),
    }
    for i in range(cfg.num_hidden_layers):
        feeds[f"k_cache.{i}"] = np.zeros((6, page, cfg.num_key_value_heads, cfg.head_dim), np.float32)
        feeds[f"v_cache.{i}"] = np.zeros((6, page, cfg.num_key_value_heads, cfg.head_dim), np.float32)
        if cfg.is_sparse_layer(i):
            feeds[f"index_k_cache.{i}"] = np.zeros((6, page, cfg.index_head_dim), np.float32)
    return feeds


def _run(art, graph, feeds):
    sess = ort.InferenceSession(str(art.path(graph)), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})))


def test_parts_chain_to_the_whole_graph(split_artifact):
    art = load_artifact(split_artifact)
    assert [p["layers"] for p in art.manifest.parts] == [[0, 3], [3, 4]]
    feeds = _feeds(art, np.random.default_rng(0))
    whole = _run(art, "model", feeds)
    chained, hidden = {}, None
    for part in art.manifest.parts:
        out = _run(art, part["graph"], {**feeds, "hidden_in": hidden} if hidden is not None else feeds)
        hidden = out.pop("hidden_out", None)
        chained.update(out)
    assert set(chained) == set(whole)
    for name, want in whole.items():
        if name.startswith("selection"):
            assert np.array_equal(chained[name], want), name
        else:
            np.testing.assert_allclose(chained[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
    assert (whole["selection.1"][..., -1] >= 0).any()  # selection was exercised (more blocks than top-k)


def test_split_layers_validated(tmp_path):
    with pytest.raises(ArtifactError, match="--split-layers must be a positive integer"):
        export_artifact("tiny", tmp_path / "x", split_layers=0, progress=False)
    assert not (tmp_path / "x").exists()
