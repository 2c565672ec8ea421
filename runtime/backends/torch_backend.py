"""PyTorch backend: ``M3ForCausalLM.step`` / ``mtp_step`` on pools it allocates with the model.

On CPU the custom ops run their reference implementations; on a CUDA device the backend makes the Triton kernels
of ``m3export.plugins.kernels`` their implementation (``use_on``), with no other change here.
"""

from __future__ import annotations

import torch

from m3export.model import M3ForCausalLM, fusion
from m3export.model.batch import Batch
from m3export.model.media import place_rows

from ..scheduler import CPU_TOKEN_BUDGET, default_token_budget
from .base import Backend


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, model: M3ForCausalLM, cache_dtype: torch.dtype | None = None):
        self.model = model.eval()
        self.config = model.config
        self.device = model.lm_head.weight.device
        self.dtype = cache_dtype or model.lm_head.weight.dtype
        # CUDA: the kernels serve the ops, each layer's projections one launch
        self.kernels = fusion.serve_on(model, self.device)
        self._caches: list | None = None
        self._mtp_caches: list | None = None

    @property
    def default_max_num_batched_tokens(self) -> int:
        """With the Triton kernels on a GPU a prefill chunk streams its attention (memory linear in the chunk), so
        the step takes the device's budget (``scheduler.default_token_budget``); the reference ops on CUDA hold
        [heads, chunk, context] scores, and keep the CPU's."""
        return default_token_budget(self.device) if self.kernels else CPU_TOKEN_BUDGET

    @property
    def takes_device_token_ids(self) -> bool:
        return True  # the model embeds ids wherever they are; the graphed subclass copies them into its inputs

    @property
    def num_mtp_modules(self) -> int:
        return len(self.model.mtp)

    def page_bytes(self, page_size: int) -> int:
        """Every pool's bytes for one page, the scale pools of an FP8 cache included (built on ``meta``)."""
        pools = [p for layers in ("main", "mtp")
                 for layer in self.model.allocate_caches(1, page_size, self.dtype, "meta", layers) for p in layer]
        return sum(p.numel() * p.element_size() for p in pools)

    def allocate(self, num_pages: int, page_size: int) -> None:
        m = self.model
        self._caches = m.allocate_caches(num_pages, page_size, self.dtype, self.device, layers="main")
        self._mtp_caches = m.allocate_caches(num_pages, page_size, self.dtype, self.device, layers="mtp")
        m.check_caches(self._caches, "main")  # once here: the layers' forwards do not check per step
        m.check_caches(self._mtp_caches, "mtp")

    def forward(self, input_ids, batch: Batch, logits_indices, media=None):
        if self._caches is None:
            raise RuntimeError("TorchBackend.forward before allocate()")
        with torch.inference_mode():
            embeds = None
            if media is not None:  # image / video tokens over the placeholders' token embeddings
                rows, values = media
                e = self.model.model.embed_tokens(input_ids)
                embeds = place_rows(e, rows.to(e.device), values.to(e.device))
            out = self.model.step(input_ids, batch, self._caches, logits_indices, inplace=True, inputs_embeds=embeds)
        self._caches = out.caches
        return out.logits.float(), out.hidden

    def encode_media(self, pixel_values, grid_thw):
        with torch.inference_mode():
            return self.model.encode_media(pixel_values.to(self.device), grid_thw)

    def mtp_forward(self, module, input_ids, hidden, batch: Batch, logits_indices):
        if self._mtp_caches is None:
            raise RuntimeError("TorchBackend.mtp_forward before allocate()")
        with torch.inference_mode():
            logits, out, cache, _ = self.model.mtp_step(module, input_ids, hidden, batch, self._mtp_caches[module],
                                                        logits_indices, inplace=True)
        self._mtp_caches[module] = cache
        return logits.float(), out
