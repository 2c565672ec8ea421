"""The one interface the engine drives: run the target model or an MTP module on a flattened paged batch.

A backend owns the cache pools (their memory layout is its business: torch tensors, ORT values bound in place,
TensorRT buffers); the engine owns which pages each request uses and passes that in every ``Batch``. Inputs and
outputs cross the interface as CPU-or-device torch tensors so sampling and scheduling stay backend-agnostic.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod

import torch

from m3export.config import M3Config
from m3export.model.batch import Batch


class Backend(ABC):
    name: str = "?"
    config: M3Config
    #: Pages of a fixed size baked into the graph, or None when the engine may choose.
    required_page_size: int | None = None
    #: Where batch tensors are built for this backend (the pools live there too).
    device: torch.device = torch.device("cpu")

    @property
    def default_max_num_batched_tokens(self) -> int:
        """Tokens per step when the engine is given none: the CPU's budget (``scheduler.CPU_TOKEN_BUDGET``) unless
        the backend's prefill streams attention on a GPU (the torch backend with the Triton kernels). The ONNX
        graphs' function bodies hold a chunk's [tokens, heads, context] scores, which ONNX Runtime's CUDA kernels
        index with 32-bit ints (``docs/ops.md``: 512-token chunks stay below 2^31 elements up to 64k context, 8192
        would not past 4k); the TensorRT backend is not measured with larger chunks."""
        from ..scheduler import CPU_TOKEN_BUDGET

        return CPU_TOKEN_BUDGET

    @property
    def batch_device(self) -> torch.device:
        """Where the engine builds a step's batch: ``device`` unless the backend copies batches into buffers of
        its own (CUDA-graph inputs), which then takes them on the host: one host-to-device copy instead of two
        copies, and the batch's layout readable without a device-to-host copy."""
        return self.device

    @property
    def replays_single_position_mtp_steps(self) -> bool:
        """MTP module steps of one position per request are replayed (CUDA graphs), so the drafter keeps its calls
        to that shape; otherwise it merges each module's pending positions into one call (fewer, longer calls)."""
        return False

    @property
    def takes_device_token_ids(self) -> bool:
        """``forward`` / ``mtp_forward`` accept ``input_ids`` already on the device where their logits are (the
        rest of the batch still on ``batch_device``): the drafter and the engine then leave draft tokens there
        instead of reading each one back (``runtime/device_drafts.py``). Backends that feed host arrays keep the
        default and get the drafts' values read back at every chain step."""
        return False

    @property
    def stages_draft_tokens(self) -> bool:
        """``forward`` takes the host ``input_ids`` of a batch built on the host together with ``drafts=`` (the
        (row, round, flat index) places of ``device_drafts.fill_tokens`` whose values are still on the device) and
        puts them in place itself: a backend that copies its inputs from a host staging image (CUDA graphs) copies
        the drafts straight into it, instead of getting ids sent to the device, drafts scattered there and the
        whole row copied back into its staging image to be sent again."""
        return False

    @property
    def replays_mtp_chains(self) -> bool:
        """``mtp_chain`` may run a speculative round's MTP calls as one (CUDA graphs); the drafter then builds
        one batch per round instead of one per call."""
        return False

    def mtp_chain(self, plan: tuple[tuple[int, int, int], ...], input_ids: torch.Tensor, hidden: torch.Tensor,
                  batch: Batch) -> torch.Tensor | None:
        """A greedy round of MTP calls (``drafter.chain_plan``: (module, first, end) per call, positions relative
        to each sequence's first) over B sequences of q kept positions and k drafts: ``batch`` covers each
        sequence's q + k - 1 positions, ``input_ids`` [B * (q + k - 1)] their kept tokens (chain slots: any
        value), ``hidden`` [B * q, H] the target's hidden states at the kept positions. Writes what the calls
        one by one would write and returns the drafts [B, k] int64 on the device (argmax of each call's last
        position), or None when this shape is not replayed (the drafter then makes the calls itself)."""
        return None

    @property
    @abstractmethod
    def num_mtp_modules(self) -> int:
        """MTP modules with weights; 0 means the engine cannot speculate."""

    @abstractmethod
    def page_bytes(self, page_size: int) -> int:
        """Bytes one page takes across every pool (main, index keys, all MTP modules): for sizing."""

    @abstractmethod
    def allocate(self, num_pages: int, page_size: int) -> None:
        """Create every pool (main model and each MTP module), all addressed by the same page ids."""

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, batch: Batch, logits_indices: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Target model step: writes the new tokens' K/V and index keys; returns (logits [N, V] float32,
        final-normed hidden [T, H])."""

    @property
    def supports_media(self) -> bool:
        """Images / video: the model has a vision tower, ``encode_media`` works and ``forward`` takes
        ``media=(rows [M], embeddings [M, H])`` (placed over the token embeddings at those rows)."""
        return self.config.vision is not None and "media" in inspect.signature(self.forward).parameters

    def encode_media(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """One media item's patches -> one [tokens, H] block per ``grid_thw`` row."""
        from m3export.errors import MediaError

        raise MediaError(f"the {self.name} backend does not run the vision encoder (use the torch backend)")

    def close(self) -> None:
        """Release resources held outside this object (processes, process groups, ONNX Runtime sessions); a no-op
        for most backends."""

    @abstractmethod
    def mtp_forward(self, module: int, input_ids: torch.Tensor, hidden: torch.Tensor, batch: Batch,
                    logits_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP module ``module`` at positions t with tokens x_{t+1} and hidden h_t; writes its own caches;
        returns (logits [N, V] float32, output hidden [T, H] for chaining)."""
