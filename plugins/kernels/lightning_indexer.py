"""``m3::lightning_indexer`` on the GPU: a paged index-key scan that keeps only per-block maxima, then block top-k.

Semantics: ``m3export.ops.indexer.lightning_indexer_reference`` (``docs/ops.md`` §2). Two launches:

1. ``_index_scan``: one program per (query tile, context split). A query tile is up to ``TOKENS`` consecutive new
   tokens of one sequence times the index heads, packed as the rows of one dot against ``BLOCK_N`` index keys at
   a time (read straight from the paged pool through the block table). Each tile of scores is reduced on chip to
   the max of every ``block_size`` keys (causally masked per row), and only those block maxima reach memory
   (1/block_size of the token scores). The context is cut into a fixed number of splits chosen from shapes, so
   one decode batch shape is one launch shape whatever the lengths (CUDA-graph safe).
2. ``_block_topk``: one program per (token, head) over at most ``ceil(max_pages * page_size / block_size)``
   blocks: forced blocks (local / init) as +inf, blocks after the token's own as -inf, then ``topk`` rounds of
   "largest value, lowest id among equals": exactly the reference's stable descending order; -inf -> -1.
   The ``"bitonic"`` method gives the same ids from one bitonic top-k (``tl.topk``) over
   one int64 key per block, (order-preserving bits of the score) << 32 | (NB_PAD - 1 - id): keys are distinct and
   their descending order is "larger score first, lower id among equal scores" (0.0 and -0.0 made one value
   first, as float comparison has them equal).

Launch parameters are the table ``DEFAULTS``; ``forward(..., config=...)`` overrides entries of it (how
``bench/attention.py --sweep`` times the alternatives in one run). Every entry keeps the op's exact result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._batch import (cdiv, dot_precision, interpreted, launch_settings, log2_ceil, mma, next_pow2, query_tiles,
                     sequence_of, splits_for, tokens_per_tile)
from ._fp8 import widen

OP = "m3::lightning_indexer"

DEFAULTS = {
    # block_n: key tile (raised to block_size when blocks are longer: a tile never splits a block);
    # waves: programs per multiprocessor the context splits aim for; max_splits: most splits of one tile's
    # context (the launch has slots x splits programs); min_split_tiles: when > 0, no more splits than
    # ceil(key tiles of the widest block table / min_split_tiles) (a shape, so still one launch per batch
    # shape), so short contexts do not launch programs that find no key.
    # H200 sweep 2026-11-30 22:12 UTC: "n64-w4-s3-waves4-max1024" 0.94x the earlier defaults' time; top-k
    # "bitonic-w4" 0.61x.
    "scan": dict(block_n=64, num_warps=4, num_stages=3, waves=4, max_splits=1024, min_split_tiles=0),
    # method: "rounds" (topk rounds of max / min) or "bitonic" (tl.topk over packed int64 keys).
    "topk": dict(method="bitonic", num_warps=4),
}


def _scan(block_n, num_warps, num_stages, waves, max_splits, min_split_tiles=0):
    return dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages, waves=waves, max_splits=max_splits,
                min_split_tiles=min_split_tiles)


# Alternatives ``bench/attention.py --sweep`` times against DEFAULTS in one run (every one checked on CPU by
# tests/test_kernels_attention_variants.py). Each is a COMPLETE setting, named for what it runs (n: key tile, w:
# warps, s: stages, waves, max: most splits, min: min_split_tiles; topk: method, w: warps; the test derives every
# name from its settings), so a change of DEFAULTS renames nothing; a part's winner is copied into DEFAULTS by
# hand (the sweep skips a variant equal to the defaults).
#
# Scan at batch 1 / 128k on the H200 (59 % of copy bandwidth; 71 % at batch 8 / 32k): blocks of 128 keys raise every
# key tile to 128 (n64 runs as n128 there), so the launch reads 1024 tiles of 32 KB (33.5 MB) from one query tile. The
# defaults' 4 waves ask for 528 splits: 2 tiles each, 512 programs with work (the launcher now drops the 16 empty
# ones); at 64-96 KB of shared memory in 3 stages (an estimate: 2-3 buffered key tiles) two or three programs fit on
# an SM, so 264-396 run at once, in about two waves of programs that are nearly all start (sequence, position, query,
# block table, then the first key tile: dependent loads) and no steady streaming. The old defaults (256 splits of 4
# tiles, one wave) were slower still (54 %), so the variants below try the other corners: 2 stages (32-64 KB: three or
# more per SM) with 342 splits of 3 tiles (all resident at once) or 1024 splits of one tile (short programs, ~2.6
# waves, each one's start hidden under the others' streaming), and 128 long programs of 8 tiles in 4 stages (one per
# SM, three tiles in flight).
VARIANTS = {
    "scan": {
        "n64-w4-s3-waves2-max256": _scan(64, 4, 3, 2, 256),  # the defaults before 2026-11-30 22:12
        "n64-w4-s3-waves4-max1024": _scan(64, 4, 3, 4, 1024),
        "n64-w4-s3-waves8-max1024-min2": _scan(64, 4, 3, 8, 1024, 2),
        "n64-w4-s3-waves2-max256-min4": _scan(64, 4, 3, 2, 256, 4),
        "n256-w4-s3-waves4-max1024": _scan(256, 4, 3, 4, 1024),
        "n64-w8-s3-waves4-max1024": _scan(64, 8, 3, 4, 1024),
        "n64-w4-s4-waves4-max1024-min2": _scan(64, 4, 4, 4, 1024, 2),
        # aimed at batch 1 / 128k (above)
        "n128-w4-s2-waves3-max1024": _scan(128, 4, 2, 3, 1024),
        "n128-w4-s2-waves8-max1024": _scan(128, 4, 2, 8, 1024),
        "n128-w4-s4-waves1-max1024": _scan(128, 4, 4, 1, 1024),
    },
    "topk": {
        "rounds-w4": dict(method="rounds", num_warps=4),  # the defaults before 2026-11-30 22:12
        "rounds-w1": dict(method="rounds", num_warps=1),
        "rounds-w2": dict(method="rounds", num_warps=2),
        "bitonic-w1": dict(method="bitonic", num_warps=1),
        "bitonic-w4": dict(method="bitonic", num_warps=4),
    },
}


@triton.jit
def _index_scan(
    q_ptr, k_ptr, ks_ptr, bt_ptr, pos_ptr, qsl_ptr, tile_seq_ptr, tile_start_ptr, tile_end_ptr, out_ptr,
    num_seqs, sq_t, sq_h, sk_p, sk_r, sks_p, sks_r, sbt_b, so_t, so_h,
    FP8: tl.constexpr, H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BS: tl.constexpr, TOKENS: tl.constexpr, ROWS: tl.constexpr, LOG2_SEQS: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr, PREC: tl.constexpr, INTERPRETED: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    if TOKENS == 1:  # one program per token (decode-like batches): its sequence by binary search
        seq = sequence_of(qsl_ptr, tile, num_seqs, LOG2_SEQS)
        start = tile
        end = tile + 1
    else:
        seq = tl.load(tile_seq_ptr + tile)
        start = tl.load(tile_start_ptr + tile)
        end = tl.load(tile_end_ptr + tile)

    rows = tl.arange(0, ROWS)
    tok = start + rows // H_PAD
    head = rows % H_PAD
    row_ok = (tok < end) & (head < H)
    pos = tl.load(pos_ptr + tok, mask=row_ok, other=-1).to(tl.int32)
    last = tl.max(pos, axis=0)  # keys 0..last are all this tile reads (-1: an unused slot)

    n_tiles = (last + BLOCK_N) // BLOCK_N
    per = (n_tiles + SPLITS - 1) // SPLITS
    lo = split * per
    hi = tl.minimum(lo + per, n_tiles)

    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + tok[:, None].to(tl.int64) * sq_t + head[:, None] * sq_h + d[None, :],
                mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
    own = pos // BS
    NB_TILE: tl.constexpr = BLOCK_N // BS
    out_row = out_ptr + tok.to(tl.int64) * so_t + head * so_h
    for it in range(lo, hi):
        j = it * BLOCK_N + tl.arange(0, BLOCK_N)
        kmask = j <= last
        page = tl.load(bt_ptr + seq.to(tl.int64) * sbt_b + j // PAGE, mask=kmask, other=0).to(tl.int64)
        k = tl.load(k_ptr + page[:, None] * sk_p + (j % PAGE)[:, None] * sk_r + d[None, :],
                    mask=kmask[:, None] & (d[None, :] < D), other=0.0)
        if FP8:  # E4M3 keys: the dot on the exact values, each key's scale on its score column
            k = widen(k, q_ptr.dtype.element_ty)
            ks = tl.load(ks_ptr + page * sks_p + (j % PAGE) * sks_r, mask=kmask, other=0.0)
            s = mma(q, tl.trans(k), PREC, INTERPRETED) * ks[None, :]
        else:
            s = mma(q, tl.trans(k), PREC, INTERPRETED)
        s = tl.where(j[None, :] <= pos[:, None], s, float("-inf"))
        bmax = tl.max(tl.reshape(s, (ROWS, NB_TILE, BS)), axis=2)
        c = it * NB_TILE + tl.arange(0, NB_TILE)
        tl.store(out_row[:, None] + c[None, :], bmax, mask=row_ok[:, None] & (c[None, :] <= own[:, None]))


@triton.jit
def _block_topk(
    scores_ptr, pos_ptr, out_ptr, ss_t, ss_h, so_t, so_h,
    NB: tl.constexpr, NB_PAD: tl.constexpr, BS: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
    LOCAL: tl.constexpr, INIT: tl.constexpr, METHOD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    own = (tl.load(pos_ptr + t) // BS).to(tl.int32)
    c = tl.arange(0, NB_PAD)
    visible = (c <= own) & (c < NB)
    v = tl.load(scores_ptr + t.to(tl.int64) * ss_t + h * ss_h + c, mask=visible, other=float("-inf"))
    forced = visible & ((c > own - LOCAL) | (c < INIT))
    v = tl.where(forced, float("inf"), v)
    base = out_ptr + t.to(tl.int64) * so_t + h * so_h
    if METHOD == "rounds":
        for i in tl.static_range(TOPK):
            top = tl.max(v, axis=0)
            pick = tl.min(tl.where(v == top, c, NB_PAD), axis=0)
            tl.store(base + i, tl.where(top == float("-inf"), -1, pick))
            v = tl.where(c == pick, float("-inf"), v)
    else:  # "bitonic": one key per block, (order-preserving score bits) << 32 | (NB_PAD - 1 - id), top-k of keys
        bits = v.to(tl.int32, bitcast=True)
        bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 -> 0.0: equal as floats, so one key value
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # signed int order == float order
        key = (ordered.to(tl.int64) << 32) | (NB_PAD - 1 - c).to(tl.int64)
        top = tl.topk(key, TOPK_PAD)  # descending
        pick = (NB_PAD - 1 - (top & 0xFFFFFFFF)).to(tl.int32)
        NEG_INF: tl.constexpr = -2139095041  # float("-inf"), 0xFF800000, after the order map: 0x807FFFFF
        i = tl.arange(0, TOPK_PAD)
        tl.store(base + i, tl.where((top >> 32) == NEG_INF, -1, pick), mask=i < TOPK)


def forward(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    topk_blocks: int,
    local_blocks: int,
    init_blocks: int,
    index_k_scale: torch.Tensor | None = None,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """index_q [T, H, D], index_k_cache [pages, page, D] -> selected block ids [T, H, topk_blocks] int32.
    An FP8 key pool comes with its fp32 scale pool [pages, page]. ``config``: {"scan": {...}, "topk": {...}},
    entries overriding ``DEFAULTS`` (None for the op)."""
    t, h, _ = index_q.shape
    if topk_blocks == 0 or t == 0 or seq_lens.shape[0] == 0:
        _check(index_q, index_k_cache, block_size, index_k_scale)
        return torch.full((t, h, topk_blocks), -1, dtype=torch.int32, device=index_q.device)
    scores = scan(index_q, index_k_cache, block_tables, query_start_loc, seq_lens, positions, block_size,
                  index_k_scale, config=config)
    return block_topk(scores, positions, block_size, topk_blocks, local_blocks, init_blocks, config=config)


def _check(index_q, index_k_cache, block_size, index_k_scale) -> None:
    from m3export.ops.kv_fp8 import FP8, check_pair

    d = index_q.shape[2]
    if index_k_cache.dim() != 3 or index_k_cache.shape[2] != d:
        raise ValueError(f"lightning_indexer: index_k_cache {tuple(index_k_cache.shape)} must be [pages, page, {d}]")
    check_pair("index_k_cache", index_k_cache, index_k_scale)
    if index_k_cache.dtype != index_q.dtype and index_k_cache.dtype != FP8:
        raise ValueError(f"lightning_indexer: index_q is {index_q.dtype} but index_k_cache is {index_k_cache.dtype}")
    if block_size < 1 or block_size & (block_size - 1) or block_size > 256:
        raise ValueError(f"lightning_indexer kernel: block_size {block_size} must be a power of two <= 256")


def scan(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    index_k_scale: torch.Tensor | None = None,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """The first launch alone: block maxima [T, H, NB] fp32, NB = blocks of the widest block table (entries past a
    token's own block are not written)."""
    _check(index_q, index_k_cache, block_size, index_k_scale)
    cfg = launch_settings("lightning_indexer", DEFAULTS, config, "scan")
    t, h, d = index_q.shape
    b = seq_lens.shape[0]
    page = index_k_cache.shape[1]
    q = index_q if index_q.stride(2) == 1 else index_q.contiguous()
    kc = index_k_cache if index_k_cache.stride(2) == 1 else index_k_cache.contiguous()
    bt = block_tables.contiguous()
    pos = positions.contiguous()

    nb = cdiv(block_tables.shape[1] * page, block_size)  # most blocks any sequence of this batch can have
    scores = torch.empty((t, h, nb), dtype=torch.float32, device=index_q.device)
    h_pad = next_pow2(h)
    qsl = query_start_loc.contiguous()
    tokens = tokens_per_tile(t, b, h_pad)
    if tokens == 1:
        seq = start = end = qsl  # unused: the kernel finds each token's sequence itself
        slots = t
    else:
        seq, start, end, slots = query_tiles(qsl, t, tokens)
    block_n = max(cfg["block_n"], block_size)
    most = cfg["max_splits"]
    if cfg["min_split_tiles"] > 0:
        most = min(most, cdiv(cdiv(block_tables.shape[1] * page, block_n), cfg["min_split_tiles"]))
    splits = splits_for(index_q.device, slots, most, cfg["waves"])
    widest = cdiv(block_tables.shape[1] * page, block_n)  # key tiles of the widest block table
    splits = cdiv(widest, cdiv(widest, splits))  # none left without a tile there (528 of 1024 -> 512 of 2 each)
    ks = index_k_scale.contiguous() if index_k_scale is not None else kc  # kc: never read (FP8 off)
    _index_scan[(slots, splits)](
        q, kc, ks, bt, pos, qsl, seq, start, end, scores, b,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), bt.stride(0),
        scores.stride(0), scores.stride(1), FP8=index_k_scale is not None,
        H=h, H_PAD=h_pad, D=d, BLOCK_D=next_pow2(max(d, 16)), PAGE=page, BS=block_size, TOKENS=tokens,
        ROWS=max(16, tokens * h_pad), LOG2_SEQS=log2_ceil(b), BLOCK_N=block_n, SPLITS=splits,
        PREC=dot_precision(index_q.dtype), INTERPRETED=interpreted(index_q), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return scores


def block_topk(
    scores: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    topk_blocks: int,
    local_blocks: int,
    init_blocks: int,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """The second launch alone: block maxima [T, H, NB] (as ``scan`` leaves them) -> ids [T, H, topk_blocks]."""
    cfg = launch_settings("lightning_indexer", DEFAULTS, config, "topk")
    t, h, nb = scores.shape
    out = torch.empty((t, h, topk_blocks), dtype=torch.int32, device=scores.device)  # every id is written
    pos = positions.contiguous()
    if cfg["method"] not in ("rounds", "bitonic"):
        raise ValueError(f"lightning_indexer: topk method {cfg['method']!r} is not 'rounds' or 'bitonic'")
    topk_pad = next_pow2(max(topk_blocks, 2))
    _block_topk[(t, h)](
        scores, pos, out, scores.stride(0), scores.stride(1), out.stride(0), out.stride(1),
        NB=nb, NB_PAD=max(next_pow2(max(nb, 2)), topk_pad), BS=block_size, TOPK=topk_blocks, TOPK_PAD=topk_pad,
        LOCAL=local_blocks, INIT=init_blocks, METHOD=cfg["method"], num_warps=cfg["num_warps"],
    )
    return out
