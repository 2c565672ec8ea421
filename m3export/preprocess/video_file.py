"""Encoded video files -> frames, with the frame cap enforced while decoding (a long video never lands in memory).

Two decoders, tried in order:

1. Pillow (a dependency): animated GIF, APNG and WebP (and any image, as a one-frame video). The frame rate
   comes from the frames' durations.
2. PyAV (``pip install av``, in the ``serve`` and ``video`` extras): MP4, WebM, MKV, AVI, ... through FFmpeg's
   decoders, the rate from the stream's average frame rate. Without PyAV such files are one clear error that
   says what to install, or to send the frames as images instead.

Only bytes are decoded: nothing is fetched or read from a path.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from ..errors import MediaError
from .video import DEFAULT_MAX_FRAMES

# Decoded pixels over all frames (uint8 RGB: 3 bytes each): 2^28 is 500 frames of 730 x 730, ~800 MB.
MAX_VIDEO_PIXELS = 1 << 28


@dataclass
class DecodedVideo:
    frames: list[np.ndarray]  # uint8 [H, W, 3] each
    fps: float | None  # source frame rate when the file states it


def decode_video(data: bytes, max_frames: int = DEFAULT_MAX_FRAMES, what: str = "video") -> DecodedVideo:
    """Encoded video bytes -> its frames (RGB uint8) and frame rate. More than ``max_frames`` frames, or more
    than ``MAX_VIDEO_PIXELS`` decoded pixels, is one clear error naming the limit."""
    if not data:
        raise MediaError(f"{what}: no bytes")
    decoded = _decode_with_pillow(data, max_frames, what)
    if decoded is not None:
        return decoded
    return _decode_with_pyav(data, max_frames, what)


def decode_frames(images: list[bytes], max_frames: int = DEFAULT_MAX_FRAMES, what: str = "video") -> DecodedVideo:
    """A video sent as its frames, each an encoded image: decoded one by one within the same frame cap and pixel
    budget as a video file (the rate is not known)."""
    from .image import decode_image, to_rgb_uint8

    budget, frames = _Budget(max_frames, what), []
    for i, data in enumerate(images):
        image = decode_image(bytes(data), f"{what} frame {i}")
        budget.add(image.width, image.height)
        frames.append(to_rgb_uint8(image, f"{what} frame {i}").permute(1, 2, 0).numpy())
    return DecodedVideo(frames, None)


class _Budget:
    """Counts frames and pixels as they are decoded; raises as soon as a limit is passed."""

    def __init__(self, max_frames: int, what: str):
        self.max_frames, self.what = max_frames, what
        self.frames = self.pixels = 0

    def add(self, width: int, height: int) -> None:
        self.frames += 1
        self.pixels += width * height
        if self.frames > self.max_frames:
            raise MediaError(f"{self.what}: more than {self.max_frames} frames, the cap on video frames; send a "
                             "shorter clip or fewer frames")
        if self.pixels > MAX_VIDEO_PIXELS:
            raise MediaError(f"{self.what}: {self.frames} frames of {width} x {height} exceed the decode limit of "
                             f"{MAX_VIDEO_PIXELS} pixels; send fewer or smaller frames")


def _decode_with_pillow(data: bytes, max_frames: int, what: str) -> DecodedVideo | None:
    """Frames of an image sequence Pillow reads, or None when Pillow does not recognise the bytes."""
    from PIL import Image, ImageSequence, UnidentifiedImageError

    from .image import to_rgb_uint8

    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        return None
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(f"{what}: cannot decode the video bytes ({e})") from None
    budget, frames, durations = _Budget(max_frames, what), [], []
    try:
        with img:
            for frame in ImageSequence.Iterator(img):
                budget.add(frame.width, frame.height)
                frames.append(to_rgb_uint8(frame.copy(), f"{what} frame {len(frames)}").permute(1, 2, 0).numpy())
                durations.append(frame.info.get("duration"))
    except MediaError:
        raise
    except (OSError, ValueError, EOFError) as e:
        raise MediaError(f"{what}: cannot decode frame {len(frames)} ({e})") from None
    known = [d for d in durations if isinstance(d, (int, float)) and d > 0]
    fps = 1000.0 * len(known) / sum(known) if known and len(frames) > 1 else None
    return DecodedVideo(frames, fps)


def _decode_with_pyav(data: bytes, max_frames: int, what: str) -> DecodedVideo:
    try:
        import av
    except ImportError:
        raise MediaError(f"{what}: not an image sequence Pillow reads (GIF, APNG, WebP), and PyAV is not installed "
                         "to decode other video files (MP4, WebM, ...): pip install av, or send the frames as "
                         "images") from None
    budget, frames = _Budget(max_frames, what), []
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError(f"{what}: the file has no video stream")
            stream = container.streams.video[0]
            for frame in container.decode(stream):
                budget.add(frame.width, frame.height)
                frames.append(frame.to_ndarray(format="rgb24"))
            rate = stream.average_rate
    except MediaError:
        raise
    except (av.error.FFmpegError, OSError, ValueError) as e:
        raise MediaError(f"{what}: cannot decode the video bytes ({e})") from None
    if not frames:
        raise MediaError(f"{what}: the video stream holds no frames")
    fps = float(rate) if rate else None
    return DecodedVideo(frames, fps if fps and fps > 0 else None)
