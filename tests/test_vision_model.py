"""The VL model (vision tower + projector + text backbone) against ``transformers``' own, from the same checkpoint.

``transformers`` saves its VL model in the release's (original) layout; we load that, re-write it in the
``transformers`` layout, check that ``transformers`` reads our layout back to the same logits, and compare logits
on text only, one image, two images of different sizes, a video in several chunks, and a mixed batch.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import m3export
from m3export.checkpoint.writer import write_checkpoint
from m3export.config import preset
from m3export.errors import MediaError
from m3export.ops import mxfp8 as mx

from .hf_vl_oracle import MiniMaxM3SparseForConditionalGeneration, hf_vl_model
from .vl_config import IMAGE, VIDEO, VISION



def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers reference, ours loaded from its save, ours loaded from our hf-layout rewrite, tmp dir)."""
    tmp = tmp_path_factory.mktemp("vl")
    cfg = preset("tiny").replace(num_mtp_modules=0, vision=VISION)
    ref = hf_vl_model(cfg, seed=3)
    ref.save_pretrained(tmp / "saved")
    ours = m3export.load_model(tmp / "saved", progress=False)
    write_checkpoint(tmp / "hf", ours.config, "hf", "fp32", model=ours, progress=False, with_tokenizer=False)
    ours_hf = m3export.load_model(tmp / "hf", progress=False)
    return ref, ours, ours_hf, tmp


def _ids(g, *parts):
    """Concatenate random text runs (ints: lengths) and placeholder runs ((token, count) tuples) into [1, T]."""
    out = []
    for p in parts:
        out.append(torch.full((p[1],), p[0]) if isinstance(p, tuple) else torch.randint(0, 256, (p,), generator=g))
    return torch.cat(out)[None]


def _pixels(g, grid):
    return torch.randn(int(torch.tensor(grid).prod(-1).sum()), VISION.patch_dim, generator=g)


def _cases():
    g = torch.Generator().manual_seed(11)
    one = [[1, 6, 8]]  # 48 patches -> 12 tokens
    two = [[1, 8, 12], [1, 4, 2]]  # 96 + 8 patches -> 24 + 2 tokens
    video = [[4, 4, 6], [1, 4, 6]]  # a 5-temporal-patch video cut into chunks of 4 and 1: 96 + 24 -> 24 + 6 tokens
    cases = {
        "text-only": (_ids(g, 30), {}),
        "one-image": (_ids(g, 7, (IMAGE, 12), 9), dict(pixel_values=_pixels(g, one), image_grid_thw=one)),
        "two-images": (_ids(g, 3, (IMAGE, 24), 5, (IMAGE, 2), 4),
                       dict(pixel_values=_pixels(g, two), image_grid_thw=two)),
        "video": (_ids(g, 4, (VIDEO, 30), 6), dict(pixel_values_videos=_pixels(g, video), video_grid_thw=video)),
    }
    # Mixed batch: row 0 holds an image then a video, row 1 the other image; equal lengths, no padding.
    row0 = _ids(g, 2, (IMAGE, 12), 3, (VIDEO, 30), 3)
    row1 = _ids(g, 20, (IMAGE, 24), 6)
    grid_i = one + [[1, 8, 12]]
    cases["mixed-batch"] = (torch.cat([row0, row1]), dict(pixel_values=_pixels(g, grid_i), image_grid_thw=grid_i,
                                                          pixel_values_videos=_pixels(g, video),
                                                          video_grid_thw=video))
    return {k: (ids, {n: torch.tensor(v) if "grid" in n else v for n, v in kw.items()})
            for k, (ids, kw) in cases.items()}


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(models, name):
    ref, ours, ours_hf, _ = models
    ids, media = CASES[name]
    with torch.no_grad():
        want = ref(input_ids=ids, **media).logits
        got = ours(ids, **media)
        got_hf = ours_hf(ids, **media)
    # fp32 on both sides; the differences are summation order (SDPA vs eager softmax, matmul vs Conv3d patch
    # embedding): ~1e-6 relative measured, so 1e-5 leaves margin without hiding a wrong op (those give >1e-2).
    assert _rel(got, want) <= 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.equal(got, got_hf)  # the two layouts load the very same weights


def test_media_changes_logits(models):
    """The image must matter: the same prompt with other pixels gives other logits (guards a no-op scatter)."""
    _, ours, _, _ = models
    ids, media = CASES["one-image"]
    with torch.no_grad():
        a = ours(ids, **media)
        b = ours(ids, pixel_values=media["pixel_values"] + 1.0, image_grid_thw=media["image_grid_thw"])
    placeholder = (ids[0] == IMAGE).nonzero()[0, 0]
    # Causal: text before the image is untouched (up to kernel summation order over the longer rows, ~1e-7).
    assert _rel(a[:, :placeholder], b[:, :placeholder]) < 1e-6
    assert _rel(a[:, placeholder:], b[:, placeholder:]) > 1e-2


def test_original_and_hf_layouts_load_the_same_parameters(models):
    _, ours, ours_hf, _ = models
    assert ours.checkpoint_info["layout"] == "original" and ours_hf.checkpoint_info["layout"] == "hf"
    names = [n for n, _ in ours.named_parameters()]
    assert any(n.startswith("vision_tower.layers.1.") for n in names)
    assert any(n.startswith("multi_modal_projector.merge_linear_2") for n in names)
    for (n1, p1), (n2, p2) in zip(ours.named_parameters(), ours_hf.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_transformers_reads_our_hf_layout(models):
    """Our ``hf`` names are the ones ``transformers`` expects: its model loads our checkpoint to the same logits."""
    ref, _, _, tmp = models
    again = MiniMaxM3SparseForConditionalGeneration.from_pretrained(tmp / "hf", attn_implementation="eager").eval()
    ids, media = CASES["two-images"]
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids, **media).logits, ref(input_ids=ids, **media).logits)


def test_mxfp8_checkpoint_with_quantised_projector(models, tmp_path):
    """An MXFP8 release quantises the text linears and may also store projector linears as E4M3 + UE8M0: the
    tower and projector load dequantised (floating point), the text model keeps its E4M3 weights."""
    _, ours, _, _ = models
    write_checkpoint(tmp_path / "q", ours.config, "original", "mxfp8", model=ours, progress=False,
                     with_tokenizer=False)
    path = tmp_path / "q" / "model.safetensors"
    tensors = load_file(path)
    assert tensors["vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    quantized = ("multi_modal_projector.linear_1.weight", "patch_merge_mlp.linear_1.weight")
    for name in quantized:
        tensors[name], tensors[name + "_scale_inv"] = mx.quantize(tensors[name].float())
    save_file(tensors, path, metadata={"format": "pt"})
    model = m3export.load_model(tmp_path / "q", progress=False)
    params = dict(model.named_parameters())
    assert params["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    for ours_name, name in zip(("multi_modal_projector.linear_1.weight", "multi_modal_projector.merge_linear_1.weight"),
                               quantized):
        want = mx.dequantize(tensors[name], tensors[name + "_scale_inv"], torch.float32)
        assert params[ours_name].dtype == torch.float32 and torch.equal(params[ours_name], want)
    assert torch.equal(params["vision_tower.layers.0.self_attn.q_proj.weight"],
                       tensors["vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight"].float())
    ids, media = CASES["one-image"]
    with torch.no_grad():
        assert model(ids, **media).isfinite().all()


def test_bad_media_is_one_clear_error(models):
    _, ours, _, _ = models
    ids, media = CASES["one-image"]
    first = int((ids[0] == IMAGE).nonzero()[0, 0])
    short = torch.cat([ids[:, :first], ids[:, first + 1:]], dim=1)  # one placeholder fewer than the 12 tokens
    with pytest.raises(MediaError, match="prompt has 11 placeholder token.*encode to 12"):
        ours(short, **media)
    with pytest.raises(MediaError, match="grid_thw describes 48 patches but pixel values hold 47"):
        ours(ids, pixel_values=media["pixel_values"][:-1], image_grid_thw=media["image_grid_thw"])
    with pytest.raises(MediaError, match=r"pixel values must be \[patches, 96\]"):
        ours(ids, pixel_values=media["pixel_values"][:, :-1], image_grid_thw=media["image_grid_thw"])
    with pytest.raises(MediaError, match="multiples of the spatial merge size 2"):
        ours(ids, pixel_values=media["pixel_values"], image_grid_thw=torch.tensor([[1, 3, 16]]))
    text_only = m3export.load_model("tiny")
    with pytest.raises(MediaError, match="no vision tower"):
        text_only(ids, **media)


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 33}, r"vision_config.hidden_size \(33\) must be a multiple of num_attention_heads"),
    ({"hidden_act": "relu"}, "vision_config.hidden_act 'relu' is not supported"),
    ({"rope_parameters": {"rope_type": "mrope"}}, "rope_type 'mrope' is not supported"),
    ({"head_dim": 8}, r"vision_config.head_dim \(8\) must equal hidden_size / num_attention_heads \(16\)"),
    ({"patch_size": 0}, "vision_config.patch_size must be a positive integer"),
])
def test_vision_config_errors_name_the_field(change, message):
    from m3export.config import ConfigError, M3Config

    raw = preset("tiny").replace(vision=VISION).to_original_dict()
    raw["vision_config"].update(change)
    with pytest.raises(ConfigError, match=message):
        M3Config.from_dict(raw)


def test_placeholder_ids_must_be_tokens():
    from m3export.config import ConfigError, M3Config

    raw = preset("tiny").replace(vision=VISION).to_original_dict()
    assert M3Config.from_dict(raw).vision == VISION
    raw["image_token_index"] = 320
    with pytest.raises(ConfigError, match=r"image_token_index \(320\) must be a token id below vocab_size \(320\)"):
        M3Config.from_dict(raw)


def test_every_config_spelling_keeps_the_vision_tower():
    """Original (release), transformers (VL wrapper) and the artifact manifest's flat spelling all round-trip."""
    from m3export.config import M3Config

    cfg = preset("tiny").replace(num_mtp_modules=0, vision=VISION)
    for spelling in (cfg.to_original_dict(), cfg.to_hf_dict(), cfg.to_text_dict()):
        assert M3Config.from_dict(spelling) == cfg
    assert "vision_config" not in cfg.to_original_dict()["text_config"]
