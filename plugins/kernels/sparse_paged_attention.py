"""``m3::sparse_paged_attention`` on the GPU: GQA over only the blocks the lightning indexer selected.

Semantics: ``m3export.ops.attention.sparse_paged_attention_reference`` (``docs/ops.md`` §4). One program per
(query tile, KV head, split of the tile's selections). Rows are the tile's tokens times the ``Hq / Hkv`` query
heads of the KV head (16 on M3: one token already fills a 16-row tile; prefill packs 4 tokens into 64 rows,
which Hopper runs on ``wgmma``). The program walks every (token, selection slot) of its tile and reads each
distinct block once, at its first occurrence, for all rows whose token selected it; a row only ever sees its own
token's blocks (multi-token verify never unions selections), causally. Online softmax in fp32 (base 2). Decode
(one token per program) splits the selection so that a small batch still fills the device, and ``_splitk``
merges the splits. Selection entries that are -1, after the token's own block, or repeated are skipped, so the
allowed set is exactly the reference's (order and duplicates do not matter).

Launch parameters are the table ``DEFAULTS`` (one entry for decode-like batches, one for prefill); ``forward(...,
config=...)`` overrides entries of it (how ``bench/attention.py --sweep`` times the alternatives in one run). Two
loop forms besides the default "nested" walk (an inner loop over one block's key tiles, so the compiler's software
pipelining overlaps loads within a block only): "flat" walks (visit, key tile) pairs in one loop and masks the loads
of skipped visits instead of branching around them, so the next block's loads can be in flight while this one is
computed (``num_stages``); "union" (tiles of several tokens) first computes each tile's sorted list of distinct
usable blocks (``_tile_plan``: one small launch before this kernel, which also makes the tile lists and the
"_chosen" bits) so that the kernel visits exactly those, once each, with no per-visit de-duplication. A union tile
computes every row against every block of the union, so its work over the op's is (union / top-k): on selections
like a real prompt's (``bench/prefill_selections.py``) 1.3 / 1.6 / 2.0 for 4 / 8 / 16 tokens. Every form computes the
same allowed set; only the summation order of the online softmax differs (the blocks' order). In prefill, where a
key tile lies inside one page (it divides the page and the block), its page id is one scalar load instead of one per
key.

Two modifiers of a loop form (``loop_form``). "_fused": the split-K merge in the same launch
(``_splitk.finish_rows_fused``): every split stores its partial and takes a ticket on a per-(tile, KV head) counter;
the last one merges, in split order, and resets the counter (``_batch.ticket_counters``: persistent, zeroed once, so
CUDA graphs replay it); one-token programs then also find their sequence by one vector load (``_sequence_by_count``) instead of
a chain of dependent loads. "_tma": K / V tiles as bulk tensor copies through descriptors made on the device. A bulk
copy cannot be masked, so the one-token "flat" walk and the "union" walk then visit whole key tiles only: the
token's usable blocks (first occurrences, -1 and later blocks dropped, in registers) or the tile's union, with the
block holding the last position last, every key tile up to that position (all keys in the sequence, so nothing is
zeroed), then the one partial tile, if any, by masked pointer loads. The other walks zero V's rows outside the
sequence instead (``_load_kv``). TMA needs key tiles inside one page and a row-major pool (``tma_usable``); where
it does not hold, the same walk runs with pointer loads.
"""

from __future__ import annotations

import functools
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._batch import (cdiv, dot_precision, interpreted, launch_settings, log2_ceil, max_shared_memory, next_pow2,
                     sequence_of, splits_for, ticket_counters, tokens_per_tile)
from ._fp8 import by_bits, check_widen
from ._splitk import LOG2E, Partials, attend_tile, attend_tile_lean, finish_rows, finish_rows_fused
from ._tile_plan import tile_plan
from ._tma import ensure_descriptor_allocator
from .paged_attention import _check, scale_pools

OP = "m3::sparse_paged_attention"

DEFAULTS = {
    # tile_tokens: tokens of one sequence per program (None: ``tokens_per_tile`` up to 64 rows; 1: one program
    # per token); block_n: key tile (at most the block); waves: programs per multiprocessor the selection
    # splits aim for; max_splits: most splits (None: top-k x tile tokens); loop: "nested" | "flat" | "union".
    # H200 sweep 2026-11-30 22:12 UTC (bench/results/attention_sweep.json): decode "flat-n128-w4-s3-waves2" 0.94x
    # the earlier defaults' time (geometric mean of batch 1 / 16 / 64).
    # Prefill: H200 sweep 2026-12-01 03:58 UTC (commit 353d677, bench/results/attention_prefill_h200.json):
    # "union-t8-n128-w8-s2-waves2" 0.555x the time of the previous default ("flat-t1-n64-w4-s3-waves2") on
    # selections like a prompt's (bench/prefill_selections.py "model": 192 / 208 / 185 TFLOP/s at 4k / 16k / 64k
    # against 91 / 115 / 121), but 1.2-2.1x its time on independent random selections (the worst case, where 8
    # tokens' union is 5x top-k: 92 / 58 TFLOP/s at 16k / 64k against 115 / 121). Prompts' neighbouring tokens
    # share most blocks (the forced local block, slowly moving queries). It is NOT the default yet: inside the
    # `mini` model (tests/test_kernels_attention_gpu.py, 04:20 UTC) its launch asked for 256 KB of shared memory
    # (the H200 has 227 KB) where the benchmark's compiled 160 KB. The cause is the dtype, not the page: the model
    # tests run in fp32, so K and V tiles of 128 keys x 128 dims in 2 stages are 256 KB (compiled for sm_90 on the
    # CPU machine: 262144 bytes, pages of 64 and 128 alike). The launcher now fits key tile and stages to the
    # device's shared memory (``fit_shared_memory``: that fp32 launch runs 64-key tiles, 160 KB compiled; bf16 and
    # FP8 pools keep every swept setting). Before copying the union setting here, one H200 call must pass, with it:
    #   timeout 600 python3 -m pytest -q -x tests/test_kernels_attention_gpu.py -k "greedy or mini_dims"
    #   timeout 600 python3 -m pytest -q -x tests/test_runtime_cuda_graph.py -k mini_kernels
    # (the mini greedy test: fp32, pages of 128; the graphs test: fp32, pages of 64, no-spec and MTP k = 2).
    # H200 sweep 2026-12-01 06:30 UTC (commit ced295b, bench/results/attention_sweep_C.json, 52 measurements, every
    # output within the bound): decode "flat_tma_fused-n128-w4-s3-waves2" (K / V by bulk copies, the split-K merge in
    # the same launch): batch 16 / 32k 26.4 us = 60.4 % of copy bandwidth (the flat default 30 us, 52-54 %), batch
    # 64 / 32k 78.5 us (81 %; the default 90.4 us in that run); 0.87x the defaults' time. It replaced
    # "flat-n128-w4-s3-waves2". Prefill "union_tma_lean-t8-n128-w8-s2-waves2" (the 8-token union tile with bulk
    # copies and the lean softmax step): 227 TFLOP/s at 16k on prompt-like selections against the one-token flat
    # default's 116 (0.51x its time); plain "union-t8-n128-w8-s2-waves2" 208. The union tile passed the two `mini`
    # GPU tests above in call 1 of 2026-12-01 05:55 UTC; this form of it must pass them too (the defaults' GPU
    # validation call, docs/performance.md). It replaced "flat-t1-n64-w4-s3-waves2".
    # H200 sweep 2026-12-01 10:47 UTC (commit bf6c7d0, bench/results/attention_sweep_C3_prefill.json; eager call / the
    # same replayed from a CUDA graph, TFLOP/s of the op's own work on prompt-like selections, every output within the
    # bound): the 4-token union tile with the chooser bits and the rescale-every-tile step,
    # "union_tma_lean_chosen_rescale-t4-n64-w4-s3-waves2" (one warpgroup, 167 registers, 80 KB: two programs per SM):
    # 16k 270 / 277 and 64k 258 / 258, against "union_tma_lean-t8-n128-w8-s2-waves2" (the default then) 228 / 231 and
    # 202 / 203; its 4-token union is 1.24 / 1.35x top-k at 16k / 64k where 8 tokens' is 1.43 / 1.66x. At 4k every
    # form's kernel runs 237-248 in the graph while the eager call reaches 134-192: that launch is host-bound, not short
    # of programs (the 8-token tile launches 2052 there, 15.5 per SM, the 4-token one 4100, and both kernels run at the
    # same rate), so neither smaller tiles nor splitting the key walk lifts it. The chooser bits cost ~25 more tensor
    # ops per launch (``union_choosers``; the tile lists are ~55 without them), which the short 4k launch pays in its
    # eager time (1.51 ms against 1.26 for the same tile without them; 0.85 / 0.83 ms on the device), so launches of
    # fewer than 8192 new tokens ran "union_tma_lean_rescale-t4-n64-w4-s3-waves2" then. Checked on the H200 before the
    # flip (2026-12-01 11:10 UTC, commit 013c513) with ``pytest --sparse-prefill NAME`` (tests/conftest.py;
    # ``--sparse-prefill-fp32`` for fp32 activations):
    #   timeout 200 python3 -m pytest -q -x -m gpu tests/test_kernels_attention_gpu.py -k "mini_dims and not
    #       fused_norm" tests/test_kv_cache_fp8_gpu.py --sparse-prefill NAME
    # 8 passed with this setting (mixed batches on pages of 128 and 64, an 8192-token chunk at 16k context, FP8 pools),
    # 3 with the short launches' (without the FP8 file). The fp32 `mini` model tests above run ``FP32_PREFILL``. It
    # replaced "union_tma_lean-t8-n128-w8-s2-waves2".
    # Since the launch's plan is one kernel (``_tile_plan``; H200 2026-12-01 14:20 UTC, snapshot ea7f650,
    # lead_call6_attn_prefill.json, eager / graph TFLOP/s): this setting 325 / 325 at 4k and 307 / 303 at 16k, the same
    # tile without the bits 310 / 309 and 279 / 288, so it serves launches of every size (the short launches' own
    # setting, "union_tma_lean_rescale-t4-n64-w4-s3-waves2" below 8192 new tokens, was dropped).
    # fp8_widen (FP8 pools, bf16 queries; ``_fp8.WIDENS``): "bits" widens E4M3 K / V by bit placement
    # (``_fp8.widen_by_bits``, the same values as "convert"'s sm_90 conversions; since 2026-12-02). H200 04:56 UTC
    # (`mini`, FP8 cache, pages of 16, decode, three layers, bench/results/decode_profile_h200_s20_sparse_fp8.json):
    # 28.8 / 46.8 / 231.5 us a step at batch 1 / 128k, 8 / 32k, 64 / 4k against "convert"'s 29.2 / 48.8 / 310.5.
    "decode": dict(block_n=128, num_warps=4, num_stages=3, waves=2, max_splits=None, loop="flat_tma_fused",
                   fp8_widen="bits"),
    "prefill": dict(tile_tokens=4, block_n=64, num_warps=4, num_stages=3, waves=2, max_splits=None,
                    loop="union_tma_lean_chosen_rescale", fp8_widen="bits"),
}
_LOOPS = ("nested", "flat", "union")
# Modifiers a loop form takes after "_" (e.g. "flat_tma_fused"): "tma", K / V tiles as bulk tensor copies where the
# pools allow it (``tma_usable``; else the same walk with pointer loads); "host" (after "tma"), their descriptors made
# at launch and passed by value instead of written by every program at its start (then fenced); "fused", the split-K merge in the same launch
# (``_splitk.finish_rows_fused``: the last split of each tile merges; no second launch); "lean" (after "tma", whole-tile
# walks, 16-bit / fp32 pools): each key tile's online-softmax step with less vector work (``attend_tile_lean``);
# "rescale" (after "lean"): that step rescales the accumulator at every tile (no per-tile any-row test: a CTA barrier);
# "chosen" (union walk, after "lean"): which tokens of the tile chose each union block, as bits made with the union
# (``_tile_plan``), so that a key tile's rows that want it and whether all do are one scalar load, not a compare of
# every row's selection and two reductions across the program's warps per tile.
_MODIFIERS = ("tma", "host", "fused", "lean", "chosen", "rescale")


# Most sequences whose starts a one-token program loads at once to find its sequence (``_sequence_by_count``; the fused
# variants): 1024 starts are 4 KB, 8 registers a thread at 4 warps; above, the binary search.
_COUNTED_SEQS = 1024


def loop_form(loop: str) -> tuple[str, bool, bool, bool, bool]:
    """A ``loop`` setting -> (walk, tma, host, fused, lean); refused by name unless it is a walk of ``_LOOPS`` followed by
    distinct modifiers of ``_MODIFIERS`` in that order."""
    walk, *mods = loop.split("_")
    if walk not in _LOOPS or mods != [m for m in _MODIFIERS if m in mods]:
        raise ValueError(f"sparse_paged_attention: loop {loop!r} is not one of {_LOOPS}, optionally followed by "
                         f"{' / '.join('_' + m for m in _MODIFIERS)} in that order")
    if "host" in mods and "tma" not in mods:
        raise ValueError(f"sparse_paged_attention: loop {loop!r}: '_host' names where TMA descriptors are made, so it "
                         "follows '_tma'")
    if "lean" in mods and ("tma" not in mods or walk not in ("flat", "union")):
        raise ValueError(f"sparse_paged_attention: loop {loop!r}: '_lean' is a step of the whole-tile TMA walks "
                         "('flat_tma...' with one token per program, 'union_tma...')")
    if "chosen" in mods and ("lean" not in mods or walk != "union"):
        raise ValueError(f"sparse_paged_attention: loop {loop!r}: '_chosen' is a form of the union walk's '_lean' "
                         "step")
    if "rescale" in mods and "lean" not in mods:
        raise ValueError(f"sparse_paged_attention: loop {loop!r}: '_rescale' is a form of the '_lean' step")
    return walk, "tma" in mods, "host" in mods, "fused" in mods, "lean" in mods


def _decode(loop, block_n, num_warps, num_stages, waves, max_splits=None, fp8_widen="bits"):
    return dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages, waves=waves, max_splits=max_splits,
                loop=loop, fp8_widen=fp8_widen)


def _prefill(loop, tile_tokens, block_n, num_warps, num_stages, waves=2, max_splits=None, fp8_widen="bits"):
    return dict(tile_tokens=tile_tokens, **_decode(loop, block_n, num_warps, num_stages, waves, max_splits, fp8_widen))


# Alternatives ``bench/attention.py --sweep`` times against DEFAULTS in one run (every one checked on CPU by
# tests/test_kernels_attention_variants.py). Each is a COMPLETE setting, named for what it runs (loop, t: tile
# tokens, n: key tile, w: warps, s: stages, waves, max: most splits; the test derives every name from its
# settings), so a change of DEFAULTS renames nothing; a mode's winner is copied into DEFAULTS by hand (the sweep
# skips a variant equal to the defaults).
#
# Decode at batch 16 / 32k on the H200 (52 % of copy bandwidth; 81 % at batch 64): 16 tokens x 4 KV heads = 64
# programs before splitting, each over 16 blocks of 128 keys (64 KB of K and V per block). The defaults' waves=2 give
# 5 splits of 4 blocks (the fifth empty before the launcher dropped empty splits): 256 programs of 256 KB, and with
# 128-key tiles in 3 stages (128-192 KB of shared memory: 2-3 buffered K+V tiles, an estimate, not read from the
# compiled kernel) one program per multiprocessor, so 132 SMs run two waves of programs whose start (sequence search,
# selection, block table: ~5 dependent loads) overlaps nothing. At batch 64 (512 programs of 8 blocks) that start is
# amortised, hence 81 %. The "...-max8/16" variants aim at batch 16: 64-key tiles (64-96 KB in 3 stages, 32-64 KB in
# 2: two or more programs per SM, so one program's start overlaps another's streaming) and 8 or 16 splits (512 or 1024
# programs of 2 or 1 blocks: 1024 block visits over 132 SMs is 7.8 each, 8 at most in whole programs); each split adds
# a 16-row fp32 partial (8 KB written, read back by the merge) per 64 KB block it reads, so 16 splits cost 25 % more
# traffic, 8 splits 12 %.
VARIANTS = {
    "decode": {
        "nested-n64-w4-s2-waves2": _decode("nested", 64, 4, 2, 2),  # the defaults before 2026-11-30 22:12
        "nested-n128-w4-s2-waves2": _decode("nested", 128, 4, 2, 2),
        "flat-n64-w4-s3-waves2": _decode("flat", 64, 4, 3, 2),  # batch 64's best then (76.4 us, 83 %)
        "flat-n128-w4-s3-waves2": _decode("flat", 128, 4, 3, 2),
        "flat-n64-w4-s3-waves1": _decode("flat", 64, 4, 3, 1),
        "flat-n64-w4-s3-waves4": _decode("flat", 64, 4, 3, 4),
        "flat-n64-w4-s4-waves2": _decode("flat", 64, 4, 4, 2),
        "flat-n64-w8-s3-waves2": _decode("flat", 64, 8, 3, 2),
        # aimed at batch 16 (above): 8 splits of 2 blocks, two / three programs per SM, or 128-key tiles
        "flat-n64-w4-s3-waves4-max8": _decode("flat", 64, 4, 3, 4, 8),
        "flat-n64-w4-s2-waves4-max8": _decode("flat", 64, 4, 2, 4, 8),
        "flat-n128-w4-s3-waves4-max8": _decode("flat", 128, 4, 3, 4, 8),
        # one block per split: 1024 programs at batch 16 (the most programs, the most partial traffic)
        "flat-n64-w4-s3-waves8-max16": _decode("flat", 64, 4, 3, 8, 16),
        # One launch (issue 11, 2026-12-01): the split-K merge fused into the kernel ("_fused": the last split of a
        # (token, KV head) merges, _splitk.finish_rows_fused) and the sequence found by one vector load of the starts
        # instead of a binary search (_sequence_by_count): at batch 16 / 32k the 29-30 us held ~13 us that do not
        # scale with the bytes (batch 64 reads 4x the bytes in 76 us), of which the second launch and the programs'
        # chain of dependent loads before their first key are the part these remove. "waves" from the sm_90 compile
        # (Triton 3.6 ptxas on the CPU machine): flat_fused n128 s3 168 registers / 74 KB -> 3 programs per SM; n64
        # s2 ~120 registers / 39 KB -> 4.
        "flat_fused-n128-w4-s3-waves2": _decode("flat_fused", 128, 4, 3, 2),
        "flat_fused-n128-w4-s3-waves3": _decode("flat_fused", 128, 4, 3, 3),
        "flat_fused-n64-w4-s2-waves4-max8": _decode("flat_fused", 64, 4, 2, 4, 8),
        "flat_fused-n64-w4-s3-waves4-max8": _decode("flat_fused", 64, 4, 3, 4, 8),
        # K / V through TMA ("_tma": a bulk tensor copy per key tile, _load_kv) over the selection compacted to its
        # usable blocks, whole tiles only, the partial one by pointers (module docstring), merge fused. sm_90
        # compile: n64 s3 167 registers / 39 KB -> 3 programs per SM; n128 s3 224 / 74 KB -> 2 (the pointer loads'
        # 121 / 168: the bulk copies save no registers here, so this measures their issue cost and depth alone).
        "flat_tma_fused-n64-w4-s3-waves3-max8": _decode("flat_tma_fused", 64, 4, 3, 3, 8),
        "flat_tma_fused-n128-w4-s3-waves2": _decode("flat_tma_fused", 128, 4, 3, 2),
        "flat_tma-n64-w4-s3-waves3-max8": _decode("flat_tma", 64, 4, 3, 3, 8),
        # the same with the descriptors made at launch ("_host"): no descriptor write + fence at each program's start
        "flat_tma_host_fused-n64-w4-s3-waves3-max8": _decode("flat_tma_host_fused", 64, 4, 3, 3, 8),
        "flat_tma_host_fused-n128-w4-s3-waves2": _decode("flat_tma_host_fused", 128, 4, 3, 2),
    },
    "prefill": {
        "nested-tauto-n64-w4-s2-waves2": _prefill("nested", None, 64, 4, 2),  # the defaults before 22:12
        "flat-t1-n64-w4-s3-waves2": _prefill("flat", 1, 64, 4, 3),
        "flat-t1-n128-w4-s3-waves2": _prefill("flat", 1, 128, 4, 3),
        "union-t4-n128-w4-s3-waves2": _prefill("union", 4, 128, 4, 3),
        "union-t8-n64-w8-s3-waves2": _prefill("union", 8, 64, 8, 3),
        "union-t8-n128-w8-s2-waves2": _prefill("union", 8, 128, 8, 2),  # best on smooth index queries (0.75x)
        "union-t16-n64-w8-s2-waves2": _prefill("union", 16, 64, 8, 2),
        "union-t8-n64-w8-s4-waves2": _prefill("union", 8, 64, 8, 4),  # one stage more (215 registers, no spill)
        # the union tile with K / V through TMA (bulk tensor copies, pipelined by the compiler without cp.async's
        # per-thread address math; sm_90 n64 s3: 96 KB = three K+V buffers in a ring, one barrier wait per tile).
        # (The "halves" walk, two 4-token row groups of an 8-token union tile that skip blocks none of their tokens
        # chose, lost at every measured shape, 81-99 TFLOP/s with pointer loads and 88 with TMA against 180-227 for
        # the union tiles, and was removed; docs/performance.md.)
        "union_tma-t8-n128-w8-s2-waves2": _prefill("union_tma", 8, 128, 8, 2),
        "union_tma-t8-n64-w8-s3-waves2": _prefill("union_tma", 8, 64, 8, 3),
        # ... and with the lean step (attend_tile_lean: mask only on the tiles that need one, the scale in the
        # exponent's FMA, the accumulator rescaled only when a row's max grew). sm_90: n128 s2 253 registers, n64 s3
        # 202, no spill, 160 / 96 KB (the plain union tile n128 s2 spills 8 bytes at 255).
        "union_tma_lean-t8-n128-w8-s2-waves2": _prefill("union_tma_lean", 8, 128, 8, 2),
        "union_tma_lean-t8-n64-w8-s3-waves2": _prefill("union_tma_lean", 8, 64, 8, 3),
        "union_tma_host_lean-t8-n128-w8-s2-waves2": _prefill("union_tma_host_lean", 8, 128, 8, 2),
        # issue 11's last prefill step (227 -> 250 TFLOP/s at 16k). The lean 8-warp tile's sm_90 SASS holds 9 CTA
        # barriers per key tile (cross-warp reductions: the rows that chose the block, the mask test, the rescale
        # test), so its two warpgroups run in step and never overlap one's softmax with the other's wgmma. "_rescale"
        # drops the rescale test's (sm_90: 252 registers, 160 KB, 3 barriers and 6 shuffles fewer in the loop). A
        # 4-warp tile (one warpgroup: no barrier between warpgroups) of 4 tokens (union 1.24x top-k, not 1.43x) with
        # 64-key tiles in 3 stages: 192 registers, 80 KB, so two programs per multiprocessor. Not listed: 8 tokens
        # at 4 warps (one warpgroup, M = 128 as two wgmma issues) spills (n64 s2: 255 registers + 208 bytes of
        # stack), 4 tokens n128 w4 s2 is 255 registers and 144 KB (one program per multiprocessor, half the rows).
        "union_tma_lean_rescale-t8-n128-w8-s2-waves2": _prefill("union_tma_lean_rescale", 8, 128, 8, 2),
        "union_tma_host_lean_rescale-t8-n128-w8-s2-waves2": _prefill("union_tma_host_lean_rescale", 8, 128, 8, 2),
        "union_tma_lean-t4-n64-w4-s3-waves2": _prefill("union_tma_lean", 4, 64, 4, 3),
        # The 4-token tile (252 TFLOP/s at 16k on 2026-12-01 07:36 UTC, the 8-token default 229) with the lighter
        # steps. sm_90 (Triton 3.6's ptxas, without a GPU): lean 192 registers, lean_rescale 194, lean_chosen_rescale
        # 167; all 82 KB of shared memory, no spill, so two programs per multiprocessor each (by shared memory).
        "union_tma_lean_rescale-t4-n64-w4-s3-waves2": _prefill("union_tma_lean_rescale", 4, 64, 4, 3),
        "union_tma_lean_chosen_rescale-t4-n64-w4-s3-waves2": _prefill("union_tma_lean_chosen_rescale", 4, 64, 4, 3),
        # "_chosen": the rows that want a block and whether all do from one load of bits made with the union.
        # sm_90 key-tile loop (t8 n128 w8 s2, instructions / CTA barriers / shuffles a tile): lean 787 / 10 / 24,
        # lean_rescale 763 / 7 / 18, lean_chosen 673 / 5 / 14, lean_chosen_rescale 647 / 4 / 8 (241 registers).
        # (Its 8-token entries without host descriptors, "union_tma_lean_chosen(_rescale)-t8-n128-w8-s2-waves2", lost at
        # every measured shape, 16k 232 / 232 and 4k 96 / 123 TFLOP/s against the t8 rescale form's 240 / 134,
        # 2026-12-01 07:36 UTC, and were removed; the 4-token form with the bits is the prefill default since.)
        "union_tma_host_lean_chosen_rescale-t8-n128-w8-s2-waves2": _prefill("union_tma_host_lean_chosen_rescale", 8,
                                                                             128, 8, 2),
    },
}

# The prefill setting fp32 activations run when the caller names none (``forward``).
FP32_PREFILL = VARIANTS["prefill"]["union-t8-n128-w8-s2-waves2"]


def settings(config: dict | None, mode: str) -> dict:
    """DEFAULTS[mode] with the entries of ``config[mode]`` (unknown names or loop forms refused by name)."""
    cfg = launch_settings("sparse_paged_attention", DEFAULTS, config, mode)
    loop_form(cfg["loop"])
    check_widen("sparse_paged_attention", cfg["fp8_widen"])
    return cfg


def tma_usable(pool: torch.Tensor, block_n: int, block_size: int, block_d: int) -> bool:
    """Whether ``_load_kv`` can read ``pool`` [pages, page, Hkv, D] as bulk tensor copies: a Hopper-or-later GPU (or
    the interpreter), the pool laid out as a row-major [pages * page, Hkv * D] matrix with a 16-byte aligned base and
    row length (a tensor descriptor's rules), D a power of two (the box is [BLOCK_N, D]) and key tiles inside one
    page and one block (one box per tile)."""
    if pool.device.type == "cuda" and torch.cuda.get_device_capability(pool.device)[0] < 9:
        return False
    pages, page, hkv, d = pool.shape
    row = hkv * d
    return (d == block_d and pool.stride(3) == 1 and pool.stride(2) == d and pool.stride(1) == row
            and pool.stride(0) == page * row and pool.data_ptr() % 16 == 0 and row * pool.element_size() % 16 == 0
            and page % block_n == 0 and block_size % block_n == 0)


# Shared memory the compiled kernel may need beyond its tiles (pipeline barriers, reductions' scratch): the largest
# remainder over the cases tests/test_kernels_attention_shared_memory.py records is 1 KB.
_SHARED_SLACK = 2048


def shared_memory_bound(rows: int, block_n: int, block_d: int, block_dv: int, stages: int, q_bytes: int,
                        kv_bytes: int, fp8: bool) -> int:
    """Most bytes of shared memory a launch of ``_sparse_paged_attention`` can ask for: every stage's K and V tiles
    as loaded (``stages`` buffers of [BLOCK_N, BLOCK_D + BLOCK_DV] in the pool's dtype: what the software pipeliner
    allocates), FP8 tiles once more widened to the queries' dtype (the dots' operands; for fp32 queries also their
    16-bit step, E4M3 pairs converting to f16 pairs), the queries [ROWS, BLOCK_D] (a dot operand), and
    ``_SHARED_SLACK``. An upper bound, not the compiler's exact plan: checked against Triton 3.6's sm_90 compiles
    (``metadata.shared``) of every loop form, dtype and tile the launcher runs
    (tests/test_kernels_attention_shared_memory.py): 160 KB for the 8-token union tile with bf16 pools, bound 162 KB;
    256 KB with fp32 pools (the `mini` model tests' dtype), bound 322 KB; loose mostly where the compiler buffers
    fewer stages than asked or keeps the queries in registers."""
    tiles = block_n * (block_d + block_dv)
    widened = tiles * (q_bytes + (2 if q_bytes > 2 else 0)) if fp8 else 0
    return stages * tiles * kv_bytes + widened + rows * block_d * q_bytes + _SHARED_SLACK


@functools.lru_cache(maxsize=256)  # a pure function of launch shape and device limit, asked per prefill call
def fit_shared_memory(rows: int, block_n: int, block_d: int, block_dv: int, stages: int, q_bytes: int,
                      kv_bytes: int, fp8: bool, limit: int) -> tuple[int, int]:
    """(block_n, stages) whose ``shared_memory_bound`` fits ``limit``: the largest key tile (halving down to 16, a
    tensor-core dot's least) that fits with 2 or more of the stages asked for, with the most of those stages; else
    16-key tiles in one stage. The requested pair when it fits (every bf16 / FP8 setting of DEFAULTS and VARIANTS
    at M3's dims does); fp32 pools (the reference-comparison tests' model dtype) are what it shrinks: the 8-token
    union tile asked for 256 KB there, where the H200 has 227 KB (now 64-key tiles in 2 stages), and, the bound
    being loose there, it would shrink the decode default's 128-key tiles in 3 stages (compiled 145 KB) to 64-key
    tiles in 3, so ``forward`` applies it to tiles of several tokens only."""
    def fits(n, s):
        return shared_memory_bound(rows, n, block_d, block_dv, s, q_bytes, kv_bytes, fp8) <= limit

    n = block_n
    while n >= 16:
        for s in range(stages, min(stages, 2) - 1, -1):
            if fits(n, s):
                return n, s
        n //= 2
    if fits(16, 1):
        return 16, 1
    raise ValueError(f"sparse_paged_attention: a tile of {rows} query rows x {block_d} dims needs "
                     f"{shared_memory_bound(rows, 16, block_d, block_dv, 1, q_bytes, kv_bytes, fp8)} bytes of "
                     f"shared memory with 16-key tiles in one stage; the device has {limit}")


@triton.jit
def _sequence_by_count(qsl_ptr, t, num_seqs, SEQS_PAD: tl.constexpr):
    """``sequence_of``'s answer (the largest b < num_seqs with query_start_loc[b] <= t) as the count of starts <= t,
    less one: query_start_loc is non-decreasing, so that count is exactly b + 1. One load of ``SEQS_PAD`` starts
    where the binary search makes log2(B) loads that each wait for the last (the start latency of a short decode
    program)."""
    b = tl.arange(0, SEQS_PAD)
    starts = tl.load(qsl_ptr + b, mask=b < num_seqs, other=2147483647)
    return tl.sum((starts <= t).to(tl.int32), axis=0) - 1


@triton.jit
def _tile_visit(sel_base, ss_t, start, visit, rel, kk, sel_rows, last, K: tl.constexpr, BS: tl.constexpr):
    """Visit ``visit`` = (token ``visit // K`` of the tile, selection slot ``visit % K``) -> (block id, whether the
    tile reads the block here, the rows whose token selected it). A block is read once per tile, at its first
    occurrence (an earlier token, or an earlier slot of this token), for every row whose token selected it;
    -1 and blocks after the tile's last position are never read."""
    i = visit // K
    slot = visit % K
    c = tl.load(sel_base + (start + i).to(tl.int64) * ss_t + slot)
    earlier = ((rel[:, None] < i) | ((rel[:, None] == i) & (kk[None, :] < slot))) & (sel_rows == c)
    seen = tl.max(tl.max(earlier.to(tl.int32), axis=1), axis=0)
    wants = tl.max((sel_rows == c).to(tl.int32), axis=1) > 0
    return c, (c >= 0) & (c * BS <= last) & (seen == 0), wants


@triton.jit
def _load_kv(k_ptr, v_ptr, bt_row, c, sub, use, last, d, dv, g, sk_p, sk_r, sk_h, sv_p, sv_r, sv_h, D: tl.constexpr,
             DV: tl.constexpr, PAGE: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
             TILE_IN_PAGE: tl.constexpr, TMA: tl.constexpr = 0):
    """Key tile ``sub`` of block ``c``: (key positions j, which exist and are visible to the tile, page id and row
    of each key, K [BLOCK_N, D], V [BLOCK_N, DV]); nothing is read unless ``use``. ``TILE_IN_PAGE``: the tile
    lies inside one page (BLOCK_N divides both the page and the block), so its page id is one scalar load and
    its rows are consecutive, instead of a page id per key. ``TMA`` 1 or 2 (the tile inside one page): ``k_ptr`` /
    ``v_ptr`` are tensor descriptors over the pools viewed [pages * page, Hkv * D], and the tile is one bulk copy of
    the box [BLOCK_N, D] at (page * PAGE + first row, g * D). A bulk copy cannot be masked: a tile that is not
    ``use``d reads page 0's rows, and a pool row past a sequence's end may hold anything, NaN included (a masked
    score gives P = 0, but 0 * NaN in P V is NaN; K's rows are harmless, their scores are masked). So with 1 V's
    rows outside ``kmask`` are zeroed (which costs the sm_90 build V in registers: 168 registers instead of 128 for
    64-key decode tiles); 2 is for callers that only ask for tiles whose every key is in the sequence."""
    j = c * BS + sub * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = use & (j < c * BS + BS) & (j <= last)
    if TMA:
        j0 = c * BS + sub * BLOCK_N
        page = tl.load(bt_row + j0 // PAGE, mask=use & (j0 <= last), other=0)
        row0 = page * PAGE + j0 % PAGE
        k = k_ptr.load([row0, g * D])
        v = v_ptr.load([row0, g * DV])
        if TMA == 1:  # not known to be whole: rows past the sequence zeroed
            v = tl.where(kmask[:, None], v, tl.zeros_like(v))
        page = page.to(tl.int64)
        row = j0 % PAGE + tl.arange(0, BLOCK_N)
    else:
        if TILE_IN_PAGE:
            j0 = c * BS + sub * BLOCK_N
            page = tl.load(bt_row + j0 // PAGE, mask=use & (j0 <= last), other=0).to(tl.int64)
            row = j0 % PAGE + tl.arange(0, BLOCK_N)
        else:
            page = tl.load(bt_row + j // PAGE, mask=kmask, other=0).to(tl.int64)
            row = j % PAGE
        k_rows = k_ptr + page * sk_p + row * sk_r + g * sk_h
        v_rows = v_ptr + page * sv_p + row * sv_r + g * sv_h
        k = tl.load(k_rows[:, None] + d[None, :], mask=kmask[:, None] & (d[None, :] < D), other=0.0)
        v = tl.load(v_rows[:, None] + dv[None, :], mask=kmask[:, None] & (dv[None, :] < DV), other=0.0)
    return j, kmask, page, row, k, v


@triton.jit
def _attend_block(q, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, c, sub, use, wants, pos, last, d, dv, g, sk_p, sk_r, sk_h,
                  sv_p, sv_r, sv_h, sks_p, sks_r, svs_p, svs_r, qk_scale, m_i, l_i, acc, FP8: tl.constexpr,
                  D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                  TILE_IN_PAGE: tl.constexpr, PREC: tl.constexpr, INTERPRETED: tl.constexpr, TMA: tl.constexpr):
    """Key tile ``sub`` of block ``c`` for the rows that ``wants`` (causally); nothing is read unless ``use``. FP8: 0
    16-bit / fp32 pools, 1 E4M3 pools widened by conversion, 2 by bit placement (``_fp8.widen_by_bits``)."""
    j, kmask, page, row, k, v = _load_kv(k_ptr, v_ptr, bt_row, c, sub, use, last, d, dv, g, sk_p, sk_r, sk_h, sv_p,
                                         sv_r, sv_h, D, DV, PAGE, BS, BLOCK_N, TILE_IN_PAGE, TMA)
    allowed = wants[:, None] & kmask[None, :] & (j[None, :] <= pos[:, None])
    return attend_tile(q, k, v, ks_ptr + page * sks_p + row * sks_r + g, vs_ptr + page * svs_p + row * svs_r + g,
                       kmask, allowed, qk_scale, m_i, l_i, acc, FP8 > 0, PREC, INTERPRETED, FP8 == 2)


@triton.jit
def _tile_rows(q_ptr, pos_ptr, sel_base, start, end, g, sq_t, sq_h, ss_t, G: tl.constexpr, G_PAD: tl.constexpr,
               TOKENS: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, K: tl.constexpr,
               K_PAD: tl.constexpr):
    """Rows (the tile's ``TOKENS`` tokens times the query heads of KV head ``g``): (token within the tile, token,
    query head, row exists, position, queries [ROWS, BLOCK_D], each row's token's selection [ROWS, K_PAD])."""
    rows = tl.arange(0, ROWS)
    rel = rows // G_PAD  # token of the row within the tile
    tok = start + rel
    hh = rows % G_PAD
    hq = g * G + hh
    row_ok = (tok < end) & (hh < G) & (rel < TOKENS)
    pos = tl.load(pos_ptr + tok, mask=row_ok, other=-1).to(tl.int32)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + tok[:, None].to(tl.int64) * sq_t + hq[:, None] * sq_h + d[None, :],
                mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
    kk = tl.arange(0, K_PAD)
    sel_rows = tl.load(sel_base + tok[:, None].to(tl.int64) * ss_t + kk[None, :],
                       mask=row_ok[:, None] & (kk[None, :] < K), other=-1)
    return rel, tok, hq, row_ok, pos, q, sel_rows


@triton.jit
def _sparse_paged_attention(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, pos_ptr, qsl_ptr, tile_seq_ptr, tile_start_ptr, tile_end_ptr,
    sel_ptr, uni_ptr, cnt_ptr, out_ptr, acc_ptr, m_ptr, l_ptr, num_seqs,
    sq_t, sq_h, sk_p, sk_r, sk_h, sv_p, sv_r, sv_h, sks_p, sks_r, svs_p, svs_r, sbt_b, ss_t, ss_g, so_t, so_h,
    qk_scale, FP8: tl.constexpr,
    HQ: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, TOKENS: tl.constexpr, ROWS: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE: tl.constexpr,
    BS: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, LOG2_SEQS: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr, LOOP: tl.constexpr, PREC: tl.constexpr, INTERPRETED: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr = False,  # these last, with defaults: the TensorRT wrappers pass the others by position
    TMA: tl.constexpr = 0, FUSED: tl.constexpr = False, tick_ptr=None, kv_rows=0, SEQS_PAD: tl.constexpr = 0,
    LEAN: tl.constexpr = False, k_desc=None, v_desc=None, HOST_DESC: tl.constexpr = False,
    RESCALE: tl.constexpr = False, cho_ptr=None, CHOSEN: tl.constexpr = False,
):
    tile = tl.program_id(0)
    g = tl.program_id(1)
    hkv = tl.num_programs(1)
    split = tl.program_id(2)
    if TOKENS == 1:  # one program per token (decode-like batches): its sequence by binary search
        if SEQS_PAD > 0:  # or by one vector load of every sequence's start (no chain of dependent loads)
            seq = _sequence_by_count(qsl_ptr, tile, num_seqs, SEQS_PAD)
        else:
            seq = sequence_of(qsl_ptr, tile, num_seqs, LOG2_SEQS)
        start = tile
        end = tile + 1
    else:
        seq = tl.load(tile_seq_ptr + tile)
        start = tl.load(tile_start_ptr + tile)
        end = tl.load(tile_end_ptr + tile)

    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    kk = tl.arange(0, K_PAD)
    sel_base = sel_ptr + g * ss_g
    VISITS: tl.constexpr = TOKENS * K  # (token of the tile, selection slot) pairs, cut into SPLITS pieces
    PER: tl.constexpr = (VISITS + SPLITS - 1) // SPLITS
    SUB: tl.constexpr = (BS + BLOCK_N - 1) // BLOCK_N
    bt_row = bt_ptr + seq.to(tl.int64) * sbt_b
    if HOST_DESC:  # the descriptors made at launch, passed by value (no descriptor write and fence per program)
        k_src = k_desc
        v_src = v_desc
    elif TMA:  # K / V tiles as bulk tensor copies (_load_kv) through descriptors over the pools as [pages * page, Hkv * D]
        k_src = tl.make_tensor_descriptor(k_ptr, shape=[kv_rows, hkv * D], strides=[sk_r, 1],
                                          block_shape=[BLOCK_N, BLOCK_D])
        v_src = tl.make_tensor_descriptor(v_ptr, shape=[kv_rows, hkv * DV], strides=[sv_r, 1],
                                          block_shape=[BLOCK_N, BLOCK_DV])
    else:
        k_src = k_ptr
        v_src = v_ptr
    rel, tok, hq, row_ok, pos, q, sel_rows = _tile_rows(q_ptr, pos_ptr, sel_base, start, end, g, sq_t, sq_h, ss_t,
                                                        G, G_PAD, TOKENS, ROWS, D, BLOCK_D, K, K_PAD)
    last = tl.max(pos, axis=0)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_DV], tl.float32)
    if LOOP == "nested":
        for visit in range(split * PER, tl.minimum(split * PER + PER, (end - start) * K)):
            c, use, wants = _tile_visit(sel_base, ss_t, start, visit, rel, kk, sel_rows, last, K, BS)
            for sub in range(0, tl.where(use, SUB, 0)):
                m_i, l_i, acc = _attend_block(
                    q, k_src, v_src, ks_ptr, vs_ptr, bt_row, c, sub, use, wants, pos, last, d, dv, g, sk_p, sk_r,
                    sk_h, sv_p, sv_r, sv_h, sks_p, sks_r, svs_p, svs_r, qk_scale, m_i, l_i, acc, FP8, D, DV, PAGE,
                    BS, BLOCK_N, TILE_IN_PAGE, PREC, INTERPRETED, TMA)
    elif TMA == 2:  # bulk copies of whole key tiles only (see the module docstring); the tail by pointers
        if LOOP == "union":  # the tile's distinct usable blocks, ascending: the last one is the only one that
            # can reach past the tile's last position
            n_vis = tl.load(cnt_ptr + tile * hkv + g)
            uni_base = uni_ptr + (tile * hkv + g).to(tl.int64) * VISITS
            c_last = tl.load(uni_base + tl.maximum(n_vis - 1, 0))
            has_own = (n_vis > 0) & (c_last == last // BS)
            n_other = n_vis - has_own.to(tl.int32)
        else:  # one token: its usable first occurrences, the token's own block (if chosen) last
            sel_one = tl.load(sel_base + start.to(tl.int64) * ss_t + kk, mask=kk < K, other=-1)
            repeat = tl.max(((kk[None, :] < kk[:, None]) & (sel_one[None, :] == sel_one[:, None])).to(tl.int32),
                            axis=1)
            first_use = (sel_one >= 0) & (sel_one * BS <= last) & (repeat == 0)
            other = first_use & (sel_one != last // BS)
            rank = tl.cumsum(other.to(tl.int32), axis=0) - 1
            n_other = tl.sum(other.to(tl.int32), axis=0)
            has_own = tl.sum((first_use & (sel_one == last // BS)).to(tl.int32), axis=0) > 0
        own = last // BS
        pos_min = tl.min(tl.where(row_ok, pos, last), axis=0)  # the earliest position of the tile's rows
        own_keys = last + 1 - own * BS  # keys of the own block up to the last position (1..BS)
        n_full = n_other * SUB + tl.where(has_own, own_keys // BLOCK_N, 0)  # whole key tiles, in walk order
        t_lo = split * PER * SUB
        t_hi = t_lo + PER * SUB
        for it in range(t_lo, tl.minimum(t_hi, n_full)):
            visit = it // SUB
            sub = it % SUB
            if LOOP == "union":
                c = tl.load(uni_base + visit)
                if CHOSEN:  # bit i: token i of the tile chose c (union_choosers); rows of padding never set
                    bits = tl.load(cho_ptr + (tile * hkv + g).to(tl.int64) * VISITS + visit)
                    wants = ((bits >> rel) & 1) != 0
                elif TOKENS == 1:
                    wants = row_ok
                else:
                    wants = tl.max((sel_rows == c).to(tl.int32), axis=1) > 0
            else:
                c = tl.where(visit < n_other, tl.sum(tl.where(other & (rank == visit), sel_one, 0), axis=0), own)
                wants = row_ok
            if LEAN:  # the mask only where a row may not see a key of the tile (attend_tile_lean)
                j, kmask, page, row, k, v = _load_kv(k_src, v_src, bt_row, c, sub, True, last, d, dv, g, sk_p,
                                                     sk_r, sk_h, sv_p, sv_r, sv_h, D, DV, PAGE, BS, BLOCK_N,
                                                     TILE_IN_PAGE, 2)
                if CHOSEN:  # a real token of the tile that did not choose c: a scalar test
                    some_not = bits != (1 << (end - start)) - 1
                else:
                    some_not = tl.min(tl.where(row_ok, wants, True).to(tl.int32), axis=0) == 0
                need = some_not | (c * BS + sub * BLOCK_N + BLOCK_N - 1 > pos_min)
                m_i, l_i, acc = attend_tile_lean(q, k, v, need, wants[:, None] & (j[None, :] <= pos[:, None]),
                                                 qk_scale, m_i, l_i, acc, PREC, INTERPRETED, RESCALE)
            else:
                m_i, l_i, acc = _attend_block(
                    q, k_src, v_src, ks_ptr, vs_ptr, bt_row, c, sub, True, wants, pos, last, d, dv, g, sk_p, sk_r,
                    sk_h, sv_p, sv_r, sv_h, sks_p, sks_r, svs_p, svs_r, qk_scale, m_i, l_i, acc, FP8, D, DV, PAGE,
                    BS, BLOCK_N, TILE_IN_PAGE, PREC, INTERPRETED, 2)
        if has_own & (own_keys % BLOCK_N != 0) & (t_lo <= n_full) & (n_full < t_hi):  # the partial tile
            if TOKENS == 1:
                wants = row_ok
            else:
                wants = tl.max((sel_rows == own).to(tl.int32), axis=1) > 0
            m_i, l_i, acc = _attend_block(
                q, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, own, own_keys // BLOCK_N, True, wants, pos, last, d, dv,
                g, sk_p, sk_r, sk_h, sv_p, sv_r, sv_h, sks_p, sks_r, svs_p, svs_r, qk_scale, m_i, l_i, acc, FP8, D,
                DV, PAGE, BS, BLOCK_N, True, PREC, INTERPRETED, 0)
    else:
        if TOKENS == 1:
            sel_one = tl.load(sel_base + start.to(tl.int64) * ss_t + kk, mask=kk < K, other=-1)
        if LOOP == "union":  # the tile's distinct usable blocks, ascending (tile_unions)
            n_vis = tl.load(cnt_ptr + tile * hkv + g)
            uni_base = uni_ptr + (tile * hkv + g).to(tl.int64) * VISITS
        else:
            n_vis = (end - start) * K
        v_lo = split * PER
        v_hi = tl.minimum(v_lo + PER, n_vis)
        for it in range(v_lo * SUB, v_hi * SUB):  # (visit, key tile) pairs: one loop the compiler can pipeline
            visit = it // SUB
            sub = it % SUB
            if LOOP == "union":
                c = tl.load(uni_base + visit)
                use = c >= 0  # always: the list holds usable blocks only
                if TOKENS == 1:
                    wants = row_ok
                else:
                    wants = tl.max((sel_rows == c).to(tl.int32), axis=1) > 0
            else:
                if TOKENS == 1:  # one token: its selection held in registers, so no load stands between the
                    # loop counter and this visit's addresses, and repeats are a 1-D test
                    c = tl.sum(tl.where(kk == visit, sel_one, 0), axis=0)
                    seen = tl.max(((kk < visit) & (sel_one == c)).to(tl.int32), axis=0)
                    wants = row_ok
                    use = (c >= 0) & (c * BS <= last) & (seen == 0)
                else:
                    c, use, wants = _tile_visit(sel_base, ss_t, start, visit, rel, kk, sel_rows, last, K, BS)
            # a skipped visit masks every load (no memory traffic) and every score: an exact no-op step
            m_i, l_i, acc = _attend_block(
                q, k_src, v_src, ks_ptr, vs_ptr, bt_row, c, sub, use, wants, pos, last, d, dv, g, sk_p, sk_r, sk_h,
                sv_p, sv_r, sv_h, sks_p, sks_r, svs_p, svs_r, qk_scale, m_i, l_i, acc, FP8, D, DV, PAGE, BS,
                BLOCK_N, TILE_IN_PAGE, PREC, INTERPRETED, TMA)

    if FUSED:  # the split-K merge in this launch: the last split of the (tile, KV head) merges (_splitk)
        finish_rows_fused(out_ptr, acc_ptr, m_ptr, l_ptr, tick_ptr + tile * hkv + g, acc, m_i, l_i, tok, hq, row_ok,
                          split, so_t, so_h, dv, HQ, DV, SPLITS)
    else:
        finish_rows(out_ptr, acc_ptr, m_ptr, l_ptr, acc, m_i, l_i, tok, hq, row_ok, split, so_t, so_h, dv, HQ, DV,
                    SPLITS)


def forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    block_idx: torch.Tensor,
    block_size: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """As paged_attention, but token t / head h sees only blocks ``block_idx[t, h // (Hq/Hkv)]`` (-1 = none).
    FP8 pools come with their fp32 scale pools [pages, page, Hkv]. ``config``: {"decode": {...}, "prefill":
    {...}}, entries overriding ``DEFAULTS`` (None for the op); "decode" serves batches with fewer than two new
    tokens per sequence on average (``tokens_per_tile``), "prefill" the others."""
    t, hq, d = q.shape
    _check(q, k_cache, v_cache, "sparse_paged_attention", k_scale, v_scale)
    hkv, dv, page = k_cache.shape[2], v_cache.shape[3], k_cache.shape[1]
    if block_idx.dim() != 3 or block_idx.shape[:2] != (t, hkv):
        raise ValueError(f"sparse_paged_attention: block_idx {tuple(block_idx.shape)} must be [{t}, {hkv}, K]")
    if block_size < 1:
        raise ValueError(f"sparse_paged_attention: block_size {block_size} must be >= 1")
    out = torch.empty((t, hq, dv), dtype=q.dtype, device=q.device)
    b = seq_lens.shape[0]
    topk = block_idx.shape[2]
    if t == 0 or b == 0:
        return out
    if topk == 0:  # nothing allowed: a softmax over nothing, as the reference
        return out.fill_(float("nan"))
    q = q if q.stride(2) == 1 else q.contiguous()
    kc = k_cache if k_cache.stride(3) == 1 else k_cache.contiguous()
    vc = v_cache if v_cache.stride(3) == 1 else v_cache.contiguous()
    bt = block_tables.contiguous()
    pos = positions.contiguous()
    sel = block_idx.to(torch.int32).contiguous()
    qsl = query_start_loc.contiguous()
    group = hq // hkv
    g_pad = next_pow2(group)
    mode = "decode" if t < 2 * b else "prefill"
    cfg = settings(config, mode)
    if mode == "prefill" and not (config and "prefill" in config):
        if q.element_size() > 2 and not interpreted(q):
            # fp32 activations (tests, precision runs): the union tile as the `mini` fp32 GPU tests passed it
            # (2026-12-01 05:55 UTC); the TMA lean forms were measured in bf16 only, and their fp32 tiles spill
            cfg = dict(cfg, **FP32_PREFILL)
    tokens = cfg.get("tile_tokens") or tokens_per_tile(t, b, g_pad)
    loop, tma, host, fused, lean = loop_form(cfg["loop"])
    ks, vs = scale_pools(k_scale, v_scale, kc)
    # rows of a program: tile tokens x the KV head's query heads, at least the 16 a tensor-core dot needs.
    # TILE_IN_PAGE (one page id per key tile) in prefill only: compiled for sm_90 at mini dims it takes the prefill
    # default from 168 to 115 registers, but the decode default from 168 to 186 (three programs per multiprocessor by
    # registers down to two), so decode keeps a page id per key.
    rows = max(16, tokens * g_pad)
    block_d, block_dv = next_pow2(max(d, 16)), next_pow2(max(dv, 16))
    # key tile at most the block; for tiles of several tokens, key tile and stages within the device's shared memory
    # (fit_shared_memory: the union tile in fp32 asked for 256 KB). One token per program (16 rows) launches as set:
    # every such setting ran on the H200 in bf16 and fp32 as it is (e.g. the fp32 decode default, 128-key tiles in
    # 3 stages, compiled 145 KB), where the bound, loose for fp32, would shrink it to an untested tile.
    block_n, stages = min(cfg["block_n"], max(16, next_pow2(block_size))), cfg["num_stages"]
    if rows > 16:
        block_n, stages = fit_shared_memory(rows, block_n, block_d, block_dv, stages, q.element_size(),
                                            kc.element_size(), k_scale is not None, max_shared_memory(q.device))
    tma = tma and tma_usable(kc, block_n, block_size, block_d) and tma_usable(vc, block_n, block_size, block_dv)
    # the chooser bits where the step that reads them runs: the lean TMA union walk of 16-bit pools
    chosen = "chosen" in cfg["loop"].split("_") and loop == "union" and tokens > 1 and tma and lean and k_scale is None
    # tiles of several tokens: each one's sequence and token range, for the union walk each (tile, KV head)'s
    # distinct usable blocks and their count, and the chooser bits, all from one launch (_tile_plan). A one-token
    # program finds its sequence itself: its tile lists are placeholders the kernel never reads.
    tseq, tstart, tend, slots, uni, cnt, cho = tile_plan(qsl, sel, pos, t, tokens, block_size, union=loop == "union",
                                                         chosen=chosen)
    if tokens == 1:
        tseq = tstart = tend = qsl
    if uni is None:  # never read unless the loop is "union"
        uni = cnt = sel
    visits = tokens * topk
    splits = splits_for(q.device, slots * hkv, min(visits, cfg["max_splits"] or visits), cfg["waves"])
    splits = cdiv(visits, cdiv(visits, splits))  # no split left without visits (5 splits of 16 -> 4 of 4)
    parts = Partials(t, hq, dv, splits, q.device) if splits > 1 else None
    scratch = (parts.acc, parts.m, parts.l) if parts else (out, out, out)
    ticks = ticket_counters(q.device, slots * hkv) if fused else None
    descs = {}
    if tma and host:
        descs = dict(k_desc=TensorDescriptor(kc, shape=[kc.shape[0] * page, hkv * d], strides=[kc.stride(1), 1],
                                             block_shape=[block_n, block_d]),
                     v_desc=TensorDescriptor(vc, shape=[vc.shape[0] * page, hkv * dv], strides=[vc.stride(1), 1],
                                             block_shape=[block_n, block_dv]), HOST_DESC=True)
    elif tma and not interpreted(q):
        ensure_descriptor_allocator()
    _sparse_paged_attention[(slots, hkv, splits)](
        q, kc, vc, ks, vs, bt, pos, qsl, tseq, tstart, tend, sel, uni, cnt, out, *scratch, b,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1),
        vc.stride(2), ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1), bt.stride(0), sel.stride(0),
        sel.stride(1), out.stride(0), out.stride(1), scale * LOG2E,
        FP8=0 if k_scale is None else 2 if by_bits(cfg["fp8_widen"], True, q.dtype) else 1,
        HQ=hq, G=group, G_PAD=g_pad, TOKENS=tokens, ROWS=rows, D=d,
        BLOCK_D=block_d, DV=dv, BLOCK_DV=block_dv, PAGE=page, BS=block_size, K=topk,
        K_PAD=next_pow2(max(topk, 2)), LOG2_SEQS=log2_ceil(b), BLOCK_N=block_n, SPLITS=splits, LOOP=loop,
        PREC=dot_precision(q.dtype), INTERPRETED=interpreted(q),
        TILE_IN_PAGE=mode == "prefill" and page % block_n == 0 and block_size % block_n == 0,
        TMA=(2 if loop == "union" or (loop == "flat" and tokens == 1) else 1) if tma else 0, FUSED=fused, tick_ptr=ticks, kv_rows=kc.shape[0] * page,
        SEQS_PAD=next_pow2(b) if fused and tokens == 1 and b <= _COUNTED_SEQS else 0,
        LEAN=lean and k_scale is None, RESCALE="rescale" in cfg["loop"].split("_"), **descs,
        cho_ptr=cho, CHOSEN=chosen,
        num_warps=cfg["num_warps"], num_stages=stages,
    )
    return parts.merge_into(out) if parts and not fused else out
