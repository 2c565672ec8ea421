"""The M3 vision tower: Conv3d patch embedding, LayerNorm, then a ViT whose attention carries 3D rotary.

One call encodes one media item (an image, or one chunk of a video's temporal patches): attention spans all of
the item's patches and nothing else, so a batch of items is a loop over items, each a plain dense attention
over a dynamic number of patches. That is also exactly the graph the exporter writes (one item per run).

Patches arrive flattened as ``[N, C * T * P * P]`` in spatial-merge block order (each 2 x 2 group of neighbouring
patches consecutive), the order the preprocessing writes and the projector's merge expects.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..config import VisionConfig

ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def vision_position_ids(t: int, h: int, w: int, merge: int, device=None) -> torch.Tensor:
    """(temporal, row, column) of every patch of a t x h x w grid, in the patches' block-major order: [t*h*w, 3]."""
    if h % merge or w % merge:
        raise ValueError(f"grid {h} x {w} is not a multiple of the spatial merge size {merge}")
    rows = torch.arange(h, device=device)[:, None].expand(h, w)
    cols = torch.arange(w, device=device)[None, :].expand(h, w)
    block = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(block).transpose(1, 2).reshape(-1)
    cols = cols.reshape(block).transpose(1, 2).reshape(-1)
    frames = torch.arange(t, device=device).repeat_interleave(h * w)
    return torch.stack([frames, rows.repeat(t), cols.repeat(t)], dim=-1)


class PatchEmbedding(nn.Module):
    """The checkpoint's Conv3d kernel [hidden, C, T, P, P] applied as one matmul: stride == kernel, so each
    flattened patch meets the flattened kernel once (and the exported graph is a MatMul, not a Conv)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.num_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(pixel_values.to(w.dtype), w.reshape(w.shape[0], -1))


class VisionRotary(nn.Module):
    """Axial 3D RoPE: each of t, h, w gets the same ``2 * ((head_dim // 3) // 2)``-dim frequency band; the bands
    are laid side by side, duplicated for the rotate-half pairing, and cover the leading dims of every head."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.theta = cfg.rope_theta
        self.band = 2 * ((cfg.head_dim // 3) // 2)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [N, 3] -> cos, sin [N, 3 * band] (fp32 angles, rounded to the activation dtype).

        The frequencies are recomputed per call (band/2 values): no buffer to restore after a ``meta`` build."""
        exponent = torch.arange(0, self.band, 2, dtype=torch.float, device=position_ids.device) / self.band
        inv_freq = 1.0 / (self.theta ** exponent)
        freqs = (position_ids[..., None].float() * inv_freq).flatten(1)
        freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_vision_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D]: dims [0, R) rotate with the rotate-half pairing (i, i + R/2); the rest pass through."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
    turned = torch.cat([-x2, x1], dim=-1)
    return torch.cat([rot * cos[:, None, :] + turned * sin[:, None, :], rest], dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d = cfg.hidden_size
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q = apply_vision_rope(self.q_proj(x).view(n, self.heads, self.head_dim), cos, sin)
        k = apply_vision_rope(self.k_proj(x).view(n, self.heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(n, self.heads, self.head_dim)
        # [1, heads, N, D]: one item, every patch sees every patch (the exporter's attention wants 4-D).
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        return self.out_proj(o[0].transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """Pre-norm: x += Attn(LN1(x)); x += MLP(LN2(x))."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), cos, sin)
        return x + self.mlp(self.layer_norm2(x))


class VisionTower(nn.Module):
    """Parameter names follow ``transformers`` (``embeddings.proj``, ``pre_layrnorm``, ``layers.{i}``)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = PatchEmbedding(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.rotary = VisionRotary(cfg)

    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One item: pixel_values [N, patch_dim], position_ids [N, 3] -> hidden states [N, hidden]."""
        h = self.embeddings(pixel_values).to(self.pre_layrnorm.weight.dtype)
        cos, sin = self.rotary(position_ids, h.dtype)
        h = self.pre_layrnorm(h)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return h
