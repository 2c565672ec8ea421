"""The expert-parallel path of the MoE kernels (``run_moe(..., owned=...)``) against the references.

Two ranks are simulated in one process (no collectives needed: the all-reduce is a sum): each gets its experts
and its tensor-parallel slice of the shared expert, and its output must equal the reference's partial sum for the
same experts (``m3export.ops.moe._moe`` with ``owned``); the two partials must add up to the whole MoE. On a
machine without CUDA the kernels run under the Triton interpreter (``tests/conftest.py``) at tiny sizes.

Tolerance: fp32 activations, the kernels and the references do the same fp32 products and differ only in the
order of the sums (K <= 64 here, top_k + 1 expert outputs): 1e-5 of the output's largest magnitude, as
``tests/test_kernels_moe.py`` argues.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="the kernels need triton (the [gpu] extra)")

from m3export.ops import mxfp8  # noqa: E402
from m3export.ops.moe import _moe, moe_reference  # noqa: E402
from m3export.plugins.kernels.moe import run_moe  # noqa: E402

INTERPRETED = bool(triton.knobs.runtime.interpret)
ALPHA, LIMIT, SCALING, TOP_K = 1.702, 7.0, 2.0, 2
T, H, I, IS, E, RANKS = 5, 64, 32, 64, 8, 2


def weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) / s[-1] ** 0.5  # noqa: E731
    return dict(x=torch.randn(T, H, generator=g), router=torch.randn(E, H, generator=g),
                bias=0.05 * torch.randn(E, generator=g), w13=r(E, 2 * I, H), w2=r(E, H, I), s13=r(2 * IS, H),
                s2=r(H, IS))


def rank_slices(w: dict, rank: int) -> dict:
    """Experts [rank * E/2, (rank + 1) * E/2); the shared expert's gate and up rows and down columns of the rank."""
    n, k = E // RANKS, IS // RANKS
    rows = torch.cat([torch.arange(rank * k, (rank + 1) * k), IS + torch.arange(rank * k, (rank + 1) * k)])
    return dict(w13=w["w13"][rank * n:(rank + 1) * n], w2=w["w2"][rank * n:(rank + 1) * n], s13=w["s13"][rows],
                s2=w["s2"][:, rank * k:(rank + 1) * k], owned=(rank * n, n))


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def device_or_skip(device: str) -> str:
    if device == "cpu" and not INTERPRETED:
        pytest.skip("TRITON_INTERPRET=0 in this process: CPU tensors cannot run the kernels")
    if device == "cuda" and (INTERPRETED or not torch.cuda.is_available()):
        pytest.skip("needs CUDA and compiled kernels (TRITON_INTERPRET unset)")
    return device


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("quantized", [False, True])
def test_owned_experts_give_the_ranks_partial_sums(quantized, device):
    w = {k: v.to(device_or_skip(device)) for k, v in weights().items()}
    if quantized:  # values E4M3 + UE8M0 can hold exactly: quantising a rank's slice again is lossless
        for key in ("w13", "w2", "s13", "s2"):
            w[key] = mxfp8.dequantize(*mxfp8.quantize(w[key]), torch.float32)
    partials = []
    for rank in range(RANKS):
        sl = rank_slices(w, rank)
        lo, n = sl["owned"]
        tensors = [sl[k] for k in ("w13", "w2", "s13", "s2")]
        if quantized:
            pairs = [mxfp8.quantize(t) for t in tensors]
            args, scales = tuple(q for q, _ in pairs), tuple(s for _, s in pairs)
        else:
            args, scales = tuple(tensors), (None,) * 4
        got = run_moe(w["x"], w["router"], w["bias"], *args, TOP_K, SCALING, ALPHA, LIMIT, scales=scales,
                      owned=(lo, n))
        want = _moe(w["x"], w["router"], w["bias"], lambda e: (sl["w13"][e - lo], sl["w2"][e - lo]),
                    lambda: (sl["s13"], sl["s2"]), TOP_K, SCALING, ALPHA, LIMIT, owned=range(lo, lo + n))
        close(got, want)
        partials.append(got)
    whole = moe_reference(w["x"], w["router"], w["bias"], w["w13"], w["w2"], w["s13"], w["s2"], TOP_K, SCALING,
                          ALPHA, LIMIT)
    close(partials[0] + partials[1], whole)
    assert partials[0].abs().max() > 0 and partials[1].abs().max() > 0


def test_owned_must_match_the_expert_stack():
    w = weights()
    with pytest.raises(ValueError, match="owned experts"):
        run_moe(w["x"], w["router"], w["bias"], w["w13"][:4], w["w2"][:4], w["s13"], w["s2"], TOP_K, SCALING, ALPHA,
                LIMIT, owned=(6, 4))
