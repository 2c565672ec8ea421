"""One copy of an artifact's weights for all of its ONNX Runtime sessions (``plugins/onnxruntime/shared_weights.py``).

What is checked: two sessions given one ``SharedWeights`` read the same buffer (a change written into the shared
tensor shows in both sessions' next outputs; a session that loaded its own copy would not see it); the onnxruntime
backend's sessions (general step graph, decode graph, MTP module) all read the one copy, which holds each distinct
weight once, and give the logits the unshared backend gives; on a GPU, a second session of a 256 MiB-weight model
allocates no second copy."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper as h

from m3export.plugins.onnxruntime.shared_weights import SharedWeights

ROWS, COLS = 1024, 64  # the synthetic table's shape


def _gather_model(folder, rows: int = ROWS, cols: int = COLS, offset: int = 64) -> torch.Tensor:
    """Writes ``g.onnx``: ``y = float(table[i])`` with ``table`` [rows, cols] bf16 as external data at ``offset``
    of ``w.bin`` (row r holds r / 8 rounded to bf16); returns the table."""
    table = (torch.arange(rows, dtype=torch.float32) / 8).repeat_interleave(cols).view(rows, cols).to(torch.bfloat16)
    (folder / "w.bin").write_bytes(b"\0" * offset + table.view(torch.uint8).numpy().tobytes())
    init = onnx.TensorProto(name="table", data_type=TP.BFLOAT16, dims=[rows, cols],
                            data_location=TP.EXTERNAL)
    for k, v in (("location", "w.bin"), ("offset", str(offset)), ("length", str(rows * cols * 2))):
        init.external_data.add(key=k, value=v)
    graph = h.make_graph([h.make_node("Gather", ["table", "i"], ["g"]), h.make_node("Cast", ["g"], ["y"], to=TP.FLOAT)],
                         "gather", [h.make_tensor_value_info("i", TP.INT64, [2])],
                         [h.make_tensor_value_info("y", TP.FLOAT, [2, cols])], initializer=[init])
    # IR version 10, as the exporter writes (onnxruntime-gpu 1.31 refuses the onnx package's newer default, 14)
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 20)], ir_version=10), str(folder / "g.onnx"))
    return table


def _session(folder, provider: str, weights: SharedWeights | None):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if weights is not None:
        weights.add_to(options, onnx.load(str(folder / "g.onnx"), load_external_data=False), folder)
    return ort.InferenceSession(str(folder / "g.onnx"), sess_options=options, providers=[provider])


def test_two_sessions_read_one_buffer(tmp_path):
    table = _gather_model(tmp_path)
    weights = SharedWeights("cpu")
    a, b = (_session(tmp_path, "CPUExecutionProvider", weights) for _ in range(2))
    own = _session(tmp_path, "CPUExecutionProvider", None)
    i = np.array([3, 1000], dtype=np.int64)
    want = table[torch.from_numpy(i)].float().numpy()
    for s in (a, b, own):
        assert np.array_equal(s.run(None, {"i": i})[0], want)  # the file's bytes at its offset, as ORT reads them
    assert weights.nbytes == ROWS * COLS * 2  # one copy for both sessions
    (shared,) = (t for t, _ in weights._values.values())
    shared.mul_(2)  # written into the shared buffer after both sessions were made (x2: exact in bf16)
    assert np.array_equal(a.run(None, {"i": i})[0], 2 * want) and np.array_equal(b.run(None, {"i": i})[0], 2 * want)
    assert np.array_equal(own.run(None, {"i": i})[0], want)  # its own copy: unchanged
    del a, b
    weights.close()


def test_backend_sessions_share_one_copy_and_give_the_same_logits(tiny_artifact):  # noqa: F811
    from m3export.export.artifact import load_artifact
    from m3export.model.batch import Segment, build_batch
    from m3export.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

    art = load_artifact(tiny_artifact, verify_checksums=False)
    page = art.page_size
    segments = [Segment([2 * b, 2 * b + 1], 20 + b, [5 + b]) for b in range(3)]
    ids, batch = build_batch(segments, page)
    rows = torch.arange(3)

    def step(be):
        be.allocate(8, page)
        gen = torch.Generator().manual_seed(0)
        for t in be._main.pool_tensors.values():
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        decode, _ = be.forward(ids, batch, rows)  # one token per sequence: the decode graph
        ids2, batch2 = build_batch([Segment(s.pages, s.start, [t, t + 1]) for s, t in zip(segments, ids.tolist())],
                                   page)
        general, _ = be.forward(ids2, batch2, torch.arange(6))  # two tokens per sequence: the general graph
        hidden = torch.zeros(3, art.config.hidden_size, dtype=be.graph_dtype.torch)
        mtp, _ = be.mtp_forward(0, ids, hidden, batch, rows)
        return decode, general, mtp

    own = OnnxRuntimeBackend(art, "cpu", decode_graph=True, share_weights=False, threads=1)
    shared = OnnxRuntimeBackend(art, "cpu", decode_graph=True, threads=1)
    try:
        want, got = step(own), step(shared)
        assert shared.decode_steps == 1 and shared.general_steps == 1
        for w, g in zip(want, got):
            assert torch.equal(w, g)  # the same weights' bytes, the same kernels
        # each distinct weight once: the general graph, its decode form and the MTP module (which names the
        # embedding and LM head too) read one copy, no more than the artifact's weight file holds
        size = (tiny_artifact / "weights.safetensors").stat().st_size
        assert not shared._weights.refused, shared._weights.refused
        assert 0.9 * size < shared._weights.nbytes <= size, (shared._weights.nbytes, size)
        # the embedding table, zeroed in the shared copy: every session's next logits move (their own copies would not)
        key = next(k for k in shared._weights._values if k[4] == (art.config.vocab_size, art.config.hidden_size)
                   and shared._weights.tensor(k).abs().sum() > 0)
        shared._weights.tensor(key).zero_()
        moved = step(shared)
        assert all(not torch.equal(m, g) for m, g in zip(moved, got))
    finally:
        own.close()
        shared.close()


@pytest.mark.gpu
@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers() or not torch.cuda.is_available(),
                    reason="needs onnxruntime-gpu and a CUDA device")
def test_second_cuda_session_allocates_no_second_copy(tmp_path):
    """A 256 MiB table: a second session with the shared copy takes less device memory than the table (what it
    takes is the session's own CUDA workspace and arena: 150 MiB with onnxruntime-gpu 1.31.1 on the H200,
    2026-12-01 12:05 UTC), and at least a table less than a session loading its own copy (658 MiB there), which
    takes at least the table (the control: the measure sees a copy)."""
    rows, cols = 2 << 20, 64  # bf16: 256 MiB
    table = _gather_model(tmp_path, rows, cols)
    weights = SharedWeights("cuda:0")
    provider = ("CUDAExecutionProvider", {"device_id": 0})
    i = np.array([3, rows - 1], dtype=np.int64)

    def free() -> int:
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info(0)[0]

    first = _session(tmp_path, provider, weights)
    first.run(None, {"i": i})
    before = free()
    second = _session(tmp_path, provider, weights)
    assert np.array_equal(second.run(None, {"i": i})[0], table[torch.from_numpy(i)].float().numpy())
    shared_cost = before - free()
    before = free()
    own = _session(tmp_path, provider, None)
    own.run(None, {"i": i})
    own_cost = before - free()
    assert not weights.refused, weights.refused  # onnxruntime wrapped the device tensor (DLPack)
    nbytes = rows * cols * 2
    assert own_cost >= nbytes, own_cost  # the control: a session's own copy shows
    assert shared_cost < nbytes and own_cost - shared_cost >= nbytes, (shared_cost, own_cost)
    del first, second, own
    weights.close()


@pytest.mark.parametrize("flavour", [None, "decode", "decode-all-experts"])
def test_onnxruntime_folds_no_copy_of_a_weight(tiny_artifact, tmp_path, flavour):  # noqa: F811
    """Sharing covers a weight only where the session reads it as it lies: ONNX Runtime constant-folds a weight's
    ``Transpose`` into a transposed initializer of the session's own (the MoE bodies once transposed every expert
    weight: a copy per session, the shared original unused). The optimised graphs hold no initializer of more
    than 1024 elements that the artifact's graph does not (the router's fp32 [E, H] transpose is 512 here)."""
    import math

    from m3export.export.artifact import load_artifact

    art = load_artifact(tiny_artifact, verify_checksums=False)
    file = art.root / (art.graphs["model"].file if flavour is None else art.manifest.flavours[flavour]["model"]["file"])
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(tmp_path / "opt.onnx")
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "opt.data")
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "64")
    ort.InferenceSession(str(file), sess_options=options, providers=["CPUExecutionProvider"])
    ours = {i.name for i in onnx.load(str(file), load_external_data=False).graph.initializer}
    folded = [(i.name, list(i.dims)) for i in onnx.load(str(tmp_path / "opt.onnx"), load_external_data=False)
              .graph.initializer if i.name not in ours and math.prod(i.dims) > 1024]
    assert not folded, folded


def test_weights_the_session_folds_are_left_to_it(tmp_path):
    """A weight that only constant nodes read (here a ``Transpose``, as the lowered MoE's gate / up interleave) is
    not shared: ONNX Runtime folds those nodes at load only from initializers the session loaded itself (over a
    shared device buffer the lowered decode graph ran its three ``w13`` interleaves on every step). A weight read
    both by such a node and as it lies stays shared; the outputs are the unshared session's."""
    from m3export.plugins.onnxruntime.shared_weights import folded_by_the_session

    gen = torch.Generator().manual_seed(0)
    tables = {name: torch.randn(8, 4, generator=gen) for name in ("relaid", "read", "both", "in_body", "body_read")}
    blob, inits = b"", []
    for name, t in tables.items():
        init = onnx.TensorProto(name=name, data_type=TP.FLOAT, dims=[8, 4], data_location=TP.EXTERNAL)
        for k, v in (("location", "w.bin"), ("offset", str(len(blob))), ("length", str(t.numel() * 4))):
            init.external_data.add(key=k, value=v)
        blob += t.numpy().tobytes()
        inits.append(init)
    (tmp_path / "w.bin").write_bytes(blob)
    nodes = [h.make_node("Transpose", ["relaid"], ["rt"], perm=[1, 0]), h.make_node("MatMul", ["x", "rt"], ["a"]),
             h.make_node("Gather", ["read", "i"], ["b"]),
             h.make_node("Transpose", ["both"], ["bt"], perm=[1, 0]), h.make_node("MatMul", ["x", "bt"], ["c"]),
             h.make_node("Gather", ["both", "i"], ["d"]),
             # a model-local function (as the m3 bodies): its weight transposed inside (folds once inlined), and
             # another read as it lies
             h.make_node("F", ["in_body", "body_read", "x"], ["e"], domain="t")]
    body = h.make_function("t", "F", ["w", "v", "x"], ["y"],
                           [h.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), h.make_node("MatMul", ["x", "wt"],
                                                                                            ["xw"]),
                            h.make_node("MatMul", ["xw", "v"], ["y"])], [h.make_opsetid("", 20)])
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", TP.FLOAT, [2, 4]),
                                      h.make_tensor_value_info("i", TP.INT64, [2])],
                         [h.make_tensor_value_info(n, TP.FLOAT, None) for n in "abcde"], initializer=inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 20), h.make_opsetid("t", 1)], ir_version=10,
                         functions=[body])
    onnx.save(model, str(tmp_path / "g.onnx"))
    assert folded_by_the_session(model) == {"relaid", "in_body"}
    weights = SharedWeights("cpu")
    options = ort.SessionOptions()
    options.log_severity_level = 3
    assert sorted(weights.add_to(options, onnx.load(str(tmp_path / "g.onnx"), load_external_data=False),
                                 tmp_path)) == ["body_read", "both", "read"]
    feeds = {"x": torch.randn(2, 4, generator=gen).numpy(), "i": np.array([3, 5])}
    shared = ort.InferenceSession(str(tmp_path / "g.onnx"), sess_options=options, providers=["CPUExecutionProvider"])
    own = ort.InferenceSession(str(tmp_path / "g.onnx"), providers=["CPUExecutionProvider"])
    for s, o in zip(shared.run(None, feeds), own.run(None, feeds)):
        assert np.array_equal(s, o)
    del shared
    weights.close()


def test_sessions_lift_onnxruntimes_constant_folding_limit(tiny_artifact):  # noqa: F811
    """ONNX Runtime folds no constant node whose output passes 1 GiB by default, so a `mini` layer's 1.2 GB w13
    interleave (the lowered MoE) ran every step; every ``PagedSession`` lifts the limit (``session.FOLD_LIMIT``)."""
    from m3export.export.artifact import load_artifact
    from m3export.plugins.onnxruntime.session import FOLD_LIMIT, PagedSession

    art = load_artifact(tiny_artifact, verify_checksums=False)
    session = PagedSession.from_artifact(art, threads=1)
    try:
        assert session._session.get_session_options().get_session_config_entry(FOLD_LIMIT[0]) == FOLD_LIMIT[1]
        assert int(FOLD_LIMIT[1]) >= 1 << 36  # past any one weight of the full model
    finally:
        session.close()
