"""Shared by the runtime tests: a float64 tiny model and its cache-free greedy reference.

float64 keeps argmax comparisons away from fp32 rounding ties; ``reference`` recomputes the whole sequence for
every token (``model(ids)``), the oracle that paged, chunked, batched and speculative decoding must equal.
"""

import functools

import pytest
import torch

from m3export.config import preset
from m3export.model import M3ForCausalLM


def tiny_model(num_mtp_modules=None, seed=0) -> M3ForCausalLM:
    torch.manual_seed(seed)
    model = M3ForCausalLM(preset("tiny"), num_mtp_modules=num_mtp_modules).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    return model.double()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def reference(model):
    """Greedy continuation by full recomputation (``model(ids)`` on the whole sequence at every token)."""

    @functools.cache
    def run(prompt: tuple, n: int) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        return ids[len(prompt):]

    return run


def prompts(n, seed, lo=1, hi=40):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (length,), generator=g).tolist() for length in lengths]
