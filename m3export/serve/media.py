"""Images and video in served requests: encoded bytes (a Triton ``image`` input, an OpenAI ``image_url`` data:
URL), images or frames (``LLM.generate``'s ``multi_modal_data``) -> preprocessed media items for the engine, with
the prompt's markers expanded to placeholder tokens.

A text prompt marks each image with ``]<]image[>[`` (what M3's chat template writes for an image part); the
markers are expanded here, one placeholder per image token, and the engine's tokenizer turns each placeholder
into ``image_token_index``. A token-id prompt must already hold the expanded placeholders.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence

from ..config import M3Config
from ..errors import MediaError
from ..preprocess import ImageSettings, VideoSettings, expand_prompt, preprocess_images, preprocess_video
from ..preprocess.prompt import IMAGE_TOKEN, VIDEO_TOKEN


def image_bytes(element: bytes | str) -> bytes:
    """One ``image`` element: base64 text (as Triton's vLLM backend sends) or the encoded image itself."""
    raw = element.encode() if isinstance(element, str) else bytes(element)
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return raw  # binary: PNG, JPEG, ... as is
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("image: neither base64 text nor an encoded image") from None


def prepare_images(config: M3Config, prompt: str | list[int], images: Sequence[bytes]):
    """-> (prompt with the image markers expanded, media items for ``Engine.add_request(media=...)``)."""
    return prepare_media(config, prompt, images=images)


def prepare_media(config: M3Config, prompt: str | list[int], images: Sequence = (), videos: Sequence = (),
                  video_fps: float | None = None):
    """Images (encoded bytes, PIL images or uint8 arrays) and videos (frames: a [T, H, W, C] uint8 array or a list
    of images) -> (the prompt with its ``]<]image[>[`` / ``]<]video[>[`` markers expanded, media items).

    A token-id prompt is returned as is: it must already hold the expanded placeholders."""
    from m3export.runtime.media import MediaItem

    if config.vision is None:
        raise MediaError("this model has no vision tower: requests cannot carry images or video")
    v = config.vision
    settings = ImageSettings.for_vision(v)
    video_settings = VideoSettings(patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                                   merge_size=v.spatial_merge_size)
    items, grids, clips = [], [], []
    for i, data in enumerate(images):
        pixels, grid = preprocess_images([data], settings, first_index=i)
        items.append(MediaItem("image", pixels, grid))
        grids.append(grid[0])
    for j, frames in enumerate(videos):
        out = preprocess_video(frames, video_settings, fps=video_fps, what=f"video {j}")
        items.append(MediaItem("video", out.pixel_values, out.grid_thw))
        clips.append((out.grid_thw, out.timestamps))
    if isinstance(prompt, str):
        for marker, n, kind in ((IMAGE_TOKEN, len(images), "image"), (VIDEO_TOKEN, len(videos), "video")):
            if prompt.count(marker) != n:
                raise MediaError(f"the prompt marks {prompt.count(marker)} {kind}(s) with {marker!r} but {n} "
                                 f"{kind}(s) were sent: put one marker where each {kind} goes")
        prompt = expand_prompt(prompt, grids, clips, merge_size=v.spatial_merge_size)
    return prompt, items
