"""Preprocessing against ``transformers``' real M3 image / video processors, and bad media.

The processors import torchvision, which CI's CPU torch cannot load, so their outputs on the inputs of
``tests/media_cases.py`` were produced once by ``tests/data/make_processor_refs.py`` (its docstring has the command)
and are committed; the prompt expansion is compared live against ``MiniMaxM3VLProcessor``'s own methods.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from m3export.errors import MediaError
from m3export.preprocess import (
    ImageSettings, VideoSettings, decode_image, expand_prompt, placeholder_text, preprocess_images, preprocess_video,
)
from m3export.preprocess.prompt import IMAGE_TOKEN, VIDEO_TOKEN

from .media_cases import VIDEO_FPS, images, videos

DATA = Path(__file__).parent / "data"
REFS = load_file(DATA / "processor_refs.safetensors")
META = json.loads((DATA / "processor_refs.json").read_text())

# Bit-for-bit equality (measured): the same uint8 bicubic kernel and the same float32 normalisation order. The
# references came from torch 2.14; should a torch release change the resize kernel's rounding, a pixel would move
# by one level (1/255/std ~ 0.015 after normalisation) and this must fail.
TOL = 0.0


@pytest.mark.parametrize("name", list(images()))
def test_images_match_transformers(name):
    image, kwargs = images()[name]
    pixels, grid = preprocess_images([image], ImageSettings(**kwargs))
    assert grid.tolist() == META["images"][name]["grid_thw"]
    want = REFS[f"image/{name}"]
    assert pixels.shape == want.shape and pixels.dtype == torch.float32
    assert float((pixels - want).abs().max()) <= TOL
    assert placeholder_text("image", grid[0]) == META["images"][name]["prompt"]


def test_several_images_in_one_call_concatenate():
    cases = images()
    names = ["rgb-array", "pil-grey", "pil-rgba"]
    pixels, grid = preprocess_images([cases[n][0] for n in names])
    assert grid.tolist() == [META["images"][n]["grid_thw"][0] for n in names]
    assert float((pixels - torch.cat([REFS[f"image/{n}"] for n in names])).abs().max()) <= TOL


@pytest.mark.parametrize("name", list(videos()))
def test_videos_match_transformers(name):
    frames, kwargs = videos()[name]
    settings = VideoSettings(**{k: v for k, v in kwargs.items() if k in ("max_pixels", "min_pixels")})
    sample = {"sample_fps": 1.0} if kwargs.get("do_sample_frames") else {}  # the processor's default 1 frame/s
    out = preprocess_video(frames, settings, fps=VIDEO_FPS, **sample)
    ref = META["videos"][name]
    assert out.grid_thw.tolist() == ref["grid_thw"]
    assert out.frame_indices == ref["frame_indices"]
    want = REFS[f"video/{name}"]
    assert out.pixel_values.shape == want.shape
    assert float((out.pixel_values - want).abs().max()) <= TOL
    # transformers prints timestamps only when it sampled frames (then it knows the indices and the fps).
    stamps = out.timestamps if sample else None
    assert placeholder_text("video", out.grid_thw, timestamps=stamps) == ref["prompt"]


def test_list_of_pil_frames_equals_the_array():
    frames, _ = videos()["odd-frames"]
    a = preprocess_video(frames)
    b = preprocess_video([Image.fromarray(f) for f in frames])
    assert torch.equal(a.pixel_values, b.pixel_values) and torch.equal(a.grid_thw, b.grid_thw)


def test_grey_array_without_channel_axis():
    image, _ = images()["grey-array-upscaled"]
    assert torch.equal(preprocess_images([image[..., 0]])[0], preprocess_images([image])[0])


def test_expand_prompt_matches_the_processor():
    """Marker by marker, in order, exactly the processor's own replacement strings."""
    from transformers.models.minimax_m3_vl.processing_minimax_m3_vl import MiniMaxM3VLProcessor

    proc = object.__new__(MiniMaxM3VLProcessor)
    proc.__dict__.update(image_processor=type("P", (), {"merge_size": 2})(),
                         video_processor=type("P", (), {"merge_size": 2, "temporal_patch_size": 2})())
    grids = torch.tensor([[1, 4, 6], [1, 2, 2]])
    video = preprocess_video(videos()["sampled-at-1fps"][0], fps=VIDEO_FPS, sample_fps=1.0)
    md = type("M", (), {"fps": VIDEO_FPS, "frames_indices": video.frame_indices})()
    want = ("a" + proc.replace_image_token({"image_grid_thw": grids}, 0) + "b"
            + proc.replace_video_token({"video_grid_thw": video.grid_thw, "num_chunks_per_video": [1],
                                        "video_metadata": [md]}, 0)
            + "c" + proc.replace_image_token({"image_grid_thw": grids}, 1))
    got = expand_prompt(f"a{IMAGE_TOKEN}b{VIDEO_TOKEN}c{IMAGE_TOKEN}", list(grids),
                        [(video.grid_thw, video.timestamps)])
    assert got == want


def _png(array) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def test_encoded_bytes_decode_like_the_image():
    image, _ = images()["rgb-array"]
    assert torch.equal(preprocess_images([_png(image)])[0], preprocess_images([image])[0])
    assert decode_image(_png(image)).size == (61, 45)


@pytest.mark.parametrize("bad, message", [
    (b"\x89PNG\r\n\x1a\nnot really", "image 0: cannot decode the image bytes"),
    (b"", "image 0: no bytes"),
    (np.zeros((0, 5, 3), np.uint8), "image 0: size 5 x 0 is empty"),
    (np.zeros((8, 8, 3), np.float32), "image 0: arrays must be uint8"),
    (np.zeros((8, 8, 4), np.uint8), r"image 0: arrays must be H x W or H x W x C with C in \(1, 3\)"),
    (np.zeros((2, 500, 3), np.uint8), "image 0: aspect ratio 250.0 exceeds 200"),
    ("a string", "image 0: expected a PIL image or a uint8 array, got str"),
])
def test_bad_images_are_one_clear_error(bad, message):
    with pytest.raises(MediaError, match=message):
        preprocess_images([bad])


def test_frame_cap_errors_or_downsamples():
    frames = np.zeros((9, 28, 28, 3), np.uint8)
    capped = VideoSettings(max_frames=4)
    with pytest.raises(MediaError, match="video: 9 frames exceed the cap of 4"):
        preprocess_video(frames, capped)
    out = preprocess_video(frames, capped, downsample=True)
    assert out.frame_indices == [0, 2, 4, 6] and int(out.grid_thw[:, 0].sum()) == 2


@pytest.mark.parametrize("call, message", [
    (lambda: preprocess_video([]), "video: no frames"),
    (lambda: preprocess_video([np.zeros((28, 28, 3), np.uint8), np.zeros((28, 56, 3), np.uint8)]),
     "video: frames differ in size"),
    (lambda: preprocess_video(np.zeros((3, 28, 28, 3), np.uint8), sample_fps=1.0), "needs the source fps"),
    (lambda: expand_prompt(f"{IMAGE_TOKEN}{IMAGE_TOKEN}", [[1, 2, 2]]),
     "the prompt has 2 image and 0 video marker.s. but 1 image.s. and 0 video.s. were given"),
])
def test_bad_video_and_prompts_are_one_clear_error(call, message):
    with pytest.raises(MediaError, match=message):
        call()


def test_preprocessor_config_and_data_urls():
    import base64

    from m3export.preprocess import decode_data_url

    s = ImageSettings.from_preprocessor_config({"size": {"shortest_edge": 100, "longest_edge": 2000},
                                                "patch_size": 16, "image_mean": [0.5, 0.5, 0.5]})
    assert (s.min_pixels, s.max_pixels, s.patch_size, s.image_mean) == (100, 2000, 16, (0.5, 0.5, 0.5))
    png = _png(images()["rgb-array"][0])
    assert decode_data_url("data:image/png;base64," + base64.b64encode(png).decode()) == png
    for bad, message in (("http://x/y.png", "only data: URLs"), ("data:image/png,raw", "without a base64 payload"),
                         ("data:image/png;base64,@@", "does not decode")):
        with pytest.raises(MediaError, match=message):
            decode_data_url(bad)
