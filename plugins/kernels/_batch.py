"""The flattened paged batch as the attention kernels see it: query tiles and launch sizes, all from shapes.

Not a kernel module (it is not in ``KERNEL_MODULES``): the three attention launchers share it. Everything here
runs as device tensor ops or plain shape arithmetic, so a launch never waits for the device (no ``.tolist()``,
``.item()`` or data-dependent shapes) and one decode batch shape always gives one launch shape (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _interpreter

_interpreter.apply()  # only changes how the CPU interpreter reads loop bounds; see _interpreter.py

# Programs per multiprocessor that a launch aims for when it splits work along the context.
_WAVES = 2


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_sms(device: torch.device) -> int:
    """Multiprocessors of the device (a property read, no sync); the interpreter (CPU tensors) gets 4."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


# Shared memory one program may use on Hopper (H100 / H200: 227 KB, the opt-in per-block limit Triton checks a launch
# against). The interpreter (CPU tensors) assumes it too, so the CPU tests run the settings an H200 launch would.
HOPPER_SHARED_BYTES = 232448


def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory a program may use on ``device`` (a property read, no sync); Hopper's on the CPU."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "shared_memory_per_block_optin", HOPPER_SHARED_BYTES))
    return HOPPER_SHARED_BYTES


def launch_settings(kernel: str, defaults: dict, config: dict | None, part: str) -> dict:
    """``defaults[part]`` (a kernel module's DEFAULTS table) with the entries of ``config[part]``; a name the table
    does not have is refused by name, so a misspelt setting never silently keeps its default."""
    cfg = dict(defaults[part])
    extra = (config or {}).get(part, {})
    unknown = set(extra) - set(cfg)
    if unknown:
        raise ValueError(f"{kernel}: unknown {part} settings {sorted(unknown)}; known: {sorted(cfg)}")
    cfg.update(extra)
    return cfg


def splits_for(device: torch.device, programs: int, most: int, waves: int = _WAVES) -> int:
    """How many pieces to cut each program's context into so that the launch has about ``waves`` programs per
    multiprocessor (1..most)."""
    return max(1, min(most, cdiv(waves * num_sms(device), max(1, programs))))


# Ticket counters of "the last program to finish does the rest" launches (``ticket_counters``), per device; every
# buffer ever handed out stays referenced (a CUDA graph captured with a smaller one keeps its address).
_TICKETS: dict = {}
_OUTGROWN: list = []
_MIN_TICKETS = 1 << 14


def ticket_counters(device: torch.device, n: int) -> torch.Tensor:
    """A device buffer of at least ``n`` int32 counters, all 0, for launches whose programs take a ticket
    (``tl.atomic_add(counter, 1, sem="acq_rel")`` after their stores) so that the last one of a group to finish
    finishes the group's work, and then puts its counter back to 0 (``tl.atomic_xchg(counter, 0)``). So the buffer
    is zero between launches without a host-side reset per call, and a CUDA graph replays the launch as is.

    One buffer per device, allocated (zeroed) on first use and grown outside graph capture only: during a capture a
    new buffer would come from the graph's private pool and outlive it here, so a capture that needs more counters
    than a launch before it did is refused (a warm-up call before capturing, as every capture here makes, sizes
    it). Launches that take tickets on one device must be ordered (one stream), as a model step's are; two
    concurrent launches on two streams of one device would share counters."""
    key = (device.type, device.index)
    buf = _TICKETS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"ticket_counters: {n} counters on {device} not allocated before CUDA graph capture "
                               f"(have {0 if buf is None else buf.numel()}); run the launch once before capturing")
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = torch.zeros(max(_MIN_TICKETS, next_pow2(n)), dtype=torch.int32, device=device)
        _TICKETS[key] = buf
    return buf


@triton.jit
def sequence_of(qsl_ptr, t, num_seqs, LOG2_SEQS: tl.constexpr):
    """The sequence token ``t`` belongs to: the largest b < num_seqs with query_start_loc[b] <= t (a binary
    search in the kernel, so per-token launches need no host-side map; sequences without new tokens share their
    start with the next one and are skipped by taking the largest)."""
    lo = t * 0
    hi = lo + num_seqs - 1
    for _ in tl.static_range(LOG2_SEQS):
        mid = (lo + hi + 1) // 2
        go = tl.load(qsl_ptr + mid) <= t
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    return lo


def log2_ceil(n: int) -> int:
    """Binary-search steps over n candidates (at least 1)."""
    return max(1, (max(1, n) - 1).bit_length())


def tile_slots(num_seqs: int, num_tokens: int, tile: int) -> int:
    """Tiles of at most ``tile`` tokens of one sequence that any batch of ``num_tokens`` over ``num_seqs`` sequences
    can need, from shapes alone: sum over sequences of ceil(q_len / tile) <= (T + B * (tile - 1)) / tile."""
    return cdiv(num_tokens + num_seqs * (tile - 1), tile)


def query_tiles(query_start_loc: torch.Tensor, num_tokens: int, tile: int):
    """Cut every sequence's new tokens into tiles of at most ``tile`` consecutive tokens of that one sequence.

    Returns (seq, start, end, slots): int32 tensors of length ``slots`` giving each tile's sequence and token range
    ``[start, end)``; ``slots`` is an upper bound from shapes alone (sum over sequences of ceil(q_len / tile)
    <= (T + B * (tile - 1)) / tile), and unused slots have ``start == end`` so their programs exit at once.
    """
    b = query_start_loc.shape[0] - 1
    device = query_start_loc.device
    slots = tile_slots(b, num_tokens, tile)
    qsl = query_start_loc.long()
    ntiles = (qsl[1:] - qsl[:-1] + tile - 1) // tile
    cum = torch.cumsum(ntiles, 0)
    i = torch.arange(slots, device=device)
    seq = torch.searchsorted(cum, i, right=True).clamp(max=b - 1)
    valid = i < cum[-1]
    start = qsl[seq] + (i - (cum[seq] - ntiles[seq])) * tile
    end = torch.minimum(start + tile, qsl[seq + 1])
    start = torch.where(valid, start, 0)
    end = torch.where(valid, end, 0)
    return seq.to(torch.int32), start.to(torch.int32), end.to(torch.int32), slots


def tokens_per_tile(num_tokens: int, num_seqs: int, rows_per_token: int, most_rows: int = 64) -> int:
    """Tokens of one sequence packed into a program, from the shapes T and B alone. 1 (one program per token,
    sequence found in the kernel, no tile map) while the batch is decode-like (fewer than 2 new tokens per
    sequence on average); otherwise enough tokens for a tensor-core tile of 16 to ``most_rows`` rows."""
    if num_tokens < 2 * num_seqs:
        return 1
    lo = max(1, 16 // rows_per_token)
    hi = max(lo, most_rows // rows_per_token)
    return max(lo, min(hi, next_pow2(num_tokens // num_seqs)))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands are multiplied in full fp32 ("ieee"), as the references do; 16-bit ones are exact anyway."""
    return "ieee" if dtype == torch.float32 else "tf32"


def interpreted(t: torch.Tensor) -> bool:
    """CPU tensors can only be run by Triton's interpreter."""
    return t.device.type != "cuda"


@triton.jit
def mma(a, b, PREC: tl.constexpr, INTERPRETED: tl.constexpr):
    """a @ b accumulated in fp32. The interpreter holds bf16 as raw uint16 and would multiply the bit patterns,
    so there both operands go through fp32 first (exact: a bf16 / fp16 value is an fp32 value)."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)
