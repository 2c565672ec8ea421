"""CUDA-graph decode for the torch backend: decode-only steps are captured once per batch bucket and replayed.

A decode step launches hundreds of small kernels whose launch gaps, not their bytes, set its time at small batch.
``GraphedTorchBackend`` is a ``TorchBackend`` whose ``forward`` recognises a decode-only step from shapes alone
(one new token per sequence, every token sampled: ``T == B == len(logits_indices)``), pads it to the smallest
bucket (1, 2, 4, ..., 64) that holds it and replays that bucket's graph; mixed or prefill steps, batches past the
largest bucket, MTP modules, and everything on a device without CUDA graphs run eagerly, exactly as
``TorchBackend``.

Padding rows are decode tokens of length-1 sequences that live on one scratch page which the backend allocates
beyond the pages the engine owns (the engine never addresses it), so they write and read nothing of any request.
Block tables are padded to one fixed width (the longest sequence the pool can hold), so one bucket is one set of
input shapes whatever the context lengths. The graph needs every op of the step to be capturable (no host
synchronisation): with the Triton kernels registered (``m3export.plugins.kernels.register``) the step is; the
reference ops are not (they read lengths on the host), and a failed capture turns graphs off with one warning.
"""

from __future__ import annotations

import logging

import torch

from m3export.model.batch import Batch

from .torch_backend import TorchBackend

log = logging.getLogger("m3export.runtime")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def decode_bucket(num_tokens: int, num_seqs: int, num_logits: int, buckets: tuple[int, ...]) -> int | None:
    """The bucket a step is replayed in, or None when it must run eagerly (not decode-only, or too large)."""
    if not (num_tokens == num_seqs == num_logits):
        return None
    return next((b for b in buckets if b >= num_seqs), None)


class DecodeInputs:
    """The static input buffers of one bucket: what a captured graph reads, refilled before every replay."""

    def __init__(self, bucket: int, table_width: int, scratch_page: int, page_size: int, device):
        self.bucket = bucket
        self.input_ids = torch.zeros(bucket, dtype=torch.int64, device=device)
        self.logits_indices = torch.arange(bucket, dtype=torch.int64, device=device)
        self.batch = Batch(
            positions=torch.zeros(bucket, dtype=torch.int64, device=device),
            query_start_loc=torch.arange(bucket + 1, dtype=torch.int32, device=device),
            seq_lens=torch.ones(bucket, dtype=torch.int32, device=device),
            block_tables=torch.zeros((bucket, table_width), dtype=torch.int32, device=device),
            slot_mapping=torch.zeros(bucket, dtype=torch.int64, device=device),
        )
        self._scratch_slot = scratch_page * page_size
        self._scratch_page = scratch_page

    def fill(self, input_ids: torch.Tensor, batch: Batch) -> None:
        """Copy a decode step of B <= bucket sequences in; rows past B become scratch-page padding."""
        b, w = input_ids.shape[0], batch.block_tables.shape[1]
        s = self.batch
        if w > s.block_tables.shape[1]:
            raise ValueError(f"block table of {w} pages is wider than the captured {s.block_tables.shape[1]}")
        self.input_ids[:b].copy_(input_ids)
        self.input_ids[b:].zero_()
        s.positions[:b].copy_(batch.positions)
        s.positions[b:].zero_()
        s.seq_lens[:b].copy_(batch.seq_lens)
        s.seq_lens[b:].fill_(1)
        s.slot_mapping[:b].copy_(batch.slot_mapping)
        s.slot_mapping[b:].fill_(self._scratch_slot)
        s.block_tables[:b, :w].copy_(batch.block_tables)
        s.block_tables[:b, w:].zero_()
        s.block_tables[b:].zero_()
        s.block_tables[b:, 0] = self._scratch_page
        # query_start_loc is arange(bucket + 1) for every decode step: one token per sequence.


class GraphedTorchBackend(TorchBackend):
    """``TorchBackend`` with decode steps replayed from CUDA graphs (see the module docstring)."""

    def __init__(self, model, cache_dtype: torch.dtype | None = None, buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                 use_graphs: bool | None = None, max_model_len: int | None = None, pad_eagerly: bool = False):
        """``max_model_len`` bounds the padded block-table width (default: the whole pool). ``pad_eagerly`` runs
        the padded bucket shapes without a graph: the same inputs a graph sees, on any device (tests, and to
        tell a capture problem from a padding one)."""
        super().__init__(model, cache_dtype)
        self.buckets = tuple(sorted(buckets))
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        self.max_model_len = max_model_len
        self.pad_eagerly = pad_eagerly
        self._graphs: dict[int, tuple] = {}
        self._inputs: dict[int, DecodeInputs] = {}
        self._pool = None
        self.replays = 0  # decode steps served from a graph (for benchmarks and tests)

    def allocate(self, num_pages: int, page_size: int) -> None:
        super().allocate(num_pages + 1, page_size)  # page num_pages: scratch for padding rows
        self._scratch_page, self._page_size = num_pages, page_size
        width = num_pages if self.max_model_len is None else -(-self.max_model_len // page_size)
        self._table_width = min(num_pages, width)  # no sequence holds more pages than this
        self._graphs.clear()
        self._inputs.clear()

    def padded_inputs(self, input_ids: torch.Tensor, batch: Batch, bucket: int) -> DecodeInputs:
        """The bucket's static inputs filled with this step (also what eager padding runs on, for tests)."""
        if bucket not in self._inputs:
            self._inputs[bucket] = DecodeInputs(bucket, self._table_width, self._scratch_page, self._page_size,
                                                self.device)
        inputs = self._inputs[bucket]
        inputs.fill(input_ids, batch)
        return inputs

    def forward(self, input_ids, batch: Batch, logits_indices):
        if self._caches is None:
            raise RuntimeError("GraphedTorchBackend.forward before allocate()")
        bucket = decode_bucket(input_ids.shape[0], batch.seq_lens.shape[0], logits_indices.shape[0], self.buckets)
        if bucket is None or not (self.use_graphs or self.pad_eagerly):
            return super().forward(input_ids, batch, logits_indices)
        b = input_ids.shape[0]
        inputs = self.padded_inputs(input_ids, batch, bucket)
        if self.pad_eagerly:
            with torch.inference_mode():
                out = self.model.step(inputs.input_ids, inputs.batch, self._caches, inputs.logits_indices,
                                      inplace=True)
            return out.logits[:b].float(), out.hidden[:b]
        if bucket not in self._graphs:
            try:
                self._graphs[bucket] = self._capture(inputs)
            except Exception as exc:  # an op that synchronises with the host cannot be captured
                log.warning("CUDA-graph capture of decode bucket %d failed (%s: %s); decoding eagerly", bucket,
                            type(exc).__name__, str(exc)[:200])
                self.use_graphs = False
                torch.cuda.synchronize(self.device)
                return super().forward(input_ids, batch, logits_indices)
        graph, logits, hidden = self._graphs[bucket]
        graph.replay()
        self.replays += 1
        return logits[:b].float().clone(), hidden[:b].clone()

    def _capture(self, inputs: DecodeInputs):
        def step():
            out = self.model.step(inputs.input_ids, inputs.batch, self._caches, inputs.logits_indices, inplace=True)
            return out.logits, out.hidden

        with torch.inference_mode():
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: compiles kernels, sizes the allocator, outside the graph
                step()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._pool):
                logits, hidden = step()
        return graph, logits, hidden
