"""Tensor / expert parallel backend: rank 0's ``Backend`` over a group of processes, one per device.

The engine, its scheduler and sampling run unchanged on rank 0 and drive this backend as any other. Each call
that runs the model (``allocate``, ``forward``, ``mtp_forward``) first broadcasts its inputs to the workers
(``runtime.distributed_messages``: a header of sizes, then the tensors), then runs rank 0's own shard through an
ordinary torch backend; every rank's step meets the others' in the collectives inside the sharded model, and rank
0's logits (the same on every rank) go back to the engine. Pools are per rank (each holds its KV heads only), so
``page_bytes`` is one rank's: ``kv_cache_bytes`` sizes each device's pools, as vLLM's memory budget does.

Any failure inside a step ends the group (see ``runtime.distributed``): the ranks may be stopped at different
collectives, so nothing could be run after it; the error names the rank that failed.
"""

from __future__ import annotations

import weakref

import torch

from m3export.errors import M3Error
from m3export.model.batch import Batch

from .. import distributed_messages as messages
from ..distributed import LaunchSpec, ParallelGroup, resolve
from .base import Backend


class DistributedBackend(Backend):
    name = "torch-parallel"

    def __init__(self, group: ParallelGroup, local: Backend):
        """``local``: rank 0's own shard backend; ``group``: the started workers (see ``launch``)."""
        self.group, self.local = group, local
        self.config = local.config
        self.device = local.device
        self.required_page_size = local.required_page_size
        self.dtype = local.dtype
        self.world_size = group.spec.world_size
        self._failed: BaseException | None = None
        # no worker outlives the engine, also when nobody calls close() (finalize also runs at interpreter exit)
        # (rank 0's CUDA graphs are released before the group is torn down: NCCL's teardown waits for them)
        self._finalizer = weakref.finalize(self, group.close, True, local)

    @classmethod
    def launch(cls, spec: LaunchSpec) -> DistributedBackend:
        """Start ranks 1 .. N-1, build rank 0's shard here, and wait until every rank has its backend."""
        group = ParallelGroup(spec)
        try:
            local = resolve(spec.backend_factory)(spec, 0, group.device)
            group.wait_ready()
        except BaseException as exc:
            err = group.failure(wait_s=2.0) if not isinstance(exc, M3Error) else None
            group.close(graceful=False)
            if err is not None:
                raise err from exc
            raise
        return cls(group, local)

    # ------------------------------------------------------------------ the Backend interface
    @property
    def num_mtp_modules(self) -> int:
        return self.local.num_mtp_modules

    @property
    def supports_media(self) -> bool:
        return self.local.supports_media

    @property
    def default_max_num_batched_tokens(self) -> int:
        return self.local.default_max_num_batched_tokens

    @property
    def batch_device(self) -> torch.device:
        return self.local.batch_device  # the host for CUDA graphs; the broadcast moves the batch to the devices

    @property
    def replays_single_position_mtp_steps(self) -> bool:
        return self.local.replays_single_position_mtp_steps

    def page_bytes(self, page_size: int) -> int:
        return self.local.page_bytes(page_size)

    def allocate(self, num_pages: int, page_size: int) -> None:
        msg = messages.StepMessage(messages.ALLOCATE, num_pages=num_pages, page_size=page_size)
        self._run(msg, lambda: self.local.allocate(num_pages, page_size))

    def forward(self, input_ids: torch.Tensor, batch: Batch, logits_indices: torch.Tensor, media=None):
        msg = messages.StepMessage(messages.FORWARD, input_ids, batch, logits_indices, media=media)
        if media is None:
            return self._run(msg, lambda: self.local.forward(input_ids, batch, logits_indices))
        return self._run(msg, lambda: self.local.forward(input_ids, batch, logits_indices, media=media))

    def mtp_forward(self, module: int, input_ids: torch.Tensor, hidden: torch.Tensor, batch: Batch,
                    logits_indices: torch.Tensor):
        msg = messages.StepMessage(messages.MTP_FORWARD, input_ids, batch, logits_indices, module=module,
                                   hidden=hidden)
        return self._run(msg, lambda: self.local.mtp_forward(module, input_ids, hidden, batch, logits_indices))

    def encode_media(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """The vision tower runs on rank 0 only; its embeddings reach the workers with the step that places them."""
        return self.local.encode_media(pixel_values, grid_thw)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent; also at interpreter exit)."""
        self._finalizer()

    def _run(self, msg: messages.StepMessage, call):
        if self._failed is not None:
            raise M3Error(f"the parallel group failed earlier and was shut down ({self._failed}); start a new engine")
        if self.group.closed:
            raise M3Error("the parallel backend is closed")
        try:
            self.group.check()
            messages.send(msg, self.device, messages.wire_dtype(self.local))
            return call()
        except BaseException as exc:
            err = self.group.failure() if not isinstance(exc, M3Error) else None
            self._failed = err or exc
            self.group.close(graceful=False, local=self.local)
            if err is not None:
                raise err from exc
            raise


def launch_backend(source, tensor_parallel_size: int, expert_parallel: bool, device: str = "cpu",
                   dtype: torch.dtype | None = None, enforce_eager: bool = False,
                   kv_cache_dtype: str | None = None) -> DistributedBackend:
    """The parallel backend over ``source`` (checkpoint directory or preset), checked before any process starts:
    the device count (``check_world``) and that the model splits that way (``ParallelConfig.validate``)."""
    from m3export.dtypes import of_torch
    from m3export.parallel import ParallelConfig
    from m3export.sources import PRESET, source_kind

    from ..distributed import check_world

    check_world(tensor_parallel_size, str(device))
    if source_kind(str(source)) == PRESET:
        from m3export.config import preset

        cfg = preset(str(source))
    else:
        from m3export.config import M3Config

        cfg = M3Config.from_pretrained(source)
    ParallelConfig(tensor_parallel_size=tensor_parallel_size, expert_parallel=expert_parallel).validate(cfg)
    spec = LaunchSpec(str(source), tensor_parallel_size, expert_parallel, str(device),
                      None if dtype is None else of_torch(dtype).name, enforce_eager, kv_cache_dtype)
    return DistributedBackend.launch(spec)
