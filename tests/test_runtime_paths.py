"""Engine paths no other test runs: MXFP8 checkpoints and artifacts (torch and onnxruntime), 16-bit engines (bf16
torch, fp16 ONNX), onnxruntime's accept path with a drafter that gets accepted (multi-accept and rollback of the
in-place pools), and the zero-copy in-place artifact through ``verify`` and ``generate``.

Every engine's greedy output is compared with a cache-free recompute (``model(ids)`` for each token) through
``agreeing_prefix``: equal tokens, or a near-tie after which the comparison stops. Bounds are in units of the
dtype's resolution relative to the largest logit.
"""

from __future__ import annotations

import functools

import pytest
import torch

import m3export
from m3export.export.artifact import load_torch_model
from m3export.export.exporter import export_artifact
from m3export.model import Batch
from m3export.runtime import Engine, SamplingParams
from m3export.runtime.backends.torch_backend import TorchBackend

from .greedy_agreement import agreeing_prefix
from .runtime_fixtures import prompts
from .test_runtime_speculative import OracleDrafter

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
FP32_MARGIN = 1e-4  # fp32 paths differ by ~1e-6 of the logit scale (verify measures <= 1e-6); 100x that
# 16 bit: two roundings of the largest logit (2 ulp): 2^-7 relative in bf16, 2^-10 in fp16
BF16_MARGIN, FP16_MARGIN = 2.0**-7, 2.0**-10


def _check(reference, ps, outs, margin, min_agree):
    agreed = [agreeing_prefix(reference, p, o.token_ids, margin) for p, o in zip(ps, outs, strict=True)]
    # near-ties are rare: most continuations must be compared in full, or the test would check nothing
    assert sum(agreed) >= min_agree * sum(len(o.token_ids) for o in outs), agreed
    return agreed


def test_mxfp8_checkpoint_through_the_torch_engine(mxfp8_checkpoint):  # noqa: F811
    """E4M3 + UE8M0 weights (m3::mxfp8_linear, m3::moe_mxfp8) in the paged engine, chunked and batched, against
    the same checkpoint dequantised (plain fp32 linears and m3::moe) in float64."""
    ps = prompts(4, seed=3, hi=30)
    eng = Engine.from_checkpoint(str(mxfp8_checkpoint), page_size=4, num_pages=128, max_num_batched_tokens=16)
    assert eng.backend.model.mxfp8
    outs = eng.generate(ps, GREEDY)
    reference = m3export.load_model(str(mxfp8_checkpoint), dequantize=True).double()
    _check(reference, ps, outs, FP32_MARGIN, 0.9)


def test_mxfp8_artifact_through_onnxruntime(mxfp8_artifact, mxfp8_checkpoint):  # noqa: F811
    ps = prompts(4, seed=4, hi=30)
    eng = Engine.from_artifact(mxfp8_artifact, backend="onnxruntime", num_pages=64)
    outs = eng.generate(ps, GREEDY)
    reference = m3export.load_model(str(mxfp8_checkpoint), dequantize=True).double()
    _check(reference, ps, outs, FP32_MARGIN, 0.9)


def test_bf16_torch_engine():
    """bf16 weights and activations: paging, chunked prefill and batching against the bf16 model's own
    cache-free recompute (the bf16 semantics of each op are the conformance suite's business)."""
    model = m3export.load_model("tiny", dtype=torch.bfloat16)
    ps = prompts(4, seed=6, lo=5, hi=36)
    eng = Engine(TorchBackend(model), page_size=4, num_pages=128, max_num_batched_tokens=16)
    outs = eng.generate(ps, GREEDY)
    _check(model, ps, outs, BF16_MARGIN, 0.9)
    assert eng.blocks.num_free == eng.blocks.num_pages


@pytest.mark.slow  # the session's float16 export (~15-30 s), shared with test_tensorrt_build
def test_fp16_onnx_engine(fp16_trt_artifact):
    """ONNX Runtime's fp16 graph against the float64 recompute with the same (fp16) weights. As ``m3export
    verify`` judges greedy flips, a flip is a near-tie when the reference's margin is within twice the largest
    logit difference of the two on a whole sequence (measured here: ~1.5e-3 of the logit scale; bounded, as a
    broken graph differs by O(1)). PyTorch's own fp16 recompute is no reference here: on the CPU it departs from
    float64 by up to 0.7 of the logit scale on some of these prompts, where ONNX Runtime's fp16 stays at 1.5e-3."""
    art = fp16_trt_artifact  # the tiny preset in float16, pages of 8 tokens (its TensorRT flavour unused here)
    ps = prompts(4, seed=7, lo=5, hi=36)
    eng = Engine.from_artifact(art, backend="onnxruntime", num_pages=64)
    outs = eng.generate(ps, GREEDY)
    reference = load_torch_model(art)
    assert reference.lm_head.weight.dtype == torch.float16
    reference = reference.double()
    err = 0.0
    for p, o in zip(ps, outs, strict=True):
        ids = torch.tensor(p + o.token_ids)
        got, _ = eng.backend.forward(ids, Batch.contiguous(1, len(ids), eng.page_size), torch.arange(len(ids)))
        with torch.no_grad():
            want = reference(ids[None])[0]
        err = max(err, float((got.double() - want).abs().max() / want.abs().max()))
    assert err < 1e-2, f"fp16 ONNX logits differ from the float64 recompute by {err:.2e} of the logit scale"
    _check(reference, ps, outs, max(FP16_MARGIN, 2 * err), 0.75)


@pytest.mark.parametrize("corrupt_every", [0, 2])
def test_onnxruntime_multi_accept_and_rollback(tiny_artifact, corrupt_every):  # noqa: F811
    """A drafter that proposes the target's own greedy tokens (every second proposal corrupted in the middle):
    ONNX Runtime's in-place pools keep accepted drafts' rows and forget rejected ones."""
    reference = load_torch_model(tiny_artifact).double()

    @functools.cache
    def greedy(prompt: tuple, n: int) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(reference(torch.tensor([ids]))[0, -1].argmax()))
        return ids[len(prompt):]

    ps = prompts(3, seed=8 + corrupt_every, lo=5, hi=30)
    eng = Engine.from_artifact(tiny_artifact, backend="onnxruntime", num_pages=64, num_speculative_tokens=3,
                               drafter=OracleDrafter(greedy, corrupt_every))
    outs = eng.generate(ps, GREEDY)
    _check(reference, ps, outs, FP32_MARGIN, 0.9)
    st = eng.stats
    if corrupt_every:
        assert 0 < st.accepted_tokens < st.draft_tokens  # accepted and rejected drafts both happened
    else:
        assert st.accepted_tokens == st.draft_tokens > 0 and st.mean_acceptance_length > 3
    assert eng.blocks.num_free == eng.blocks.num_pages


@pytest.mark.slow  # writes, exports in place and verifies a tiny MXFP8 checkpoint (~30-60 s)
def test_zero_copy_in_place_artifact_through_verify_and_generate(tmp_path, capsys):
    """``--in-place``: graphs and manifest inside the checkpoint directory, initializers pointing at the shard's own
    bytes. ``verify`` and ``generate`` (both backends) run from there."""
    from m3export.checkpoint.writer import write_checkpoint
    from m3export.cli import main as cli
    from m3export.config import preset
    from m3export.export.artifact import load_artifact
    from m3export.export.verify import verify_artifact

    # without the MTP module (nothing here drafts): its weights would take the trunk's zero-copy path, and its
    # graph a third of the export's time
    root = write_checkpoint(tmp_path / "ckpt", preset("tiny"), "original", "mxfp8", with_mtp=False, progress=False)
    shards = {p.name for p in root.glob("*.safetensors")}
    export_artifact(str(root), None, dtype="float32", in_place=True, progress=False)  # ORT's CPU EP: no bf16
    art = load_artifact(root)
    fp8 = [e for e in art.manifest.tensors.values() if e.dtype == "float8_e4m3fn"]
    # zero copy: every E4M3 weight (the bulk of the bytes) is read straight from the checkpoint's own shard
    assert fp8 and all(pc.entry.file in shards for e in fp8 for pc in e.pieces)
    report = verify_artifact(root, decode_steps=2, progress=False)
    assert report.passed and all(s.max_rel <= 1e-5 for s in report.outputs.values()), "\n".join(report.lines())
    reference = m3export.load_model(str(root), dequantize=True, progress=False).double()
    ps = prompts(3, seed=9, lo=5, hi=30)
    checked = set()
    for backend in ("torch", "onnxruntime"):
        eng = Engine.from_artifact(root, backend=backend, num_pages=64)
        outs = eng.generate(ps, GREEDY)
        tokens = tuple(tuple(o.token_ids) for o in outs)
        if tokens not in checked:  # the same tokens would pass the same check again
            _check(reference, ps, outs, FP32_MARGIN, 0.9)
            checked.add(tokens)
    assert cli(["generate", str(root), "--prompt", "Hi", "--max-tokens", "4", "--backend", "onnxruntime"]) == 0
    assert capsys.readouterr().out.strip()
