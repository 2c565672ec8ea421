"""Image preprocessing: RGB uint8 -> resized to the patch grid within pixel bounds -> normalised -> patches.

Each step is the one ``transformers``' ``MiniMaxM3VLImageProcessor`` takes, written on plain torch:

1. RGB: PIL images are converted as PIL does (transparency composited onto white); arrays must be uint8,
   ``H x W`` (grey) or ``H x W x C`` with C in {1, 3}.
2. ``smart_resize``: both sides multiples of ``patch_size * merge_size``, the area within
   ``[min_pixels, max_pixels]``, the aspect ratio kept as closely as possible.
3. Bicubic resize with antialiasing on the uint8 image (the same ``interpolate`` call torchvision makes on CPU).
4. ``(x - 255 * mean) / (255 * std)`` in float32 (rescale by 1/255 fused into the normalisation, as transformers does).
5. Patches in spatial-merge block order, each image repeated ``temporal_patch_size`` times along time.
"""

from __future__ import annotations

import dataclasses
import io
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch.nn import functional as F

from ..config import VisionConfig
from ..errors import MediaError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200
MAX_DECODED_PIXELS = 1 << 27  # refuse to decode images above ~134 megapixels (decompression bombs)


@dataclass(frozen=True)
class ImageSettings:
    """The image processor's settings; defaults are ``transformers``' ``MiniMaxM3VLImageProcessor`` defaults."""

    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 451584
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def for_vision(cls, vision: VisionConfig, **overrides: Any) -> "ImageSettings":
        """Patch geometry from the model's vision config (what its tower was trained on), the rest as given."""
        return cls(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                   merge_size=vision.spatial_merge_size, **overrides)

    @classmethod
    def from_preprocessor_config(cls, raw: dict[str, Any], base: "ImageSettings | None" = None) -> "ImageSettings":
        """``preprocessor_config.json`` as the release ships it (``size`` or ``min_pixels`` / ``max_pixels``) over
        ``base`` (default: the processor's defaults). Unchecked: ``MediaSettings.from_directory`` checks files."""
        size = raw.get("size") or {}
        kw: dict[str, Any] = {}
        if isinstance(size, dict):
            if "shortest_edge" in size:
                kw["min_pixels"] = size["shortest_edge"]
            if "longest_edge" in size:
                kw["max_pixels"] = size["longest_edge"]
        for name in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
                     "rescale_factor"):
            if name in raw:
                kw[name] = raw[name]
        for name in ("image_mean", "image_std"):
            if name in raw:
                kw[name] = tuple(raw[name])
        return dataclasses.replace(base or cls(), **kw)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
                 what: str = "image") -> tuple[int, int]:
    """The target (height, width): multiples of ``factor``, area in [min_pixels, max_pixels], aspect kept."""
    if height <= 0 or width <= 0:
        raise MediaError(f"{what}: size {width} x {height} is empty")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(f"{what}: aspect ratio {max(height, width) / min(height, width):.1f} exceeds "
                         f"{MAX_ASPECT_RATIO} ({width} x {height})")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def decode_image(data: bytes, what: str = "image") -> Any:
    """Encoded bytes (PNG, JPEG, ...) -> a fully decoded PIL image; unreadable or empty data is one clear error."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise MediaError(f"{what}: no bytes")
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width * img.height > MAX_DECODED_PIXELS:
                raise MediaError(f"{what}: {img.width} x {img.height} pixels exceeds the decode limit of "
                                 f"{MAX_DECODED_PIXELS}")
            img.load()
            return img.copy()
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(f"{what}: cannot decode the image bytes ({e})") from None


_ARTICLE = {"image": "an image", "video": "a video"}


def decode_data_url(url: str, what: str = "image_url", kinds: tuple[str, ...] = ("image",)) -> bytes:
    """``data:image/<type>;base64,<payload>`` -> the encoded image bytes (``kinds``: the MIME types accepted,
    e.g. ``("video", "image")`` for a video_url, where an animated GIF is a video). Nothing is fetched: any other
    URL (http, https, file, ...) is refused with a clear error."""
    import base64
    import binascii

    if not isinstance(url, str) or not url.startswith("data:"):
        shown = url[:40] if isinstance(url, str) else type(url).__name__
        raise MediaError(f"{what}: only data: URLs are accepted (this server fetches nothing), got {shown!r}")
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise MediaError(f"{what}: expected data:<mime>;base64,<data>, got a data: URL without a base64 payload")
    if header and not header.startswith(tuple(f"{k}/" for k in kinds)):
        wanted = " or ".join(_ARTICLE.get(k, k) for k in kinds)
        raise MediaError(f"{what}: the data: URL holds {header.split(';')[0]!r}, not {wanted}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"{what}: the base64 payload does not decode ({e})") from None


def to_rgb_uint8(image: Any, what: str = "image") -> torch.Tensor:
    """A PIL image, or a uint8 array / tensor (H x W or H x W x C, C in {1, 3}) -> uint8 tensor [3, H, W]."""
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow is a dependency
        Image = None
    if Image is not None and isinstance(image, Image.Image):
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            image = Image.alpha_composite(white, rgba).convert("RGB")
        else:
            image = image.convert("RGB")
        array = np.array(image)
    elif isinstance(image, (np.ndarray, torch.Tensor)):
        array = image.numpy() if isinstance(image, torch.Tensor) else image
        if array.dtype != np.uint8:
            raise MediaError(f"{what}: arrays must be uint8 (0-255), got {array.dtype}")
        if array.ndim == 2:
            array = array[..., None]
        if array.ndim != 3 or array.shape[-1] not in (1, 3):
            raise MediaError(f"{what}: arrays must be H x W or H x W x C with C in (1, 3) (channels last), got "
                             f"shape {list(array.shape)}")
        if array.shape[-1] == 1:
            array = np.repeat(array, 3, axis=-1)
    else:
        raise MediaError(f"{what}: expected a PIL image or a uint8 array, got {type(image).__name__}")
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise MediaError(f"{what}: size {array.shape[1]} x {array.shape[0]} is empty")
    return torch.from_numpy(np.ascontiguousarray(array)).permute(2, 0, 1).contiguous()


def resize(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [..., 3, H, W] -> uint8 [..., 3, height, width]: antialiased bicubic, computed on uint8 directly."""
    if images.shape[-2:] == (height, width):
        return images
    lead = images.shape[:-3]
    flat = images.reshape(-1, *images.shape[-3:])
    out = F.interpolate(flat, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    return out.reshape(*lead, *out.shape[-3:])


def normalize(images: torch.Tensor, settings: ImageSettings) -> torch.Tensor:
    """uint8 [..., 3, H, W] -> float32, rescale and normalisation fused: (x - mean / r) / (std / r), r = 1/255."""
    mean = torch.tensor(settings.image_mean) * (1.0 / settings.rescale_factor)
    std = torch.tensor(settings.image_std) * (1.0 / settings.rescale_factor)
    return (images.to(torch.float32) - mean[:, None, None]) / std[:, None, None]


def patchify(frames: torch.Tensor, settings: ImageSettings) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """float [T, C, H, W] (T a multiple of the temporal patch) -> patches [t*h*w, C*tp*P*P] in block order."""
    s = settings
    t_len, c, height, width = frames.shape
    t, h, w, m, p, tp = t_len // s.temporal_patch_size, height // s.patch_size, width // s.patch_size, \
        s.merge_size, s.patch_size, s.temporal_patch_size
    x = frames.reshape(t, tp, c, h // m, m, p, w // m, m, p)
    # -> [t, h/m, w/m, m(row), m(col), C, tp, P(row), P(col)]
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * h * w, c * tp * p * p), (t, h, w)


def preprocess_images(images: Sequence[Any], settings: ImageSettings = ImageSettings(), first_index: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (PIL or uint8 arrays, or encoded bytes) -> (pixel_values [patches, patch_dim], image_grid_thw [n, 3]).

    Errors name the image as ``image {first_index + i}``."""
    if not isinstance(images, (list, tuple)):
        images = [images]
    if not images:
        raise MediaError("image: no images given")
    patches, grids = [], []
    for i, image in enumerate(images):
        what = f"image {first_index + i}"
        if isinstance(image, (bytes, bytearray, memoryview)):
            image = decode_image(bytes(image), what)
        rgb = to_rgb_uint8(image, what)
        height, width = smart_resize(rgb.shape[1], rgb.shape[2], settings.factor, settings.min_pixels,
                                     settings.max_pixels, what)
        frame = normalize(resize(rgb, height, width), settings)
        x, grid = patchify(frame[None].expand(settings.temporal_patch_size, -1, -1, -1), settings)
        patches.append(x)
        grids.append(grid)
    return torch.cat(patches), torch.tensor(grids, dtype=torch.long)
