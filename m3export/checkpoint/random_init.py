"""Deterministic random weights, one tensor at a time.

Each parameter's values depend only on (seed, parameter name), never on the order tensors are produced in, so
a preset model built in memory and a synthetic checkpoint written shard by shard hold identical weights.
Norm weights are random offsets too (the release stores them as offsets from one; all-zero would hide bugs).
"""

from __future__ import annotations

import math
import zlib

import torch


def random_parameter(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """fp32 values for parameter ``name`` with a scale that keeps activations O(1) through the network."""
    g = torch.Generator().manual_seed((zlib.crc32(name.encode()) * 1_000_003 + seed) % (2**63))
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name:
        std = 0.2
    elif leaf == "e_score_correction_bias":
        std = 0.05
    elif "embed_tokens" in name:
        std = 1.0
    else:
        std = 1.0 / math.sqrt(shape[-1])
    return torch.randn(shape, generator=g) * std
