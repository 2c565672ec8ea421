"""``m3::lightning_indexer`` on the GPU: a paged index-key scan that keeps only per-block maxima, then block top-k.

Semantics: ``m3export.ops.indexer.lightning_indexer_reference`` (``docs/ops.md`` §2). Two launches:

1. ``_index_scan``: one program per (query tile, context split). A query tile is up to ``TOKENS`` consecutive new
   tokens of one sequence times the index heads, packed as the rows of one dot against ``BLOCK_N`` index keys at
   a time (read straight from the paged pool through the block table). Each tile of scores is reduced on chip to
   the max of every ``block_size`` keys (causally masked per row), and only those block maxima reach memory
   (1/block_size of the token scores). The context is cut into a fixed number of splits chosen from shapes, so
   one decode batch shape is one launch shape whatever the lengths (CUDA-graph safe). Key tiles come by gathering
   rows through the block table, or (``loads="tma"``) one page-sized tile per bulk tensor copy in a pipelined loop.
2. ``_block_topk``: one program per (token, head) over at most ``ceil(max_pages * page_size / block_size)``
   blocks: forced blocks (local / init) as +inf, blocks after the token's own as -inf, then ``topk`` rounds of
   "largest value, lowest id among equals": exactly the reference's stable descending order; -inf -> -1.
   The ``"bitonic"`` method gives the same ids from one bitonic top-k (``tl.topk``) over
   one int64 key per block, (order-preserving bits of the score) << 32 | (NB_PAD - 1 - id): keys are distinct and
   their descending order is "larger score first, lower id among equal scores" (0.0 and -0.0 made one value
   first, as float comparison has them equal).
   With the top-k setting ``group`` a long row is ranked in two levels (``_grouped_topk``): the top-k groups of
   ``group`` consecutive blocks by their largest key, then the top-k of those groups' blocks (the same ids; two
   small sorts instead of one over the whole padded row).
   With ``tiers`` (the default) each row is ranked over the smallest of a few row sizes that holds its blocks
   before the local ones (a runtime branch per program), and the local blocks, forced, are put in their place
   among the picks: what a row costs follows its own length, not the width of the block table (a decode graph's
   is max_model_len's).
   With ``fold_topk`` the scan's last program per query tile (an atomic ticket) runs this top-k itself (whole
   rows, whatever ``group`` says): one launch.

Launch parameters are the table ``DEFAULTS``; ``forward(..., config=...)`` overrides entries of it (how
``bench/attention.py --sweep`` times the alternatives in one run). Every entry keeps the op's exact result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._batch import (cdiv, dot_precision, interpreted, launch_settings, log2_ceil, mma, next_pow2, num_sms,
                     sequence_of, splits_for, ticket_counters, tokens_per_tile)
from ._fp8 import by_bits, widen, widen_by_bits
from ._tile_plan import tile_lists
from ._tma import ensure_descriptor_allocator

OP = "m3::lightning_indexer"
# The scan's key loads (DEFAULTS["scan"]["loads"]); "auto": "tma-host" where a page holds the key tile, else the
# gathered whole-block tiles of ``SMALL_PAGE_SCAN``.
LOADS = ("gather", "tma", "tma-host", "auto")
# How FP8 keys meet 16-bit queries (DEFAULTS["scan"]["fp8_dot"]). "bf16": each key widened to the query's dtype, on
# sm_90 an e4m3x2 -> f16x2 conversion per two keys and an f16 -> bf16 one per key (64 + 128 per thread for a tile of
# 128 keys of 128 dims at 4 warps, ``scripts/compile_indexer_sm90.py``), which the multiprocessor issues at 16 per
# cycle, a quarter of the integer rate. "tf32": the f16 -> f32 step is a full-rate add (HADD2.F32), so 64 slow
# conversions per tile are left, and the dot runs TF32 (twice the HMMA instructions, on otherwise idle tensor
# cores). Same products (exact in either), the same fp32 accumulation; fp32 queries keep their IEEE dot.
# "bits": keys widened to bf16 by bit placement (``_fp8.widen_by_bits``: integer ops and one bf16 multiply per two
# keys, no conversion instruction), the dot in bf16; bf16 queries only (others run "bf16").
FP8_DOTS = ("bf16", "tf32", "bits")

DEFAULTS = {
    # block_n: key tile (gather: raised to block_size when blocks are longer, a tile never splits a block; tma:
    # lowered to the page, a tile never crosses a page, and a longer block keeps its max across its tiles);
    # loads: "gather" (each key row's address from its page id, cp.async), "tma" (one bulk tensor copy per
    # page-sized tile, descriptor made in the kernel), "tma-host" (the same, descriptor made at launch; pools a
    # descriptor cannot address, ``tma_usable``, are gathered) or "auto" (``LOADS``; since 2026-12-02); fold_topk: 1 runs the block top-k in the scan
    # launch (``forward`` only, decode-like batches up to ``FOLD_MOST_KEYS``); waves: programs per multiprocessor
    # the context splits aim for (tma: at most); max_splits: most splits of one tile's context (the launch has
    # slots x splits programs); min_split_tiles: when > 0, no more splits than ceil(key tiles of the widest block
    # table / min_split_tiles) (a shape, so still one launch per batch shape), so short contexts do not launch
    # programs that find no key; fp8_dot: how FP8 keys meet 16-bit queries, "bf16" (keys widened to the query's
    # dtype) or "tf32" (keys and queries widened to fp32, the dot in TF32: exact, as every E4M3, bf16 and fp16
    # value is a TF32 value; ``FP8_DOTS``).
    # H200 sweep 2026-11-30 22:12 UTC: "n64-w4-s3-waves4-max1024" 0.94x the earlier defaults' time; top-k
    # "bitonic-w4" 0.61x.
    # H200 sweep 2026-12-01 06:35 UTC (commit b64458a, bench/results/attention_sweep_indexer.json, every selection
    # equal to the reference's): "tma-host-n128-w4-s8-waves2-max1024" (page-sized key tiles by bulk copies, the
    # descriptor made at launch, 3 tiles in flight per program): batch 1 / 128k 10.8 us (73.3 % of copy bandwidth;
    # the gather default of then 10.8 us, 13.2-13.4 us in earlier runs), batch 8 / 32k 20.2 us (78 %; 21.5),
    # batch 1 / 4k 4.3 us (4.7). The sweep's geometric-mean winner "tma-host-n128-w4-s10-waves1-max1024" was faster at
    # 8 / 32k (18.3 us) but slower at 1 / 128k (11.6 us, 68 %). Folding the top-k into the scan lost (33 us at 128k).
    # Pools TMA cannot address fall back to the gather loads (``tma_usable``). It replaced "n64-w4-s3-waves4-max1024".
    # H200 sweep 2026-12-01 19:40 UTC (commit ef59edc, FP8 index keys, bench/results/attention_sweep_scan_fp8_h200.json,
    # every selection equal to the reference's): the same launch with fp8_dot "tf32" 0.955x the time (geometric mean;
    # batch 1 / 4k 4.7 -> 4.6 us, 1 / 128k 11.1 -> 10.5 us, 8 / 32k 18.4 -> 17.2 us); bf16 keys are not affected.
    # H200 sweep 2026-12-02 04:13 UTC (bench/results/attention_sweep_scan_fp8_bits_h200.json, every selection equal
    # to the reference's): fp8_dot "bits" (FP8 keys widened by bit placement, the dot in bf16) at the same launch
    # 4.4 / 9.8 / 15.4 us at batch 1 / 4k, 1 / 128k, 8 / 32k against "tf32"'s 4.7 / 10.6 / 17.2; in the `mini`
    # model (pages of 64, three layers) 36.0 against 39.9 us a step at 128k. 16-bit keys are not affected.
    "scan": dict(block_n=128, num_warps=4, num_stages=8, waves=2, max_splits=1024, min_split_tiles=0,
                 loads="auto", fold_topk=0, fp8_dot="bits"),
    # method: "rounds" (topk rounds of max / min) or "bitonic" (tl.topk over packed int64 keys);
    # group: 0 ranks a row's blocks padded to a power of two at once, > 0 ("bitonic") in two levels for rows of at least
    # ``GROUPED_LEAST`` x group x top-k blocks: the largest key of each group of that many blocks, the top-k groups
    # by it, then the top-k of those groups' blocks (``_grouped_topk``: the same ids).
    # H200 2026-12-01 22:45 UTC (bench/results/attention_sweep_topk_group_h200.json,
    # decode_profile_h200_s18_fp8.json; every selection equal to the reference's): group 16 ("bitonic-w4-g16") in
    # the `mini` model at batch 1 / 128k 19.8 us a step for its three layers against 24.9 (6.6 against 8.3 a layer;
    # sweep 3.9 against 4.4 us), at 4k 4.9 against 5.0 (rows of 33 blocks: one top-k, as before); sweep at
    # 8 / 32k and 64 / 32k 2.7 / 3.0 us against 2.7 / 3.1. "bitonic-w8-g16" 17.3 us in the model at 128k but
    # slower in the sweep at 8 / 32k and 64 / 32k.
    # long_warps: the warps of rows padded to at least ``LONG_ROW`` blocks (0: num_warps). H200 2026-12-02
    # (``bench/topk_launch.py``, one launch at a time, bench/results/topk_launch_h200.json; every selection the
    # stable sort's): at batch 1 / 128k (1025 blocks) 5.76 us against 4 warps' 6.14; at 32k (257 blocks, padded to
    # 512) 8 warps were slower (3.10 against 2.94), hence only long rows; in the `mini` model (FP8 keys, pages of
    # 16, three layers) 16.2 against 19.7 us a step at 128k.
    # tiers: 1 ("bitonic" only) ranks each row over the smallest of the launch's row sizes (``topk_tiers``: 64, 256,
    # 1024, ... blocks, then the padded table) that holds its blocks before the local ones, which are forced: only
    # their place among the ranked picks is found; 0 ranks every row over the whole padded table. A decode graph's
    # block table is as wide as max_model_len, so without tiers a 4k-token row of a 128k engine was ranked over 2048
    # padded blocks (16384 in a 1M-token engine), and the 1025-block row of a 128k context over 2048 where its 1024
    # ranked blocks need 1024. H200 2026-12-02 (``bench/topk_launch.py``, one launch, us, every id the reference's):
    # rows of a 128k table at 4k / 32k / 128k 1.58 / 1.98 / 4.16 against 5.60 / 5.66 / 5.73; of a 1M table at 4k /
    # 128k / 1M 1.57 / 3.39 / 8.42 against 8.22 / 8.35 / 8.80; tables as wide as the row 1.41 / 1.95 / 4.13 against
    # 1.41 / 2.91 / 5.70. In the `mini` model (FP8 keys, pages of 16, three layers, us a step): 13.4 against 17.9
    # at 128k; at 4k in a 128k engine 5.9 against 17.4.
    # align: 0, or > 0 (a multiple of 16): ``forward``'s block maxima rows start every ``align`` values and the
    # top-k takes their count rounded up to it (every read is also masked by the row's own block), so both integer
    # arguments are multiples of 16, which Triton specialises (a 128k row ranked in 3.39 us in an 8192-block table
    # and in 4.10-4.14 us in 1025, 2049 and 4097-block ones, where 4097 and 8192 compile the same tiers). 16 since
    # H200 2026-12-02 12:50 UTC (bench/results/topk_launch_s23_align_{128k,own}.json, decode_profile_s23_align_fp8.json;
    # every id the reference's, and the GPU tests of the indexer and the `mini` model's greedy tokens with it):
    # a 128k row 3.42 against 4.16 us (32k 1.86 against 1.95, 4k the same); in the `mini` model (FP8 keys, pages of
    # 16, three layers) the top-k 11.1 against 13.3 us a step at 128k.
    "topk": dict(method="bitonic", num_warps=4, group=16, long_warps=8, tiers=1, align=16),
}


def _topk(method, num_warps, group, long_warps=0, tiers=0, align=0):
    return dict(method=method, num_warps=num_warps, group=group, long_warps=long_warps, tiers=tiers, align=align)


def _scan(block_n, num_warps, num_stages, waves, max_splits, min_split_tiles=0, loads="gather", fold_topk=0,
          fp8_dot="bf16"):
    return dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages, waves=waves, max_splits=max_splits,
                min_split_tiles=min_split_tiles, loads=loads, fold_topk=fold_topk, fp8_dot=fp8_dot)


# Alternatives ``bench/attention.py --sweep`` times against DEFAULTS in one run (every one checked on CPU by
# tests/test_kernels_attention_variants.py). Each is a COMPLETE setting, named for what it runs (tma / tma-host: key
# tiles by a tensor descriptor made in the kernel / at launch; n: key tile, w: warps, s: stages, waves, max: most
# splits, min: min_split_tiles, fold: the top-k inside the scan launch; topk: method, w: warps; the test derives
# every name from its settings), so a change of DEFAULTS renames nothing; a part's winner is copied into DEFAULTS
# by hand (the sweep skips a variant equal to the defaults).
#
# Scan at batch 1 / 128k on the H200 (59 % of copy bandwidth; 71 % at batch 8 / 32k): blocks of 128 keys raise every
# key tile to 128 (n64 runs as n128 there), so the launch reads 1024 tiles of 32 KB (33.5 MB) from one query tile. The
# defaults' 4 waves ask for 528 splits: 2 tiles each, 512 programs with work. What sm_90 compiles (Triton 3.6's
# ptxas on the CPU machine, 2026-12-01; the JSON's ``compiled_kernels`` says the same on the H200): the gather loop
# holds ONE key tile buffer whatever num_stages says (37 KB of shared memory at s2, s3 and s4; 86-92 registers),
# because Triton's pipeliner splits the stages between the two chained loads (page ids, then keys) and gives each
# (num_stages - 2) / 2 buffers, rounded up: one tile in flight per program, the next copy issued only after the
# current tile is read. The "tma" loads keep that chain (a page id, then one bulk copy of the page's tile), so
# their buffers are num_stages 6 / 8 / 10 -> 2 / 3 / 4 tiles (70 / 103 / 135 KB with 128-key tiles, 89-94
# registers), i.e. 3 / 2 / 1 programs per SM; "tma" splits cut the context into runs of whole tiles that differ by
# at most one tile, never more programs than waves x SMs (132 programs of 7-8 tiles at waves 1, 128 of 16 at batch
# 8 / 32k), so each SM ramps up once and streams 3-4 tiles deep. "tma-host" passes a descriptor made at launch
# (no descriptor write and tensormap fence at each program's start: 0 tensormap instructions against 16). FP8 keys
# by TMA at s10: 72 KB (16 KB tiles), 128 registers; the fold adds ~15 registers (109 at tma s10); none spills.
# The gather loop at s8 gets 3 buffers the same way. "fold": the last program of a query tile runs the block
# top-k over the tile's block maxima (an atomic ticket per query tile; ``_batch.ticket_counters``): one launch
# instead of two per layer; its sweep row times scan + top-k (``bench/attention_sweep.py``), to be read against
# the scan row plus the top-k row of the same shape.
VARIANTS = {
    "scan": {
        "n64-w4-s3-waves2-max256": _scan(64, 4, 3, 2, 256),  # the defaults before 2026-11-30 22:12
        "n64-w4-s3-waves4-max1024": _scan(64, 4, 3, 4, 1024),
        "n128-w4-s2-waves8-max1024": _scan(128, 4, 2, 8, 1024),
        # 2026-12-01: a deeper gather pipeline, TMA key tiles in runs of one to three programs per SM, the fold
        "n128-w4-s8-waves2-max1024": _scan(128, 4, 8, 2, 1024),
        "tma-n128-w4-s10-waves1-max1024": _scan(128, 4, 10, 1, 1024, loads="tma"),
        "tma-n128-w4-s8-waves2-max1024": _scan(128, 4, 8, 2, 1024, loads="tma"),
        "tma-n128-w4-s6-waves3-max1024": _scan(128, 4, 6, 3, 1024, loads="tma"),
        "tma-n64-w4-s10-waves2-max1024": _scan(64, 4, 10, 2, 1024, loads="tma"),
        "tma-host-n128-w4-s10-waves1-max1024": _scan(128, 4, 10, 1, 1024, loads="tma-host"),
        "tma-host-n128-w4-s8-waves2-max1024": _scan(128, 4, 8, 2, 1024, loads="tma-host"),
        "tma-n128-w4-s10-waves1-max1024-fold": _scan(128, 4, 10, 1, 1024, loads="tma", fold_topk=1),
        "tma-host-n128-w4-s10-waves1-max1024-fold": _scan(128, 4, 10, 1, 1024, loads="tma-host", fold_topk=1),
        "n64-w4-s3-waves4-max1024-fold": _scan(64, 4, 3, 4, 1024, fold_topk=1),
        # 2026-12-01: FP8 keys in a TF32 dot (``FP8_DOTS``), at the defaults' loads and with more tiles in flight or
        # more programs (an FP8 tile is 16 KB, half a bf16 one); 16-bit keys run them as without. The first was
        # the default from 2026-12-01 19:40 to 2026-12-02 04:13 UTC.
        "tma-host-n128-w4-s8-waves2-max1024-tf32": _scan(128, 4, 8, 2, 1024, loads="tma-host", fp8_dot="tf32"),
        "tma-host-n128-w4-s10-waves2-max1024-tf32": _scan(128, 4, 10, 2, 1024, loads="tma-host", fp8_dot="tf32"),
        "tma-host-n128-w4-s8-waves4-max1024-tf32": _scan(128, 4, 8, 4, 1024, loads="tma-host", fp8_dot="tf32"),
        # 2026-12-02 (ninth session): FP8 keys widened by bit placement (``FP8_DOTS`` "bits", the default's), with
        # more programs or warps. H200 04:13 UTC: waves 3 9.6 / 14.5 us at 1 / 128k and 8 / 32k (the default's
        # 9.8 / 15.4), 8 warps 10.9 / 18.3; waves changes 16-bit keys' launch too, where it is not yet timed.
        "tma-host-n128-w4-s8-waves3-max1024-bits": _scan(128, 4, 8, 3, 1024, loads="tma-host", fp8_dot="bits"),
        "tma-host-n128-w8-s8-waves2-max1024-bits": _scan(128, 8, 8, 2, 1024, loads="tma-host", fp8_dot="bits"),
    },
    "topk": {
        "rounds-w4": _topk("rounds", 4, 0),  # the defaults before 2026-11-30 22:12
        "rounds-w1": _topk("rounds", 1, 0),
        "rounds-w2": _topk("rounds", 2, 0),
        "bitonic-w1": _topk("bitonic", 1, 0),
        "bitonic-w4": _topk("bitonic", 4, 0),
        # 2026-12-01, not yet timed: at batch 1 / 128k the widest table has 1025 blocks (131072 keys and the new
        # token), which the whole-row sort pads to 2048 (8.4 us a layer on the H200, 13:46 UTC): four programs
        # (one per head), each a long dependent chain. sm_90 code (``scripts/compile_indexer_sm90.py --part topk``):
        # 3544 SASS instructions per thread at w4, 2144 at w8, 1328 at w16. (A setting ``chunk``, walking the blocks
        # up to each row's own 256 at a time, lost at every shape in two H200 sweeps, 9.8 against 4.4 us at 128k;
        # removed after the two-level top-k replaced the whole-row sort for long rows.)
        "bitonic-w8": _topk("bitonic", 8, 0),
        "bitonic-w16": _topk("bitonic", 16, 0),
        # 2026-12-01 (seventh session): the two-level top-k (``_grouped_topk``). At 1025 blocks (padded to 2048) in
        # groups of 16: a max over each group's 16 keys, a top-16 of 128 group maxima, a top-16 of the 256 blocks
        # of the 16 groups it picks, reloaded (L2): sorts of 128 and 256 keys instead of one of 2048 (2936 SASS
        # instructions a thread against 3544; w8: 1824). "g16" is the default since 22:45 UTC (see DEFAULTS).
        "bitonic-w4-g16": _topk("bitonic", 4, 16),
        "bitonic-w4-g32": _topk("bitonic", 4, 32),
        "bitonic-w8-g16": _topk("bitonic", 8, 16),
        # "bitonic-w4-g16" is the default before ``long_warps`` (2026-12-02, tenth session). Tried the same day
        # and not kept: a radix selection (four 256-bin histograms of the score bits, then the blocks above the
        # threshold and the lowest-id ties, sorted): 8.5 us at batch 1 / 128k and 4.4 at 4k against the grouped
        # sort's 6.1 / 1.3 (H200, one launch each, a probe of that session): each of its four rounds of
        # histogram, prefix sum and reductions across the warps cost ~0.75 us.
        "bitonic-w4-g16-long8": _topk("bitonic", 4, 16, 8),  # the default before tiers (2026-12-02, 11th session)
        "bitonic-w8-g16-tiered": _topk("bitonic", 8, 16, 0, 1),
        # a 1024-block tier in groups of 8: sorts of 128 group maxima and 128 blocks, against 64 and 256 in groups
        # of 16
        "bitonic-w4-g8-tiered": _topk("bitonic", 4, 8, 0, 1),
        "bitonic-w4-g8-long8-tiered": _topk("bitonic", 4, 8, 8, 1),
        "bitonic-w4-g16-tiered": _topk("bitonic", 4, 16, 0, 1),
        # the default before ``align`` (2026-12-02, 23rd session)
        "bitonic-w4-g16-long8-tiered": _topk("bitonic", 4, 16, 8, 1),
    },
}

# The scan settings fp32 index-key pools run when the settings ask for TMA loads (see ``_scan_launch``): the default
# before 2026-12-01 06:35 UTC, keeping the caller's fold choice.
FP32_POOL_SCAN = {k: v for k, v in VARIANTS["scan"]["n64-w4-s3-waves4-max1024"].items() if k != "fold_topk"}

# The scan settings pools with pages smaller than the key tile run with loads "auto" (the default's;
# ``_scan_launch``): a bulk copy never crosses a page, so the TMA walk's tiles shrink to the page (16
# keys at the engine's default page, ``runtime.engine.default_page_size``), while the gather walk's tiles stay a
# whole index block. H200 2026-12-02 04:30 UTC (`mini`, pages of 16, three layers, us a step at 4k / 128k; every
# selection the references' in the tests): bf16 keys 18.5 / 62.2 by TMA, 11.5 / 34.3 with these; FP8 keys
# 20.4 / 69.3 and 10.9 / 27.5 (bench/results/decode_profile_h200_s20_p16_{bf16,fp8}.json). The caller's fold and
# FP8 dot are kept.
SMALL_PAGE_SCAN = {k: v for k, v in VARIANTS["scan"]["n128-w4-s2-waves8-max1024"].items()
                   if k not in ("fold_topk", "fp8_dot")}


@triton.jit
def _index_scan(
    q_ptr, k_ptr, ks_ptr, bt_ptr, pos_ptr, qsl_ptr, tile_seq_ptr, tile_start_ptr, tile_end_ptr, out_ptr,
    num_seqs, sq_t, sq_h, sk_p, sk_r, sks_p, sks_r, sbt_b, so_t, so_h,
    FP8: tl.constexpr, H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BS: tl.constexpr, TOKENS: tl.constexpr, ROWS: tl.constexpr, LOG2_SEQS: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS, PREC: tl.constexpr, INTERPRETED: tl.constexpr,
    # the TMA loads and the fold (defaults: neither, so callers of the gather scan pass none of these)
    num_rows=0, cnt_ptr=None, sel_ptr=None, ssel_t=0, ssel_h=0, k_desc=None, TMA: tl.constexpr = False,
    HOST_DESC: tl.constexpr = False,
    STAGES: tl.constexpr = 1, FOLD: tl.constexpr = False, NB=1, NB_PAD: tl.constexpr = 2,
    TOPK: tl.constexpr = 1, TOPK_PAD: tl.constexpr = 2, LOCAL: tl.constexpr = 0, INIT: tl.constexpr = 0,
    METHOD: tl.constexpr = "bitonic", FP8_TF32: tl.constexpr = False, FP8_BITS: tl.constexpr = False,
):
    """TMA: key tiles of BLOCK_N keys (<= PAGE, so one page each) copied by a tensor descriptor over the pool
    viewed [pages * PAGE, D] (made in the kernel, or with HOST_DESC the host-made ``k_desc``: no descriptor write
    and proxy fence at each program's start), in a loop pipelined STAGES deep; the context is cut into SPLITS runs
    of whole groups (max(BLOCK_N, BS) keys) of sizes differing by at most one, and a block longer than the tile
    keeps its running max across its tiles. FOLD: after its stores every program takes a ticket on its query
    tile's counter; the last of the tile's SPLITS programs puts the counter back to 0 and runs the block top-k of
    the tile's rows on the block maxima (as ``_block_topk``)."""
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

    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + tok[:, None].to(tl.int64) * sq_t + head[:, None] * sq_h + d[None, :],
                mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
    if FP8_TF32:
        q = q.to(tl.float32)  # exact: a bf16 / fp16 value is a TF32 value
    own = pos // BS
    out_row = out_ptr + tok.to(tl.int64) * so_t + head * so_h
    if TMA:
        GROUP: tl.constexpr = BLOCK_N if BLOCK_N > BS else BS  # what a split never cuts: whole tiles, whole blocks
        SUBS: tl.constexpr = GROUP // BLOCK_N  # key tiles per block (1 when a tile holds whole blocks)
        NB_TILE: tl.constexpr = BLOCK_N // BS if BLOCK_N > BS else 1
        units = (last + GROUP) // GROUP
        lo = (split * units) // SPLITS * SUBS
        hi = ((split + 1) * units) // SPLITS * SUBS
        if HOST_DESC:  # made on the host, passed by value with the launch
            desc = k_desc
        else:
            desc = tl.make_tensor_descriptor(k_ptr, shape=[num_rows, D], strides=[sk_r, 1],
                                             block_shape=[BLOCK_N, BLOCK_D])
        run = tl.full((ROWS,), float("-inf"), tl.float32)  # a block longer than the tile: its max so far
        for it in tl.range(lo, hi, num_stages=STAGES):
            j0 = it * BLOCK_N
            # a tile past the last key (the rest of the last block) reads page 0's first rows, all masked below
            page = tl.load(bt_ptr + seq.to(tl.int64) * sbt_b + j0 // PAGE, mask=j0 <= last, other=0)
            k = desc.load([page * PAGE + j0 % PAGE, 0])
            j = j0 + tl.arange(0, BLOCK_N)
            if FP8:
                k = widen_by_bits(k, INTERPRETED) if FP8_BITS else widen(k, q.dtype)
                ks = tl.load(ks_ptr + page.to(tl.int64) * sks_p + (j % PAGE) * sks_r, mask=j <= last, other=0.0)
                s = mma(q, tl.trans(k), "tf32" if FP8_TF32 else PREC, INTERPRETED) * ks[None, :]
            else:
                s = mma(q, tl.trans(k), PREC, INTERPRETED)
            s = tl.where(j[None, :] <= pos[:, None], s, float("-inf"))
            if SUBS == 1:
                bmax = tl.max(tl.reshape(s, (ROWS, NB_TILE, BS)), axis=2)
                c = it * NB_TILE + tl.arange(0, NB_TILE)
                tl.store(out_row[:, None] + c[None, :], bmax, mask=row_ok[:, None] & (c[None, :] <= own[:, None]))
            else:
                run = tl.maximum(run, tl.max(s, axis=1))
                done = it % SUBS == SUBS - 1
                blk = it // SUBS
                tl.store(out_row + blk, run, mask=row_ok & (blk <= own) & done)
                run = tl.where(done, float("-inf"), run)
    else:
        n_tiles = (last + BLOCK_N) // BLOCK_N
        per = (n_tiles + SPLITS - 1) // SPLITS
        lo = split * per
        hi = tl.minimum(lo + per, n_tiles)
        NB_TILE: tl.constexpr = BLOCK_N // BS
        for it in range(lo, hi):
            j = it * BLOCK_N + tl.arange(0, BLOCK_N)
            kmask = j <= last
            page = tl.load(bt_ptr + seq.to(tl.int64) * sbt_b + j // PAGE, mask=kmask, other=0).to(tl.int64)
            k = tl.load(k_ptr + page[:, None] * sk_p + (j % PAGE)[:, None] * sk_r + d[None, :],
                        mask=kmask[:, None] & (d[None, :] < D), other=0.0)
            if FP8:  # E4M3 keys: the dot on the exact values, each key's scale on its score column
                k = widen_by_bits(k, INTERPRETED) if FP8_BITS else widen(k, q.dtype)
                ks = tl.load(ks_ptr + page * sks_p + (j % PAGE) * sks_r, mask=kmask, other=0.0)
                s = mma(q, tl.trans(k), "tf32" if FP8_TF32 else PREC, INTERPRETED) * ks[None, :]
            else:
                s = mma(q, tl.trans(k), PREC, INTERPRETED)
            s = tl.where(j[None, :] <= pos[:, None], s, float("-inf"))
            bmax = tl.max(tl.reshape(s, (ROWS, NB_TILE, BS)), axis=2)
            c = it * NB_TILE + tl.arange(0, NB_TILE)
            tl.store(out_row[:, None] + c[None, :], bmax, mask=row_ok[:, None] & (c[None, :] <= own[:, None]))
    if FOLD:
        if not INTERPRETED:  # each thread's block-maximum stores ordered before the ticket at GPU scope
            tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.b32 $0, $1;", "=r,r", [rows], dtype=tl.int32,
                                      is_pure=False, pack=1)
        tl.debug_barrier()  # then the whole program's, before the one thread that takes the ticket
        ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLITS - 1:  # the tile's last program: all its block maxima are written
            tl.atomic_xchg(cnt_ptr + tile, 0)  # zero again for the next launch (or graph replay)
            FROWS: tl.constexpr = TOKENS * H_PAD
            fr = tl.arange(0, FROWS)
            ftok = start + fr // H_PAD
            fhead = fr % H_PAD
            fok = (ftok < end) & (fhead < H)
            fown = (tl.load(pos_ptr + ftok, mask=fok, other=0) // BS).to(tl.int32)
            cb = tl.arange(0, NB_PAD)
            visible = (cb[None, :] <= fown[:, None]) & (cb[None, :] < NB) & fok[:, None]
            v = tl.load(out_ptr + ftok[:, None].to(tl.int64) * so_t + fhead[:, None] * so_h + cb[None, :],
                        mask=visible, other=float("-inf"), cache_modifier=".cg")  # from L2: other SMs wrote them
            _select_blocks(v, visible, fown, sel_ptr + ftok.to(tl.int64) * ssel_t + fhead * ssel_h, fok, FROWS,
                           NB_PAD, TOPK, TOPK_PAD, LOCAL, INIT, METHOD)


@triton.jit
def _select_blocks(v, visible, own, out_row, row_ok, R: tl.constexpr, NB_PAD: tl.constexpr, TOPK: tl.constexpr,
                   TOPK_PAD: tl.constexpr, LOCAL: tl.constexpr, INIT: tl.constexpr, METHOD: tl.constexpr):
    """Block maxima v [R, NB_PAD] (-inf where not ``visible``), each row's own block ``own`` [R] -> the ids of its
    top-k stored at ``out_row`` [R] + 0..TOPK-1 (rows where ``row_ok``): forced blocks (local / init) as +inf, then
    "largest value, lowest id among equals"; -inf -> -1. ("rounds" never uses TOPK_PAD.)"""
    c = tl.arange(0, NB_PAD)
    v = _forced_first(v, c[None, :], own, visible, LOCAL, INIT)
    if METHOD == "rounds":
        for r in tl.static_range(TOPK):
            top = tl.max(v, axis=1)
            pick = tl.min(tl.where(v == top[:, None], c[None, :], NB_PAD), axis=1)
            tl.store(out_row + r, tl.where(top == float("-inf"), -1, pick), mask=row_ok)
            v = tl.where(c[None, :] == pick[:, None], float("-inf"), v)
    else:  # "bitonic": one key per block, (order-preserving score bits) << 32 | (NB_PAD - 1 - id), top-k of keys
        top = tl.topk(_block_keys(v, c[None, :], NB_PAD), TOPK_PAD)  # descending, along the blocks
        _store_picks(top, out_row, row_ok, NB_PAD, TOPK, TOPK_PAD)


@triton.jit
def _forced_first(v, c, own, visible, LOCAL: tl.constexpr, INIT: tl.constexpr):
    """Block maxima ``v`` of blocks ``c`` with the forced ones (visible, and local to the row's own block ``own``
    [R] or among the first INIT) at +inf: ranked before every score."""
    forced = visible & ((c > own[:, None] - LOCAL) | (c < INIT))
    return tl.where(forced, float("inf"), v)


@triton.jit
def _block_keys(v, c, NB_PAD: tl.constexpr):
    """Scores v and their block ids c -> distinct int64 keys whose descending order is "larger score first, lower
    id among equal scores" (ids below NB_PAD): (order-preserving score bits) << 32 | (NB_PAD - 1 - id)."""
    bits = v.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 -> 0.0: equal as floats, so one key value
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # signed int order == float order
    return (ordered.to(tl.int64) << 32) | (NB_PAD - 1 - c).to(tl.int64)


@triton.jit
def _store_picks(top, out_row, row_ok, NB_PAD: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr):
    """Top keys [R, TOPK_PAD] (``_block_keys``, descending) -> their block ids at ``out_row`` [R]; -inf -> -1."""
    pick = (NB_PAD - 1 - (top & 0xFFFFFFFF)).to(tl.int32)
    NEG_INF: tl.constexpr = -2139095041  # float("-inf"), 0xFF800000, after the order map: 0x807FFFFF
    i = tl.arange(0, TOPK_PAD)
    tl.store(out_row[:, None] + i[None, :], tl.where((top >> 32) == NEG_INF, -1, pick),
             mask=row_ok[:, None] & (i[None, :] < TOPK))


@triton.jit
def _block_topk(
    scores_ptr, pos_ptr, out_ptr, ss_t, ss_h, so_t, so_h,
    NB, NB_PAD: tl.constexpr, BS: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
    LOCAL: tl.constexpr, INIT: tl.constexpr, METHOD: tl.constexpr, GROUP: tl.constexpr = 0,
    TIERS: tl.constexpr = (), GROUPED_FROM: tl.constexpr = 0, LOCAL_PAD: tl.constexpr = 1,
):
    """One program per (token, head): the row's top-k at once (``_select_blocks``) or, GROUP > 0 ("bitonic"), in
    two levels (``_grouped_topk``). With row sizes TIERS (ascending, ``topk_tiers``; empty: none) the row's blocks
    before its local ones are ranked over the smallest size that holds them (``_tier``) and the local blocks are
    put in their place among the picks (``_store_with_local``)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    own = (tl.load(pos_ptr + t + tl.arange(0, 1)) // BS).to(tl.int32)  # [1]: one row of _select_blocks
    base = out_ptr + t.to(tl.int64) * so_t + h * so_h + own * 0  # [1]
    row = scores_ptr + t.to(tl.int64) * ss_t + h * ss_h
    if len(TIERS) > 0:  # one runtime branch per tier, each compiled at its own size
        ranked = tl.max(own, axis=0) - LOCAL + 1  # scalar: the blocks 0 .. own - LOCAL ranked by score
        for i in tl.static_range(len(TIERS)):
            _tier(row, own, base, ranked, NB, TIERS[i - 1] if i > 0 else -2147483647, TIERS[i],
                  i == len(TIERS) - 1, TOPK_PAD, TOPK, LOCAL, INIT, GROUP, GROUPED_FROM, LOCAL_PAD)
        return
    if GROUP > 0:
        top = _grouped_topk(row, own, NB, NB_PAD, TOPK_PAD, LOCAL, INIT, GROUP)
        _store_picks(top, base, own >= 0, NB_PAD, TOPK, TOPK_PAD)
        return
    c = tl.arange(0, NB_PAD)
    visible = (c[None, :] <= own[:, None]) & (c[None, :] < NB)
    v = tl.load(row + c[None, :], mask=visible, other=float("-inf"))
    _select_blocks(v, visible, own, base, own >= 0, 1, NB_PAD, TOPK, TOPK_PAD, LOCAL, INIT, METHOD)


@triton.jit
def _tier(row, own, base, ranked, NB, LO: tl.constexpr, P: tl.constexpr, LAST: tl.constexpr, TOPK_PAD: tl.constexpr,
          TOPK: tl.constexpr, LOCAL: tl.constexpr, INIT: tl.constexpr, GROUP: tl.constexpr, GROUPED_FROM: tl.constexpr,
          LOCAL_PAD: tl.constexpr):
    """When the row ranks more than LO and at most P blocks (the last tier: any number above LO), its top-k ids:
    the blocks 0 .. own - LOCAL ranked over P (keys as ``_block_keys`` with P for the pad: the same order, as ids
    are below P), two levels where GROUP asks and P has at least GROUPED_FROM blocks (``GROUPED_LEAST``), then the
    local blocks placed among the picks (``_store_with_local``)."""
    if LAST:
        mine = ranked > LO
    else:
        mine = (ranked > LO) & (ranked <= P)
    if mine:
        before = own - LOCAL  # [1]: the last ranked block; the local ones after it are forced
        if GROUP > 0 and P >= GROUPED_FROM:
            top = _grouped_topk(row, before, NB, P, TOPK_PAD, 0, INIT, GROUP)
        else:
            c = tl.arange(0, P)[None, :]
            top = tl.topk(_row_keys(row, c, before, NB, P, 0, INIT), TOPK_PAD)
        _store_with_local(top, base, own, NB, P, TOPK, TOPK_PAD, LOCAL, LOCAL_PAD)


@triton.jit
def _store_with_local(top, out_row, own, NB, P: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
                      LOCAL: tl.constexpr, LOCAL_PAD: tl.constexpr):
    """The ranked blocks' top keys [1, TOPK_PAD] (descending, ids encoded with P) and the row's visible local blocks
    max(own - LOCAL + 1, 0) .. min(own, NB - 1) -> ids at ``out_row`` [1] + 0..TOPK-1 in the order of one top-k of
    the whole row, where the local blocks are +inf at their ids: after every pick whose score is +inf or a NaN
    ordered above it (those are larger, or equal with a lower id: every ranked id is below the local ones), before
    every other pick; -inf picks -> -1."""
    NEG_INF: tl.constexpr = -2139095041  # float("-inf") after the order map of ``_block_keys``
    POS_INF: tl.constexpr = 2139095040  # float("inf"), 0x7F800000, which the order map keeps
    score = top >> 32
    ids = tl.where(score == NEG_INF, -1, (P - 1 - (top & 0xFFFFFFFF)).to(tl.int32))
    first = tl.maximum(own - LOCAL + 1, 0)  # [1]
    n_local = tl.maximum(tl.minimum(own, NB - 1) - first + 1, 0)  # [1]
    ahead = tl.sum((score >= POS_INF).to(tl.int32), axis=1)  # [1]: picks ranked before the local blocks
    ok = own >= 0
    i = tl.arange(0, TOPK_PAD)[None, :]
    place = tl.where(i < ahead[:, None], i, i + n_local[:, None])
    tl.store(out_row[:, None] + place, ids, mask=ok[:, None] & (place < TOPK))
    li = tl.arange(0, LOCAL_PAD)[None, :]
    at = ahead[:, None] + li
    tl.store(out_row[:, None] + at, first[:, None] + li, mask=ok[:, None] & (li < n_local[:, None]) & (at < TOPK))


@triton.jit
def _row_keys(row, c, own, NB, NB_PAD: tl.constexpr, LOCAL: tl.constexpr, INIT: tl.constexpr):
    """The keys (``_block_keys``) of one row's blocks ``c`` [1, N], read from ``row``: forced blocks (local / init)
    as +inf, blocks past the row's own (or the table) as -inf."""
    visible = (c <= own[:, None]) & (c < NB)
    v = tl.load(row + c, mask=visible, other=float("-inf"))
    return _block_keys(_forced_first(v, c, own, visible, LOCAL, INIT), c, NB_PAD)


@triton.jit
def _grouped_topk(row, own, NB, NB_PAD: tl.constexpr, TOPK_PAD: tl.constexpr, LOCAL: tl.constexpr,
                  INIT: tl.constexpr, GROUP: tl.constexpr):
    """The top TOPK_PAD keys [1, TOPK_PAD] of one row in two levels (NB_PAD >= 2 x GROUP x TOPK_PAD): the row's keys
    in NB_PAD / GROUP groups of GROUP consecutive blocks, each group's largest key, the TOPK_PAD groups with the
    largest of those, then the top keys of those groups' blocks (read again from ``row``). The same keys as one
    top-k of the whole row: keys are distinct, so if a block's group is not among the chosen ones, each chosen
    group's largest key is larger than that block's, TOPK_PAD keys above it, and it is not among the top."""
    NG: tl.constexpr = NB_PAD // GROUP
    keys = _row_keys(row, tl.arange(0, NB_PAD)[None, :], own, NB, NB_PAD, LOCAL, INIT)  # [1, NB_PAD]
    largest = tl.max(tl.reshape(keys, (NG, GROUP)), axis=1)  # [NG]: each group's largest key
    groups = tl.topk(tl.reshape(largest, (1, NG)), TOPK_PAD)  # [1, TOPK_PAD]
    first = (NB_PAD - 1 - (groups & 0xFFFFFFFF)).to(tl.int32) // GROUP * GROUP  # each chosen group's first block
    c = tl.reshape(tl.reshape(first, (TOPK_PAD, 1)) + tl.arange(0, GROUP)[None, :], (1, TOPK_PAD * GROUP))
    return tl.topk(_row_keys(row, c, own, NB, NB_PAD, LOCAL, INIT), TOPK_PAD)


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
    entries overriding ``DEFAULTS`` (None for the op). With the scan's ``fold_topk`` the top-k of decode-like
    batches runs inside the scan launch (one launch; ``FOLD_MOST_KEYS``)."""
    t, h, _ = index_q.shape
    if topk_blocks == 0 or t == 0 or seq_lens.shape[0] == 0:
        _check(index_q, index_k_cache, block_size, index_k_scale)
        return torch.full((t, h, topk_blocks), -1, dtype=torch.int32, device=index_q.device)
    fold = None
    if launch_settings("lightning_indexer", DEFAULTS, config, "scan")["fold_topk"]:
        fold = (topk_blocks, local_blocks, init_blocks)
    align = launch_settings("lightning_indexer", DEFAULTS, config, "topk")["align"]
    scores, ids = _scan_launch(index_q, index_k_cache, block_tables, query_start_loc, seq_lens, positions,
                               block_size, index_k_scale, config, fold, align)
    if ids is not None:
        return ids
    return block_topk(scores, positions, block_size, topk_blocks, local_blocks, init_blocks, config=config)


# The fold's last program ranks all of its query tile's rows at once ([rows, blocks] int64 keys in registers), so
# it folds decode-like batches (one token per program: 4 index heads) up to this many (row, block) keys (4 heads x
# 1024 blocks = 128k tokens: 32 keys per thread at 4 warps); longer contexts and prefill tiles run the top-k
# launch.
FOLD_MOST_KEYS = 4096


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
    token's own block are not written). A ``fold_topk`` setting is not run here (the top-k needs the op's
    attributes): ``forward`` runs it."""
    return _scan_launch(index_q, index_k_cache, block_tables, query_start_loc, seq_lens, positions, block_size,
                        index_k_scale, config, fold=None)[0]


def block_maxima_buffer(t: int, h: int, nb: int, device, align: int = 0) -> torch.Tensor:
    """The scan's output [T, H, NB] fp32; with ``align`` (the top-k setting) a view whose rows start every
    ``align`` values (the columns past NB are never written or read)."""
    width = -(-max(nb, 1) // align) * align if align else nb
    return torch.empty((t, h, width), dtype=torch.float32, device=device)[:, :, :nb]


MIN_TMA_TILE = 16  # keys: the tensor-core dot's smallest N
MAX_TMA_BOX = 256  # a bulk tensor copy's box has at most 256 entries along each dimension


def tma_usable(index_k_cache: torch.Tensor) -> str | None:
    """Why a tensor descriptor cannot read this key pool in page-sized tiles, or None: the pool viewed
    [pages * page, D] needs unit stride along D, pages of contiguous rows, a 16-byte aligned base and row stride,
    and a power-of-two page of at least ``MIN_TMA_TILE`` keys (a key tile never crosses a page). The launcher reads
    any other pool by gathering."""
    kc = index_k_cache
    pages, page, d = kc.shape
    size = kc.element_size()
    if kc.stride(2) != 1 or kc.stride(0) != page * kc.stride(1) or kc.data_ptr() % 16 or (kc.stride(1) * size) % 16:
        return f"index_k_cache {tuple(kc.shape)} strides {kc.stride()} is not rows of 16-byte aligned contiguous keys"
    if page & (page - 1) or page < MIN_TMA_TILE:
        return f"page size {page} is not a power of two >= {MIN_TMA_TILE} (a key tile is one page or part of one)"
    if next_pow2(max(d, 16)) > MAX_TMA_BOX:
        return f"index head dim {d} is wider than a bulk copy's box ({MAX_TMA_BOX})"
    if pages * page >= 2**31:
        return f"{pages * page} key rows do not fit a descriptor's 32-bit coordinates"
    return None


def _scan_launch(index_q, index_k_cache, block_tables, query_start_loc, seq_lens, positions, block_size,
                 index_k_scale, config, fold, align=0):
    """(block maxima, ids or None): the scan launch, with the top-k folded in when ``fold`` = (topk_blocks,
    local_blocks, init_blocks) and the batch is one the fold serves (``FOLD_MOST_KEYS``; otherwise ids is None)."""
    _check(index_q, index_k_cache, block_size, index_k_scale)
    cfg = launch_settings("lightning_indexer", DEFAULTS, config, "scan")
    if cfg["loads"] not in LOADS:
        raise ValueError(f"lightning_indexer: scan loads {cfg['loads']!r} is not one of {LOADS}")
    if cfg["fp8_dot"] not in FP8_DOTS:
        raise ValueError(f"lightning_indexer: scan fp8_dot {cfg['fp8_dot']!r} is not one of {FP8_DOTS}")
    t, h, d = index_q.shape
    b = seq_lens.shape[0]
    page = index_k_cache.shape[1]
    q = index_q if index_q.stride(2) == 1 else index_q.contiguous()
    kc = index_k_cache if index_k_cache.stride(2) == 1 else index_k_cache.contiguous()
    bt = block_tables.contiguous()
    pos = positions.contiguous()

    nb = cdiv(block_tables.shape[1] * page, block_size)  # most blocks any sequence of this batch can have
    scores = block_maxima_buffer(t, h, nb, index_q.device, align)
    h_pad = next_pow2(h)
    qsl = query_start_loc.contiguous()
    tokens = tokens_per_tile(t, b, h_pad)
    if tokens == 1:
        seq = start = end = qsl  # unused: the kernel finds each token's sequence itself
        slots = t
    else:
        seq, start, end, slots = tile_lists(qsl, t, tokens)  # one launch (_tile_plan)
    if cfg["loads"] != "gather" and kc.element_size() > 2 and not interpreted(index_q):
        # fp32 pools: 128 fp32 keys per bulk-copied tile in the TMA default's stages asked for 288 KB of shared memory
        # (the H200 has 227 KB; the `mini` fp32 greedy test, 2026-12-01 07:45 UTC): compiled, they run the gather
        # scan of the earlier default, which those tests passed with (the interpreter has no shared memory to run
        # out of: its fp32 tests keep the TMA walk). 16-bit and FP8 pools keep the TMA settings.
        cfg = dict(cfg, **FP32_POOL_SCAN)
    elif cfg["loads"] == "auto":  # pages below the key tile: gathered whole-block tiles; else bulk copies
        cfg = dict(cfg, **SMALL_PAGE_SCAN) if page < cfg["block_n"] else dict(cfg, loads="tma-host")
    tma = cfg["loads"] != "gather" and tma_usable(kc) is None  # any other pool: the same launch by gathering
    if tma:
        block_n = min(max(cfg["block_n"], MIN_TMA_TILE), page, MAX_TMA_BOX)  # one page per key tile, or part of one
        group = max(block_n, block_size)  # splits cut whole groups (tiles and blocks)
    else:
        block_n = group = max(cfg["block_n"], block_size)
    widest = cdiv(block_tables.shape[1] * page, group)  # groups of the widest block table
    most = cfg["max_splits"]
    if cfg["min_split_tiles"] > 0:
        most = min(most, cdiv(widest, cfg["min_split_tiles"]))
    if tma:  # resident at once: never more programs than waves x multiprocessors (batch 8 at waves 1: 8 x 16)
        splits = max(1, min(most, widest, cfg["waves"] * num_sms(index_q.device) // slots))
    else:  # none left without a group there (528 of 1024 -> 512 of 2 each)
        splits = splits_for(index_q.device, slots, most, cfg["waves"])
        splits = cdiv(widest, cdiv(widest, splits))
    ks = index_k_scale.contiguous() if index_k_scale is not None else kc  # kc: never read (FP8 off)
    fold_args = {}
    counters = sel = scores  # never touched without the fold
    if fold is not None:
        topk_blocks, local_blocks, init_blocks = fold
        topk_pad = next_pow2(max(topk_blocks, 2))
        nb_pad = max(next_pow2(max(nb, 2)), topk_pad)
        if tokens > 1 or h_pad * nb_pad > FOLD_MOST_KEYS:
            fold = None  # ``forward`` runs the top-k launch
    if fold is not None:
        method = launch_settings("lightning_indexer", DEFAULTS, config, "topk")["method"]
        _check_method(method)
        sel = torch.empty((t, h, topk_blocks), dtype=torch.int32, device=index_q.device)
        counters = ticket_counters(index_q.device, slots)
        fold_args = dict(FOLD=True, NB=nb, NB_PAD=nb_pad, TOPK=topk_blocks, TOPK_PAD=topk_pad, LOCAL=local_blocks,
                         INIT=init_blocks, METHOD=method)
    host_desc = tma and cfg["loads"] == "tma-host"
    k_desc = None
    if host_desc:
        k_desc = TensorDescriptor(kc, shape=[kc.shape[0] * page, d], strides=[kc.stride(1), 1],
                                  block_shape=[block_n, next_pow2(max(d, 16))])
    elif tma and not interpreted(index_q):
        ensure_descriptor_allocator()
    _index_scan[(slots, splits)](
        q, kc, ks, bt, pos, qsl, seq, start, end, scores, b,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), ks.stride(0), ks.stride(1), bt.stride(0),
        scores.stride(0), scores.stride(1), FP8=index_k_scale is not None,
        H=h, H_PAD=h_pad, D=d, BLOCK_D=next_pow2(max(d, 16)), PAGE=page, BS=block_size, TOKENS=tokens,
        ROWS=max(16, tokens * h_pad), LOG2_SEQS=log2_ceil(b), BLOCK_N=block_n, SPLITS=splits,
        PREC=dot_precision(index_q.dtype), INTERPRETED=interpreted(index_q), num_rows=kc.shape[0] * page,
        cnt_ptr=counters, sel_ptr=sel, ssel_t=sel.stride(0), ssel_h=sel.stride(1), k_desc=k_desc, TMA=tma,
        HOST_DESC=host_desc, STAGES=cfg["num_stages"],
        FP8_TF32=index_k_scale is not None and cfg["fp8_dot"] == "tf32" and index_q.element_size() == 2,
        FP8_BITS=by_bits(cfg["fp8_dot"], index_k_scale is not None, index_q.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **fold_args,
    )
    return scores, (sel if fold is not None else None)


# Rows padded to at least this many blocks (a context past 128k tokens at M3's blocks of 128) run the top-k setting
# ``long_warps``.
LONG_ROW = 2048

# The two-level top-k (setting ``group``) runs for rows padded to at least this many x group x top-k blocks; below
# that the groups' blocks it ranks again are half the row or more.
GROUPED_LEAST = 2


def _check_method(method: str) -> None:
    if method not in ("rounds", "bitonic"):
        raise ValueError(f"lightning_indexer: topk method {method!r} is not 'rounds' or 'bitonic'")


def topk_tiers(nb_pad: int, topk_pad: int) -> list[int]:
    """The row sizes the tiered top-k ranks over (setting ``tiers``): ``TIER_FIRST`` blocks (at least the top-k),
    times ``TIER_STEP`` each, ending with the padded table ``nb_pad``; at most ``MAX_TIERS`` (the last ones merged
    into ``nb_pad``). One size (a table of at most ``TIER_FIRST`` blocks) runs the untiered launch: no smaller row
    to rank over, and the local blocks set aside cost 0.1 us (H200, 4k rows)."""
    tiers, size = [], max(TIER_FIRST, topk_pad)
    while size < nb_pad and len(tiers) < MAX_TIERS - 1:
        tiers.append(size)
        size *= TIER_STEP
    return tiers + [nb_pad]


# The tiered top-k's row sizes (``topk_tiers``): a 4k-token row (33 blocks) ranks over 64, a 32k one over 256, a
# 128k one over 1024 (its own, local block set aside), whatever the table's width.
TIER_FIRST = 64
TIER_STEP = 4
MAX_TIERS = 6  # runtime branches (each a sort compiled at its size) at most


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
    consts, warps = topk_launch(nb, topk_blocks, local_blocks, cfg)
    nb_pad = consts["NB_PAD"]
    align = cfg["align"]
    if align < 0 or align % 16:
        raise ValueError(f"lightning_indexer: topk align {align} must be 0 or a multiple of 16")
    nb_arg = nb
    if align and nb_pad >= align and scores.stride(1) % align == 0 and scores.stride(0) % align == 0:
        nb_arg = -(-nb // align) * align  # <= nb_pad; the columns past nb are masked by each row's own block
    _block_topk[(t, h)](
        scores, pos, out, scores.stride(0), scores.stride(1), out.stride(0), out.stride(1),
        NB=nb_arg, BS=block_size, TOPK=topk_blocks, LOCAL=local_blocks, INIT=init_blocks, num_warps=warps, **consts,
    )
    return out


def topk_launch(nb: int, topk_blocks: int, local_blocks: int, cfg: dict) -> tuple[dict, int]:
    """The top-k launch's compile-time constants for rows of at most ``nb`` blocks under the top-k settings
    ``cfg`` (DEFAULTS["topk"] with overrides): NB_PAD, TOPK_PAD, METHOD, GROUP and, with ``tiers``, TIERS,
    GROUPED_FROM and LOCAL_PAD (absent: the kernel's defaults, untiered); and its warps. The one owner of that
    choice: ``block_topk`` and the TensorRT plugin's top-k (``plugins/tensorrt/aot.py``) launch with it."""
    _check_method(cfg["method"])
    topk_pad = next_pow2(max(topk_blocks, 2))
    group = cfg["group"]
    if group and (cfg["method"] != "bitonic" or group & (group - 1) or group < 2):
        raise ValueError(f"lightning_indexer: topk group {group} needs the 'bitonic' method and a power of two")
    nb_pad = max(next_pow2(max(nb, 2)), topk_pad)
    consts = dict(NB_PAD=nb_pad, TOPK_PAD=topk_pad, METHOD=cfg["method"])
    sizes = topk_tiers(nb_pad, topk_pad)
    if cfg["tiers"] and cfg["method"] == "bitonic" and len(sizes) > 1:  # ("rounds" ranks whole rows)
        consts["TIERS"] = tuple(sizes)
        consts.update(GROUPED_FROM=GROUPED_LEAST * group * topk_pad, LOCAL_PAD=next_pow2(max(local_blocks, 1)))
    elif nb_pad < GROUPED_LEAST * group * topk_pad:
        group = 0  # a row this short: one top-k of its blocks is no larger than the two levels
    consts["GROUP"] = group
    warps = cfg["long_warps"] if cfg["long_warps"] and nb_pad >= LONG_ROW else cfg["num_warps"]
    return consts, warps
