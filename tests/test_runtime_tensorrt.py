"""The tensorrt backend: a clear BackendUnavailable (what to install, or what is missing) instead of a crash."""

import importlib.util

import pytest

from m3export.errors import BackendUnavailable
from m3export.runtime.backends import create_backend

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None


@pytest.mark.skipif(HAS_TENSORRT, reason="TensorRT is installed here; the missing-package message cannot be seen")
def test_missing_tensorrt_says_what_to_install(tmp_path):
    with pytest.raises(BackendUnavailable, match=r"pip install 'm3export\[trt\]'"):
        create_backend("tensorrt", tmp_path)


@pytest.mark.skipif(not HAS_TENSORRT, reason="TensorRT is not installed (pip install 'm3export[trt]' on a GPU host)")
def test_a_directory_without_engines_says_how_to_build_them(tmp_path):
    with pytest.raises(BackendUnavailable, match="holds no TensorRT engines: build them with 'm3export build"):
        create_backend("tensorrt", tmp_path)


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="expected one of torch, onnxruntime, tensorrt"):
        create_backend("tvm", ".")


# ------------------------------------------------------------------ the binding plan (plain Python, no TensorRT)
import json  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402

from m3export.build.profiles import Limits, engine_metadata, profiles_for  # noqa: E402
from m3export.errors import ArtifactError  # noqa: E402
from m3export.export.manifest import GraphInfo, TensorSig  # noqa: E402
from m3export.runtime.backends import tensorrt_backend as trb  # noqa: E402
from m3export.runtime.backends import tensorrt_bindings as tb  # noqa: E402

V, H, PAGE = 32, 16, 4


def _graph(media: bool = False) -> GraphInfo:
    """The main graph's signature as export writes it (manifest.json), at small static dims; ``media``: a
    vision-language step graph's, whose media rows come after the pools."""
    ins = (TensorSig("input_ids", "int64", ("T",)), TensorSig("positions", "int64", ("T",)),
           TensorSig("query_start_loc", "int32", ("B + 1",)), TensorSig("seq_lens", "int32", ("B",)),
           TensorSig("block_tables", "int32", ("B", "max_pages")), TensorSig("slot_mapping", "int64", ("T",)),
           TensorSig("logits_indices", "int64", ("N",)), TensorSig("k_cache.0", "float32", ("pages", PAGE, 2, 8)),
           TensorSig("index_k_cache.0", "float32", ("pages", PAGE, 8)))
    if media:
        ins += (TensorSig("media_rows", "int64", ("M",)), TensorSig("media_embeds", "float32", ("M", H)))
    outs = (TensorSig("logits", "float32", ("N", V)), TensorSig("hidden", "float32", ("T", H)),
            TensorSig("k_cache_out.0", "float32", ("pages", PAGE, 2, 8)),
            TensorSig("index_k_cache_out.0", "float32", ("pages", PAGE, 8)))
    return GraphInfo("model.onnx", ins, outs, {"k_cache_out.0": "k_cache.0", "index_k_cache_out.0": "index_k_cache.0"})


def _shapes(t=3, b=2, max_pages=2, n=2, pages=9):
    return {"input_ids": (t,), "positions": (t,), "query_start_loc": (b + 1,), "seq_lens": (b,),
            "block_tables": (b, max_pages), "slot_mapping": (t,), "logits_indices": (n,),
            "k_cache.0": (pages, PAGE, 2, 8), "index_k_cache.0": (pages, PAGE, 8)}


LIMITS = Limits(max_num_tokens=64, max_batch=8, max_model_len=40, page_size=PAGE)  # 10 pages a sequence, 81 a pool


def _profiles():
    """What build.json records and the engine reports (through a JSON round trip, as the runtime reads it)."""
    meta = engine_metadata("10.13.0", (9, 0), "H200", LIMITS, {"model": profiles_for(_graph(), LIMITS)}, {}, {}, [])
    return json.loads(json.dumps(meta))["profiles"]["model"]


def test_profiles_by_token_count_decode_first():
    profiles = _profiles()
    assert [p["input_ids"] for p in profiles] == [[[1], [8], [8]], [[1], [64], [64]]]
    assert all(p["block_tables"][2] == [8, 10] and p["k_cache.0"][2] == [81, PAGE, 2, 8] for p in profiles)
    assert profiles_for(_graph(), Limits(8, 8, 40, PAGE)) == profiles_for(_graph(), Limits(8, 8, 40, PAGE))[:1]


@pytest.mark.parametrize("shapes, want", [(_shapes(t=1, b=1, n=1), 0), (_shapes(t=8, b=8, n=8), 0),
                                          (_shapes(t=8, b=2, n=0), 0), (_shapes(t=40, b=2, n=0), 1),
                                          (_shapes(t=9, b=2, n=2), 1), (_shapes(t=64, b=8, n=64, pages=81), 1)])
def test_the_smallest_profile_that_holds_the_step_is_chosen(shapes, want):
    assert tb.select_profile(_graph(), _profiles(), shapes, "e") == want


@pytest.mark.parametrize("shapes, match", [
    (_shapes(t=65, n=1), r"input input_ids .* is 65, the engine was built for 1\.\.64 .*--max-num-tokens"),
    (_shapes(b=9), r"input query_start_loc .* \(B \+ 1\) is 10, .* 2\.\.9 .*--max-batch"),
    (_shapes(max_pages=11), r"input block_tables .* \(max_pages\) is 11, .* 1\.\.10 .*--max-model-len"),
    (_shapes(pages=82), r"input k_cache.0 .* \(pages\) is 82, .* 1\.\.81 .*--num-pages"),
])
def test_a_step_beyond_every_profile_names_the_input_and_the_build_option(shapes, match):
    with pytest.raises(tb.StepError, match=match):
        tb.select_profile(_graph(), _profiles(), shapes, "e")


def test_step_dims_and_output_shapes():
    dims = tb.step_dims(_graph(), _shapes(t=5, b=3, max_pages=4, n=3, pages=20), "e")
    assert dims == {"T": 5, "B": 3, "max_pages": 4, "N": 3, "pages": 20}
    assert tb.output_shapes(_graph(), dims, "e") == {"logits": (3, V), "hidden": (5, H),
                                                     "k_cache_out.0": (20, PAGE, 2, 8),
                                                     "index_k_cache_out.0": (20, PAGE, 8)}
    assert _profiles()[0]["logits_indices"] == [[0], [8], [8]]  # a step may sample no row
    bounds = tb.dim_bounds(_graph(), _profiles(), "e")
    assert bounds == {"T": 64, "N": 64, "B": 8, "max_pages": 10, "pages": 81}
    assert tb.output_shapes(_graph(), bounds, "e")["logits"] == (64, V)  # the preallocated logits buffer


@pytest.mark.parametrize("change, match", [
    (dict(query_start_loc=(4,)), r"input seq_lens dim 'B' is 2, so B = 2, but another input has B = 3"),
    (dict(k_cache=(9, PAGE, 2, 7)), r"input k_cache.0 has shape \[9, 4, 2, 7\], the graph takes"),
    (dict(block_tables=(2,)), r"input block_tables has rank 1"),
    (dict(extra=(1,)), r"unexpected inputs \['extra'\]"),
    (dict(drop="seq_lens"), r"missing inputs \['seq_lens'\]"),
])
def test_step_feeds_are_checked_against_the_signature(change, match):
    shapes = _shapes()
    for k, v in change.items():
        if k == "drop":
            del shapes[v]
        else:
            shapes["k_cache.0" if k == "k_cache" else k] = v
    with pytest.raises(tb.StepError, match=match):
        tb.step_dims(_graph(), shapes, "e")


def _engine_tensors(graph):
    return [tb.EngineTensor(t.name, is_in, t.dtype, tuple(d if isinstance(d, int) else -1 for d in t.shape))
            for is_in, sigs in ((True, graph.inputs), (False, graph.outputs)) for t in sigs]


def test_engine_io_must_be_the_graph_signature():
    g = _graph()
    tensors = _engine_tensors(g)
    tb.check_engine_io(g, list(reversed(tensors)), "e")  # order does not matter, names do
    cases = [(tensors[:-1], "the engine has no output 'index_k_cache_out.0'"),
             (tensors + [tb.EngineTensor("x", False, "float32", (1,))], r"tensors \['x'\] that model.onnx does not"),
             ([tb.EngineTensor("logits", True, "float32", (-1, V)) if t.name == "logits" else t for t in tensors],
              "'logits' is an input of the engine, an output of model.onnx"),
             ([tb.EngineTensor("hidden", False, "float16", (-1, H)) if t.name == "hidden" else t for t in tensors],
              "output 'hidden' is float16 in the engine, float32 in model.onnx"),
             ([tb.EngineTensor("hidden", False, "float32", (-1, H + 1)) if t.name == "hidden" else t for t in tensors],
              r"output 'hidden' has shape \[-1, 17\] in the engine, \['T', 16\] in model.onnx")]
    for bad, match in cases:
        with pytest.raises(ArtifactError, match=match):
            tb.check_engine_io(g, bad, "e")


def test_engine_profiles_must_be_the_recorded_ones():
    recorded = _profiles()
    engine = [{n: [tuple(s) for s in r] for n, r in p.items()} for p in recorded]  # what TensorRT reports
    tb.check_profiles(engine, recorded, "e")
    with pytest.raises(ArtifactError, match="not the ones build.json records"):
        tb.check_profiles(engine[:1], recorded, "e")


def test_ping_pong_pools_give_the_in_place_cache_writes():
    """Three steps of an out-of-place cache write (what TensorRT runs for the graph's ScatterND: copy the pool read,
    write the new rows) through PoolPair's bindings equal the same rows written in place into one pool."""
    g = _graph()
    made = []

    def allocate(name, shape, dtype):
        made.append((name, shape, dtype))
        return torch.zeros(shape)

    pools = tb.PoolPair(g, 9, allocate)
    assert made == [("k_cache.0", (9, PAGE, 2, 8), "float32")] * 2 + [("index_k_cache.0", (9, PAGE, 8), "float32")] * 2
    in_place = {n: torch.zeros(s) for n, s, _ in made[::2]}
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        slots = torch.randperm(9 * PAGE, generator=gen)[:5]
        reads, writes = pools.bindings()
        assert set(reads) == {"k_cache.0", "index_k_cache.0"} and set(writes) == {"k_cache_out.0",
                                                                                "index_k_cache_out.0"}
        assert all(writes[o].data_ptr() != reads[i].data_ptr() for i, o in tb.pool_pairs(g))
        for inp, out in tb.pool_pairs(g):
            rows = torch.randn((5, *reads[inp].shape[2:]), generator=gen)
            writes[out].copy_(reads[inp])  # ScatterND out of place
            writes[out].view(-1, *rows.shape[1:])[slots] = rows
            in_place[inp].view(-1, *rows.shape[1:])[slots] = rows
        pools.swap()
        for inp, _ in tb.pool_pairs(g):
            assert torch.equal(pools.current(inp), in_place[inp]), (step, inp)


def test_feeds_that_must_be_copied_before_binding():
    out = [(4096, 1024)]
    assert not tb.needs_copy(8192, 512, out)
    assert tb.needs_copy(8192 + 4, 512, out)  # misaligned (a slice of another tensor)
    assert tb.needs_copy(4096 + 256, 256, out)  # inside an output buffer (an output fed back)
    assert tb.needs_copy(3840, 512, out)  # straddles its start
    assert not tb.needs_copy(3840, 256, out) and not tb.needs_copy(4096 + 4, 0, out)  # adjacent; empty


def test_engine_graphs_and_files(tmp_path):
    meta = {"engines": {"model": {"file": "model.engine", "bytes": 3}, "mtp1": {"file": "mtp1.engine", "bytes": 1}}}
    assert trb.engine_graphs(meta, 2, "e") == ("model", [])  # mtp1 without mtp0 cannot chain
    meta["engines"]["mtp0"] = {"file": "mtp0.engine", "bytes": 1}
    assert trb.engine_graphs(meta, 2, "e") == ("model", ["mtp0", "mtp1"])
    with pytest.raises(ArtifactError, match="lists no engine of graph 'model'"):
        trb.engine_graphs({"engines": {}}, 1, "e")
    with pytest.raises(ArtifactError, match="engine of graph 'model' is missing"):
        trb.check_engine_file(tmp_path, meta["engines"]["model"], "model")
    (tmp_path / "model.engine").write_bytes(b"ab")
    with pytest.raises(ArtifactError, match="2 bytes, build.json records 3"):
        trb.check_engine_file(tmp_path, meta["engines"]["model"], "model")
    (tmp_path / "model.engine").write_bytes(b"abc")
    assert trb.check_engine_file(tmp_path, meta["engines"]["model"], "model") == tmp_path / "model.engine"
    with pytest.raises(ArtifactError, match="names no file in the directory"):
        trb.check_engine_file(tmp_path, {"file": "../model.engine", "bytes": 3}, "model")


def test_the_cache_dtype_check_reads_the_artifact_an_engine_directory_was_built_from(tiny_artifact, tmp_path):
    """``--backend tensorrt`` is given an engine directory, not an artifact: ``--kv-cache-dtype`` is checked
    against the pools of the artifact its build.json names (float32 here), before TensorRT is needed."""
    from m3export.runtime import Engine

    meta = engine_metadata("10.13.0", (9, 0), "H200", LIMITS, {}, {}, {}, [])
    (tmp_path / "build.json").write_text(json.dumps({**meta, "artifact": str(tiny_artifact)}))
    with pytest.raises(BackendUnavailable, match=rf"--kv-cache-dtype bf16: {tmp_path} \(TensorRT engines built "
                                                 rf"from {tiny_artifact}\) was exported with float32 caches, not bfloat16"):
        Engine.from_artifact(tmp_path, backend="tensorrt", kv_cache_dtype="bf16")
    (tmp_path / "build.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="build.json names no artifact"):
        Engine.from_artifact(tmp_path, backend="tensorrt", kv_cache_dtype="bf16")


def test_profiles_of_the_exported_graphs(tiny_artifact):
    """The real signatures of the tiny export: every graph's profiles hold a decode and a prefill step."""
    from m3export.export.artifact import load_artifact

    art = load_artifact(tiny_artifact, verify_checksums=False)
    limits = Limits.for_config(art.config, art.page_size, 32, 4, 64)
    for name, graph in art.graphs.items():
        if name == "vision":
            continue
        profiles = profiles_for(graph, limits)
        pages = math.ceil(64 / art.page_size)
        dims = dict(t=4, b=4, max_pages=pages, n=4, pages=limits.pool_pages)
        shapes = {t.name: tb.resolve(t.shape, {"T": 4, "B": 4, "max_pages": pages, "N": 4,
                                               "pages": limits.pool_pages}, "x") for t in graph.inputs}
        assert tb.step_dims(graph, shapes, name) == {"T": 4, "B": 4, "max_pages": pages, "N": 4,
                                                      "pages": limits.pool_pages}, dims
        assert tb.select_profile(graph, profiles, shapes, name) == 0
        shapes.update({n: tb.resolve(t.shape, {"T": 20, "B": 2, "max_pages": pages, "N": 2,
                                               "pages": limits.pool_pages}, "x")
                       for n, t in {t.name: t for t in graph.inputs}.items()})
        assert tb.select_profile(graph, profiles, shapes, name) == 1


# ------------------------------------------------ the runner's TensorRT calls, against a stand-in engine (CPU)
class _Trt:
    """The names of the ``tensorrt`` module the runner uses (dtypes, I/O modes)."""

    __version__ = "10.13.0"
    float32, float16, bfloat16, int32, int64, uint8, fp8 = ("f32", "f16", "bf16", "i32", "i64", "u8", "fp8")

    class TensorIOMode:
        INPUT, OUTPUT = "input", "output"


_TRT_DTYPE = {"float32": "f32", "int32": "i32", "int64": "i64"}
_NP = {"float32": "float32", "int32": "int32", "int64": "int64"}


def _at(address: int, shape, dtype: str) -> torch.Tensor:
    """The memory at a bound address as a tensor: how an engine sees what it is bound to (no copy)."""
    import ctypes

    import numpy as np

    n = math.prod(shape) * np.dtype(_NP[dtype]).itemsize
    if n == 0:  # an empty tensor: bound to some address, never read
        return torch.empty(shape, dtype=getattr(torch, _NP[dtype]))
    return torch.from_numpy(np.frombuffer((ctypes.c_char * n).from_address(address), _NP[dtype]).reshape(shape))


def _step_semantics(t: dict) -> dict:
    """What the stand-in engine computes, on tensors (the same function runs in place for the reference): each
    new token writes its id into its slot of both pools; hidden depends on the whole updated pool, so reading a
    stale pool buffer shows; logits pick hidden rows."""
    k, ik = t["k_cache.0"].clone(), t["index_k_cache.0"].clone()  # ScatterND, out of place
    ids, slots = t["input_ids"].float(), t["slot_mapping"]
    k.view(-1, 2, 8)[slots] = ids.view(-1, 1, 1)
    ik.view(-1, 8)[slots] = 2 * ids.view(-1, 1)
    hidden = (k.sum() + ik.sum() + t["positions"].float()).view(-1, 1) + torch.arange(H).float()
    logits = hidden[t["logits_indices"], :1] + torch.arange(V).float()
    return {"logits": logits, "hidden": hidden, "k_cache_out.0": k, "index_k_cache_out.0": ik}


class _Engine:
    def __init__(self, graph, profiles):
        self.graph, self.profiles = graph, profiles
        self.sigs = {t.name: (t, True) for t in graph.inputs} | {t.name: (t, False) for t in graph.outputs}
        self.num_io_tensors, self.num_optimization_profiles = len(self.sigs), len(profiles)
        self.contexts = []

    def get_tensor_name(self, i):
        return list(self.sigs)[i]

    def get_tensor_mode(self, n):
        return _Trt.TensorIOMode.INPUT if self.sigs[n][1] else _Trt.TensorIOMode.OUTPUT

    def get_tensor_dtype(self, n):
        return _TRT_DTYPE[self.sigs[n][0].dtype]

    def get_tensor_shape(self, n):
        return [d if isinstance(d, int) else -1 for d in self.sigs[n][0].shape]

    def get_tensor_profile_shape(self, n, i):
        return [list(s) for s in self.profiles[i][n]]

    def create_execution_context(self):
        self.contexts.append(_Context(self))
        return self.contexts[-1]


class _Context:
    def __init__(self, engine):
        self.engine, self.profile, self.shapes, self.addresses, self.profile_calls = engine, 0, {}, {}, []

    def set_optimization_profile_async(self, i, stream):
        self.profile = i
        self.profile_calls.append(i)
        return True

    def set_input_shape(self, name, shape):
        lo, _, hi = self.engine.profiles[self.profile][name]
        self.shapes[name] = tuple(shape)
        return all(a <= n <= b for a, n, b in zip(lo, shape, hi))

    def set_tensor_address(self, name, address):
        self.addresses[name] = address
        return True

    def get_tensor_shape(self, name):
        dims = tb.step_dims(self.engine.graph, self.shapes, "engine")
        return tb.resolve(self.engine.sigs[name][0].shape, dims, "engine")

    def execute_async_v3(self, stream):
        g = self.engine.graph
        ins = {t.name: _at(self.addresses[t.name], self.shapes[t.name], t.dtype) for t in g.inputs}
        for name, value in _step_semantics(ins).items():
            sig = self.engine.sigs[name][0]
            _at(self.addresses[name], self.get_tensor_shape(name), sig.dtype).copy_(value)
        return True


class _Runtime:
    def __init__(self, engine):
        self.engine = engine

    def deserialize_cuda_engine(self, data):
        return self.engine


def _feeds(t, b, pages_of, n_rows, start, ids):
    """A step of ``b`` sequences of ``t // b`` new tokens each, sequence i on pages ``pages_of[i]``."""
    per = t // b
    pos = torch.arange(start, start + per).repeat(b)
    slots = torch.cat([torch.tensor([pages_of[i][int(p) // PAGE] * PAGE + int(p) % PAGE for p in pos[:per]])
                       for i in range(b)])
    width = max(len(p) for p in pages_of[:b])
    return {"input_ids": ids, "positions": pos, "query_start_loc": torch.arange(0, t + 1, per, dtype=torch.int32),
            "seq_lens": torch.full((b,), start + per, dtype=torch.int32),
            "block_tables": torch.tensor([p + [0] * (width - len(p)) for p in pages_of[:b]], dtype=torch.int32),
            "slot_mapping": slots, "logits_indices": torch.arange(n_rows, dtype=torch.int64)}


def test_the_runner_binds_pools_and_outputs_by_address_and_picks_profiles(tmp_path):
    """EngineRunner against a stand-in engine that, like TensorRT, reads and writes only the addresses it is
    bound to: three steps (decode-size, prefill-size, a step sampling no row) give the outputs of the same steps
    run in place on one pool, the profile switches 0 -> 1 -> 0, and outputs land in the runner's own buffers."""
    (tmp_path / "model.engine").write_bytes(b"stand-in")
    profiles = _profiles()
    engine = _Engine(_graph(), [{n: [tuple(s) for s in r] for n, r in p.items()} for p in profiles])
    runner = trb.EngineRunner(_Trt, _Runtime(engine), tmp_path / "model.engine", _graph(), profiles,
                              torch.device("cpu"))
    with pytest.raises(ValueError, match=r"90 pages, the engine was built for pools of at most 81 .*--num-pages"):
        runner.allocate(90)
    runner.allocate(20)
    ref = {"k_cache.0": torch.zeros(20, PAGE, 2, 8), "index_k_cache.0": torch.zeros(20, PAGE, 8)}
    pages = [[3, 7, 11, 2, 9, 4], [5, 1, 8, 6, 12, 13]]
    gen = torch.Generator().manual_seed(0)
    steps = [(4, 2, 2, 0), (20, 1, 1, 2), (2, 2, 0, 22)]  # (tokens, sequences, sampled rows, first position)
    for t, b, n, start in steps:
        feeds = _feeds(t, b, pages, n, start, torch.randint(1, 50, (t,), generator=gen))
        got = runner.run(dict(feeds))
        want = _step_semantics({**feeds, **ref})
        ref["k_cache.0"], ref["index_k_cache.0"] = want["k_cache_out.0"], want["index_k_cache_out.0"]
        assert set(got) == {"logits", "hidden"}
        assert torch.equal(got["logits"], want["logits"]) and torch.equal(got["hidden"], want["hidden"])
        assert got["logits"].shape == (n, V)
        assert got["hidden"].data_ptr() == runner._out["hidden"].data_ptr()  # written into the preallocated buffer
    for name in ref:
        assert torch.equal(runner.pools.current(name), ref[name])
    assert engine.contexts[0].profile_calls == [0, 1, 0]
    with pytest.raises(tb.StepError, match="are cache pools, bound from the backend's own buffers"):
        runner.run({**feeds, "k_cache.0": ref["k_cache.0"]})


def test_text_steps_of_a_vision_language_engine_feed_zero_media_rows(tmp_path):
    """A vision-language step graph takes ``media_rows`` [M] / ``media_embeds`` [M, H]: its profiles range M from
    0 (tuned at 0) to the profile's tokens, and the backend's steps (through ``TensorRTBackend.forward`` on a
    stand-in engine) bind both with M = 0 and give the outputs of the same steps without media inputs; the
    backend still refuses media itself (no vision encoder)."""
    from types import SimpleNamespace

    from m3export.errors import MediaError
    from m3export.model.batch import Batch

    graph = _graph(media=True)
    profiles = json.loads(json.dumps(profiles_for(graph, LIMITS)))  # as build.json records them
    assert [p["media_rows"] for p in profiles] == [[[0], [0], [8]], [[0], [0], [64]]]  # decode, then every step
    assert [p["media_embeds"] for p in profiles] == [[[0, H], [0, H], [8, H]], [[0, H], [0, H], [64, H]]]
    assert tb.empty_media(graph) == {"media_rows": ((0,), "int64"), "media_embeds": ((0, H), "float32")}
    assert tb.empty_media(_graph()) == {}

    engine = _Engine(graph, [{n: [tuple(s) for s in r] for n, r in p.items()} for p in profiles])

    class Trt(_Trt):
        class Logger:
            WARNING = "warning"

            def __init__(self, level):
                pass

        @staticmethod
        def Runtime(logger):
            return _Runtime(engine)

    (tmp_path / "model.engine").write_bytes(b"stand-in")
    artifact = SimpleNamespace(config=SimpleNamespace(vision="a vision tower"), page_size=PAGE, root=tmp_path,
                               graphs={"model": graph}, manifest=SimpleNamespace(dtype="float32", mtp_modules=0))
    meta = {"engines": {"model": {"file": "model.engine", "bytes": 8}}, "profiles": {"model": profiles}}
    backend = trb.TensorRTBackend(tmp_path, meta, artifact, Trt, torch.device("cpu"))
    backend.allocate(20, PAGE)
    text = trb.EngineRunner(_Trt, _Runtime(_Engine(_graph(), [{n: [tuple(s) for s in r] for n, r in p.items()}
                                                               for p in _profiles()])),
                            tmp_path / "model.engine", _graph(), _profiles(), torch.device("cpu"))
    text.allocate(20)
    pages = [[3, 7, 11, 2, 9, 4], [5, 1, 8, 6, 12, 13]]
    for t, b, n, start in [(4, 2, 2, 0), (20, 1, 1, 2)]:  # a decode-size step, then a prefill-size one
        feeds = _feeds(t, b, pages, n, start, torch.arange(1, t + 1))
        batch = Batch(*(feeds[name] for name in Batch.input_names()))
        logits, hidden = backend.forward(feeds["input_ids"], batch, feeds["logits_indices"])
        assert engine.contexts[0].shapes["media_rows"] == (0,) and engine.contexts[0].shapes["media_embeds"] == (0, H)
        want = text.run(dict(feeds))
        assert torch.equal(logits, want["logits"]) and torch.equal(hidden, want["hidden"])
    assert engine.contexts[0].profile_calls == [0, 1]
    assert not backend.supports_media
    with pytest.raises(MediaError, match="the tensorrt backend does not run the vision encoder"):
        backend.encode_media(torch.zeros(4, 48), torch.tensor([[1, 2, 2]]))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TENSORRT, reason="TensorRT is not installed (its wheels download from NVIDIA's index, "
                    "unreachable here; pip install 'm3export[trt]' on a GPU host)")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tiny_engines_match_the_torch_backend(tiny_artifact, tmp_path):
    """Build the tiny model's engines and run the same paged steps through them and the torch backend."""
    from m3export.build.engine import build_engines
    from m3export.compare import compare_backends

    engines = build_engines(tiny_artifact, tmp_path / "engines", max_num_tokens=64, max_batch=4, max_model_len=64)
    report = compare_backends(engines, ["torch", "tensorrt"], decode_steps=3, device="cuda")
    assert report.passed, "\n".join(report.lines())
