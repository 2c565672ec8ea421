"""The independent oracle: ``transformers``' own MiniMax M3 (``MiniMaxM3VLForCausalLM``), built from our config."""

from __future__ import annotations

import math

import torch

from m3export.config import M3Config

transformers = __import__("pytest").importorskip("transformers", minversion="5.24")
from transformers.models.minimax_m3_vl import MiniMaxM3VLTextConfig  # noqa: E402
from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (  # noqa: E402
    MiniMaxM3VLForCausalLM,
    MiniMaxM3VLIndexer,
)

HF_KEYS = set(MiniMaxM3VLTextConfig.__dataclass_fields__) | {"rope_parameters"}


def hf_model(cfg: M3Config, seed: int) -> MiniMaxM3VLForCausalLM:
    """A randomly initialised reference model, norm weights and routing bias included (eager attention)."""
    d = {k: v for k, v in cfg.to_hf_dict().items() if k in HF_KEYS}
    hf_cfg = MiniMaxM3VLTextConfig(**d)
    hf_cfg._attn_implementation = "eager"
    model = MiniMaxM3VLForCausalLM(hf_cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.dtype.is_floating_point or "inv_freq" in name:
                continue
            std = 0.2 if ("norm" in name or "bias" in name) else (1.0 if "embed" in name else 1 / math.sqrt(t.shape[-1]))
            t.copy_(torch.randn(t.shape, generator=g) * std)
    return model


def hf_forward(model: MiniMaxM3VLForCausalLM, ids: torch.Tensor):
    """Logits [B, T, V] and, per sparse layer, the block selection [B, T, Hidx, topk] (sorted, -1 padded)."""
    captured = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: captured.append(out))
             for m in model.modules() if isinstance(m, MiniMaxM3VLIndexer)]
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, [c.transpose(1, 2) for c in captured]


def canonical_selection(sel: torch.Tensor, topk: int) -> torch.Tensor:
    """Selections as sets: -1 padded to ``topk`` entries, sorted, so implementations with different orders compare."""
    if sel.shape[-1] < topk:
        sel = torch.cat([sel, sel.new_full((*sel.shape[:-1], topk - sel.shape[-1]), -1)], dim=-1)
    return sel.to(torch.int64).sort(dim=-1).values
