"""CUDA-graph decode for the torch backend: decode-only steps are captured once per batch bucket and replayed.

A decode step launches hundreds of small kernels whose launch gaps, not their bytes, set its time at small batch.
``GraphedTorchBackend`` is a ``TorchBackend`` whose ``forward`` recognises a decode-only step from shapes alone
(one new token per sequence, every token sampled: ``T == B == len(logits_indices)``) or an MTP verification step
(the same number 1 + k of tokens in every sequence, all sampled), pads it to the smallest bucket (1, 2, 4, ..., 64)
that holds it and replays that (bucket, tokens per sequence) graph; mixed or prefill steps, batches past the
largest bucket, the MTP modules' own steps, and everything on a device without CUDA graphs run eagerly, exactly
as ``TorchBackend``.

Padding rows are the tokens of short sequences that live on one scratch page which the backend allocates
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


def step_shape(input_ids: torch.Tensor, batch: Batch, logits_indices: torch.Tensor, buckets: tuple[int, ...],
               page_size: int) -> tuple[int, int] | None:
    """(bucket, tokens per sequence) for a step that can be replayed, else None.

    Replayable: every sequence has the same number q of new tokens and every token's logits are wanted: plain
    decode (q = 1) and MTP verification of k drafts (q = 1 + k). A verify step's uniformity is read from
    ``query_start_loc`` (one tiny device-to-host copy; the engine has already synchronised on the previous step's
    logits); a decode step is recognised from shapes alone. Padding sequences hold their q tokens in one scratch
    page, so q may not exceed a page.
    """
    t, b, n = input_ids.shape[0], batch.seq_lens.shape[0], logits_indices.shape[0]
    if b == 0 or t % b or n != t:
        return None
    q = t // b
    bucket = next((c for c in buckets if c >= b), None)
    if bucket is None or q > page_size:
        return None
    if q > 1:
        expected = torch.arange(0, t + 1, q, dtype=batch.query_start_loc.dtype)
        if not torch.equal(batch.query_start_loc.cpu(), expected) or not torch.equal(
                logits_indices.cpu(), torch.arange(t, dtype=logits_indices.dtype)):
            return None
    return bucket, q


class DecodeInputs:
    """The static input buffers of one (bucket, q) shape: what a captured graph reads, refilled before every replay.

    Real sequences fill the first B slots; padding sequences have q tokens at positions 0 .. q-1 of the scratch page.
    """

    def __init__(self, bucket: int, q: int, table_width: int, scratch_page: int, page_size: int, device):
        self.bucket, self.q = bucket, q
        rows = bucket * q
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.logits_indices = torch.arange(rows, dtype=torch.int64, device=device)
        self.batch = Batch(
            positions=torch.zeros(rows, dtype=torch.int64, device=device),
            query_start_loc=torch.arange(0, rows + 1, q, dtype=torch.int32, device=device),
            seq_lens=torch.full((bucket,), q, dtype=torch.int32, device=device),
            block_tables=torch.zeros((bucket, table_width), dtype=torch.int32, device=device),
            slot_mapping=torch.zeros(rows, dtype=torch.int64, device=device),
        )
        offsets = torch.arange(q, device=device).repeat(bucket)
        self._pad_positions = offsets
        self._pad_slots = scratch_page * page_size + offsets
        self._scratch_page = scratch_page

    def fill(self, input_ids: torch.Tensor, batch: Batch) -> None:
        """Copy a step of B <= bucket sequences of q tokens each in; the rest becomes scratch-page padding."""
        t, b, w = input_ids.shape[0], batch.seq_lens.shape[0], batch.block_tables.shape[1]
        s = self.batch
        if w > s.block_tables.shape[1]:
            raise ValueError(f"block table of {w} pages is wider than the captured {s.block_tables.shape[1]}")
        self.input_ids[:t].copy_(input_ids)
        self.input_ids[t:].zero_()
        s.positions[:t].copy_(batch.positions)
        s.positions[t:].copy_(self._pad_positions[t:])
        s.seq_lens[:b].copy_(batch.seq_lens)
        s.seq_lens[b:].fill_(self.q)
        s.slot_mapping[:t].copy_(batch.slot_mapping)
        s.slot_mapping[t:].copy_(self._pad_slots[t:])
        s.block_tables[:b, :w].copy_(batch.block_tables)
        s.block_tables[:b, w:].zero_()
        s.block_tables[b:].zero_()
        s.block_tables[b:, 0] = self._scratch_page
        # query_start_loc is arange(0, bucket * q + 1, q) for every such step.


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
        self._graphs: dict[tuple[int, int], tuple] = {}
        self._inputs: dict[tuple[int, int], DecodeInputs] = {}
        self._pool = None
        self.replays = 0  # decode steps served from a graph (for benchmarks and tests)

    def allocate(self, num_pages: int, page_size: int) -> None:
        super().allocate(num_pages + 1, page_size)  # page num_pages: scratch for padding rows
        self._scratch_page, self._page_size = num_pages, page_size
        width = num_pages if self.max_model_len is None else -(-self.max_model_len // page_size)
        self._table_width = min(num_pages, width)  # no sequence holds more pages than this
        self._graphs.clear()
        self._inputs.clear()

    def padded_inputs(self, input_ids: torch.Tensor, batch: Batch, key: tuple[int, int]) -> DecodeInputs:
        """The static inputs of shape ``key`` = (bucket, q) filled with this step (also what eager padding runs)."""
        if key not in self._inputs:
            self._inputs[key] = DecodeInputs(*key, self._table_width, self._scratch_page, self._page_size,
                                             self.device)
        inputs = self._inputs[key]
        inputs.fill(input_ids, batch)
        return inputs

    def forward(self, input_ids, batch: Batch, logits_indices, media=None):
        if self._caches is None:
            raise RuntimeError("GraphedTorchBackend.forward before allocate()")
        if media is not None or not (self.use_graphs or self.pad_eagerly):
            # A step that places image / video embeddings is a prefill step: eager, as TorchBackend runs it.
            return super().forward(input_ids, batch, logits_indices, media=media)
        key = step_shape(input_ids, batch, logits_indices, self.buckets, self._page_size)
        if key is None:
            return super().forward(input_ids, batch, logits_indices)
        t = input_ids.shape[0]
        inputs = self.padded_inputs(input_ids, batch, key)
        if self.pad_eagerly:
            with torch.inference_mode():
                out = self.model.step(inputs.input_ids, inputs.batch, self._caches, inputs.logits_indices,
                                      inplace=True)
            return out.logits[:t].float(), out.hidden[:t]
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(inputs)
            except Exception as exc:  # an op that synchronises with the host cannot be captured
                log.warning("CUDA-graph capture of decode shape %s failed (%s: %s); decoding eagerly", key,
                            type(exc).__name__, str(exc)[:200])
                self.use_graphs = False
                torch.cuda.synchronize(self.device)
                return super().forward(input_ids, batch, logits_indices)
        graph, logits, hidden = self._graphs[key]
        graph.replay()
        self.replays += 1
        return logits[:t].float().clone(), hidden[:t].clone()

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
