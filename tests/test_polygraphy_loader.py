"""The polygraphy data loader every artifact ships: a valid paged step, and `polygraphy run` passing on it."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess

import numpy as np
import pytest

from m3export.export import polygraphy_loader
from m3export.model.batch import Segment, build_batch



def test_the_step_is_the_one_build_batch_makes(tiny_artifact):  # noqa: F811
    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    feeds = polygraphy_loader.step_feeds(manifest, "model")
    page = manifest["page_size"]
    qsl, lens, tables = feeds["query_start_loc"], feeds["seq_lens"], feeds["block_tables"]
    segments = []
    for b in range(len(lens)):
        new = int(qsl[b + 1] - qsl[b])
        cached = int(lens[b]) - new
        pages = tables[b, :-(-int(lens[b]) // page)].tolist()
        segments.append(Segment(pages, cached, feeds["input_ids"][qsl[b]:qsl[b + 1]].tolist()))
    ids, batch = build_batch(segments, page)
    want = batch.feeds(input_ids=ids)
    for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "slot_mapping"):
        np.testing.assert_array_equal(feeds[name], want[name], err_msg=name)
    assert sorted(tables.ravel().tolist()) == sorted(set(tables.ravel().tolist()))  # no page used twice
    assert (feeds["positions"] > 0).any() and len(lens) == 2  # a chunk after cached tokens, two sequences
    pools = [s["name"] for s in manifest["graphs"]["model"]["inputs"] if s["name"].startswith(("k_cache", "v_cache"))]
    assert pools and all(feeds[p].shape[0] > tables.max() for p in pools)


@pytest.mark.skipif(shutil.which("polygraphy") is None or importlib.util.find_spec("polygraphy") is None,
                    reason="polygraphy is not installed (pip install 'm3export[dev]')")
@pytest.mark.parametrize("graph, loader", [("model.onnx", "polygraphy_loader.py"),
                                           ("mtp0.onnx", "polygraphy_loader.py:load_mtp0")])
def test_polygraphy_runs_out_of_the_box(tiny_artifact, graph, loader):  # noqa: F811
    assert (tiny_artifact / "polygraphy_loader.py").is_file()
    run = subprocess.run(["polygraphy", "run", graph, "--onnxrt", "--data-loader-script", loader],
                         cwd=tiny_artifact, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "PASSED" in run.stdout + run.stderr, run.stdout[-2000:] + run.stderr[-2000:]
