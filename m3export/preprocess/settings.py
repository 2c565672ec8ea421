"""A checkpoint's own preprocessing: ``preprocessor_config.json`` (images) and ``video_preprocessor_config.json``.

``transformers`` saves these beside the weights; the servers and ``LLM`` read them from the model directory
(checkpoint or artifact: export copies them) so images and video are resized and normalised as the checkpoint
says. Every field is checked, and a bad one is one error naming the file and the field. The patch geometry
(``patch_size``, ``temporal_patch_size``, ``merge_size``) must agree with the model's ``vision_config``: the
tower's patch embedding is sized by it, so a disagreeing file cannot be honoured.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config import VisionConfig
from ..errors import MediaError
from .image import ImageSettings
from .video import VideoSettings

PREPROCESSOR_CONFIG = "preprocessor_config.json"
VIDEO_PREPROCESSOR_CONFIG = "video_preprocessor_config.json"
FILES = (PREPROCESSOR_CONFIG, VIDEO_PREPROCESSOR_CONFIG)

_GEOMETRY = {"patch_size": "patch_size", "temporal_patch_size": "temporal_patch_size",
             "merge_size": "spatial_merge_size"}  # file field -> VisionConfig field
_SWITCHES = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")  # must stay on: the only path here
DEFAULT_SAMPLE_FPS = 1.0  # the video processor's fps when do_sample_frames is on and the file names none


@dataclass(frozen=True)
class MediaSettings:
    image: ImageSettings
    video: VideoSettings
    #: ``do_sample_frames`` with ``fps`` in the video file: videos whose frame rate is known are sampled to this
    #: many frames per second (``preprocess_video(sample_fps=...)``, the processor's sampling); None: every frame.
    sample_fps: float | None = None

    @classmethod
    def for_vision(cls, vision: VisionConfig) -> MediaSettings:
        """The processors' defaults with the model's patch geometry (no preprocessor files)."""
        geometry = dict(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                        merge_size=vision.spatial_merge_size)
        return cls(ImageSettings(**geometry), VideoSettings(**geometry))

    @classmethod
    def from_directory(cls, directory: str | Path | None, vision: VisionConfig | None) -> MediaSettings | None:
        """The settings of the model in ``directory`` (defaults where a file is absent); None without a vision
        tower."""
        if vision is None:
            return None
        settings = cls.for_vision(vision)
        if directory is None:
            return settings
        root = Path(directory)
        image_raw = _read(root / PREPROCESSOR_CONFIG)
        if image_raw is not None:
            _check(image_raw, root / PREPROCESSOR_CONFIG, vision)
            settings = replace(settings, image=ImageSettings.from_preprocessor_config(image_raw, settings.image))
        video_raw = _read(root / VIDEO_PREPROCESSOR_CONFIG)
        if video_raw is not None:
            _check(video_raw, root / VIDEO_PREPROCESSOR_CONFIG, vision)
            _check_sampling(video_raw, root / VIDEO_PREPROCESSOR_CONFIG)
            sampling = video_raw.get("do_sample_frames", False)
            sample_fps = float(video_raw.get("fps", DEFAULT_SAMPLE_FPS)) if sampling else None
            settings = replace(settings, video=_video_settings(settings.video, video_raw), sample_fps=sample_fps)
        return settings


def _read(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise MediaError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise MediaError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _positive_int(raw: dict, field: str, where: Path) -> None:
    v = raw.get(field)
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
        raise MediaError(f"{where}: {field} must be a positive integer, got {v!r}")


def _check(raw: dict[str, Any], where: Path, vision: VisionConfig) -> None:
    """Every field this runtime reads, checked; the patch geometry against the model."""
    size = raw.get("size")
    if size is not None and not isinstance(size, (dict, list)):
        raise MediaError(f"{where}: size must be an object, got {size!r}")
    sizes = size if isinstance(size, dict) else {}
    for field in ("shortest_edge", "longest_edge"):
        _positive_int(sizes, field, where)
    for field in ("min_pixels", "max_pixels", "vision_segment_max_frames", *_GEOMETRY):
        _positive_int(raw, field, where)
    for field, theirs in _GEOMETRY.items():
        if field in raw and raw[field] != getattr(vision, theirs):
            raise MediaError(f"{where}: {field} is {raw[field]}, but the model's vision_config.{theirs} is "
                             f"{getattr(vision, theirs)} (its patch embedding is sized by it)")
    lo = raw.get("min_pixels", sizes.get("shortest_edge"))
    hi = raw.get("max_pixels", sizes.get("longest_edge"))
    if lo is not None and hi is not None and lo > hi:
        raise MediaError(f"{where}: min_pixels ({lo}) exceeds max_pixels ({hi})")
    factor = vision.patch_size * vision.spatial_merge_size
    if hi is not None and hi < factor * factor:
        raise MediaError(f"{where}: max_pixels {hi} is below one merged patch ({factor} x {factor} pixels)")
    rescale = raw.get("rescale_factor")
    if rescale is not None and (not isinstance(rescale, (int, float)) or isinstance(rescale, bool) or
                                not 0 < rescale < math.inf):
        raise MediaError(f"{where}: rescale_factor must be a positive number, got {rescale!r}")
    for field in ("image_mean", "image_std"):
        v = raw.get(field)
        if v is None:
            continue
        if not isinstance(v, list) or len(v) != 3 or not all(isinstance(x, (int, float)) and
                                                             not isinstance(x, bool) and math.isfinite(x) for x in v):
            raise MediaError(f"{where}: {field} must be a list of 3 numbers (R, G, B), got {v!r}")
        if field == "image_std" and min(v) <= 0:
            raise MediaError(f"{where}: image_std must be positive, got {v!r}")
    for field in _SWITCHES:
        if raw.get(field, True) is not True:
            raise MediaError(f"{where}: {field} is {raw[field]!r}; this runtime preprocesses only with it true "
                             "(the processors' default)")


def _check_sampling(raw: dict[str, Any], where: Path) -> None:
    if not isinstance(raw.get("do_sample_frames", False), bool):
        raise MediaError(f"{where}: do_sample_frames must be true or false, got {raw['do_sample_frames']!r}")
    fps = raw.get("fps")
    if fps is not None and (not isinstance(fps, (int, float)) or isinstance(fps, bool) or not 0 < fps < math.inf):
        raise MediaError(f"{where}: fps must be a positive number, got {fps!r}")


def _video_settings(base: VideoSettings, raw: dict[str, Any]) -> VideoSettings:
    kw: dict[str, Any] = {}
    for field in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "rescale_factor"):
        if field in raw:
            kw[field] = raw[field]
    if "vision_segment_max_frames" in raw:
        kw["segment_frames"] = raw["vision_segment_max_frames"]
    for field in ("image_mean", "image_std"):
        if field in raw:
            kw[field] = tuple(raw[field])
    return replace(base, **kw)
