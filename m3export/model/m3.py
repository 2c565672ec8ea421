"""The M3 text backbone with its MTP modules, written once for the paged, flattened batch.

``step`` is what the runtime and the exporter call. ``forward(input_ids)`` is the cache-free reference
(positions 0..T-1): it lays each sequence on fresh pages and runs the very same ``step``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .. import ops  # noqa: F401  (registers torch.ops.m3.*)
from ..config import M3Config
from ..errors import MediaError
from . import fusion
from .attention import ChooseBlocks
from .batch import Batch
from .layer import DecoderLayer
from .media import VisionEncoder, encode_items, place_tokens
from .mtp import MTPModule
from .norm import RMSNorm, add_norm
from .projector import MultiModalProjector
from .rope import Rotary
from .vision import VisionTower

LayerCache = tuple  # (k_pool, v_pool) or (k_pool, v_pool, index_k_pool)


@dataclass
class StepOutput:
    logits: torch.Tensor  # [N, vocab] at the requested token indices
    hidden: torch.Tensor  # [T, hidden] after the final norm (what the MTP modules read)
    caches: list  # updated per-layer cache tuples
    selections: list  # [T, Hkv, topk] int32 per sparse layer, in layer order


class M3TextModel(nn.Module):
    def __init__(self, cfg: M3Config, mxfp8: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, cfg.is_sparse_layer(i), cfg.is_moe_layer(i), mxfp8) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class M3ForCausalLM(nn.Module):
    def __init__(self, cfg: M3Config, mxfp8: bool = False, num_mtp_modules: int | None = None):
        super().__init__()
        self.config = cfg
        self.mxfp8 = mxfp8
        self.model = M3TextModel(cfg, mxfp8)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        n_mtp = cfg.num_mtp_modules if num_mtp_modules is None else num_mtp_modules
        self.mtp = nn.ModuleList(MTPModule(cfg, mxfp8) for _ in range(n_mtp))
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)
        # Vision tower + projector (floating point even in an MXFP8 model: the release does not quantise the tower).
        self.vision_tower = VisionTower(cfg.vision) if cfg.vision is not None else None
        self.multi_modal_projector = (MultiModalProjector(cfg.vision, cfg.hidden_size)
                                      if cfg.vision is not None else None)

    def fuse_projections(self) -> None:
        """Every attention layer's input projections (main layers and MTP modules) in one buffer each, their
        parameters views into it (``Attention.fuse_projections``): on CUDA with the kernels active they then run
        as one launch per layer. Call once the weights are on the device (the torch backend does); the state dict,
        export and the plain path are unchanged."""
        for layer in [*self.model.layers, *(m.transformer_layer for m in self.mtp)]:
            layer.self_attn.fuse_projections()

    # ------------------------------------------------------------------ caches
    def cache_shapes(self, num_pages: int, page_size: int, layers: str = "main", scales: bool = False
                     ) -> list[tuple[tuple[int, ...], ...]]:
        """Pool shapes per layer: K and V [pages, page, Hkv, D]; index keys [pages, page, D] on sparse layers.
        ``scales`` (FP8 pools): each pool's fp32 scale pool follows, its shape without the last dimension
        (``m3export.ops.kv_fp8``)."""
        c = self.config
        kv = (num_pages, page_size, c.num_key_value_heads, c.head_dim)
        ik = (num_pages, page_size, c.index_head_dim)
        sparse = [c.is_sparse_layer(i) for i in range(c.num_hidden_layers)] if layers == "main" else [True] * len(self.mtp)
        pools = [(kv, kv, ik) if s else (kv, kv) for s in sparse]
        return [p + tuple(x[:-1] for x in p) for p in pools] if scales else pools

    def allocate_caches(self, num_pages: int, page_size: int, dtype: torch.dtype, device, layers: str = "main"):
        """Zeroed pools of ``dtype``; for float8_e4m3fn also their float32 scale pools (see ``cache_shapes``)."""
        from m3export.ops.kv_fp8 import FP8, SCALE_DTYPE

        fp8 = dtype == FP8
        out = []
        for shapes in self.cache_shapes(num_pages, page_size, layers, scales=fp8):
            n = len(shapes) // 2 if fp8 else len(shapes)
            out.append(tuple(torch.zeros(s, dtype=dtype if i < n else SCALE_DTYPE, device=device)
                             for i, s in enumerate(shapes)))
        return out

    def check_caches(self, caches: list, layers: str = "main") -> None:
        """Every layer's pool tuple has the layout its attention reads (``Attention.check_cache``), one error naming
        the layer otherwise. Called once where a backend takes its pools, not per step."""
        attn = ([layer.self_attn for layer in self.model.layers] if layers == "main"
                else [m.transformer_layer.self_attn for m in self.mtp])
        if len(caches) != len(attn):
            raise ValueError(f"{layers} caches: {len(caches)} layers of pools for {len(attn)} layers")
        for i, (a, cache) in enumerate(zip(attn, caches)):
            a.check_cache(cache, f"{'layer' if layers == 'main' else 'MTP module'} {i}")

    # ------------------------------------------------------------------ runtime path
    def step(self, input_ids: torch.Tensor, batch: Batch, caches: list, logits_indices: torch.Tensor | None = None,
             inplace: bool = True, inputs_embeds: torch.Tensor | None = None,
             choose_blocks: Callable[[int], ChooseBlocks | None] | None = None) -> StepOutput:
        """One forward over a flattened mixed batch; writes the new tokens' K/V/index keys into the pools.

        ``inputs_embeds`` [T, H], when given, replaces the token embeddings (media tokens already placed).
        ``choose_blocks(layer)``, when given, returns sparse layer ``layer``'s ``ChooseBlocks`` hook (or None):
        given selections, as ``m3export verify`` feeds another runtime's near-tie swaps back; None computes them."""
        h = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        h, pending, new_caches, selections = self._layers(h, batch, caches, range(len(self.model.layers)), inplace,
                                                          choose_blocks)
        logits, hidden = self.head(h, logits_indices, pending, inplace)
        return StepOutput(logits, hidden, new_caches, selections)

    def run_layers(self, h: torch.Tensor, batch: Batch, caches: list, layers: range, inplace: bool = True,
                   choose_blocks: Callable[[int], ChooseBlocks | None] | None = None):
        """Decoder layers ``layers`` on the residual stream h [T, H] (``caches`` are those layers' pools, in order);
        one group of layers is what a split export puts in one graph. ``choose_blocks``: as in ``step``."""
        h, pending, new_caches, selections = self._layers(h, batch, caches, layers, inplace, choose_blocks)
        return (h if pending is None else h + pending), new_caches, selections

    def _layers(self, h: torch.Tensor, batch: Batch, caches: list, layers: range, inplace: bool,
                choose_blocks: Callable[[int], ChooseBlocks | None] | None):
        """``run_layers`` with the last layer's MLP output returned beside h, not added (``step`` leaves that add
        to the final norm: ``DecoderLayer``)."""
        cos, sin = self.rotary(batch.positions, h.dtype)
        new_caches, selections, pending = [], [], None
        for i, cache in zip(layers, caches):
            hook = None if choose_blocks is None else choose_blocks(i)
            h, pending, cache, sel = self.model.layers[i](h, cos, sin, batch, cache, inplace, hook, pending)
            new_caches.append(cache)
            if sel is not None:
                selections.append(sel)
        return h, pending, new_caches, selections

    def head(self, h: torch.Tensor, logits_indices: torch.Tensor | None = None, pending: torch.Tensor | None = None,
             inplace: bool = False):
        """Final norm + lm_head -> (logits at logits_indices (all tokens if None), final-normed hidden [T, H]).
        ``pending``: the last layer's MLP output, added to h here; ``inplace`` (the runtime's steps, not export)
        lets the add and the norm run fused (``fusion.use_fused_kernels``)."""
        hidden, _ = add_norm(self.model.norm, h, pending, fusion.use_fused_kernels(h, inplace))
        picked = hidden if logits_indices is None else hidden.index_select(0, logits_indices)
        return self.lm_head(picked), hidden

    def mtp_step(self, k: int, input_ids: torch.Tensor, hidden: torch.Tensor, batch: Batch, cache,
                 logits_indices: torch.Tensor | None = None, inplace: bool = True,
                 choose_blocks: ChooseBlocks | None = None):
        """MTP module ``k``: input_ids are the *next* tokens x_{t+1}, hidden the h_t they pair with.

        Returns (logits at logits_indices, pre-norm output hidden [T, H] for chaining, cache, selection).
        ``choose_blocks``: the module's sparse layer's ``ChooseBlocks`` hook (None: its own selection).
        """
        e = self.model.embed_tokens(input_ids)
        e = torch.where((batch.positions == 0)[:, None], torch.zeros_like(e), e)
        cos, sin = self.rotary(batch.positions, e.dtype)
        out, normed, cache, sel = self.mtp[k](e, hidden, cos, sin, batch, cache, inplace, choose_blocks)
        picked = normed if logits_indices is None else normed.index_select(0, logits_indices)
        return self.lm_head(picked), out, cache, sel

    # ------------------------------------------------------------------ media
    def vision_encoder(self) -> VisionEncoder:
        """Tower + projector as one module (one item per call): what the runtime and the exporter run."""
        if self.vision_tower is None:
            raise MediaError("this model has no vision tower (its config has no vision_config): images and video "
                             "cannot be encoded")
        return VisionEncoder(self.vision_tower, self.multi_modal_projector)

    def encode_media(self, pixel_values: torch.Tensor, grid_thw, what: str = "image") -> list[torch.Tensor]:
        """pixel_values [patches, patch_dim] + grid_thw [items, 3] -> one [tokens, H] block per item."""
        return encode_items(self.vision_encoder(), self.config.vision, pixel_values, grid_thw, what)

    def embed(self, input_ids: torch.Tensor, pixel_values=None, image_grid_thw=None, pixel_values_videos=None,
              video_grid_thw=None) -> torch.Tensor:
        """input_ids [T] -> embeddings [T, H], image and video tokens placed at their placeholders."""
        e = self.model.embed_tokens(input_ids)
        for what, pixels, grid in (("image", pixel_values, image_grid_thw), ("video", pixel_values_videos,
                                                                              video_grid_thw)):
            if pixels is None:
                continue
            tokens = torch.cat(self.encode_media(pixels, grid, what), dim=0)
            v = self.config.vision
            e = place_tokens(e, input_ids, v.image_token_index if what == "image" else v.video_token_index,
                             tokens, what)
        return e

    # ------------------------------------------------------------------ cache-free reference
    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None, pixel_values_videos: torch.Tensor | None = None,
                video_grid_thw: torch.Tensor | None = None, return_selections: bool = False):
        """input_ids [B, T] (positions 0..T-1, no padding) -> logits [B, T, vocab].

        Media keyword names are ``transformers``': image / video patches for all rows of the batch, in the
        order their placeholders appear in ``input_ids`` flattened row by row."""
        bsz, length = input_ids.shape
        page = 16
        batch = Batch.contiguous(bsz, length, page, input_ids.device)
        caches = self.allocate_caches(bsz * -(-length // page), page, self.lm_head.weight.dtype, input_ids.device)
        embeds = None
        if pixel_values is not None or pixel_values_videos is not None:
            embeds = self.embed(input_ids.reshape(-1), pixel_values, image_grid_thw, pixel_values_videos,
                                video_grid_thw)
        out = self.step(input_ids.reshape(-1), batch, caches, inputs_embeds=embeds)
        logits = out.logits.view(bsz, length, -1)
        if return_selections:
            return logits, [s.view(bsz, length, *s.shape[1:]) for s in out.selections]
        return logits
