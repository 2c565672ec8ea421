"""CUDA-graph decode for the torch backend: decode-only steps are captured once per batch bucket and replayed.

A decode step launches hundreds of small kernels whose launch gaps, not their bytes, set its time at small batch.
``GraphedTorchBackend`` is a ``TorchBackend`` whose ``forward`` recognises a decode-only step from shapes alone
(one new token per sequence, every token sampled: ``T == B == len(logits_indices)``) or an MTP verification step
(the same number 1 + k of tokens in every sequence, all sampled), pads it to the smallest bucket (1, 2, 4, ..., 64)
that holds it and replays that (bucket, tokens per sequence) graph. A verify step whose requests verify different
numbers of drafts (all tokens sampled) is padded to the most any of them has, the shorter ones getting masked rows
after their own (``pad_ragged``: scratch-page slots, positions their causal queries never see), and replays the
same graph; its real rows are picked from the outputs. Mixed or prefill steps, batches past the
largest bucket, and everything on a device without CUDA graphs run eagerly, exactly as ``TorchBackend``.
The MTP modules' steps of the same number q of tokens in every sequence (the drafter's chain steps, q = 1, and
its catch-up steps over the q positions each request kept after a verify step: always so for one request, and
for a batch whose requests kept as many) are captured the same way per (module, bucket, q, whether logits are
wanted), with at most one logits row per sequence; a catch-up whose requests kept different numbers of positions
runs as one such step per count. So the drafter merges each module's pending positions (its catch-up, then the
chain positions since it last ran) into its next call here as on any backend (``replays_single_position_mtp_steps``
is False): a round of k drafts is k module calls, not up to 2k - 1 one-position ones, each as launch-bound as a
decode step, and a catch-up over several positions run eagerly cost about what an eager decode step costs (on
the H200 it made a speculative round 4x slower than a plain graphed step). A uniform greedy round (every request
drafting k after keeping q positions) goes further: its k module calls replay as one graph per (bucket, plan)
(``mtp_chain``), fed one batch over the round's positions, each call's batch a slice of it inside the graph.

The engine builds its batches on the host for this backend (``batch_device``): the graph's static inputs are
filled by one host-to-device copy per step from a fixed pinned staging buffer, captured as the graph's first node
(a replayed step is one graph launch: before, the copy was its own launch from a pinned block made per step, and
the host work in front of the replay left the device idle; a copy from pageable memory waits for the device: one
per field made every replay a host-device round trip); an event recorded after that node keeps the host from
rewriting the staging buffer before the previous replay has read it. Whether a verify step has
the same number of tokens in every sequence is read from the host ``query_start_loc`` with no device-to-host
copy. ``logits_indices`` is copied into the static inputs like the rest, so a replay computes exactly the rows
asked for.

Padding rows are the tokens of short sequences that live on one scratch page which the backend allocates
beyond the pages the engine owns (the engine never addresses it), so they write and read nothing of any request.
Block tables are padded to one fixed width (the longest sequence the pool can hold), so one bucket is one set of
input shapes whatever the context lengths. The graph needs every op of the step to be capturable (no host
synchronisation): with the Triton kernels registered (``m3export.plugins.kernels.register``) the step is; the
reference ops are not (they read lengths on the host), and a failed capture turns graphs off with one warning.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math

import numpy as np
import torch

from m3export.model.batch import Batch

from ..device_drafts import MAX_COPIED_RUNS, draft_runs, fill_tokens
from ..sampling import to_device
from .torch_backend import TorchBackend

log = logging.getLogger("m3export.runtime")

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for the block (as it was after), for a CUDA-graph capture. A
    collection is triggered by whatever Python allocation crosses its threshold, so inside a capture it can finalize
    garbage made anywhere before (CUDA tensors, pinned host blocks, events): a finalizer whose CUDA call is
    illegal while a stream captures (a query, a synchronisation) fails in a destructor and aborts the process (the
    H200 saw it once, mid-capture of an MTP step: ``Fatal Python error: Aborted`` under ``Garbage-collecting``).
    ``torch.cuda.graph`` collects once before capture begins; what is made during the capture waits for the
    collector's next run after it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def step_shape(input_ids: torch.Tensor, batch: Batch, logits_indices: torch.Tensor, buckets: tuple[int, ...],
               page_size: int) -> tuple[int, int] | None:
    """(bucket, tokens per sequence) for a step that can be replayed, else None.

    Replayable: every sequence has the same number q of new tokens and as many logits rows as tokens are wanted:
    plain decode (q = 1) and MTP verification of k drafts (q = 1 + k). A decode step is recognised from shapes
    alone; a verify step's uniformity is read from ``query_start_loc``, free when the batch is on the host (the
    engine builds it there for this backend), one tiny device-to-host copy otherwise. Padding sequences hold
    their q tokens in one scratch page, so q may not exceed a page.
    """
    if logits_indices.shape[0] != input_ids.shape[0]:
        return None
    return _uniform_shape(input_ids, batch, buckets, page_size)


def mtp_step_shape(input_ids: torch.Tensor, batch: Batch, logits_indices: torch.Tensor, buckets: tuple[int, ...],
                   page_size: int) -> tuple[int, int, bool] | None:
    """(bucket, tokens per sequence, logits wanted) for an MTP module step that can be replayed, else None: every
    sequence has the same number q of tokens (a chain step, q = 1; a catch-up over q kept positions), and at most
    one logits row per sequence is wanted (the drafter asks for the last entry of each drafting request), or none
    (a module only keeping its cache current). The graph computes ``bucket`` logits rows at the given indices."""
    b, n = batch.seq_lens.shape[0], logits_indices.shape[0]
    if n > b:
        return None
    shape = _uniform_shape(input_ids, batch, buckets, page_size)
    return None if shape is None else (*shape, n > 0)


def _uniform_shape(input_ids: torch.Tensor, batch: Batch, buckets: tuple[int, ...], page_size: int
                   ) -> tuple[int, int] | None:
    """(bucket, q) when each of the B sequences has the same q new tokens, B fits a bucket and q a page (padding
    sequences hold their q tokens in one scratch page), else None."""
    t, b = input_ids.shape[0], batch.seq_lens.shape[0]
    if b == 0 or t % b:
        return None
    q = t // b
    bucket = next((c for c in buckets if c >= b), None)
    if bucket is None or q > page_size:
        return None
    if q > 1 and not _evenly_spaced(batch.query_start_loc, q):
        return None
    return bucket, q


def _evenly_spaced(query_start_loc: torch.Tensor, q: int) -> bool:
    """``query_start_loc`` == 0, q, 2q, ...: compared as a list (a torch comparison, or numpy's, of these few
    numbers costs more than the list, per MTP call and verify step); a device tensor is one tiny read back."""
    starts = query_start_loc.tolist()
    return starts == list(range(0, q * len(starts), q))


def ragged_verify_shape(input_ids: torch.Tensor, batch: Batch, logits_indices: torch.Tensor,
                        buckets: tuple[int, ...], page_size: int) -> tuple[int, int] | None:
    """(bucket, q) for a verify step whose sequences have different numbers of tokens (requests verifying
    different numbers of drafts; every token sampled), padded to q = the most any sequence has: ``pad_ragged``
    gives each shorter sequence masked rows after its own. None for anything else (prefill, mixed, past the
    buckets or a page), or when the batch is not on the host (its layout would have to be read back)."""
    t, b = input_ids.shape[0], batch.seq_lens.shape[0]
    if b == 0 or logits_indices.shape[0] != t or batch.query_start_loc.device.type != "cpu":
        return None
    starts = batch.query_start_loc.tolist()
    q = max(e - s for s, e in zip(starts, starts[1:]))
    bucket = next((c for c in buckets if c >= b), None)
    if bucket is None or q > page_size:
        return None
    return bucket, q


def pad_ragged(input_ids: torch.Tensor, batch: Batch, q: int, scratch_page: int, page_size: int
               ) -> tuple[torch.Tensor, Batch, torch.Tensor]:
    """A host batch of B sequences of at most q tokens as B sequences of exactly q, and where each real token went
    ([T] rows of the padded step). A sequence's masked rows follow its own tokens at the next positions, so its
    own queries, causal, never see them; they write their K/V and index keys into the scratch page (slot j of
    it for the sequence's j-th row), never into a page of the request; its context length counts them, as if it
    had q new tokens. Results at the real rows equal the unpadded step's (every op is per token, attention
    causal by position)."""
    starts = batch.query_start_loc.tolist()
    counts = [e - s for s, e in zip(starts, starts[1:])]
    rows = torch.tensor([b * q + j for b, n in enumerate(counts) for j in range(n)], dtype=torch.int64)
    first = batch.positions[torch.tensor(starts[:-1], dtype=torch.int64)]  # each sequence's first new position
    j = torch.arange(q).repeat(len(counts))
    positions = first.repeat_interleave(q) + j
    slots = scratch_page * page_size + j
    slots[rows] = batch.slot_mapping
    if input_ids.device.type == "cpu":
        ids = torch.zeros(len(counts) * q, dtype=input_ids.dtype)
        ids[rows] = input_ids
    else:  # ids holding drafts that stayed on the device: scattered there
        ids = torch.zeros(len(counts) * q, dtype=input_ids.dtype, device=input_ids.device)
        ids[to_device(rows, input_ids.device)] = input_ids
    padded = Batch(positions=positions.to(batch.positions.dtype),
                   query_start_loc=torch.arange(0, len(counts) * q + 1, q, dtype=batch.query_start_loc.dtype),
                   seq_lens=(first + q).to(batch.seq_lens.dtype), block_tables=batch.block_tables,
                   slot_mapping=slots.to(batch.slot_mapping.dtype))
    return ids, padded, rows


def _own_fp32(x: torch.Tensor) -> torch.Tensor:
    """A float32 copy the next replay cannot overwrite: ``.float()`` of a 16-bit output already is one."""
    return x.clone() if x.dtype == torch.float32 else x.float()


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


def _field_views(buffer, layout, as_dtype) -> dict:
    """Each (name, shape, dtype, byte offset) of ``layout`` as a view of the byte ``buffer`` (numpy or torch)."""
    return {name: as_dtype(buffer[at:at + math.prod(shape) * dtype.itemsize], dtype).reshape(shape)
            for name, shape, dtype, at in layout}


def _head(view, value: torch.Tensor):
    """The leading part of a static field that ``value`` (fewer rows, and for block tables fewer columns) fills."""
    return view[:value.shape[0]] if value.dim() == 1 else view[:value.shape[0], :value.shape[1]]


class DecodeInputs:
    """The static input buffers of one (bucket, q) shape: what a captured graph reads, refilled before every replay.

    Real sequences fill the first B slots; padding sequences have q tokens at positions 0 .. q-1 of the scratch page.

    Every integer input (ids, logits rows, positions, slots, context lengths, block tables) is a view of one device
    byte buffer, and a step fills all of them with one host-to-device copy of a host image of that buffer (a
    pinned staging buffer on a GPU), made from a template that already holds the padding (``fill``); the copy is
    the step's own first operation (``upload``), so a replayed step is one graph launch. Filling field by field took about 16 device
    operations (a copy per field, then the padding tails) per call, and a speculative round makes k + 1 such calls
    (k MTP calls, one verify step), each as launch-bound as the replay itself on a small model.
    """

    def __init__(self, bucket: int, q: int, table_width: int, scratch_page: int, page_size: int, device,
                 hidden: tuple[int, torch.dtype] | None = None, logits_rows: int | None = None):
        """``hidden`` = (size, dtype): also a [rows, size] input (an MTP module's incoming hidden states).
        ``logits_rows``: how many logits rows the graph computes (default: one per token; an MTP step: one per
        sequence); a step asking for fewer gets padding rows past its own."""
        self.bucket, self.q = bucket, q
        rows = bucket * q
        device = torch.device(device)
        self.hidden = None if hidden is None else torch.zeros(rows, hidden[0], dtype=hidden[1], device=device)
        self._hidden_seqs = 0  # sequences whose ``hidden`` rows hold a step's values (past them: zeros)
        n_logits = rows if logits_rows is None else logits_rows
        # (name, shape, dtype) of each field in the buffer: the int64 ones first, so every view is aligned.
        fields = [("input_ids", (rows,), torch.int64), ("logits_indices", (n_logits,), torch.int64),
                  ("positions", (rows,), torch.int64), ("slot_mapping", (rows,), torch.int64),
                  ("seq_lens", (bucket,), torch.int32), ("block_tables", (bucket, table_width), torch.int32)]
        sizes = [math.prod(shape) * dtype.itemsize for _, shape, dtype in fields]
        layout = [(name, shape, dtype, sum(sizes[:i])) for i, (name, shape, dtype) in enumerate(fields)]
        nbytes = sum(sizes)
        # The host image of the buffer with every row padding (``_template``), and the image a step writes its
        # real rows into (numpy: a field write costs a fraction of a torch operation's dispatch).
        self._template = np.zeros(nbytes, dtype=np.uint8)
        t = _field_views(self._template, layout, lambda x, dtype: x.view(_NUMPY[dtype]))
        t["logits_indices"][:] = np.arange(n_logits)
        offsets = np.tile(np.arange(q), bucket)
        t["positions"][:] = offsets
        t["slot_mapping"][:] = scratch_page * page_size + offsets
        t["seq_lens"][:] = q
        t["block_tables"][:, 0] = scratch_page
        # The staging image: pinned host memory on a GPU, which the graph's first node copies to the device buffer
        # (``upload``), so one step is one graph launch and no per-step pinned block (``pin_memory()``).
        pinned = device.type == "cuda"
        self._staging = torch.from_numpy(self._template.copy())
        if pinned:
            self._staging = self._staging.pin_memory()
        self._image = self._staging.numpy()  # the same memory: numpy writes land in what the upload reads
        self._host = _field_views(self._image, layout, lambda x, dtype: x.view(_NUMPY[dtype]))
        self._staged = _field_views(self._staging, layout, lambda x, dtype: x.view(dtype))
        # Recorded right after the upload (inside the graph: an event record node). The next fill waits for it
        # before rewriting the staging image, which the previous step's upload may not have read yet.
        self._uploaded = torch.cuda.Event(external=True) if pinned else None
        self._buffer = torch.from_numpy(self._template.copy()).to(device)  # never the template itself
        d = _field_views(self._buffer, layout, lambda x, dtype: x.view(dtype))
        self.input_ids, self.logits_indices = d["input_ids"], d["logits_indices"]
        self.batch = Batch(
            positions=d["positions"],
            query_start_loc=torch.arange(0, rows + 1, q, dtype=torch.int32, device=device),
            seq_lens=d["seq_lens"],
            block_tables=d["block_tables"],
            slot_mapping=d["slot_mapping"],
        )

    def fill(self, input_ids: torch.Tensor, batch: Batch, logits_indices: torch.Tensor,
             hidden: torch.Tensor | None = None, kept: int | None = None, drafts=()) -> None:
        """Copy a step of B <= bucket sequences of q tokens each in (from the host or the device); the rest becomes
        scratch-page padding. ``logits_indices``: at most as many rows as the graph computes (past them: padding
        rows), or none. Host values are written into the staging image (numpy, no torch operation); a value
        already on the device (ids holding drafts that stayed there) is one queued copy into it, an MTP
        module's hidden states one device copy. The image reaches the device in the step itself (``upload``).
        ``kept``: ``hidden`` holds each sequence's first ``kept`` positions only (a replayed MTP chain, whose graph
        writes the rest); default all q. ``drafts`` (``Backend.stages_draft_tokens``): places of host ``input_ids``
        whose values are drafts still on the device, each run of them one queued copy from the round's tensor into
        the staging image (the verify step's ids were sent to the device, the drafts scattered there and the row
        copied back into the image: host -> device -> staging -> device); more runs than ``fill_tokens`` copies one
        by one (a batch of requests) go through ``fill_tokens`` and are staged from the device as before."""
        runs = draft_runs(drafts) if drafts else []
        if len(runs) > MAX_COPIED_RUNS or (runs and input_ids.device.type != "cpu"):
            input_ids, runs = fill_tokens(input_ids, drafts), []
        w = batch.block_tables.shape[1]
        if w > self.batch.block_tables.shape[1]:
            raise ValueError(f"block table of {w} pages is wider than the captured {self.batch.block_tables.shape[1]}")
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous step's upload has read the staging image
        np.copyto(self._image, self._template)
        for name, value in (("input_ids", input_ids), ("logits_indices", logits_indices),
                            ("positions", batch.positions), ("slot_mapping", batch.slot_mapping),
                            ("seq_lens", batch.seq_lens), ("block_tables", batch.block_tables)):
            if value.device.type == "cpu":
                _head(self._host[name], value)[...] = value.numpy()
            else:
                self._stage_from_device(name, value)
        ids = self._staged["input_ids"]
        for row, rnd, src, n in runs:  # after the host ids: the queued copies land over their placeholders
            ids[row:row + n].copy_(rnd.tokens.view(-1)[src:src + n], non_blocking=self._uploaded is not None)
        if self.hidden is not None and hidden is not None:
            b, kept = batch.seq_lens.shape[0], self.q if kept is None else kept
            rows = self.hidden.view(self.bucket, self.q, self.hidden.shape[-1])
            if b:
                rows[:b, :kept].copy_(hidden.reshape(b, kept, -1))
            if self._hidden_seqs > b:  # sequences a larger step filled before: padding rows read zeros again
                rows[b:self._hidden_seqs].zero_()
            self._hidden_seqs = b
        # query_start_loc is arange(0, bucket * q + 1, q) for every such step.

    def _stage_from_device(self, name: str, value: torch.Tensor) -> None:
        """A field already on the device, copied into the staging image (device to pinned host memory: queued, no
        wait; the upload, later on the same stream, carries it back with the rest). A block table narrower than
        the captured width is first widened with the zeros the template has there, so its rows stay one
        contiguous span of the image."""
        head = _head(self._staged[name], value)
        if head.numel() == 0:
            return
        if not head.is_contiguous():
            value = torch.nn.functional.pad(value, (0, self._staged[name].shape[1] - value.shape[1]))
            head = self._staged[name][:value.shape[0]]
        head.copy_(value, non_blocking=self._uploaded is not None)

    def upload(self) -> None:
        """The staging image to the device buffer: the first thing a captured step does, so it is the graph's first
        node (a copy from fixed pinned memory) and a replay needs no copy of its own before it."""
        self._buffer.copy_(self._staging, non_blocking=self._uploaded is not None)
        if self._uploaded is not None:
            self._uploaded.record()


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
        self.mtp_replays = 0  # MTP module steps served from a graph
        self.mtp_graphs = True  # off after an MTP step failed to capture (the target's graphs stay on)
        self.padded_mtp_steps = 0  # MTP module steps run in a bucket shape (graph or pad_eagerly)
        self.eager_steps = 0  # target steps run eagerly (prefill, mixed, past the buckets, graphs off)
        self.eager_mtp_steps = 0  # MTP module steps run eagerly (what a speculative decode round should not do)
        self.ragged_verify_steps = 0  # verify steps of unequal draft counts run padded (graph or pad_eagerly)
        self.chain_replays = 0  # speculative rounds whose MTP calls ran as one (``mtp_chain``: graph or pad_eagerly)
        self._chain_indices: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # ``_chain_index``, per shape

    def allocate(self, num_pages: int, page_size: int) -> None:
        super().allocate(num_pages + 1, page_size)  # page num_pages: scratch for padding rows
        self._scratch_page, self._page_size = num_pages, page_size
        width = num_pages if self.max_model_len is None else -(-self.max_model_len // page_size)
        self._table_width = min(num_pages, width)  # no sequence holds more pages than this
        # graphs AND their pool: a pool handle kept after its graphs are gone is dead to torch's allocator (use
        # count 0), and the next capture into it fails its "pool is live" assert (the H200's eager torch rows of
        # bench/ort_gpu.py, which allocates once per shape)
        self.release_graphs()

    @property
    def batch_device(self) -> torch.device:
        """Batches are copied into the graphs' static inputs: the engine builds them on the host (see the module
        docstring); an eager step moves them itself."""
        return torch.device("cpu") if self.use_graphs or self.pad_eagerly else self.device

    def padded_inputs(self, input_ids: torch.Tensor, batch: Batch, key: tuple, logits_indices: torch.Tensor,
                      hidden: torch.Tensor | None = None, drafts=()) -> DecodeInputs:
        """The static inputs of shape ``key`` = (bucket, q) or ("mtp", module, bucket, q, logits wanted) filled
        with this step (also what eager padding runs)."""
        if key not in self._inputs:
            mtp = key[0] == "mtp"
            bucket, q = key[2:4] if mtp else key
            extra = None if hidden is None else (hidden.shape[-1], hidden.dtype)
            self._inputs[key] = DecodeInputs(bucket, q, self._table_width, self._scratch_page, self._page_size,
                                             self.device, extra, logits_rows=bucket if mtp else None)
        inputs = self._inputs[key]
        inputs.fill(input_ids, batch, logits_indices, hidden, drafts=drafts)
        return inputs

    @property
    def _mtp_in_buckets(self) -> bool:
        return (self.use_graphs and self.mtp_graphs) or self.pad_eagerly

    @property
    def stages_draft_tokens(self) -> bool:
        return self.batch_device.type == "cpu"  # the replayed steps' inputs come from a host staging image

    def _on_device(self, input_ids, batch: Batch, logits_indices):
        return input_ids.to(self.device), batch.to(self.device), logits_indices.to(self.device)

    def forward(self, input_ids, batch: Batch, logits_indices, media=None, drafts=()):
        """``drafts`` (``stages_draft_tokens``): the verify step's draft places of host ``input_ids``; a step run
        in a bucket shape copies them into its staging image (``DecodeInputs.fill``), any other one takes
        ``fill_tokens``' ids."""
        if self._caches is None:
            raise RuntimeError("GraphedTorchBackend.forward before allocate()")
        if media is not None or not (self.use_graphs or self.pad_eagerly):
            # A step that places image / video embeddings is a prefill step: eager, as TorchBackend runs it.
            self.eager_steps += 1
            ids = fill_tokens(input_ids, drafts)
            return super().forward(*self._on_device(ids, batch, logits_indices), media=media)
        key = step_shape(input_ids, batch, logits_indices, self.buckets, self._page_size)
        if key is None and drafts:  # padded ragged or eager: ids with the drafts in place
            input_ids, drafts = fill_tokens(input_ids, drafts), ()
        step_ids, step_batch, step_rows, rows = input_ids, batch, logits_indices, None
        if key is None:
            key = self._ragged_key(input_ids, batch, logits_indices)
            if key is None:
                self.eager_steps += 1
                return super().forward(*self._on_device(input_ids, batch, logits_indices))
            step_ids, step_batch, rows = pad_ragged(input_ids, batch, key[1], self._scratch_page, self._page_size)
            step_rows = torch.arange(step_ids.shape[0], dtype=torch.int64)
        t = input_ids.shape[0]
        inputs = self.padded_inputs(step_ids, step_batch, key, step_rows, drafts=drafts)
        outs = self._run(key, self._target_step(inputs))
        if outs is None:  # capture failed: graphs are off now
            self.eager_steps += 1
            return super().forward(*self._on_device(fill_tokens(input_ids, drafts), batch, logits_indices))
        if not self.pad_eagerly:
            self.replays += 1
        logits, hidden = outs
        if rows is not None:  # the real rows of a padded ragged step (index_select copies)
            self.ragged_verify_steps += 1
            idx = to_device(rows, logits.device)
            picked = logits.index_select(0, idx)
            return (picked if picked.dtype == torch.float32 else picked.float()), hidden.index_select(0, idx)
        return _own_fp32(logits[:t]), hidden[:t].clone()  # a graph's outputs are rewritten by its next replay

    def _ragged_key(self, input_ids, batch: Batch, logits_indices) -> tuple[int, int] | None:
        """The (bucket, q) shape of a verify step of unequal draft counts (``ragged_verify_shape``) when its padded
        rows stay inside the captured block-table width and the model's positions, else None (eager)."""
        key = ragged_verify_shape(input_ids, batch, logits_indices, self.buckets, self._page_size)
        if key is None:
            return None
        starts = batch.query_start_loc.tolist()
        end = max(int(batch.positions[s]) for s in starts[:-1]) + key[1]  # past each sequence's padded rows
        if end > min(self._table_width * self._page_size, self.config.max_position_embeddings):
            return None
        return key

    def mtp_forward(self, module, input_ids, hidden, batch: Batch, logits_indices):
        if self._mtp_caches is None:
            raise RuntimeError("GraphedTorchBackend.mtp_forward before allocate()")
        return self._mtp_forward(module, input_ids, hidden, batch, logits_indices)

    def _mtp_forward(self, module, input_ids, hidden, batch: Batch, logits_indices):
        """``mtp_forward``'s work, also for the parts of a call split by ``_mtp_by_count`` (one call of the
        interface stays one call for whoever wraps it)."""
        shape = None
        if self._mtp_in_buckets:
            shape = mtp_step_shape(input_ids, batch, logits_indices, self.buckets, self._page_size)
        if shape is None:
            split = self._mtp_by_count(module, input_ids, hidden, batch, logits_indices)
            return self._eager_mtp(module, input_ids, hidden, batch, logits_indices) if split is None else split
        key = ("mtp", module, *shape)
        t = input_ids.shape[0]
        inputs = self.padded_inputs(input_ids, batch, key, logits_indices, hidden)
        outs = self._run(key, self._mtp_step(module, inputs, shape[2]))
        if outs is None:
            return self._eager_mtp(module, input_ids, hidden, batch, logits_indices)
        self.padded_mtp_steps += 1
        if not self.pad_eagerly:
            self.mtp_replays += 1
        logits, out = outs
        return _own_fp32(logits[:logits_indices.shape[0]]), out[:t].clone()

    @property
    def replays_mtp_chains(self) -> bool:
        return self._mtp_in_buckets

    def mtp_chain(self, plan, input_ids, hidden, batch: Batch):
        """``Backend.mtp_chain``: the round's calls replayed from one graph per (bucket, plan), on static inputs of
        the (bucket, q + k - 1) shape filled once (padding sequences on the scratch page, as every bucket shape).
        Inside the graph each call's batch is a slice of the round's positions, its input tokens the kept ones
        and then the drafts the graph proposed, its hidden states the target's and then the previous call's
        output: the calls, positions and values of the drafter's one-by-one calls, without their host work
        (one batch, one fill and one replay per round instead of one of each per call). None for a batch not on
        the host, past the buckets, of unequal lengths, or whose q + k - 1 positions do not fit a page."""
        if not self._mtp_in_buckets or batch.query_start_loc.device.type != "cpu":
            return None
        shape = _uniform_shape(input_ids, batch, self.buckets, self._page_size)
        if shape is None:
            return None
        bucket, span = shape
        q, k = plan.q, plan.k
        if span != q + k - 1 or hidden.shape[0] != batch.seq_lens.shape[0] * q:
            raise ValueError(f"mtp_chain: {span} positions per sequence and {hidden.shape[0]} hidden rows for a plan "
                             f"of q={q} kept positions and k={k} drafts")
        key = ("chain", bucket, plan)
        inputs = self._chain_inputs(key, input_ids, batch, hidden)
        outs = self._run(key, self._chain_step(inputs, plan))
        if outs is None:
            return None
        self.chain_replays += 1
        self.padded_mtp_steps += len(plan.calls)
        if not self.pad_eagerly:
            self.mtp_replays += len(plan.calls)
        return outs[0][:batch.seq_lens.shape[0]].clone()  # the graph's buffer is rewritten by its next replay

    def _chain_inputs(self, key: tuple, input_ids, batch: Batch, hidden) -> DecodeInputs:
        """The static inputs of chain shape ``key`` filled with a round (its hidden rows at each sequence's first
        q positions, ``DecodeInputs.fill``'s ``kept``)."""
        bucket, plan = key[1], key[2]
        q, span, h = plan.q, plan.q + plan.k - 1, hidden.shape[-1]
        if key not in self._inputs:
            self._inputs[key] = DecodeInputs(bucket, span, self._table_width, self._scratch_page, self._page_size,
                                             self.device, (h, hidden.dtype), logits_rows=0)
        inputs = self._inputs[key]
        inputs.fill(input_ids, batch, input_ids[:0], hidden, kept=q)
        return inputs

    def _chain_index(self, bucket: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """A chain call's ``query_start_loc`` and last-position rows over ``bucket`` sequences of ``n`` positions,
        made once (at the capture's warm-up, outside the graph) and kept: a replayed round reads them instead of
        computing them (four kernels per call inside the graph before, eight per round of two calls)."""
        key = (bucket, n, str(device))
        if key not in self._chain_indices:
            self._chain_indices[key] = (torch.arange(0, bucket * n + 1, n, dtype=torch.int32, device=device),
                                        torch.arange(bucket, device=device) * n + (n - 1))
        return self._chain_indices[key]

    def _chain_step(self, inputs: DecodeInputs, plan):
        """The captured round (see ``mtp_chain``): returns (drafts [bucket, k], None)."""
        bucket, span = inputs.bucket, inputs.q
        q, k = plan.q, plan.k

        def step():
            inputs.upload()
            h = inputs.hidden.shape[-1]
            # The chain writes each draft and its hidden state straight into the static inputs (no copies: a clone
            # of each was two more kernels per replayed round). Safe for the next replay: the token ids are part
            # of the buffer ``upload`` rewrites whole just above; hidden rows below q are written only by ``fill``,
            # and a row at q + c only by call c, before any later call of the same replay reads it (``chain_plan``:
            # a call reads chain positions up to the one its predecessor wrote), so what a replay left at q + c is
            # never read. Nothing here aliases a graph output; the drafts returned are one (``mtp_chain`` copies).
            tokens = inputs.input_ids.view(bucket, span)
            hidden = inputs.hidden.view(bucket, span, h)
            positions = inputs.batch.positions.view(bucket, span)
            slots = inputs.batch.slot_mapping.view(bucket, span)
            first = inputs.batch.seq_lens - span  # each sequence's first position (padding: 0)
            drafts = torch.empty(bucket, k, dtype=torch.int64, device=tokens.device)
            for c, (module, lo, hi) in enumerate(plan.calls):
                n = hi - lo
                qsl, last = self._chain_index(bucket, n, tokens.device)
                sub = Batch(positions=positions[:, lo:hi].reshape(-1), query_start_loc=qsl, seq_lens=first + hi,
                            block_tables=inputs.batch.block_tables, slot_mapping=slots[:, lo:hi].reshape(-1))
                last = last if c < k else last[:0]
                logits, out, _, _ = self.model.mtp_step(module, tokens[:, lo:hi].reshape(-1),
                                                        hidden[:, lo:hi].reshape(-1, h), sub,
                                                        self._mtp_caches[module], last, inplace=True)
                if c >= k:  # a catch-up owed by a module that drafted nothing
                    continue
                draft = logits.argmax(-1)  # greedy drafts: the argmax, first index on ties, as propose_rows
                drafts[:, c] = draft
                if q + c < span:  # chain step c + 1's entry: this draft and this call's output there
                    tokens[:, q + c] = draft
                    hidden[:, q + c] = out.view(bucket, n, h)[:, -1]
            return drafts, None

        return step

    def capture_shapes(self, max_batch: int, max_tokens_per_sequence: int = 1, mtp_modules: int = 0,
                       chain_drafts: int = 0) -> int:
        """Capture now, not at first use, every graph that decoding up to ``max_batch`` sequences takes: target steps
        of 1 .. ``max_tokens_per_sequence`` tokens per sequence (plain decode; verification of up to k drafts when
        it is k + 1) and, for each of the first ``mtp_modules`` MTP modules, steps of as many positions per
        sequence with and without logits; with ``chain_drafts`` = k > 0, the replayed rounds of 1 .. k greedy
        drafts (``mtp_chain``) after 1 .. k + 1 kept positions, where they fit a page. What a benchmark calls before measuring (a capture, and a kernel
        compiled for a new shape, would otherwise count as decode time). The steps run on padding alone (every
        row on the scratch page), so this may be called at any time. Returns how many graphs it captured."""
        if not self.use_graphs or self._caches is None:
            return 0
        before = len(self._graphs)
        top = next((c for c in self.buckets if c >= max_batch), self.buckets[-1])
        ids = rows = torch.zeros(0, dtype=torch.int64)  # a step of no sequence: the static inputs are all padding
        empty = Batch(positions=ids, query_start_loc=torch.zeros(1, dtype=torch.int32),
                      seq_lens=torch.zeros(0, dtype=torch.int32), block_tables=torch.zeros(0, 0, dtype=torch.int32),
                      slot_mapping=ids)
        for bucket in (c for c in self.buckets if c <= top):
            for q in range(1, min(max_tokens_per_sequence, self._page_size) + 1):
                inputs = self.padded_inputs(ids, empty, (bucket, q), rows)
                outs = self._run((bucket, q), self._target_step(inputs))
                if outs is None:  # the capture failed (logged): every step runs eagerly now
                    return len(self._graphs) - before
                hidden = outs[1]  # what the MTP modules are fed: its width and dtype
                for module in range(mtp_modules if self.mtp_graphs else 0):
                    for wanted in (True, False):
                        key = ("mtp", module, bucket, q, wanted)
                        if key not in self._graphs and self.mtp_graphs:
                            inputs = self.padded_inputs(ids, empty, key, rows, hidden[:0])
                            self._run(key, self._mtp_step(module, inputs, wanted))
            if chain_drafts and mtp_modules and self.mtp_graphs:
                from ..drafter import chain_plan, modules_used

                used = modules_used(self.num_mtp_modules, chain_drafts)
                for k in range(1, chain_drafts + 1):  # fewer drafts: a request near its max_tokens
                    for q in range(1, min(chain_drafts + 1, self._page_size - k + 1) + 1):
                        key = ("chain", bucket, chain_plan(q, k, self.num_mtp_modules, used))
                        if key not in self._graphs and self.mtp_graphs:
                            inputs = self._chain_inputs(key, ids, empty, hidden[:0])
                            self._run(key, self._chain_step(inputs, key[2]))
        return len(self._graphs) - before

    @property
    def num_graphs(self) -> int:
        """Graphs captured so far (target and MTP shapes)."""
        return len(self._graphs)

    def _target_step(self, inputs: DecodeInputs):
        def step():
            inputs.upload()
            out = self.model.step(inputs.input_ids, inputs.batch, self._caches, inputs.logits_indices, inplace=True)
            return out.logits, out.hidden

        return step

    def _mtp_step(self, module: int, inputs: DecodeInputs, wanted: bool):
        rows = inputs.logits_indices if wanted else inputs.logits_indices[:0]

        def step():
            inputs.upload()
            logits, out, _, _ = self.model.mtp_step(module, inputs.input_ids, inputs.hidden, inputs.batch,
                                                    self._mtp_caches[module], rows, inplace=True)
            return logits, out

        return step

    def _mtp_by_count(self, module, input_ids, hidden, batch: Batch, logits_indices):
        """A catch-up whose requests kept different numbers of positions (a batch after a verify step), as one
        call per count: each call holds the requests that kept that many, a (bucket, q) shape that replays, and
        each request's positions stay in one call, so every request computes what it would alone. None when
        that is not the case (one count only, a count past a page: a prefill's catch-up, better one eager step)."""
        if not self._mtp_in_buckets or batch.query_start_loc.device.type != "cpu":
            return None
        starts = batch.query_start_loc.tolist()
        counts = [b - a for a, b in zip(starts, starts[1:])]
        if len(set(counts)) < 2 or max(counts) > self._page_size:
            return None
        wanted = {r: i for i, r in enumerate(logits_indices.tolist())}
        rows_done, outs, logit_rows, logit_dest = [], [], [], []
        for q in sorted(set(counts)):
            seqs = [i for i, c in enumerate(counts) if c == q]
            rows = [r for i in seqs for r in range(starts[i], starts[i + 1])]
            idx, sel = torch.tensor(rows), torch.tensor(seqs)
            sub = Batch(positions=batch.positions[idx], query_start_loc=torch.arange(0, len(rows) + 1, q,
                                                                                     dtype=batch.query_start_loc.dtype),
                        seq_lens=batch.seq_lens[sel], block_tables=batch.block_tables[sel],
                        slot_mapping=batch.slot_mapping[idx])
            local = [k for k, r in enumerate(rows) if r in wanted]
            logits, out = self._mtp_forward(module, input_ids[to_device(idx, input_ids.device)],
                                            hidden[to_device(idx, hidden.device)], sub,
                                            torch.tensor(local, dtype=logits_indices.dtype))
            rows_done += rows
            outs.append(out)
            logit_rows.append(logits)
            logit_dest += [wanted[rows[k]] for k in local]
        out = torch.empty((len(rows_done), outs[0].shape[-1]), dtype=outs[0].dtype, device=outs[0].device)
        out[to_device(torch.tensor(rows_done), out.device)] = torch.cat(outs)
        logits = torch.cat(logit_rows)
        order = torch.argsort(torch.tensor(logit_dest, dtype=torch.int64))  # back to the order asked for
        return logits[to_device(order, logits.device)], out

    def _eager_mtp(self, module, input_ids, hidden, batch: Batch, logits_indices):
        self.eager_mtp_steps += 1
        ids, b, li = self._on_device(input_ids, batch, logits_indices)
        return super().mtp_forward(module, ids, hidden.to(self.device), b, li)

    def _run(self, key: tuple, step) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``step`` on the static inputs: eagerly (``pad_eagerly``) or replayed from its graph, captured on first
        use; a graph's outputs are its own buffers (callers copy what they keep). None when the capture failed,
        which turns graphs off: the MTP modules' for an MTP shape, all of them for a target shape."""
        if self.pad_eagerly:
            with torch.inference_mode():
                return step()
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(step)
            except Exception as exc:  # an op that synchronises with the host cannot be captured
                mtp = key[0] in ("mtp", "chain")
                log.warning("CUDA-graph capture of step shape %s failed (%s: %s); running %s eagerly", key,
                            type(exc).__name__, str(exc)[:200], "MTP module steps" if mtp else "every step")
                if mtp:
                    self.mtp_graphs = False
                else:
                    self.use_graphs = False
                torch.cuda.synchronize(self.device)
                return None
        graph, outs = self._graphs[key]
        graph.replay()
        return outs

    def release_graphs(self) -> None:
        """Destroy every captured graph and its memory pool (the next replayable step captures again). A rank of a
        parallel group must do this before its NCCL communicator is torn down: NCCL waits in ``ncclCommDestroy``
        / ``ncclCommAbort`` until every graph that captured one of its collectives is gone, so a live graph makes
        the shutdown hang for ever."""
        if self._graphs and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for graph, _ in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._inputs.clear()
        self._pool = None

    def _capture(self, step):
        with torch.inference_mode():
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: compiles kernels, sizes the allocator, outside the graph
                step()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with collector_paused(), torch.cuda.graph(graph, pool=self._pool):
                outs = step()
        return graph, outs
