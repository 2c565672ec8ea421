"""The independent VL oracle: ``transformers``' ``MiniMaxM3SparseForConditionalGeneration`` built from our config."""

from __future__ import annotations

import math

import torch

from m3export.config import M3Config

from .hf_oracle import HF_KEYS

from transformers.models.minimax_m3_vl import MiniMaxM3VLConfig  # noqa: E402  (hf_oracle already skipped if absent)
from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (  # noqa: E402
    MiniMaxM3SparseForConditionalGeneration,
)


def hf_vl_model(cfg: M3Config, seed: int) -> MiniMaxM3SparseForConditionalGeneration:
    """A randomly initialised VL reference (eager attention); LayerNorm weights near one so activations stay O(1)."""
    d = cfg.to_hf_dict()
    d["text_config"] = {k: v for k, v in d["text_config"].items() if k in HF_KEYS}
    hf_cfg = MiniMaxM3VLConfig(**{k: v for k, v in d.items() if k not in ("model_type", "architectures")})
    hf_cfg._attn_implementation = "eager"
    hf_cfg.text_config._attn_implementation = "eager"
    hf_cfg.vision_config._attn_implementation = "eager"
    model = MiniMaxM3SparseForConditionalGeneration(hf_cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if not t.dtype.is_floating_point:
                continue
            if "layer_norm" in name or "layrnorm" in name:
                base, std = (1.0, 0.2) if name.endswith("weight") else (0.0, 0.2)
            elif "norm" in name or "bias" in name:
                base, std = 0.0, 0.2
            else:
                fan_in = t[0].numel() if t.dim() == 5 else t.shape[-1]  # the Conv3d kernel's fan-in is C*T*P*P
                base, std = 0.0, 1.0 if "embed_tokens" in name else 1 / math.sqrt(fan_in)
            t.copy_(base + torch.randn(t.shape, generator=g) * std)
    return model
