"""torch -> ONNX translation of the ``m3`` custom ops: each becomes exactly one ``m3::<Op>`` node, except the FP8
cache's code writer ``m3::quantize_kv_rows``, which becomes standard ONNX ops (``kv_fp8_onnx.encode_rows``).

The dynamo exporter passes tensor arguments positionally and reads the ``int`` / ``float`` annotations to turn
the remaining torch-op arguments into ONNX attributes, so each function mirrors its torch op's signature.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxscript
import torch

from ..ops import DOMAIN, OPSET_VERSION
from .kv_fp8_onnx import encode_rows
from .schemas import ONNX_OPSET, register_schemas

m3 = onnxscript.values.Opset(DOMAIN, OPSET_VERSION)
_onnx = onnxscript.values.Opset("", ONNX_OPSET)


class _TracedOps:
    """The emitter interface of ``onnx_builder.Builder`` (``b.<Op>(...)``, ``b.const(value, dtype)``) over the
    exporter's tracer, so an encoder written once for function bodies (``kv_fp8_onnx.encode_rows``) also
    emits its nodes straight into a traced graph."""

    def const(self, value, dtype=np.int64):
        return _onnx.Constant(value=ir.tensor(np.asarray(value, dtype=dtype)))

    def __getattr__(self, op_type: str):
        if not op_type[:1].isupper():
            raise AttributeError(op_type)
        return getattr(_onnx, op_type)


def _quantize_kv_rows(x):
    """Standard ONNX nodes, no m3 node: every runtime that runs ScatterND runs the FP8 cache write, byte-equal to
    ``kv_fp8.quantize_rows`` (``tests/test_kv_fp8_onnx.py``)."""
    return encode_rows(_TracedOps(), x)


def _scales(*scales) -> tuple:
    """The FP8 cache's scale pools, the ops' optional trailing inputs: all given (uint8 code pools) or none."""
    return () if scales[0] is None else scales


def _lightning_indexer(index_q, index_k_cache, block_tables, query_start_loc, seq_lens, positions,
                       block_size: int, topk_blocks: int, local_blocks: int, init_blocks: int, index_k_scale=None):
    return m3.LightningIndexer(index_q, index_k_cache, block_tables, query_start_loc, seq_lens, positions,
                               *_scales(index_k_scale), block_size=block_size, topk_blocks=topk_blocks,
                               local_blocks=local_blocks, init_blocks=init_blocks)


def _paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, positions, scale: float,
                     k_scale=None, v_scale=None):
    return m3.PagedAttention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, positions,
                             *_scales(k_scale, v_scale), scale=scale)


def _sparse_paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, positions, block_idx,
                            block_size: int, scale: float, k_scale=None, v_scale=None):
    return m3.SparsePagedAttention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, positions,
                                   block_idx, *_scales(k_scale, v_scale), block_size=block_size, scale=scale)


def _moe(x, router_weight, e_score_correction_bias, w13, w2, shared_w13, shared_w2, top_k: int,
         routed_scaling_factor: float, swiglu_alpha: float, swiglu_limit: float):
    return m3.MoE(x, router_weight, e_score_correction_bias, w13, w2, shared_w13, shared_w2, top_k=top_k,
                  routed_scaling_factor=routed_scaling_factor, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)


def _moe_mxfp8(x, router_weight, e_score_correction_bias, w13, w13_scale, w2, w2_scale, shared_w13,
               shared_w13_scale, shared_w2, shared_w2_scale, top_k: int, routed_scaling_factor: float,
               swiglu_alpha: float, swiglu_limit: float):
    return m3.MoEMXFP8(x, router_weight, e_score_correction_bias, w13, w13_scale, w2, w2_scale, shared_w13,
                       shared_w13_scale, shared_w2, shared_w2_scale, top_k=top_k,
                       routed_scaling_factor=routed_scaling_factor, swiglu_alpha=swiglu_alpha,
                       swiglu_limit=swiglu_limit)


def _mxfp8_linear(x, weight, weight_scale):
    return m3.MXFP8Linear(x, weight, weight_scale)


def translation_table() -> dict:
    """``custom_translation_table`` for ``torch.onnx.export(dynamo=True)``; registers the schemas it needs."""
    register_schemas()
    ops = torch.ops.m3
    return {
        ops.lightning_indexer.default: _lightning_indexer,
        ops.paged_attention.default: _paged_attention,
        ops.sparse_paged_attention.default: _sparse_paged_attention,
        ops.moe.default: _moe,
        ops.moe_mxfp8.default: _moe_mxfp8,
        ops.mxfp8_linear.default: _mxfp8_linear,
        ops.quantize_kv_rows.default: _quantize_kv_rows,
    }
