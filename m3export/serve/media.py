"""Images and video in served requests: encoded bytes (a Triton ``image`` / ``video`` input, an OpenAI
``image_url`` / ``video_url`` data: URL), images or frames (``LLM.generate``'s ``multi_modal_data``) ->
preprocessed media items for the engine, with the prompt's markers expanded to placeholder tokens.

Preprocessing follows the model directory's ``preprocessor_config.json`` / ``video_preprocessor_config.json``
(``MediaSettings``): ``Engine.from_checkpoint`` / ``Engine.from_artifact`` read them into ``engine.media_settings``,
which ``media_settings(engine)`` returns (the processors' defaults for an engine built another way).

A text prompt marks each image with ``]<]image[>[`` (what M3's chat template writes for an image part); the
markers are expanded here, one placeholder per image token, and the engine's tokenizer turns each placeholder
into ``image_token_index``. A token-id prompt must already hold the expanded placeholders.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence

from ..config import M3Config
from ..errors import MediaError
from ..preprocess import expand_prompt, preprocess_images, preprocess_video
from ..preprocess.prompt import IMAGE_TOKEN, VIDEO_TOKEN
from ..preprocess.settings import MediaSettings
from ..preprocess.video_file import decode_frames, decode_video


def image_bytes(element: bytes | str, what: str = "image") -> bytes:
    """One ``image`` (or ``video``) element: base64 text (as Triton's vLLM backend sends) or the encoded file."""
    raw = element.encode() if isinstance(element, str) else bytes(element)
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return raw  # binary: PNG, JPEG, MP4, ... as is
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{what}: neither base64 text nor an encoded {what}") from None


def video_element(element: bytes | str) -> bytes | list[bytes]:
    """One ``video`` element: a video file (base64 text or its bytes), or its frames as a JSON array of base64
    images (``["iVBOR...", ...]``: base64 text never starts with ``[``)."""
    raw = element.encode() if isinstance(element, str) else bytes(element)
    if raw.lstrip()[:1] != b"[":
        return image_bytes(raw, "video")
    try:
        frames = json.loads(raw)
    except ValueError as e:
        raise MediaError(f"video: a frame list must be a JSON array of base64 images ({e})") from None
    if not isinstance(frames, list) or not frames or not all(isinstance(f, str) for f in frames):
        raise MediaError("video: a frame list must be a non-empty JSON array of base64 image strings")
    return [image_bytes(f, f"video frame {i}") for i, f in enumerate(frames)]


def media_settings(engine) -> MediaSettings | None:
    """The preprocessing an engine's model asks for: what ``Engine.from_*`` read from its directory, or the
    processors' defaults with the model's patch geometry."""
    settings = getattr(engine, "media_settings", None)
    return settings if settings is not None else MediaSettings.from_directory(None, engine.config.vision)


def prepare_images(config: M3Config, prompt: str | list[int], images: Sequence[bytes],
                   settings: MediaSettings | None = None):
    """-> (prompt with the image markers expanded, media items for ``Engine.add_request(media=...)``)."""
    return prepare_media(config, prompt, images=images, settings=settings)


def _frames(video, what: str, settings: MediaSettings):
    """A video as frames + its rate: encoded bytes are decoded (capped at the frame limit while decoding), a list
    of encoded images decoded one by one, frames (arrays, images) passed on."""
    if isinstance(video, (bytes, bytearray, memoryview)):
        decoded = decode_video(bytes(video), settings.video.max_frames, what)
        return decoded.frames, decoded.fps
    if isinstance(video, (list, tuple)) and video and isinstance(video[0], (bytes, bytearray, memoryview)):
        decoded = decode_frames(list(video), settings.video.max_frames, what)
        return decoded.frames, decoded.fps
    return video, None


def prepare_media(config: M3Config, prompt: str | list[int], images: Sequence = (), videos: Sequence = (),
                  video_fps: float | None = None, settings: MediaSettings | None = None):
    """Images (encoded bytes, PIL images or uint8 arrays) and videos (an encoded file's bytes, or frames: a
    [T, H, W, C] uint8 array or a list of images or of encoded images) -> (the prompt with its ``]<]image[>[`` /
    ``]<]video[>[`` markers expanded, media items). ``video_fps``: the frames' rate (prompt timestamps) when the
    video is given as frames; a decoded file states its own. ``settings``: the model's preprocessing
    (``media_settings``; default: the processors' defaults).

    A token-id prompt is returned as is: it must already hold the expanded placeholders."""
    from m3export.runtime.media import MediaItem

    if config.vision is None:
        raise MediaError("this model has no vision tower: requests cannot carry images or video")
    v = config.vision
    settings = settings or MediaSettings.for_vision(v)
    items, grids, clips = [], [], []
    for i, data in enumerate(images):
        pixels, grid = preprocess_images([data], settings.image, first_index=i)
        items.append(MediaItem("image", pixels, grid))
        grids.append(grid[0])
    for j, video in enumerate(videos):
        frames, fps = _frames(video, f"video {j}", settings)
        fps = fps if fps is not None else video_fps
        sample = settings.sample_fps if fps is not None else None  # the checkpoint's sampling needs the rate
        out = preprocess_video(frames, settings.video, fps=fps, sample_fps=sample, what=f"video {j}")
        items.append(MediaItem("video", out.pixel_values, out.grid_thw))
        clips.append((out.grid_thw, out.timestamps))
    if isinstance(prompt, str):
        for marker, n, kind in ((IMAGE_TOKEN, len(images), "image"), (VIDEO_TOKEN, len(videos), "video")):
            if prompt.count(marker) != n:
                raise MediaError(f"the prompt marks {prompt.count(marker)} {kind}(s) with {marker!r} but {n} "
                                 f"{kind}(s) were sent: put one marker where each {kind} goes")
        prompt = expand_prompt(prompt, grids, clips, merge_size=v.spatial_merge_size)
    return prompt, items
