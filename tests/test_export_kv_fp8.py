"""Exported artifacts with an FP8 (E4M3) cache (``m3export export --kv-cache-dtype fp8``), end to end.

Oracles: the format's one owner, ``m3export.ops.kv_fp8`` (``quantize_rows``: the bytes every writer must give),
and the torch backend running the same artifact with its own FP8 cache (float8 pools written by
``quantize_rows``). The graphs carry each pool as uint8 codes beside an fp32 scale pool; the code writer is the
op ``m3::quantize_kv_rows``, exported as standard ONNX nodes (``kv_fp8_onnx.encode_rows``).
"""

from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest
import torch

from m3export.errors import ArtifactError, BackendUnavailable
from m3export.export.artifact import load_artifact
from m3export.export.exporter import export_artifact
from m3export.export.functions import CACHE_READERS
from m3export.export.manifest import KV_FP8
from m3export.export.translation import translation_table
from m3export.export.verify import Agreement, verify_artifact
from m3export.ops import kv_fp8
from m3export.runtime import Engine, SamplingParams
from m3export.runtime.backends import check_exported_cache_dtype

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _rows(dtype: torch.dtype) -> torch.Tensor:
    """[3, 2, 16] rows spanning 7.5 decades (subnormal codes included; finite in fp16), signs mixed, one all-zero
    row."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2, 16, generator=gen) * torch.logspace(-4, 3.5, 16)
    x[1, 0] = 0.0
    return x.to(dtype)


class _CodeWrite(torch.nn.Module):
    """What an attention layer's traced cache write is: codes and scales scattered at the step's slots."""

    def forward(self, pool, scale_pool, slots, x):
        codes, scale = torch.ops.m3.quantize_kv_rows(x)
        index = (slots // pool.shape[1], slots % pool.shape[1])
        return pool.index_put(index, codes), scale_pool.index_put(index, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_code_writer_exports_to_the_quantisers_bytes(dtype):
    """``m3::quantize_kv_rows`` eager and exported (standard ONNX nodes, no m3 node, no float8 tensor) write
    ``quantize_rows``' bytes and scales exactly."""
    x, slots = _rows(dtype), torch.tensor([3, 9, 17])
    pools = (torch.zeros(8, 4, 2, 16, dtype=torch.uint8), torch.zeros(8, 4, 2))
    q, scale = kv_fp8.quantize_rows(x)
    codes, got_scale = torch.ops.m3.quantize_kv_rows(x)
    assert torch.equal(codes, q.view(torch.uint8)) and torch.equal(got_scale, scale)

    program = torch.onnx.export(_CodeWrite().eval(), (*pools, slots, x), dynamo=True, opset_version=20, verbose=False,
                                report=False, custom_translation_table=translation_table(),
                                input_names=["pool", "scale_pool", "slots", "x"])
    proto = program.model_proto
    assert {n.domain for n in proto.graph.node} == {""}
    fp8 = onnx.TensorProto.FLOAT8E4M3FN
    assert not [n for n in proto.graph.node if any(a.name == "to" and a.i == fp8 for a in n.attribute)]
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    got_pool, got_scales = sess.run(None, {"pool": pools[0].numpy(), "scale_pool": pools[1].numpy(),
                                           "slots": slots.numpy(), "x": x.numpy()})
    want_pool, want_scales = _CodeWrite()(*pools, slots, x)
    assert (got_pool == want_pool.numpy()).all() and (got_scales == want_scales.numpy()).all()
    assert int((want_pool != 0).sum()) > 60  # the rows really landed (not a pool of zeros on both sides)


def test_fp8_artifact_declares_code_and_scale_pools(fp8_artifact):
    """Manifest: kv_cache_dtype float8_e4m3fn; every graph's pools are uint8, each with a float32 scale pool
    (the pool's shape without its last dim) bound in place like the pool; the cache readers take the scales and
    their bodies are the FP8 forms; nothing in a graph is float8."""
    art = load_artifact(fp8_artifact, verify_checksums=False)
    assert art.manifest.cache_dtype == KV_FP8
    cfg = art.config
    for name in ("model", "mtp0"):
        g = art.graphs[name]
        sigs = {t.name: t for t in g.inputs}
        pools = [t for t in g.inputs if "cache" in t.name]
        assert pools and all(t.dtype == "uint8" for t in pools)
        for t in pools:
            scale = sigs[t.name.replace("_cache", "_scale")]
            assert scale.dtype == "float32" and scale.shape == t.shape[:-1]
            assert g.aliases[scale.name.replace("_scale", "_scale_out")] == scale.name
        model = onnx.load(str(art.path(name)), load_external_data=False)
        readers = [n for n in model.graph.node if n.op_type in CACHE_READERS]
        inputs = {"LightningIndexer": 7, "PagedAttention": 9, "SparsePagedAttention": 10}  # 6 / 7 / 8 + scales
        assert readers and all(len(n.input) == inputs[n.op_type] for n in readers)
        bodies = {f.name: list(f.input) for f in model.functions}
        assert bodies["SparsePagedAttention"][-2:] == ["k_scale", "v_scale"]
        assert bodies["LightningIndexer"][-1] == "index_k_scale"
        fp8 = onnx.TensorProto.FLOAT8E4M3FN
        nodes = [*model.graph.node, *(n for f in model.functions for n in f.node)]
        assert not [n for n in nodes if any(a.name == "to" and a.i == fp8 for a in n.attribute)]
    assert sum(1 for t in art.graphs["model"].inputs if "scale" in t.name) == \
        2 * cfg.num_hidden_layers + sum(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))


def _assert_same_cache(ort_engine: Engine, torch_engine: Engine) -> None:
    """The two engines' pools, pool by pool (the graphs' alias order is the model's cache-tuple order): scales within
    fp32 rounding of each other (the rows come out of up to four layers of fp32 matmuls summed in different orders
    by the two runtimes: ~1e-6 relative measured, 1e-5 allowed, ten times below verify's fp32 tolerance of 1e-4),
    E4M3 codes equal except near-ties one code step apart, which need a row value within that rounding of an E4M3
    midpoint (``Agreement.update_codes``), at most one code in a thousand."""
    be_ort, be_torch = ort_engine.backend, torch_engine.backend
    ort_pools = [(s, n) for s in (be_ort._main, *be_ort._mtp) for n in s.pool_inputs]
    torch_pools = [p for layer in be_torch._caches for p in layer] + \
        [p for layer in be_torch._mtp_caches for p in layer]
    assert len(ort_pools) == len(torch_pools)
    codes, written = Agreement(), 0
    for (session, name), ref in zip(ort_pools, torch_pools):
        got = session.pool_tensors[name].cpu()
        if ref.dtype == kv_fp8.FP8:
            assert got.dtype == torch.uint8
            codes.update_codes(got, ref.view(torch.uint8))
            written += int((ref.view(torch.uint8) != 0).sum())
        else:
            assert got.dtype == ref.dtype == torch.float32, name
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=0, msg=name)
    assert written > 10_000 and codes.acceptable, codes
    assert codes.total - codes.same <= codes.total // 1000, codes


def test_onnxruntime_fp8_artifact_generates_the_torch_fp8_tokens_and_cache(fp8_artifact):
    """Chunked prefill (5 tokens a step) and MTP drafts (2 per step): the onnxruntime backend on the artifact's
    graphs and the torch backend with its FP8 cache (``auto`` on an FP8 artifact) give the same greedy tokens,
    and afterwards hold the same cache (``_assert_same_cache``)."""
    prompts = [[5, 17, 99, 3, 44, 8, 123, 7, 61, 2, 90, 33, 12], [250, 6, 71], [14, 15, 16, 200, 31, 9, 48, 120]]
    kw = dict(page_size=16, num_pages=16, max_num_batched_tokens=5, num_speculative_tokens=2)
    ort_engine = Engine.from_artifact(fp8_artifact, backend="onnxruntime", **kw)
    torch_engine = Engine.from_artifact(fp8_artifact, backend="torch", **kw)
    assert torch_engine.backend.dtype == kv_fp8.FP8
    # the pool budget counts the same bytes on both: uint8 codes and fp32 scales (the MTP module's included)
    assert ort_engine.backend.page_bytes(16) == torch_engine.backend.page_bytes(16)
    outs = [e.generate(prompts, GREEDY) for e in (ort_engine, torch_engine)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert all(e.stats.draft_tokens > 0 and e.stats.prefill_tokens > 0 for e in (ort_engine, torch_engine))
    assert ort_engine.stats.accepted_tokens == torch_engine.stats.accepted_tokens  # the drafts agree too
    _assert_same_cache(ort_engine, torch_engine)


@pytest.mark.gpu
def test_cuda_provider_runs_the_fp8_artifact_as_the_torch_fp8_cache_does(fp8_artifact):
    """On ONNX Runtime's CUDA EP (code and scale pools in device memory, bound in place; fp32 GEMMs without TF32,
    ``providers.EXACT_FP32``) the fp8 artifact gives the torch backend's greedy tokens on the CPU with its FP8
    cache, MTP drafts and chunked prefill included, and the same cache (``_assert_same_cache``)."""
    if "CUDAExecutionProvider" not in ort.get_available_providers() or not torch.cuda.is_available():
        pytest.skip("needs onnxruntime-gpu and a CUDA device")
    prompts = [[5, 17, 99, 3, 44, 8, 123, 7, 61, 2, 90, 33, 12], [250, 6, 71], [14, 15, 16, 200, 31, 9, 48, 120]]
    kw = dict(page_size=16, num_pages=16, max_num_batched_tokens=5, num_speculative_tokens=2)
    cuda = Engine.from_artifact(fp8_artifact, backend="onnxruntime", provider="cuda", **kw)
    assert {(t.device.type, t.dtype) for t in cuda.backend._main.pool_tensors.values()} == \
        {("cuda", torch.uint8), ("cuda", torch.float32)}
    cpu = Engine.from_artifact(fp8_artifact, backend="torch", **kw)
    assert [o.token_ids for o in cuda.generate(prompts, GREEDY)] == [o.token_ids for o in cpu.generate(prompts, GREEDY)]
    _assert_same_cache(cuda, cpu)


def test_verify_passes_on_an_fp8_artifact(fp8_artifact):
    """``m3export verify``: the reference runs its own FP8 cache; logits within the fp32 tolerance, selections
    exact, codes compared as such, scale pools as float32 outputs, every pool (scales too) bound in place."""
    report = verify_artifact(fp8_artifact, decode_steps=2, progress=False, hash_files=False)
    assert report.passed, "\n".join(report.lines())
    assert report.tolerance == 1e-4 and report.outputs["model:logits"].max_rel <= report.tolerance
    assert "model:k_cache.0" in report.cache_codes and "model:k_scale.0" in report.outputs
    assert report.pools_in_place == sum(len(load_artifact(fp8_artifact).graphs[g].aliases) for g in ("model", "mtp0"))


def test_cache_dtype_mismatches_are_one_line_each(fp8_artifact, tmp_path):
    check_exported_cache_dtype("onnxruntime", fp8_artifact, "fp8")
    check_exported_cache_dtype("onnxruntime", fp8_artifact, "auto")
    with pytest.raises(BackendUnavailable, match=rf"bf16: {fp8_artifact} was exported with fp8 caches, not "
                                                 r"bfloat16") as e:
        check_exported_cache_dtype("onnxruntime", fp8_artifact, "bf16")
    assert "\n" not in str(e.value)
    with pytest.raises(BackendUnavailable, match="exported with fp8 caches"):
        Engine.from_artifact(fp8_artifact, backend="onnxruntime", kv_cache_dtype="bf16")

    from m3export.export.tensorrt_flavour import write_flavour

    with pytest.raises(ArtifactError, match="FP8 cache .*TensorRT plugins do not read"):
        write_flavour(load_artifact(fp8_artifact, verify_checksums=False), 64)
    with pytest.raises(ArtifactError, match="--flavour tensorrt: the TensorRT plugins read no FP8 cache"):
        export_artifact("tiny", tmp_path / "trt", kv_cache_dtype="fp8", flavour="tensorrt", progress=False)
    with pytest.raises(ArtifactError, match="--lower PagedAttention"):
        export_artifact("tiny", tmp_path / "ort", kv_cache_dtype="fp8", flavour="ort-contrib",
                        lower=("PagedAttention",), progress=False)
    with pytest.raises(ArtifactError, match=r"bf16: exported pools have the model dtype \(--dtype float32\)"):
        export_artifact("tiny", tmp_path / "bf16", kv_cache_dtype="bf16", dtype="float32", progress=False)
    assert not any(tmp_path.iterdir())  # refused before any work

    from m3export.serve.repo import write_repository

    with pytest.raises(BackendUnavailable, match="exported with fp8 caches, not bfloat16"):
        write_repository(str(fp8_artifact), tmp_path / "repo", backend="onnxruntime",
                         engine_args={"kv_cache_dtype": "bf16"})
    assert write_repository(str(fp8_artifact), tmp_path / "repo", backend="onnxruntime",
                            engine_args={"kv_cache_dtype": "fp8"}).is_dir()


def test_export_command_takes_the_option(capsys):
    from m3export.cli import build_parser, main

    args = build_parser().parse_args(["export", "--preset", "tiny", "--out", "x", "--kv-cache-dtype", "fp8"])
    assert args.kv_cache_dtype == "fp8"
    assert build_parser().parse_args(["export", "--preset", "tiny", "--out", "x"]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        main(["export", "--kv-cache-dtype", "fp8", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--kv-cache-dtype {auto,bf16,fp8}" in text
    assert "pools are uint8 E4M3 codes with fp32 scale pools" in text and "--kv-cache-dtype fp8 # E4M3 cache" in text
    assert main(["export", "--preset", "tiny", "--out", "x", "-tp", "2", "--kv-cache-dtype", "fp8"]) == 2
    assert "not with --kv-cache-dtype fp8" in capsys.readouterr().err


# ONNX Runtime's CUDA EP registrations of the ops only the FP8 cache's encoder adds to a step graph (same source
# as tests/test_ort_cuda_kernel_types.py: ORT's docs/OperatorKernels.md, CUDAExecutionProvider; the encoder feeds
# them fp32 only).
_ENCODER_OPS = {"Log": ((0,), {"DOUBLE", "FLOAT", "FLOAT16"}),  # 13+
                "Floor": ((0,), {"DOUBLE", "FLOAT", "FLOAT16"}),  # 13+
                "Round": ((0,), {"DOUBLE", "FLOAT", "FLOAT16"})}  # 11+


@pytest.mark.parametrize("graph", ["model", "mtp0"])
def test_every_fp8_cache_node_has_a_cuda_kernel_for_its_types(fp8_artifact, graph):
    """The code pools' Gather / ScatterND (uint8), the decode table lookup and the encoder's arithmetic all have
    kernels in ORT's CUDA EP for the types they are fed, so an FP8 step stays on the GPU (function bodies
    inlined as ORT does; the bf16 graphs' other nodes: tests/test_ort_cuda_kernel_types.py)."""
    from tests.test_ort_cuda_kernel_types import CUDA_EP, typed_nodes

    table = {**CUDA_EP, **_ENCODER_OPS}
    model = onnx.load(str(load_artifact(fp8_artifact, verify_checksums=False).path(graph)), load_external_data=False)
    missing, unknown, uint8_moves = set(), set(), 0
    for where, node, types in typed_nodes(model):
        if node.op_type not in table:
            unknown.add(node.op_type)
            continue
        positions, allowed = table[node.op_type]
        for i in range(len(types)) if positions is None else positions:
            if i < len(types) and node.input[i] and types[i] not in allowed:
                missing.add(f"{where or '/'} {node.op_type} input {i}: {types[i]}")
        uint8_moves += node.op_type in ("Gather", "ScatterND") and types[0] == "UINT8"
    assert not unknown, f"ops without a CUDA EP registration in the table: {sorted(unknown)}"
    assert not missing, f"nodes ORT's CUDA EP has no kernel for: {sorted(missing)}"
    assert uint8_moves >= 3  # the pools' writes and the readers' gathers really are on codes
