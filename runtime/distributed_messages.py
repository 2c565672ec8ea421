"""What rank 0 sends the other ranks each step: a fixed-size header of sizes, then the step's tensors.

Every rank of a tensor / expert parallel group runs the same forward on the same inputs (its own slices of the
weights), so before each step rank 0, where the engine schedules, broadcasts those inputs. Nothing is pickled:
the header is one int64 tensor of ``HEADER_LEN`` numbers (the operation and every size a receiver needs to
allocate its buffers), followed by one int64 tensor packing every integer input (token ids, the ``Batch`` fields of
``m3export.model.batch`` in ``Batch.input_names()`` order, logits indices, media rows) and, where the step has
them, floating-point tensors in the model's dtype (the MTP module's input hidden, media embeddings). Three
broadcasts at most per step, whatever the batch holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from m3export.model.batch import Batch

# Operations (header[0]).
SHUTDOWN, ALLOCATE, FORWARD, MTP_FORWARD = 0, 1, 2, 3
OPERATIONS = {SHUTDOWN: "shutdown", ALLOCATE: "allocate", FORWARD: "forward", MTP_FORWARD: "mtp_forward"}

HEADER_LEN = 12
# The integer dtype each Batch field has on the model side (the wire carries int64).
BATCH_DTYPES = {"positions": torch.int64, "query_start_loc": torch.int32, "seq_lens": torch.int32,
                "block_tables": torch.int32, "slot_mapping": torch.int64}
if tuple(BATCH_DTYPES) != Batch.input_names():  # a new Batch field must be carried: say so at import
    raise ImportError(f"runtime.distributed_messages carries Batch fields {tuple(BATCH_DTYPES)}, Batch has "
                      f"{Batch.input_names()}: add the new field's dtype to BATCH_DTYPES")
# Header fields after the operation, by position.
_T, _B, _W, _N, _MODULE, _MEDIA, _HIDDEN, _PAGES, _PAGE_SIZE = range(1, 10)


@dataclass
class StepMessage:
    """One operation and its inputs, as every rank sees it after ``receive``."""

    op: int
    input_ids: torch.Tensor | None = None  # [T] int64
    batch: Batch | None = None
    logits_indices: torch.Tensor | None = None  # [N] int64
    module: int = 0  # MTP module (MTP_FORWARD)
    hidden: torch.Tensor | None = None  # [T, H] model dtype (MTP_FORWARD)
    media: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [M] int64, embeddings [M, H]) (FORWARD)
    num_pages: int = 0  # ALLOCATE
    page_size: int = 0  # ALLOCATE


def wire_dtype(backend) -> torch.dtype:
    """The dtype of the floating-point tensors on the wire (MTP hidden states, media embeddings): the model's
    activation dtype, which every rank derives alike. Not ``backend.dtype``, the cache dtype, which is E4M3 with
    an FP8 KV cache (hidden states squeezed through it would differ from rank 0's own)."""
    model = getattr(backend, "model", None)
    return model.lm_head.weight.dtype if model is not None else backend.dtype


def _int_fields(batch: Batch) -> list[torch.Tensor]:
    return [getattr(batch, name) for name in Batch.input_names()]


def send(msg: StepMessage, device: torch.device, float_dtype: torch.dtype, group=None) -> None:
    """Rank 0: broadcast ``msg`` (its tensors already on ``device``, the collective's device)."""
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = msg.op
    ints: list[torch.Tensor] = []
    floats: list[torch.Tensor] = []
    if msg.op == ALLOCATE:
        header[_PAGES], header[_PAGE_SIZE] = msg.num_pages, msg.page_size
    elif msg.op in (FORWARD, MTP_FORWARD):
        b = msg.batch
        header[_T], header[_B] = msg.input_ids.shape[0], b.seq_lens.shape[0]
        header[_W], header[_N] = b.block_tables.shape[1], msg.logits_indices.shape[0]
        header[_MODULE] = msg.module
        ints = [msg.input_ids, *_int_fields(b), msg.logits_indices]
        if msg.op == MTP_FORWARD:
            header[_HIDDEN] = 1
            floats.append(msg.hidden)
        if msg.media is not None:
            rows, values = msg.media
            header[_MEDIA] = rows.shape[0]
            ints.append(rows)
            floats.append(values)
    elif msg.op != SHUTDOWN:
        raise ValueError(f"unknown operation {msg.op}")
    dist.broadcast(header.to(device), 0, group=group)
    if ints:
        dist.broadcast(torch.cat([t.reshape(-1).to(device, torch.int64) for t in ints]), 0, group=group)
    for t in floats:
        dist.broadcast(t.to(device, float_dtype).contiguous(), 0, group=group)


def receive(device: torch.device, float_dtype: torch.dtype, hidden_size: int, group=None) -> StepMessage:
    """Ranks > 0: the next message from rank 0, its tensors on ``device``."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
    dist.broadcast(header, 0, group=group)
    h = header.tolist()
    op = h[0]
    if op not in OPERATIONS:
        raise RuntimeError(f"rank 0 sent an unknown operation {op} (header {h})")
    if op == SHUTDOWN:
        return StepMessage(op)
    if op == ALLOCATE:
        return StepMessage(op, num_pages=h[_PAGES], page_size=h[_PAGE_SIZE])
    t, b, w, n, m = h[_T], h[_B], h[_W], h[_N], h[_MEDIA]
    symbols = {"T": t, "B": b, "B+1": b + 1, "max_pages": w}
    shapes = [[symbols[d] for d in dims] for dims in Batch.input_dims().values()]
    sizes = [t, *(math.prod(s) for s in shapes), n, m]  # input_ids, the Batch fields, logits_indices, media rows
    packed = torch.empty(sum(sizes), dtype=torch.int64, device=device)
    dist.broadcast(packed, 0, group=group)
    ids, *fields, logits_indices, rows = packed.split(sizes)
    batch = Batch(*(f.view(s).to(dtype) for f, s, dtype in zip(fields, shapes, BATCH_DTYPES.values())))
    msg = StepMessage(op, ids, batch, logits_indices, module=h[_MODULE])
    if h[_HIDDEN]:
        msg.hidden = torch.empty((t, hidden_size), dtype=float_dtype, device=device)
        dist.broadcast(msg.hidden, 0, group=group)
    if m:
        values = torch.empty((m, hidden_size), dtype=float_dtype, device=device)
        dist.broadcast(values, 0, group=group)
        msg.media = (rows, values)
    return msg
