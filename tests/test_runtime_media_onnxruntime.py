"""Images and video on the onnxruntime backend: ``vision.onnx`` encodes each item, the step graph takes the media
rows (``media_rows`` / ``media_embeds``), and a multimodal request equals the torch backend on the same artifact
and the cache-free model recomputed at every token."""

from __future__ import annotations

import pytest
import torch

from m3export.errors import MediaError
from m3export.export.artifact import load_torch_model
from m3export.model.batch import Segment, build_batch
from m3export.preprocess.settings import MediaSettings
from m3export.runtime import Engine, SamplingParams
from m3export.runtime.backends.onnxruntime_backend import OnnxRuntimeBackend
from m3export.runtime.backends.torch_backend import TorchBackend

from .test_runtime_media import IMG, IMG2, VID, _prompt, _reference
from .vl_config import IMAGE, VIDEO, VISION

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(vl_artifact):
    return load_torch_model(vl_artifact)


@pytest.mark.slow  # the VL export (~20 s alone on the 2-core CI machine; the session's vl_artifact) is its cost
def test_a_media_step_equals_the_torch_backend_and_the_cache_free_model(vl_artifact, reference):
    """One prefill step holding an image and a video: the vision graph's tokens, placed by the step graph, give the
    torch backend's logits and the cache-free model's."""
    ort, torch_be = OnnxRuntimeBackend(vl_artifact), TorchBackend(reference)
    assert ort.supports_media
    for be in (ort, torch_be):
        be.allocate(16, 4)
    ids = _prompt(5, (IMAGE, 6), 3, (VIDEO, 6), 4)
    ids_t, batch = build_batch([Segment(list(range(7)), 0, ids)], 4)
    every = torch.arange(len(ids))
    rows = torch.tensor([i for i, t in enumerate(ids) if t in (IMAGE, VIDEO)])
    got_blocks = ort.encode_media(IMG.pixel_values, IMG.grid_thw) + ort.encode_media(VID.pixel_values, VID.grid_thw)
    want_blocks = torch_be.encode_media(IMG.pixel_values, IMG.grid_thw) + \
        torch_be.encode_media(VID.pixel_values, VID.grid_thw)
    for g, w in zip(got_blocks, want_blocks, strict=True):
        # fp32 both sides; ONNX Runtime sums attention / LayerNorm in another order (~7e-7 measured).
        assert float((g - w).abs().max() / w.abs().max()) <= 1e-5
    lo, _ = ort.forward(ids_t, batch, every, media=(rows, torch.cat(got_blocks)))
    lt, _ = torch_be.forward(ids_t, batch, every, media=(rows, torch.cat(want_blocks)))
    with torch.no_grad():
        lm = reference(torch.tensor([ids]), pixel_values=IMG.pixel_values, image_grid_thw=IMG.grid_thw,
                       pixel_values_videos=VID.pixel_values, video_grid_thw=VID.grid_thw)[0]
    # The fp32 bound of the other onnxruntime-vs-torch tests (test_runtime_onnxruntime): summation order only.
    assert torch.allclose(lo, lt, atol=1e-4) and torch.allclose(lo, lm, atol=1e-4)
    plain, _ = ort.forward(ids_t, batch, every)  # the same step without media: the placeholders' own embeddings
    assert not torch.allclose(plain, lo, atol=1e-2)


@pytest.mark.slow  # shares the VL export above
def test_multimodal_generation_equals_torch_and_the_model(vl_artifact, reference):
    """Chunked prefill across an image and a video (7 tokens per step), MTP drafts on, two requests batched."""
    ids = _prompt(5, (IMAGE, 6), 3, (VIDEO, 6), 4)
    short = _prompt(2, (IMAGE, 6), 1)
    outs = {}
    for name in ("onnxruntime", "torch"):
        eng = Engine.from_artifact(vl_artifact.root, backend=name, num_pages=64, max_num_batched_tokens=7,
                                   num_speculative_tokens=1)
        outs[name] = [o.token_ids for o in eng.generate([ids, short], GREEDY, media=[[IMG, VID], [IMG2]])]
        assert eng.blocks.num_free == eng.blocks.num_pages
    want = [_reference(reference, ids, [IMG, VID], GREEDY.max_tokens),
            _reference(reference, short, [IMG2], GREEDY.max_tokens)]
    assert outs["onnxruntime"] == outs["torch"] == want
    assert _reference(reference, short, [IMG], GREEDY.max_tokens) != want[1]  # the pixels decide the tokens


@pytest.mark.slow  # shares the VL export above
def test_the_artifact_keeps_the_checkpoints_preprocessing(vl_artifact):
    s = MediaSettings.from_directory(vl_artifact.root, VISION)
    assert (s.image.max_pixels, s.image.image_mean) == (32 * 32, (0.5, 0.5, 0.5))
    for backend in ("torch", "onnxruntime"):  # Engine.from_artifact reads them (generate, LLM, the servers)
        assert Engine.from_artifact(vl_artifact.root, backend=backend, num_pages=16).media_settings == s


@pytest.mark.slow  # shares the VL export above
def test_tensorrt_profiles_of_the_vl_graphs_hold_text_and_media_steps(vl_artifact):
    """``m3export build`` of a VL artifact: every dynamic dimension of the graphs it builds has a range, media rows
    (``M``) from 0, tuned at 0; a text step with the zero media rows the tensorrt backend feeds fits the decode
    profile, and a prefill chunk holding media rows the full one."""
    from m3export.build.profiles import Limits, profiles_for
    from m3export.runtime.backends import tensorrt_bindings as tb

    limits = Limits.for_config(vl_artifact.config, vl_artifact.page_size, 32, 4, 64)
    hidden = vl_artifact.config.hidden_size
    profiles = {name: profiles_for(vl_artifact.graphs[name], limits) for name in ("model", "mtp0")}
    assert [p["media_rows"] for p in profiles["model"]] == [((0,), (0,), (4,)), ((0,), (0,), (32,))]
    assert [p["media_embeds"] for p in profiles["model"]] == [((0, hidden), (0, hidden), (4, hidden)),
                                                             ((0, hidden), (0, hidden), (32, hidden))]
    assert not any(n.startswith("media") for n in profiles["mtp0"][0])
    graph = vl_artifact.graphs["model"]
    assert tb.empty_media(graph) == {"media_rows": ((0,), "int64"), "media_embeds": ((0, hidden), "float32")}
    dims = {"B": 2, "max_pages": limits.pages_per_sequence, "pages": limits.pool_pages}
    for step, profile in [({"T": 4, "N": 2, "M": 0}, 0), ({"T": 20, "N": 1, "M": 12}, 1)]:
        shapes = {t.name: tb.resolve(t.shape, {**dims, **step}, "step") for t in graph.inputs}
        assert tb.step_dims(graph, shapes, "step") == {**dims, **step}
        assert tb.select_profile(graph, profiles["model"], shapes, "step") == profile


@pytest.fixture
def cuda_provider():
    """Skips before the VL export when there is no CUDA execution provider."""
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers() or not torch.cuda.is_available():
        pytest.skip("needs onnxruntime-gpu and a CUDA device")


@pytest.mark.gpu
def test_cuda_provider_multimodal_generation_equals_torch(cuda_provider, vl_artifact, reference):
    """The same request with vision.onnx and the step graph on the CUDA execution provider."""
    ids = _prompt(5, (IMAGE, 6), 3, (VIDEO, 6), 4)
    eng = Engine.from_artifact(vl_artifact.root, backend="onnxruntime", device="cuda", num_pages=64,
                               max_num_batched_tokens=7)
    got = eng.generate([ids], GREEDY, media=[[IMG, VID]])[0].token_ids
    assert got == _reference(reference, ids, [IMG, VID], GREEDY.max_tokens)


def test_text_only_artifact_on_onnxruntime_refuses_media(tiny_artifact):
    eng = Engine.from_artifact(tiny_artifact, backend="onnxruntime", num_pages=32)
    assert not eng.backend.supports_media
    with pytest.raises(MediaError, match=r"the onnxruntime backend cannot take images or video \(the model has no "
                                         r"vision tower\)"):
        eng.add_request("x", _prompt(3, (IMAGE, 6)), GREEDY, media=[IMG])
