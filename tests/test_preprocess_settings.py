"""A checkpoint's ``preprocessor_config.json`` / ``video_preprocessor_config.json``: read by ``MediaSettings``, honoured
by the serving paths (``load_engine`` -> ``media_settings``), a changed value changes the preprocessing, and a bad
value is one error naming the file and the field."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from m3export.config import preset
from m3export.errors import MediaError
from m3export.preprocess import preprocess_images, preprocess_video
from m3export.preprocess.prompt import IMAGE_TOKEN, VIDEO_TOKEN
from m3export.preprocess.settings import PREPROCESSOR_CONFIG, VIDEO_PREPROCESSOR_CONFIG, MediaSettings
from m3export.serve.media import media_settings, prepare_media

from .test_serve_media import VISION

IMAGE = np.random.RandomState(0).randint(0, 256, (61, 83, 3), dtype=np.uint8)
VIDEO = np.random.RandomState(1).randint(0, 256, (9, 40, 56, 3), dtype=np.uint8)


def _write(tmp_path, image: dict | None = None, video: dict | None = None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    if image is not None:
        (tmp_path / PREPROCESSOR_CONFIG).write_text(json.dumps(image))
    if video is not None:
        (tmp_path / VIDEO_PREPROCESSOR_CONFIG).write_text(json.dumps(video))
    return tmp_path


def test_without_files_the_defaults_take_the_models_patch_geometry(tmp_path):
    s = MediaSettings.from_directory(tmp_path, VISION)
    assert s == MediaSettings.for_vision(VISION)
    assert (s.image.patch_size, s.video.patch_size, s.image.merge_size) == (VISION.patch_size, VISION.patch_size,
                                                                            VISION.spatial_merge_size)
    assert MediaSettings.from_directory(tmp_path, None) is None  # a text-only model has nothing to preprocess


def test_changed_values_change_the_result(tmp_path):
    default = MediaSettings.for_vision(VISION)
    s = MediaSettings.from_directory(_write(tmp_path, {"max_pixels": 24 * 24, "image_mean": [0.5, 0.5, 0.5]},
                                           {"min_pixels": 64, "max_pixels": 16 * 24,
                                            "vision_segment_max_frames": 1}), VISION)
    assert (s.image.max_pixels, s.image.image_mean, s.video.max_pixels, s.video.segment_frames) == \
        (24 * 24, (0.5, 0.5, 0.5), 16 * 24, 1)
    _, grid = preprocess_images([IMAGE], default.image)
    _, small = preprocess_images([IMAGE], s.image)
    assert small.prod() < grid.prod() and small.prod() * VISION.patch_size ** 2 <= 24 * 24
    mean_only = MediaSettings.from_directory(_write(tmp_path / "m", {"image_mean": [0.5, 0.5, 0.5]}), VISION)
    a, _ = preprocess_images([IMAGE], default.image)
    b, _ = preprocess_images([IMAGE], mean_only.image)
    assert a.shape == b.shape and not torch.equal(a, b)
    v_default, v_changed = preprocess_video(VIDEO, default.video), preprocess_video(VIDEO, s.video)
    assert v_default.grid_thw.tolist() != v_changed.grid_thw.tolist()
    assert v_changed.grid_thw[:, 0].tolist() == [1] * 5  # 9 frames -> 5 temporal patches, one chunk each


def test_frame_sampling_of_the_video_config(tmp_path):
    """do_sample_frames + fps: a video whose rate is known is sampled (the processor's formula, in
    preprocess_video); frames without a rate are taken as they are."""
    s = MediaSettings.from_directory(_write(tmp_path, None, {"do_sample_frames": True, "fps": 2}), VISION)
    assert s.sample_fps == 2.0
    cfg = preset("tiny").replace(num_mtp_modules=0, vision=VISION)
    # 9 frames at 4 frames/s: 2.25 s -> 4 frames sampled (2 temporal patches) instead of 9 (5)
    _, sampled = prepare_media(cfg, VIDEO_TOKEN, videos=[VIDEO], video_fps=4.0, settings=s)
    _, every = prepare_media(cfg, VIDEO_TOKEN, videos=[VIDEO], video_fps=4.0)
    _, no_rate = prepare_media(cfg, VIDEO_TOKEN, videos=[VIDEO], settings=s)
    assert int(sampled[0].grid_thw[:, 0].sum()) == 2 and int(every[0].grid_thw[:, 0].sum()) == 5
    want = preprocess_video(VIDEO, s.video, fps=4.0, sample_fps=2.0)
    assert torch.equal(sampled[0].pixel_values, want.pixel_values)
    assert int(no_rate[0].grid_thw[:, 0].sum()) == 5
    assert MediaSettings.from_directory(_write(tmp_path / "d", None, {"do_sample_frames": True}), VISION).sample_fps \
        == 1.0  # the processor's default fps


@pytest.mark.parametrize("image, video, message", [
    ({"max_pixels": -4}, None, "preprocessor_config.json: max_pixels must be a positive integer, got -4"),
    ({"patch_size": 14}, None, r"preprocessor_config.json: patch_size is 14, but the model's vision_config.patch_size "
                               r"is 4"),
    ({"min_pixels": 5000, "max_pixels": 100}, None, r"min_pixels \(5000\) exceeds max_pixels \(100\)"),
    ({"image_std": [0.2, 0, 0.3]}, None, "preprocessor_config.json: image_std must be positive"),
    ({"image_mean": [0.5, 0.5]}, None, "preprocessor_config.json: image_mean must be a list of 3 numbers"),
    ({"size": {"longest_edge": "big"}}, None, "preprocessor_config.json: longest_edge must be a positive integer"),
    ({"do_normalize": False}, None, "preprocessor_config.json: do_normalize is False; this runtime preprocesses "
                                    "only with it true"),
    (None, {"temporal_patch_size": 3}, r"video_preprocessor_config.json: temporal_patch_size is 3, but the model's "
                                       r"vision_config.temporal_patch_size is 2"),
    (None, {"max_pixels": 10}, r"video_preprocessor_config.json: max_pixels 10 is below one merged patch"),
    (None, {"vision_segment_max_frames": 0}, "video_preprocessor_config.json: vision_segment_max_frames must be"),
    (None, {"do_sample_frames": True, "fps": 0}, "video_preprocessor_config.json: fps must be a positive number"),
    (None, {"do_sample_frames": "yes"}, "video_preprocessor_config.json: do_sample_frames must be true or false"),
])
def test_invalid_values_name_the_file_and_the_field(tmp_path, image, video, message):
    with pytest.raises(MediaError, match=message):
        MediaSettings.from_directory(_write(tmp_path, image, video), VISION)


def test_unreadable_files_are_one_clear_error(tmp_path):
    (tmp_path / PREPROCESSOR_CONFIG).write_text("{not json")
    with pytest.raises(MediaError, match="preprocessor_config.json: not readable JSON"):
        MediaSettings.from_directory(tmp_path, VISION)
    (tmp_path / PREPROCESSOR_CONFIG).write_text("[1, 2]")
    with pytest.raises(MediaError, match="preprocessor_config.json: expected a JSON object, got list"):
        MediaSettings.from_directory(tmp_path, VISION)


def test_engine_from_checkpoint_reads_the_model_directorys_files(tmp_path):
    """Engine.from_checkpoint (generate, LLM, the servers) honours the checkpoint's files: a changed max_pixels
    changes the image grid of a served request; a preset has no files (the defaults); a bad file is one error."""
    from m3export.checkpoint.writer import write_checkpoint
    from m3export.runtime import Engine

    ckpt = write_checkpoint(tmp_path / "ckpt", preset("tiny").replace(num_mtp_modules=0, vision=VISION), "original",
                            "fp32", progress=False, with_tokenizer=False)
    grids = {}
    for max_pixels in (16 * 16, 32 * 32):
        _write(ckpt, {"max_pixels": max_pixels})
        engine = Engine.from_checkpoint(ckpt, num_pages=16)
        assert engine.media_settings.image.max_pixels == max_pixels
        _, items = prepare_media(engine.config, IMAGE_TOKEN, [IMAGE], settings=media_settings(engine))
        grids[max_pixels] = int(items[0].grid_thw.prod())
        assert grids[max_pixels] * VISION.patch_size ** 2 <= max_pixels
    assert grids[16 * 16] < grids[32 * 32]
    assert Engine.from_checkpoint("tiny", num_pages=16).media_settings is None  # text-only preset: nothing to read
    _write(ckpt, {"max_pixels": 0})
    with pytest.raises(MediaError, match=f"{ckpt / PREPROCESSOR_CONFIG}: max_pixels must be a positive integer"):
        Engine.from_checkpoint(ckpt, num_pages=16)


def test_load_engine_reads_the_model_directorys_files(tmp_path):
    """The servers and LLM build their engine with load_engine: the checkpoint's files decide the preprocessing
    of every served image; a bad file stops the load naming it."""
    from m3export.checkpoint.writer import write_checkpoint
    from m3export.serve.repo import load_engine

    ckpt = write_checkpoint(tmp_path / "ckpt", preset("tiny").replace(num_mtp_modules=0, vision=VISION), "original",
                            "fp32", progress=False, with_tokenizer=False)
    _write(ckpt, {"max_pixels": 16 * 16})
    params = {"source_kind": "checkpoint", "source": str(ckpt), "backend": "torch",
              "engine_args": json.dumps({"num_pages": 16})}
    engine = load_engine(params, tmp_path)
    assert media_settings(engine).image.max_pixels == 16 * 16
    _, items = prepare_media(engine.config, IMAGE_TOKEN, [IMAGE], settings=media_settings(engine))
    _, default = prepare_media(engine.config, IMAGE_TOKEN, [IMAGE])
    assert items[0].grid_thw.prod() < default[0].grid_thw.prod()
    _write(ckpt, {"max_pixels": 0})
    with pytest.raises(MediaError, match=f"{ckpt / PREPROCESSOR_CONFIG}: max_pixels must be a positive integer"):
        load_engine(params, tmp_path)
