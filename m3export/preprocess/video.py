"""Video preprocessing: frames -> (optionally sampled, capped) -> resized -> normalised -> temporal patches.

Mirrors ``transformers``' ``MiniMaxM3VLVideoProcessor``: every frame is resized to one ``smart_resize`` grid
(video pixel bounds), the frame count is padded to a multiple of ``temporal_patch_size`` by repeating the last
frame, and the temporal patches are cut into chunks of at most ``segment_frames``; each chunk is its own row of
``video_grid_thw`` and its own attention segment in the tower.

Frames are bounded: above ``max_frames`` (500 by default, vLLM's cap for M3) the call fails with a clear error,
or, with ``downsample=True``, samples ``max_frames`` frames uniformly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import MediaError
from .image import CLIP_MEAN, CLIP_STD, ImageSettings, normalize, patchify, resize, smart_resize, to_rgb_uint8

DEFAULT_MAX_FRAMES = 500


@dataclass(frozen=True)
class VideoSettings:
    """Defaults are ``transformers``' ``MiniMaxM3VLVideoProcessor`` defaults, plus the frame cap."""

    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    segment_frames: int | None = 4  # transformers' vision_segment_max_frames: temporal patches per chunk
    max_frames: int = DEFAULT_MAX_FRAMES
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255

    def image_settings(self) -> ImageSettings:
        return ImageSettings(min_pixels=self.min_pixels, max_pixels=self.max_pixels, patch_size=self.patch_size,
                             temporal_patch_size=self.temporal_patch_size, merge_size=self.merge_size,
                             image_mean=self.image_mean, image_std=self.image_std, rescale_factor=self.rescale_factor)


@dataclass
class VideoInputs:
    pixel_values: torch.Tensor  # [patches, patch_dim]
    grid_thw: torch.Tensor  # [chunks, 3]
    frame_indices: list[int]  # source frames kept, in order
    fps: float | None  # source frame rate, when known (timestamps in the prompt)
    temporal_patch_size: int = 2

    @property
    def timestamps(self) -> list[float] | None:
        """Seconds at the first frame of each temporal patch (what the prompt prints before each), or None."""
        if self.fps is None:
            return None
        t = int(self.grid_thw[:, 0].sum())
        last = len(self.frame_indices) - 1
        return [self.frame_indices[min(i * self.temporal_patch_size, last)] / self.fps for i in range(t)]


def uniform_indices(total: int, count: int) -> list[int]:
    """``count`` indices spread uniformly over ``total`` frames (``transformers``' default sampling formula)."""
    return (np.arange(count, dtype=int) * total // count).tolist()


def frames_to_tensor(frames: Any, what: str) -> torch.Tensor:
    """A uint8 array [T, H, W, C] / [T, H, W] or a sequence of frames (PIL or arrays) -> uint8 [T, 3, H, W]."""
    if isinstance(frames, (np.ndarray, torch.Tensor)) and frames.ndim in (3, 4):
        frames = list(frames)
    if not isinstance(frames, (list, tuple)):
        raise MediaError(f"{what}: expected frames as a [T, H, W, C] uint8 array or a list of images, "
                         f"got {type(frames).__name__}")
    if not frames:
        raise MediaError(f"{what}: no frames")
    out = [to_rgb_uint8(f, f"{what} frame {i}") for i, f in enumerate(frames)]
    if len({tuple(f.shape) for f in out}) != 1:
        raise MediaError(f"{what}: frames differ in size ({sorted({tuple(f.shape[1:]) for f in out})})")
    return torch.stack(out)


def preprocess_video(frames: Any, settings: VideoSettings = VideoSettings(), fps: float | None = None,
                     num_frames: int | None = None, sample_fps: float | None = None, downsample: bool = False,
                     what: str = "video") -> VideoInputs:
    """Frames -> ``VideoInputs``. ``num_frames`` / ``sample_fps`` sample uniformly first (``sample_fps`` needs the
    source ``fps``); more than ``settings.max_frames`` frames after that is an error unless ``downsample``."""
    video = frames_to_tensor(frames, what)
    total = video.shape[0]
    indices = list(range(total))
    if num_frames is not None and sample_fps is not None:
        raise MediaError(f"{what}: num_frames and sample_fps are mutually exclusive")
    if sample_fps is not None:
        if fps is None:
            raise MediaError(f"{what}: sampling at {sample_fps} frames/s needs the source fps")
        num_frames = max(1, int(total / fps * sample_fps))
    if num_frames is not None:
        if not 0 < num_frames <= total:
            raise MediaError(f"{what}: cannot sample {num_frames} frames from {total}")
        indices = uniform_indices(total, num_frames)
    if len(indices) > settings.max_frames:
        if not downsample:
            raise MediaError(f"{what}: {len(indices)} frames exceed the cap of {settings.max_frames}; sample fewer "
                             "(num_frames / sample_fps) or allow down-sampling")
        indices = [indices[i] for i in uniform_indices(len(indices), settings.max_frames)]
    video = video[indices]
    img = settings.image_settings()
    height, width = smart_resize(video.shape[2], video.shape[3], img.factor, img.min_pixels, img.max_pixels, what)
    video = normalize(resize(video, height, width), img)
    if pad := -video.shape[0] % settings.temporal_patch_size:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    pixel_values, (t, h, w) = patchify(video, img)
    step = t if settings.segment_frames is None else settings.segment_frames
    grid = [[min(step, t - start), h, w] for start in range(0, t, step)]
    return VideoInputs(pixel_values, torch.tensor(grid, dtype=torch.long), indices, fps,
                       settings.temporal_patch_size)
