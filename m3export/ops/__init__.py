"""The custom-op contract (domain ``m3``): importing this package registers every ``torch.ops.m3.*`` op.

``docs/ops.md`` is the written specification; the functions here are its reference implementations.
"""

from . import attention, indexer, kv_fp8, moe, mxfp8  # noqa: F401  (registration side effects)
from . import autograd  # noqa: F401  (gradients of the differentiable ops: training)

OPS = {
    "LightningIndexer": "m3::lightning_indexer",
    "PagedAttention": "m3::paged_attention",
    "SparsePagedAttention": "m3::sparse_paged_attention",
    "MoE": "m3::moe",
    "MoEMXFP8": "m3::moe_mxfp8",
    "MXFP8Linear": "m3::mxfp8_linear",
}
DOMAIN = "m3"
OPSET_VERSION = 1
