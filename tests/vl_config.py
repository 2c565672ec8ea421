"""The tiny vision tower of the VL model, runtime and serving tests, with its placeholder ids. Kept apart from the
``transformers`` oracle so that machines without the oracle's ``transformers`` (the GPU machine) still import it."""

from m3export.config import VisionConfig

IMAGE, VIDEO = 300, 301
VISION = VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      patch_size=4, image_token_index=IMAGE, video_token_index=VIDEO, projector_hidden_size=48)
# head_dim 16 -> a 3D rotary band of 4 per axis: 12 rotated dims and 4 passed through, as in the release (78 of 80).
