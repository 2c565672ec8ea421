"""Images and video -> ``pixel_values`` + ``grid_thw`` + expanded prompts, with no network and no torchvision.

Agrees with ``transformers``' ``MiniMaxM3VLImageProcessor`` / ``MiniMaxM3VLVideoProcessor`` / ``MiniMaxM3VLProcessor``
(checked against their outputs in ``tests/test_preprocess.py``).
"""

from .image import ImageSettings, decode_data_url, decode_image, preprocess_images, smart_resize
from .prompt import expand_prompt, placeholder_text
from .video import VideoInputs, VideoSettings, preprocess_video

__all__ = [
    "ImageSettings", "VideoInputs", "VideoSettings", "decode_data_url", "decode_image", "expand_prompt", "placeholder_text",
    "preprocess_images", "preprocess_video", "smart_resize",
]
