"""Deterministic images and videos shared by the preprocessing test and the script that produced its references
(``tests/data/make_processor_refs.py``, run where torchvision imports). Built from seeds: nothing binary is stored
but the processors' outputs."""

from __future__ import annotations

import numpy as np
from PIL import Image


def _pixels(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """Smooth gradients plus noise: resizing sees both edges and flat regions."""
    rng = np.random.RandomState(seed)
    h, w = shape[-3], shape[-2]
    ramp = (np.linspace(0, 1, h)[:, None] * np.linspace(1, 0, w)[None, :])[..., None] * 200
    return np.clip(ramp + rng.randint(0, 56, size=shape), 0, 255).astype(np.uint8)


def images() -> dict[str, tuple[object, dict]]:
    """name -> (image, image-processor keyword overrides)."""
    rgba = _pixels(3, (60, 40, 4))
    rgba[..., 3] = np.random.RandomState(4).randint(0, 256, size=(60, 40))
    return {
        "rgb-array": (_pixels(1, (45, 61, 3)), {}),
        "pil-rgb-downscaled": (Image.fromarray(_pixels(2, (150, 230, 3))), {"max_pixels": 28 * 28 * 16}),
        "pil-grey": (Image.fromarray(_pixels(5, (33, 90, 1))[..., 0], mode="L"), {}),
        "pil-rgba": (Image.fromarray(rgba, mode="RGBA"), {}),
        "grey-array-upscaled": (_pixels(6, (10, 12, 1)), {}),
    }


def videos() -> dict[str, tuple[np.ndarray, dict]]:
    """name -> (frames [T, H, W, 3], video-processor keyword overrides)."""
    return {
        "odd-frames": (_pixels(7, (5, 40, 60, 3)), {}),
        "two-chunks": (_pixels(8, (11, 30, 50, 3)), {"max_pixels": 28 * 28 * 4}),
        "sampled-at-1fps": (_pixels(9, (13, 28, 56, 3)), {"do_sample_frames": True}),  # processor default fps 1
    }


VIDEO_FPS = 2.0
