"""Images in served requests: encoded bytes (a Triton ``image`` input, an OpenAI ``image_url`` data: URL) ->
preprocessed media items for the engine, with the prompt's image markers expanded to placeholder tokens.

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
from ..preprocess import ImageSettings, expand_prompt, preprocess_images
from ..preprocess.prompt import IMAGE_TOKEN


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
    from m3export.runtime.media import MediaItem

    if config.vision is None:
        raise MediaError("this model has no vision tower: requests cannot carry images")
    settings = ImageSettings.for_vision(config.vision)
    items, grids = [], []
    for i, data in enumerate(images):
        pixels, grid = preprocess_images([data], settings, first_index=i)
        items.append(MediaItem("image", pixels, grid))
        grids.append(grid[0])
    if isinstance(prompt, str):
        if prompt.count(IMAGE_TOKEN) != len(images):
            raise MediaError(f"the prompt marks {prompt.count(IMAGE_TOKEN)} image(s) with {IMAGE_TOKEN!r} but "
                             f"{len(images)} image(s) were sent: put one marker where each image goes")
        prompt = expand_prompt(prompt, grids, merge_size=config.vision.spatial_merge_size)
    return prompt, items
