"""Tensor and expert parallelism of M3 across ranks of ``torch.distributed`` (``docs/parallel.md``).

``ParallelConfig`` (vLLM's ``--tensor-parallel-size`` / ``--expert-parallel``), ``shard_of`` (which slice of each
parameter a rank holds) and ``load_model_shard`` (a rank's model, read from only its slices of the checkpoint).
"""

from .config import ParallelConfig
from .loading import LoadStats, build_shard, load_model_shard
from .sharding import Shard, shard_of

__all__ = ["LoadStats", "ParallelConfig", "Shard", "build_shard", "load_model_shard", "shard_of"]
