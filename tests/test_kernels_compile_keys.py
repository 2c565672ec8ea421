"""A kernel's compile-time arguments must not follow a step's exact lengths.

Triton compiles a kernel once per set of ``tl.constexpr`` values. Eager steps (every prefill chunk, every mixed
prefill + decode step, decode batches past the CUDA-graph buckets) pass the block tables of the step, as wide as its
longest sequence, so any constexpr computed from that width (a block count, a split count capped by the context's
tiles) is a new compilation, about a second on the H200, each time a sequence grows into a new value: a 64k-token
prompt prefilled in chunks of 8192 ran at 11.4k tokens/s (2026-12-02, ``bench/decode.py``) against 57k for its
first chunk. Such sizes are runtime arguments; what stays compile-time is rounded to a power of two (a handful of
values over any context).

Each op's launcher runs here on two batches that differ only in their contexts (same tokens, same sequences, block
counts in the same power-of-two bucket) and every kernel launch must get the same compile-time arguments. Under the
Triton interpreter on CPU, compiled on a GPU.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.test_kernels_attention import DEVICE, spy_launches  # sets TRITON_INTERPRET before the kernels import

from m3export.ops import OPS  # noqa: E402
from m3export.ops import conformance as C  # noqa: E402
from m3export.plugins import kernels as K  # noqa: E402

MODULES = ("lightning_indexer", "paged_attention", "sparse_paged_attention", "moe", "moe_mxfp8", "mxfp8_linear",
           "moe_routing", "moe_gemv", "gemv", "_splitk", "_tile_plan")
INDEX = C._attrs(block_size=8, topk=2, local=1, init=1)
PAGE = 4


def _compile_keys(monkeypatch) -> dict:
    """Every kernel of ``MODULES`` spied on from now on (``spy_launches``): {module.kernel: (its constexpr
    parameters, its launches)}."""
    import importlib

    import triton

    spies = {}
    for name in MODULES:
        module = importlib.import_module(f"m3export.plugins.kernels.{name}")
        for attr, kernel in list(vars(module).items()):
            if isinstance(kernel, (triton.runtime.JITFunction, triton.runtime.interpreter.InterpretedFunction)):
                params = inspect.signature(kernel.fn).parameters
                const = [p for p, v in params.items() if "constexpr" in str(v.annotation)]
                spies[f"{name}.{attr}"] = (const, spy_launches(monkeypatch, module, attr))
    return spies


def _launches(spies: dict, op: str, build, dtype=torch.bfloat16) -> dict:
    """{module.kernel: the set of its launches' constexpr arguments} of one run of ``op`` on ``build``'s inputs."""
    case = C.Case(f"compile-keys-{id(build)}", op, frozenset(), build)
    inputs, attrs = case.inputs(dtype, DEVICE)
    for _, seen in spies.values():
        seen.clear()
    K.kernels()[OPS[op]](*inputs, **attrs)
    return {name: {tuple((c, launch[c]) for c in const if c in launch) for launch in seen}
            for name, (const, seen) in spies.items() if seen}


# (contexts after the step, new tokens) pairs: the same tokens and sequences; the second's contexts are longer but
# their block tables' blocks pad to the same power of two as the first's (``PagedBatch``: tables of the longest
# sequence's pages + 2; longest 36 or 40 -> 11 or 12 pages of 4 -> 6 blocks of 8; 52 -> 15 pages -> 8 blocks)
STEPS = {
    "prefill-chunk": (([40], [8]), ([52], [8])),
    "decode": (([36, 30, 20], [1, 1, 1]), ([52, 50, 41], [1, 1, 1])),
    "mixed": (([40, 9, 21], [6, 1, 1]), ([52, 12, 30], [6, 1, 1])),
}
BUILDERS = {
    "LightningIndexer": lambda ctx, new: C._indexer_case(ctx, new, PAGE, INDEX),
    "PagedAttention": lambda ctx, new: C._attention_case(ctx, new, PAGE),
    "SparsePagedAttention": lambda ctx, new: C._sparse_case(ctx, new, PAGE, INDEX, "indexer"),
}


@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("op", sorted(BUILDERS))
def test_longer_contexts_compile_nothing_new(monkeypatch, op, step):
    spies = _compile_keys(monkeypatch)
    (ctx_a, new_a), (ctx_b, new_b) = STEPS[step]
    a = _launches(spies, op, BUILDERS[op](ctx_a, new_a))
    b = _launches(spies, op, BUILDERS[op](ctx_b, new_b))
    assert a, f"{op}: no kernel launch was seen (the spy missed the launcher's kernels)"
    assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}


def test_the_check_sees_a_length_in_a_compile_time_argument(monkeypatch):
    """The spy reads what the compiler keys on: a block count passed as a constexpr (as the block top-k's was
    before 2026-12-02) differs between the two contexts of a step above."""
    spies = _compile_keys(monkeypatch)
    a = _launches(spies, "LightningIndexer", BUILDERS["LightningIndexer"](*STEPS["decode"][0]))
    keys = dict(next(iter(a["lightning_indexer._block_topk"])))
    assert keys["NB_PAD"] == 8 and "NB" not in keys  # NB: a runtime argument
    spies["lightning_indexer._block_topk"][0].append("NB")  # as if NB were compile-time again
    a = _launches(spies, "LightningIndexer", BUILDERS["LightningIndexer"](*STEPS["decode"][0]))
    b = _launches(spies, "LightningIndexer", BUILDERS["LightningIndexer"](*STEPS["decode"][1]))
    assert a["lightning_indexer._block_topk"] != b["lightning_indexer._block_topk"]


@pytest.mark.parametrize("op, build", [
    ("MoE", lambda t: C._moe_case(2, t)),
    ("MoEMXFP8", lambda t: C._moe_mxfp8_case(2, t)),
    ("MXFP8Linear", lambda t: C._mxfp8_linear_case((t,), 64, 64)),
])
def test_a_chunk_one_token_shorter_compiles_nothing_new(monkeypatch, op, build):
    """A prompt's last chunk is shorter than the others: the token count is a runtime size too."""
    spies = _compile_keys(monkeypatch)
    assert _launches(spies, op, build(8)) == _launches(spies, op, build(7))
