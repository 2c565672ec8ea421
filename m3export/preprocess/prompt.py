"""Prompt expansion: each image / video marker becomes one placeholder token per merged patch.

The strings are the release's (``transformers``' ``MiniMaxM3VLProcessor``): an image becomes
``<start> + <image> * n + <end>``; a video becomes, per temporal patch, an optional ``]<]{t:.1f} seconds[>[``
timestamp followed by ``<start> + <video> * (h * w / merge^2) + <end>``. The release's tokenizer has every marker
as one added token, so tokenising the expanded text gives exactly one id per placeholder.
"""

from __future__ import annotations

import re
from typing import Sequence

import torch

from ..errors import MediaError

IMAGE_TOKEN = "]<]image[>["
VIDEO_TOKEN = "]<]video[>["
VISION_START = "]<]start of image[>["
VISION_END = "]<]end of image[>["


def placeholder_text(kind: str, grid_thw: torch.Tensor | Sequence[Sequence[int]], merge_size: int = 2,
                     timestamps: Sequence[float] | None = None) -> str:
    """The expansion of one item: ``grid_thw`` is its row (image) or its chunk rows (video)."""
    grid = torch.as_tensor(grid_thw).reshape(-1, 3)
    unit = merge_size**2
    if kind == "image":
        return VISION_START + IMAGE_TOKEN * int(grid[0].prod() // unit) + VISION_END
    if kind != "video":
        raise ValueError(f"unknown media kind {kind!r}")
    frames = int(grid[:, 0].sum())
    per_frame = int(grid[0, 1:].prod() // unit)
    if timestamps is not None and len(timestamps) != frames:
        raise MediaError(f"video: {len(timestamps)} timestamps for {frames} temporal patches")
    out = []
    for i in range(frames):
        if timestamps is not None:
            out.append(f"]<]{timestamps[i]:.1f} seconds[>[")
        out.append(VISION_START + VIDEO_TOKEN * per_frame + VISION_END)
    return "".join(out)


def expand_prompt(text: str, image_grids: Sequence = (), videos: Sequence = (), merge_size: int = 2) -> str:
    """Replace the markers in ``text``, in order: image i takes ``image_grids[i]`` (a grid row), video j takes
    ``videos[j]`` = (chunk grid rows, timestamps or None). The counts must match the markers exactly."""
    n_img, n_vid = text.count(IMAGE_TOKEN), text.count(VIDEO_TOKEN)
    if n_img != len(image_grids) or n_vid != len(videos):
        raise MediaError(f"the prompt has {n_img} image and {n_vid} video marker(s) but {len(image_grids)} "
                         f"image(s) and {len(videos)} video(s) were given")
    images, vids = iter(image_grids), iter(videos)
    parts = re.split(f"({re.escape(IMAGE_TOKEN)}|{re.escape(VIDEO_TOKEN)})", text)
    out = []
    for part in parts:
        if part == IMAGE_TOKEN:
            out.append(placeholder_text("image", next(images), merge_size))
        elif part == VIDEO_TOKEN:
            grid, stamps = next(vids)
            out.append(placeholder_text("video", grid, merge_size, stamps))
        else:
            out.append(part)
    return "".join(out)
