"""The RMSNorm / RoPE graph passes (``fused_norms.py``, ``compact_rope.py``) inside the real decode graphs at batch 8
(issue 16: on the H200 the `mini` bf16 decode graph with both passes gave other greedy tokens than the torch
backend at batch 8 / 4k, logits 0.95 apart, and the same tokens at batch 1).

Each pass alone and both, in the tiny artifact's decode graphs (the all-experts MoE form a batch of 8 takes), on a
decode step of sequences at DIFFERENT positions, padded to the bucket as the backend pads it for CUDA-graph replay
(``pad_decode``): the RoPE pass must give the no-pass decode graph's logits bit for bit (its rewrite is exact), the
RMSNorm pass logits within its bound. The CPU test runs fp32 (the CPU EP has no bf16 Mul); the GPU test runs fp32
and bf16 on the CUDA EP, replayed as CUDA graphs, and names which pass breaks what (it is the test to run on the
H200 to find the batch-8 bug; the CPU EP does not reproduce it)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from m3export.export import decode_graph, fused_norms
from m3export.export.artifact import load_artifact
from m3export.export.exporter import export_artifact
from m3export.model.batch import Segment, build_batch

ort = pytest.importorskip("onnxruntime")

PASSES = {"none": {"fuse_norms": False, "compact_rope": False}, "rms_norm": {"fuse_norms": True, "compact_rope": False},
          "rope": {"fuse_norms": False, "compact_rope": True}, "both": {"fuse_norms": True, "compact_rope": True}}
for _kw in PASSES.values():  # these two passes alone (the cache-scatter pass: tests/test_element_scatters.py)
    _kw["scatter_elements"] = False
CONTEXTS = (21, 9, 37, 14, 30, 5, 26, 42)  # a different position for every sequence
POOL_PAGES = 96


def _export(tmp_path_factory, monkeypatch_module, dtype: str):
    """The tiny artifact whose decode graphs carry no pass (the exporter calls ``write_decode_graphs``)."""
    real = decode_graph.write_decode_graphs
    monkeypatch_module.setattr(decode_graph, "write_decode_graphs", functools.partial(real, **PASSES["none"]))
    try:
        return load_artifact(export_artifact("tiny", tmp_path_factory.mktemp("art") / f"{dtype}-none",
                                             dtype=dtype, page_size=4, progress=False))
    finally:
        monkeypatch_module.setattr(decode_graph, "write_decode_graphs", real)


def _with_passes(tmp_path_factory, base, passes: str):
    """A copy of the no-pass artifact ``base`` whose decode graphs (both MoE forms) carry ``passes``, written by
    ``write_decode_graphs`` from the copy's step graphs as the exporter writes them (the step graphs and weights
    do not depend on the passes: one torch export serves every pass set); the manifest records the new files."""
    import json
    import shutil

    from m3export.export.manifest import sha256_file

    root = shutil.copytree(base.root, tmp_path_factory.mktemp("art") / f"{base.root.name.split('-')[0]}-{passes}")
    manifest = json.loads((root / "manifest.json").read_text())
    for form in decode_graph.MOE_FORMS:
        name = decode_graph.flavour_name(moe=form)
        for record in manifest["flavours"][name].values():
            (root / record["file"]).unlink()
            del manifest["files"][record["file"]]
        manifest["flavours"][name] = decode_graph.write_decode_graphs(root, base.graphs, moe=form, **PASSES[passes])
        for record in manifest["flavours"][name].values():
            path = root / record["file"]
            manifest["files"][record["file"]] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return load_artifact(root)


def _checked(art, passes: str):
    record = art.manifest.flavours[decode_graph.flavour_name(moe="all-experts")]["model"]
    want = {"rms_norm": 23, "rope": 14}  # the tiny model: 23 norms (4 layers + final), 14 rotations
    assert record["graph_passes"] == {decode_graph.FUSED_NORMS if k == "rms_norm" else decode_graph.COMPACT_ROPE: n
                                      for k, n in want.items() if k in passes or passes == "both"}, record
    return art


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, monkeypatch_module):
    made = {}

    def get(dtype: str, passes: str):
        if (dtype, "none") not in made:
            made[dtype, "none"] = _checked(_export(tmp_path_factory, monkeypatch_module, dtype), "none")
        if (dtype, passes) not in made:
            made[dtype, passes] = _checked(_with_passes(tmp_path_factory, made[dtype, "none"], passes), passes)
        return made[dtype, passes]

    return get


def _step(art, provider: str, batch_size: int, device: str, **kw) -> torch.Tensor:
    """Logits of one decode step (sequences at ``CONTEXTS``) through the decode graph, padded to its bucket, on pools
    holding the same seeded values in every backend; run three times (a CUDA-graph capture, then replays)."""
    from m3export.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend

    page = art.page_size
    need = [-(-(c + 1) // page) for c in CONTEXTS[:batch_size]]
    starts = [sum(need[:i]) for i in range(batch_size)]
    segments = [Segment(list(range(s, s + n)), c, [7 + 3 * b]) for b, (s, n, c) in
                enumerate(zip(starts, need, CONTEXTS))]
    ids, batch = build_batch(segments, page)
    be = OnnxRuntimeBackend(art, provider, **kw)
    try:
        be.allocate(POOL_PAGES, page)
        gen = torch.Generator(device=device).manual_seed(0)
        for t in be._main.pool_tensors.values():
            t[:POOL_PAGES].copy_(torch.randn(t[:POOL_PAGES].shape, generator=gen, device=device).to(t.dtype))
        where = be.batch_device
        batch = batch.to(where) if hasattr(batch, "to") else batch
        for _ in range(3):
            logits, _ = be.forward(ids.to(where), batch, torch.arange(batch_size, device=where))
        assert be.padded_decode_steps == 3 and be.general_steps == 0
        # tiny: 8 experts, top 2: every batch runs every expert (decode_graph.GATHER_COST)
        assert "all-experts" in be._decodes
        return logits.float().cpu().clone()
    finally:
        be.close()


def _differences(results: dict, batch_size: int, dtype: str) -> list[str]:
    """What breaks each pass's bound against the no-pass graph (empty: every pass within it), one line per pass."""
    none = results["none"]
    scale = float(none.abs().max())
    bad = []
    for name in [n for n in ("rope", "both", "rms_norm") if n in results]:
        got = results[name]
        diff = float((got - none).abs().max())
        rows = sorted({int(r) for r in ((got - none).abs().amax(-1) > 0).nonzero().reshape(-1)})
        same_tokens = bool(torch.equal(got.argmax(-1), none.argmax(-1)))
        if name == "rope":  # the rewrite rounds every element where the traced nodes round it: bit-equal
            ok = torch.equal(got, none)
        else:
            # the fused norm differs from the traced one by a few fp32 ulps (fused_norms.py); through 4 layers that
            # stays ~1e-6 relative in fp32; in bf16 a moved rounding (2^-8) can propagate: 2^-5 of the logits'
            # scale is 8 bf16 ulps, far below the 0.95-of-~3 the H200 showed
            ok = diff <= (1e-5 if dtype == "float32" else 2.0 ** -5) * scale
        ok = ok and (same_tokens or dtype != "float32")
        if not ok:
            bad.append(f"batch {batch_size} {dtype} pass {name}: max |logit diff| {diff:.3g} (scale {scale:.3g}), "
                       f"rows differing {rows}, greedy {'same' if same_tokens else 'DIFFERENT'}")
    return bad


def _check(results: dict, batch_size: int, dtype: str) -> None:
    bad = _differences(results, batch_size, dtype)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("batch_size", [7, 8])  # 7 pads to the bucket 8 with a scratch sequence; 8 fills it
def test_decode_graph_passes_at_batch_8_cpu(artifacts, batch_size):
    # none and both only (one tiny export, both's decode graphs rewritten from it): the GPU test below separates
    # the passes
    results = {p: _step(artifacts("float32", p), "cpu", batch_size, "cpu", pad_decode=True, threads=1)
               for p in ("none", "both")}
    _check(results, batch_size, "float32")


@pytest.mark.gpu
@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers() or not torch.cuda.is_available(),
                    reason="needs onnxruntime-gpu and a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("provider", ["cuda", "cuda:enable_cuda_graph=1"])
def test_decode_graph_passes_at_batch_8_cuda(artifacts, dtype, provider):
    """Eager (``pad_decode``) and replayed: each pass alone against the no-pass graph; the message names the pass."""
    bad = []  # every batch and pass, then one message naming each that breaks its bound
    for batch_size in (8, 7, 1):
        kw = {"pad_decode": True} if provider == "cuda" else {}
        results = {p: _step(artifacts(dtype, p), provider, batch_size, "cuda", **kw) for p in PASSES}
        bad += _differences(results, batch_size, dtype)
    assert not bad, "\n".join(bad)


def _optimized_ops(art, provider: str, tmp_path) -> dict:
    """Op types (``domain:op``) of the all-experts decode graph as ONNX Runtime optimises it for ``provider``
    (``optimized_model_filepath``: the graph after the EP's own fusions, which the CPU EP does not run for CUDA),
    and what feeds each ``SimplifiedLayerNormalization`` there (a ``Cast`` to fp32 keeps the pass's premise)."""
    import onnx

    from m3export.plugins.onnxruntime.providers import parse_provider

    record = art.manifest.flavours[decode_graph.flavour_name(moe="all-experts")]["model"]
    out = tmp_path / f"opt-{provider.replace(':', '_')}.onnx"
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.optimized_model_filepath = str(out)
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", out.name + ".data")
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(art.root / record["file"]), sess_options=options,
                         providers=parse_provider(provider).session_providers())
    model = onnx.load(str(out), load_external_data=False)
    producers = {o: n for n in model.graph.node for o in n.output}
    counts: dict[str, int] = {}
    for n in model.graph.node:
        key = f"{n.domain or 'ai.onnx'}:{n.op_type}"
        counts[key] = counts.get(key, 0) + 1
    fed = []
    for n in model.graph.node:
        if n.op_type == fused_norms.OP:
            p = producers.get(n.input[0])
            to = next((a.i for a in p.attribute if a.name == "to"), None) if p is not None else None
            fed.append(f"{p.op_type}(to={to})" if p is not None and p.op_type == "Cast" else
                       (p.op_type if p is not None else "graph input"))
    return {"ops": dict(sorted(counts.items())), "norms_fed_by": sorted(set(fed)), "norms": len(fed)}


def _check_optimized(got: dict, dtype: str, provider: str) -> None:
    """Each pass's rewrite survives ONNX Runtime's optimiser as written: the 23 fused norms still
    ``SimplifiedLayerNormalization`` on an fp32 ``x`` (a Cast to float; ORT's CUDA fusions could fold them with the
    residual Add into ``SkipSimplifiedLayerNormalization``, or drop the casts, which changes the rounding), the
    RoPE's ``Gather`` not turned into something else; where it differs the message holds both op tables. On a GPU
    the tables are also written to ``$OUT/optimized_ops_<dtype>.json`` (what the H200 optimised, to read beside
    the batch-8 logits)."""
    import json
    import os

    if os.environ.get("OUT") and provider != "cpu":
        (Path(os.environ["OUT"]) / f"optimized_ops_{dtype}.json").write_text(json.dumps(got, indent=1))
    none, both = got["none"], got["both"]
    assert both["norms"] == 23 and none["norms"] == 0, (dtype, provider, both, none)
    if dtype != "float32":  # in fp32 the casts are no-ops ORT removes (the residual Add, the embedding feed it)
        assert both["norms_fed_by"] == [f"Cast(to={onnx_float()})"], (dtype, provider, both["norms_fed_by"])
    skip = [k for k in both["ops"] if "SkipSimplifiedLayerNormalization" in k]
    assert not skip, (dtype, provider, both["ops"])
    # the RoPE pass adds one Gather per rotation (14) beside the graph's own Gathers (embedding, tables)
    gathers = both["ops"].get("ai.onnx:Gather", 0) - none["ops"].get("ai.onnx:Gather", 0)
    assert gathers == 14, (dtype, provider, gathers, both["ops"], none["ops"])


def onnx_float() -> int:
    import onnx

    return onnx.TensorProto.FLOAT


def test_optimiser_keeps_the_passes_rewrites_cpu(artifacts, tmp_path):
    got = {p: _optimized_ops(artifacts("float32", p), "cpu", tmp_path) for p in ("none", "both")}
    _check_optimized(got, "float32", "cpu")


@pytest.mark.gpu
@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers() or not torch.cuda.is_available(),
                    reason="needs onnxruntime-gpu and a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_optimiser_keeps_the_passes_rewrites_cuda(artifacts, dtype, tmp_path):
    """ORT's CUDA EP optimises the graph with fusions the CPU EP does not run (the batch-8 difference does not
    reproduce on the CPU EP): first what it made of each pass."""
    got = {p: _optimized_ops(artifacts(dtype, p), "cuda", tmp_path) for p in PASSES}
    _check_optimized(got, dtype, "cuda")
