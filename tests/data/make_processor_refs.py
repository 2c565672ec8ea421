"""Produce processor_refs.safetensors / processor_refs.json from transformers' real M3 processors.

transformers' image and video processors import torchvision, which does not import beside the CPU torch wheel CI
uses; the references are therefore made once, elsewhere, and committed. Command (any machine with Python 3.11):

    python3 -m venv --system-site-packages /tmp/tvenv
    /tmp/tvenv/bin/pip install torch==2.14.1 torchvision==0.29.1      # transformers 5.24 from the system site
    cd <repo> && PYTHONPATH=. /tmp/tvenv/bin/python tests/data/make_processor_refs.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers.models.minimax_m3_vl import MiniMaxM3VLImageProcessor, MiniMaxM3VLVideoProcessor
from transformers.models.minimax_m3_vl.processing_minimax_m3_vl import MiniMaxM3VLProcessor
from transformers.video_utils import VideoMetadata

from tests.media_cases import VIDEO_FPS, images, videos

OUT = Path(__file__).resolve().parent


def main() -> None:
    tensors, meta = {}, {"transformers": transformers.__version__, "torch": torch.__version__,
                         "images": {}, "videos": {}}
    image_proc, video_proc = MiniMaxM3VLImageProcessor(), MiniMaxM3VLVideoProcessor()
    # The processor's expansion methods read only these two attributes (no tokenizer needed).
    expander = object.__new__(MiniMaxM3VLProcessor)
    expander.__dict__.update(image_processor=image_proc, video_processor=video_proc)
    for name, (image, kwargs) in images().items():
        out = image_proc(images=image, return_tensors="pt", **kwargs)
        tensors[f"image/{name}"] = out["pixel_values"].contiguous()
        meta["images"][name] = {"grid_thw": out["image_grid_thw"].tolist(),
                                "prompt": MiniMaxM3VLProcessor.replace_image_token(expander, out, 0)}
    for name, (frames, kwargs) in videos().items():
        metadata = VideoMetadata(total_num_frames=len(frames), fps=VIDEO_FPS, width=frames.shape[2],
                                 height=frames.shape[1])
        out = video_proc(videos=[frames], video_metadata=[metadata], return_metadata=True, return_tensors="pt",
                         **kwargs)
        tensors[f"video/{name}"] = out["pixel_values_videos"].contiguous()
        md = out["video_metadata"][0]
        indices = md.frames_indices if md.frames_indices is not None else list(range(len(frames)))
        meta["videos"][name] = {"grid_thw": out["video_grid_thw"].tolist(), "frame_indices": [int(i) for i in indices],
                                "prompt": MiniMaxM3VLProcessor.replace_video_token(expander, out, 0)}
    save_file(tensors, OUT / "processor_refs.safetensors")
    (OUT / "processor_refs.json").write_text(json.dumps(meta, indent=1) + "\n")
    print({k: list(v.shape) for k, v in tensors.items()})


if __name__ == "__main__":
    main()
