"""The plugin kernels in TensorRT's launch order: thin ``@triton.jit`` wrappers around the ``plugins/kernels``
bodies (Triton inlines the call: the same kernel code, compiled once more with TensorRT's parameter list).

Each wrapper takes ``(input pointers..., int32 extras..., output pointers...)`` (see ``aot.py``) and passes the
kernel everything else as compile-time constants: strides of contiguous tensors, the one-token-per-program tiling
(``TOKENS`` 1, no tile map), a single context split (no split-K scratch, no merge launch), bf16 / fp16 / fp32
caches (``FP8`` False: the FP8 cache's scale pools are not plugin inputs yet) and ``INTERPRETED`` False. Unused
pointer slots of the kernel (tile map, split-K scratch, cache scales) get a pointer the kernel never reads in that
configuration, as the torch launchers do.
"""

from __future__ import annotations

import triton
import triton.language as tl

from m3export.plugins.kernels import lightning_indexer as li
from m3export.plugins.kernels import moe as moe_k
from m3export.plugins.kernels import moe_gemv as gemv
from m3export.plugins.kernels import moe_routing as routing
from m3export.plugins.kernels import mxfp8_linear as ml
from m3export.plugins.kernels import paged_attention as pa
from m3export.plugins.kernels import sparse_paged_attention as spa


@triton.jit
def m3_paged_attention(q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, pos_ptr, num_seqs, max_pages,
                       out_ptr, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                       D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                       PAGE: tl.constexpr, ROWS: tl.constexpr, LOG2_SEQS: tl.constexpr, BLOCK_N: tl.constexpr,
                       PREC: tl.constexpr, QK_SCALE: tl.constexpr):
    pa._paged_attention(
        q_ptr, k_ptr, v_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, qsl_ptr, qsl_ptr, qsl_ptr, qsl_ptr, out_ptr, out_ptr,
        out_ptr, out_ptr, num_seqs, HQ * D, D, PAGE * HKV * D, HKV * D, D, PAGE * HKV * DV, HKV * DV, DV, 0, 0, 0,
        0, max_pages, HQ * DV, DV, QK_SCALE, False, HQ, G, G_PAD, D, BLOCK_D, DV, BLOCK_DV, PAGE, 1, ROWS,
        LOG2_SEQS, BLOCK_N, 1, PREC, False)

@triton.jit
def m3_sparse_paged_attention(q_ptr, k_ptr, v_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, pos_ptr, sel_ptr, num_seqs,
                              max_pages, out_ptr, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr,
                              G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr,
                              BLOCK_DV: tl.constexpr, PAGE: tl.constexpr, BS: tl.constexpr, K: tl.constexpr,
                              K_PAD: tl.constexpr, ROWS: tl.constexpr, LOG2_SEQS: tl.constexpr,
                              BLOCK_N: tl.constexpr, PREC: tl.constexpr, QK_SCALE: tl.constexpr):
    spa._sparse_paged_attention(
        q_ptr, k_ptr, v_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, qsl_ptr, qsl_ptr, qsl_ptr, qsl_ptr, sel_ptr, sel_ptr,
        sel_ptr, out_ptr, out_ptr, out_ptr, out_ptr, num_seqs, HQ * D, D, PAGE * HKV * D, HKV * D, D,
        PAGE * HKV * DV, HKV * DV, DV, 0, 0, 0, 0, max_pages, HKV * K, K, HQ * DV, DV, QK_SCALE, False, HQ, G, G_PAD,
        1, ROWS, D, BLOCK_D, DV, BLOCK_DV, PAGE, BS, K, K_PAD, LOG2_SEQS, BLOCK_N, 1, "nested", PREC, False)

@triton.jit
def m3_lightning_indexer_scan(q_ptr, k_ptr, bt_ptr, qsl_ptr, pos_ptr, num_seqs, max_pages, num_blocks,
                              out_ptr, H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr,
                              BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr,
                              LOG2_SEQS: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                              PREC: tl.constexpr):
    li._index_scan(q_ptr, k_ptr, k_ptr, bt_ptr, pos_ptr, qsl_ptr, qsl_ptr, qsl_ptr, qsl_ptr, out_ptr, num_seqs, H * D,
                   D, PAGE * D, D, 0, 0, max_pages, H * num_blocks, num_blocks, False, H, H_PAD, D, BLOCK_D, PAGE,
                   BS, 1, ROWS, LOG2_SEQS, BLOCK_N, SPLITS, PREC, False,
                   # the TMA / fold arguments, spelled out: the gather scan (TMA False, FOLD False) never reads the
                   # pointers (out_ptr stands in); left to the callee's defaults (None, a str), Triton 3.6's
                   # jit-to-jit call failed to compile ("'str' object has no attribute 'type'")
                   0, out_ptr, out_ptr, 0, 0, out_ptr, False, False, 1, False, 1, 2, 1, 2, 0, 0, "bitonic")

@triton.jit
def m3_lightning_indexer_topk(scores_ptr, pos_ptr, num_blocks, out_ptr, H: tl.constexpr, NB: tl.constexpr,
                              NB_PAD: tl.constexpr, BS: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
                              LOCAL: tl.constexpr, INIT: tl.constexpr, METHOD: tl.constexpr, GROUP: tl.constexpr,
                              TIERS: tl.constexpr, GROUPED_FROM: tl.constexpr, LOCAL_PAD: tl.constexpr):
    # every parameter passed (a jit-to-jit call leaves the rest at the callee's defaults, which Triton 3.6 does not
    # always compile); rows of the scores are ``num_blocks`` apart, ranked as ``li.block_topk`` ranks them
    li._block_topk(scores_ptr, pos_ptr, out_ptr, H * num_blocks, num_blocks, H * TOPK, TOPK, NB, NB_PAD, BS, TOPK,
                   TOPK_PAD, LOCAL, INIT, METHOD, GROUP, TIERS, GROUPED_FROM, LOCAL_PAD)

@triton.jit
def m3_mxfp8_linear(x_ptr, w_ptr, s_ptr, rows, y_ptr, N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr,
                    MX_MODE: tl.constexpr):
    ml._mxfp8_linear(x_ptr, w_ptr, s_ptr, y_ptr, rows, N, K, K, 1, K // 32, 1, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                     F32, PREC, MX_MODE)



# MoE as permutation-free GEMV steps (moe_gemv.py): weights [E, N, K] contiguous, activations contiguous. Plugins
# run without split-K or prefetch (SPLIT_K 1, PREFETCH 0), so the split-K scratch pointers are placeholders.
@triton.jit
def m3_moe_route(logits_ptr, bias_ptr, num_tokens, ids_ptr, w_ptr, E: tl.constexpr, TOP_K: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    routing._route(logits_ptr, bias_ptr, ids_ptr, w_ptr, num_tokens, E, E, TOP_K, BLOCK_T, BLOCK_E)


@triton.jit
def _gate_up(x_ptr, w_ptr, s_ptr, ids_ptr, act_ptr, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
             ROUTED: tl.constexpr, MXFP8: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    gemv._gate_up_gemv(x_ptr, w_ptr, s_ptr, act_ptr, ids_ptr, act_ptr, ids_ptr, H, 2 * I * H, H, 1, 2 * I * (H // 32), H // 32, 1, I,
                       ALPHA, LIMIT, H, I, TOP_K, ROUTED, MXFP8, BLOCK_N, BLOCK_K, 1, 0)


@triton.jit
def m3_moe_gate_up(x_ptr, w_ptr, ids_ptr, act_ptr, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                   ALPHA: tl.constexpr, LIMIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    _gate_up(x_ptr, w_ptr, w_ptr, ids_ptr, act_ptr, H, I, TOP_K, True, False, ALPHA, LIMIT, BLOCK_N, BLOCK_K)


@triton.jit
def m3_moe_gate_up_mxfp8(x_ptr, w_ptr, s_ptr, ids_ptr, act_ptr, H: tl.constexpr, I: tl.constexpr,
                         TOP_K: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    _gate_up(x_ptr, w_ptr, s_ptr, ids_ptr, act_ptr, H, I, TOP_K, True, True, ALPHA, LIMIT, BLOCK_N, BLOCK_K)


@triton.jit
def m3_moe_shared_gate_up(x_ptr, w_ptr, act_ptr, H: tl.constexpr, I: tl.constexpr, ALPHA: tl.constexpr,
                          LIMIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    _gate_up(x_ptr, w_ptr, w_ptr, x_ptr, act_ptr, H, I, 1, False, False, ALPHA, LIMIT, BLOCK_N, BLOCK_K)


@triton.jit
def m3_moe_shared_gate_up_mxfp8(x_ptr, w_ptr, s_ptr, act_ptr, H: tl.constexpr, I: tl.constexpr, ALPHA: tl.constexpr,
                                LIMIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    _gate_up(x_ptr, w_ptr, s_ptr, x_ptr, act_ptr, H, I, 1, False, True, ALPHA, LIMIT, BLOCK_N, BLOCK_K)


@triton.jit
def _down(act_ptr, w_ptr, s_ptr, ids_ptr, rw_ptr, y_ptr, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
          ROUTED: tl.constexpr, MXFP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    gemv._down_gemv(act_ptr, w_ptr, s_ptr, y_ptr, ids_ptr, rw_ptr, y_ptr, ids_ptr, I, H * I, I, 1, H * (I // 32), I // 32, 1,
                    (TOP_K + 1) * H, H, H, I, TOP_K, ROUTED, MXFP8, BLOCK_N, BLOCK_K, 1, 0)


@triton.jit
def m3_moe_down(act_ptr, w_ptr, ids_ptr, rw_ptr, y_ptr, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    _down(act_ptr, w_ptr, w_ptr, ids_ptr, rw_ptr, y_ptr, H, I, TOP_K, True, False, BLOCK_N, BLOCK_K)


@triton.jit
def m3_moe_down_mxfp8(act_ptr, w_ptr, s_ptr, ids_ptr, rw_ptr, y_ptr, H: tl.constexpr, I: tl.constexpr,
                      TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    _down(act_ptr, w_ptr, s_ptr, ids_ptr, rw_ptr, y_ptr, H, I, TOP_K, True, True, BLOCK_N, BLOCK_K)


@triton.jit
def m3_moe_shared_down(act_ptr, w_ptr, y_in_ptr, y_ptr, H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    _down(act_ptr, w_ptr, w_ptr, act_ptr, act_ptr, y_ptr, H, I, TOP_K, False, False, BLOCK_N, BLOCK_K)


@triton.jit
def m3_moe_shared_down_mxfp8(act_ptr, w_ptr, s_ptr, y_in_ptr, y_ptr, H: tl.constexpr, I: tl.constexpr,
                             TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    _down(act_ptr, w_ptr, s_ptr, act_ptr, act_ptr, y_ptr, H, I, TOP_K, False, True, BLOCK_N, BLOCK_K)


@triton.jit
def m3_moe_combine(y_ptr, num_tokens, out_ptr, H: tl.constexpr, TOP_K: tl.constexpr, SCALING: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    moe_k._combine(y_ptr, out_ptr, num_tokens, (TOP_K + 1) * H, H, H, SCALING, H, TOP_K, BLOCK_H)


WRAPPERS = dict(PagedAttention=m3_paged_attention, SparsePagedAttention=m3_sparse_paged_attention,
                LightningIndexerScan=m3_lightning_indexer_scan, LightningIndexerTopK=m3_lightning_indexer_topk,
                MXFP8Linear=m3_mxfp8_linear, MoERoute=m3_moe_route, MoEGateUp=m3_moe_gate_up,
                MoEGateUpMXFP8=m3_moe_gate_up_mxfp8, MoESharedGateUp=m3_moe_shared_gate_up,
                MoESharedGateUpMXFP8=m3_moe_shared_gate_up_mxfp8, MoEDown=m3_moe_down, MoEDownMXFP8=m3_moe_down_mxfp8,
                MoESharedDown=m3_moe_shared_down, MoESharedDownMXFP8=m3_moe_shared_down_mxfp8,
                MoECombine=m3_moe_combine)
