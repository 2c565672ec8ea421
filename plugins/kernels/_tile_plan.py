"""The sparse attention prefill's per-launch plan in one Triton launch: query tiles, tile unions, chooser bits.

Not a kernel module (it is not in ``KERNEL_MODULES``): ``sparse_paged_attention.forward`` runs it before its own
kernel, and the dense attention and indexer launchers of tiles of several tokens take their tile lists from it
(``tile_lists``). A prefill launch of tiles of several tokens needs (a) each tile's sequence and token range (what
``_batch.query_tiles`` computes), and for the "union" walk (b) each (tile, KV head)'s sorted distinct usable blocks
and their count (``tile_unions``) and for its "_chosen" step (c) which tokens of the tile chose each of those blocks
(``union_choosers``). As torch op chains these were ~70 (~110 with the bits) small device ops dispatched from Python
per launch: on the H200 a 4k-token prompt's launch spent ~0.25 ms of host time on them against ~0.85 ms of kernel
(issue 11, ``docs/performance.md``), and inside a CUDA graph they were as many tiny kernels. ``_tile_plan`` computes
all three with one program per (tile, KV head), sized from shapes alone (no host sync, CUDA-graph safe).

The torch chains stay as the definitions the kernel is tested against, bit for bit (``tile_unions``,
``union_choosers`` here, ``_batch.query_tiles``; ``bench/prefill_selections.py`` also counts union sizes with them);
no launch runs them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._batch import next_pow2, tile_slots

# Padding of a union after its distinct blocks (the union walk reads only the first ``count`` entries).
_PAD = torch.iinfo(torch.int32).max
# Sequences whose starts one step of a program's tile search loads at once: 1024 int32 (8 registers a thread at 4
# warps); longer batches loop.
_SEQ_BLOCK = 1024


@triton.jit
def _tile_range(qsl_ptr, num_seqs, tile, TOKENS: tl.constexpr, SEQ_BLOCK: tl.constexpr):
    """Tile ``tile`` of the batch cut into tiles of at most TOKENS tokens of one sequence, as ``query_tiles``
    numbers them: (sequence, first token, end). Tiles are numbered sequence by sequence, so tile ``tile`` belongs to
    the sequence whose running tile count first exceeds it; a tile past the last one gets start = end = 0 and the
    last sequence, as ``query_tiles`` gives it. The starts are loaded SEQ_BLOCK at a time with a running count."""
    zero = tile * 0
    done = zero  # tiles of the sequences before this block
    seen = zero  # sequences whose running tile count is <= tile (searchsorted right)
    start = zero
    end = zero
    for s0 in range(0, num_seqs, SEQ_BLOCK):
        s = s0 + tl.arange(0, SEQ_BLOCK)
        m = s < num_seqs
        lo = tl.load(qsl_ptr + s, mask=m, other=0).to(tl.int32)
        hi = tl.load(qsl_ptr + s + 1, mask=m, other=0).to(tl.int32)
        n = tl.where(m, (hi - lo + TOKENS - 1) // TOKENS, 0)
        cum = tl.cumsum(n, axis=0) + done
        seen += tl.sum((m & (cum <= tile)).to(tl.int32), axis=0)
        hit = m & (cum - n <= tile) & (tile < cum)  # at most one sequence (one with tiles) holds the tile
        first = lo + (tile - (cum - n)) * TOKENS
        start += tl.sum(tl.where(hit, first, 0), axis=0)
        end += tl.sum(tl.where(hit, tl.minimum(first + TOKENS, hi), 0), axis=0)
        done += tl.sum(n, axis=0)
    return tl.minimum(seen, num_seqs - 1), start, end


@triton.jit
def _tile_plan(qsl_ptr, num_seqs, sel_ptr, ss_t, ss_g, pos_ptr, seq_ptr, start_ptr, end_ptr, uni_ptr, cnt_ptr,
               cho_ptr, BS: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, TOKENS: tl.constexpr,
               E_PAD: tl.constexpr, SEQ_BLOCK: tl.constexpr, PER_TOKEN: tl.constexpr, TILES: tl.constexpr,
               UNION: tl.constexpr, CHOSEN: tl.constexpr):
    """Program (tile, KV head g). TILES: tile g = 0 writes the tile's (sequence, start, end). UNION: the tile's
    TOKENS x K selected ids for head g, masked where not usable (-1, after the selecting token's own block, a token
    past the tile's end) to the padding value, sorted; an entry equal to the one before it is a repeat; the distinct
    ones are written ascending, then the padding, with their count. CHOSEN: each distinct block's bit i set iff token
    i chose it and may use it (an OR over the token's K entries, so repeats count once). PER_TOKEN: tile t is token
    t alone (the one-token union walk). Compiled for sm_90 at M3's sizes (K = 16, Triton 3.6's ptxas without a GPU):
    22 registers for 4-token unions, 40 with the bits (4 or 8 tokens), 32 for 16 tokens; no spill; 256-2048 bytes
    of shared memory (the sort's and the neighbour gather's exchanges)."""
    tile = tl.program_id(0)
    g = tl.program_id(1)
    if PER_TOKEN:
        start = tile
        end = tile + 1
    else:
        seq, start, end = _tile_range(qsl_ptr, num_seqs, tile, TOKENS, SEQ_BLOCK)
        if TILES:
            if g == 0:
                tl.store(seq_ptr + tile, seq)
                tl.store(start_ptr + tile, start)
                tl.store(end_ptr + tile, end)
    if UNION:
        W: tl.constexpr = TOKENS * K
        PAD: tl.constexpr = 2147483647
        e = tl.arange(0, E_PAD)
        tok = start + e // K
        real = (e < W) & (tok < end)
        ids = tl.load(sel_ptr + tok.to(tl.int64) * ss_t + g * ss_g + e % K, mask=real, other=-1)
        own = tl.load(pos_ptr + tok, mask=real, other=0) // BS
        v = tl.sort(tl.where(real & (ids >= 0) & (ids <= own), ids, PAD))
        prev = tl.gather(v, tl.maximum(e - 1, 0), 0)
        distinct = (v != PAD) & ((e == 0) | (v != prev))
        count = tl.sum(distinct.to(tl.int32), axis=0)
        rank = tl.cumsum(distinct.to(tl.int32), axis=0) - 1  # distinct entries before this one
        dest = tl.where(distinct, rank, count + e - rank - 1)  # the others after them, in order: a permutation
        base = (tile * tl.num_programs(1) + g).to(tl.int64)
        tl.store(uni_ptr + base * W + dest, tl.where(distinct, v, PAD), mask=dest < W)
        tl.store(cnt_ptr + base, count)
        if CHOSEN:
            kk = tl.arange(0, K_PAD)
            bits = tl.zeros([E_PAD], dtype=tl.int32)
            for i in tl.static_range(TOKENS):
                real_i = start + i < end
                ids_i = tl.load(sel_ptr + (start + i).to(tl.int64) * ss_t + g * ss_g + kk, mask=real_i & (kk < K),
                                other=-1)
                own_i = tl.load(pos_ptr + start + i, mask=real_i, other=0) // BS
                ok_i = real_i & (kk < K) & (ids_i >= 0) & (ids_i <= own_i)
                hit = tl.max(((ids_i[None, :] == v[:, None]) & ok_i[None, :]).to(tl.int32), axis=1)
                bits = bits | (hit << i)
            tl.store(cho_ptr + base * W + dest, tl.where(distinct, bits, 0), mask=dest < W)


def tile_plan(query_start_loc: torch.Tensor, sel: torch.Tensor, positions: torch.Tensor, num_tokens: int,
              tokens: int, block_size: int, *, union: bool, chosen: bool):
    """At most one launch of ``_tile_plan``. -> (tile_seq, tile_start, tile_end, slots, union, count, choosers): the first
    four as ``query_tiles`` gives them (None for ``tokens`` == 1: the attention kernel finds a token's sequence
    itself, and a one-token union's tiles are the tokens), union [slots, Hkv, tokens * K] int32 and count [slots,
    Hkv] as ``tile_unions``, choosers as ``union_choosers`` (None unless ``chosen``; ``union`` None unless asked).
    sel [T, Hkv, K] int32 with unit stride along K; positions and query_start_loc contiguous."""
    if chosen and tokens > 31:
        raise ValueError(f"sparse_paged_attention: '_chosen' keeps a tile's tokens as int32 bits: {tokens} tokens")
    if not union:  # tile lists alone (one-token tiles need none)
        if tokens == 1:
            return None, None, None, num_tokens, None, None, None
        return (*tile_lists(query_start_loc, num_tokens, tokens), None, None, None)
    device, hkv, k = sel.device, sel.shape[1], sel.shape[2]
    b = query_start_loc.shape[0] - 1
    if tokens == 1:
        slots, tiles = num_tokens, (None, None, None)
    else:
        slots = tile_slots(b, num_tokens, tokens)
        tiles = torch.empty((3, slots), dtype=torch.int32, device=device).unbind(0)
    uni = torch.empty((slots, hkv, tokens * k), dtype=torch.int32, device=device)
    cnt = torch.empty((slots, hkv), dtype=torch.int32, device=device)
    cho = torch.empty_like(uni) if chosen else None
    if slots:
        e_pad = next_pow2(max(2, tokens * k))
        seq, start, end = tiles if tokens > 1 else (uni, uni, uni)  # not written for one-token tiles
        _tile_plan[(slots, hkv)](
            query_start_loc, b, sel, sel.stride(0), sel.stride(1), positions, seq, start, end, uni, cnt,
            cho if chosen else uni, BS=block_size, K=k, K_PAD=next_pow2(max(2, k)), TOKENS=tokens, E_PAD=e_pad,
            SEQ_BLOCK=min(_SEQ_BLOCK, next_pow2(max(2, b))), PER_TOKEN=tokens == 1, TILES=tokens > 1, UNION=True,
            CHOSEN=chosen, num_warps=4 if e_pad >= 128 else (2 if e_pad >= 64 else 1))
    return (*tiles, slots, uni, cnt, cho)


def tile_lists(query_start_loc: torch.Tensor, num_tokens: int, tokens: int):
    """``_batch.query_tiles``' answer (seq, start, end, slots) from one launch of ``_tile_plan`` (tile lists only)
    instead of its ~15 torch ops: what the dense attention and indexer launchers of tiles of several tokens use."""
    b = query_start_loc.shape[0] - 1
    slots = tile_slots(b, num_tokens, tokens)
    seq, start, end = torch.empty((3, slots), dtype=torch.int32, device=query_start_loc.device).unbind(0)
    if slots:
        _tile_plan[(slots, 1)](
            query_start_loc, b, seq, 0, 0, seq, seq, start, end, seq, seq, seq, BS=1, K=1, K_PAD=2, TOKENS=tokens,
            E_PAD=2, SEQ_BLOCK=min(_SEQ_BLOCK, next_pow2(max(2, b))), PER_TOKEN=False, TILES=True, UNION=False,
            CHOSEN=False, num_warps=1)
    return seq, start, end, slots


# ------------------------------------------------------------------------------------ the torch definitions
def _tile_selections(sel: torch.Tensor, positions: torch.Tensor, tile_start: torch.Tensor, tile_end: torch.Tensor,
                     tokens: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tile's tokens' selections, [slots, Hkv, tokens, K] int32 (a token past the tile's end reads token 0's),
    and which entries the token may use (a real token's id >= 0, not after its own block)."""
    t = sel.shape[0]
    tok = tile_start.long()[:, None] + torch.arange(tokens, device=sel.device)  # [slots, tokens]
    real = tok < tile_end.long()[:, None]
    tok = torch.where(real, tok, 0).clamp(max=max(t - 1, 0))
    ids = sel[tok]  # [slots, tokens, Hkv, K]
    own = (positions[tok] // block_size)[:, :, None, None]
    ok = real[:, :, None, None] & (ids >= 0) & (ids <= own)
    return ids.permute(0, 2, 1, 3), ok.permute(0, 2, 1, 3)


def tile_unions(sel: torch.Tensor, positions: torch.Tensor, tile_start: torch.Tensor, tile_end: torch.Tensor,
                tokens: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every (query tile, KV head): the distinct blocks some token of the tile selected and may see (id >= 0,
    not after that token's own block), ascending, then padding; and how many there are. The definition
    ``_tile_plan`` is tested against (torch ops: two sorts of tokens * K ids per tile).

    sel [T, Hkv, K] int32, tiles [slots] -> (union [slots, Hkv, tokens * K] int32, count [slots, Hkv] int32)."""
    slots, (hkv, k) = tile_start.shape[0], sel.shape[1:]
    ids, ok = _tile_selections(sel, positions, tile_start, tile_end, tokens, block_size)
    ids = torch.where(ok, ids, _PAD).reshape(slots, hkv, tokens * k)
    ids = torch.sort(ids, dim=-1).values
    repeat = torch.zeros_like(ids, dtype=torch.bool)
    repeat[..., 1:] = ids[..., 1:] == ids[..., :-1]
    ids = torch.sort(torch.where(repeat, _PAD, ids), dim=-1).values
    count = (ids != _PAD).sum(-1, dtype=torch.int32)
    return ids.to(torch.int32).contiguous(), count.contiguous()


def union_choosers(sel: torch.Tensor, positions: torch.Tensor, tile_start: torch.Tensor, tile_end: torch.Tensor,
                   tokens: int, block_size: int, union: torch.Tensor) -> torch.Tensor:
    """For every entry of ``tile_unions``' union: bit i set iff token i of the tile selected that block and may see it
    (id <= its own block); int32 [slots, Hkv, tokens * K] (tokens <= 31). The union walk's rows that want a block,
    and whether all real tokens do, from one load (loop modifier "_chosen"). The definition ``_tile_plan`` is
    tested against (torch ops: each selection entry's place in the sorted union by a batched binary search, then
    one scatter)."""
    if tokens > 31:
        raise ValueError(f"sparse_paged_attention: '_chosen' keeps a tile's tokens as int32 bits: {tokens} tokens")
    slots, (hkv, k), width = tile_start.shape[0], sel.shape[1:], union.shape[-1]
    ids, ok = _tile_selections(sel, positions, tile_start, tile_end, tokens, block_size)
    at = torch.searchsorted(union.reshape(slots * hkv, width), ids.reshape(slots * hkv, tokens * k))
    at = at.view(slots, hkv, tokens, k)
    at = torch.where(ok, at, width)  # not usable by that token: the spare column
    seen = torch.zeros(slots, hkv, tokens, width + 1, dtype=torch.uint8, device=sel.device)
    seen.scatter_(-1, at, 1)
    weights = (1 << torch.arange(tokens, dtype=torch.int32, device=sel.device)).view(1, 1, tokens, 1)
    return (seen[..., :width] * weights).sum(2, dtype=torch.int32).contiguous()
