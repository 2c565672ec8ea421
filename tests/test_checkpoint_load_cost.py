"""What one checkpoint load costs beyond the weights: the model is built once and the tensors checked once, and the
finiteness check's temporaries are bounded by a slice, never the size of the tensor (the full checkpoint is 444 GB).

Counts, never timings: calls are counted by wrapping the loader's own names; temporaries by the bytes each torch op
allocates (``torch.profiler`` with ``profile_memory``: CPU allocations made inside each op).
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import m3export
from m3export.checkpoint import loader
from m3export.checkpoint.writer import write_checkpoint
from m3export.config import preset
from m3export.errors import CheckpointError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "c", preset("tiny"), "original", "mxfp8",
                            shard_bytes=100_000, progress=False)


def _counting(monkeypatch, name: str) -> list:
    calls = []
    real = getattr(loader, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(loader, name, counted)
    return calls


@pytest.mark.parametrize("dequantize", [False, True], ids=["mxfp8", "dequantized"])
def test_a_load_builds_the_model_once_and_checks_the_tensors_once(ckpt, monkeypatch, dequantize):
    builds = _counting(monkeypatch, "M3ForCausalLM")
    checks = _counting(monkeypatch, "check_tensors")
    model = m3export.load_model(ckpt, dequantize=dequantize, progress=False)
    assert (len(builds), len(checks)) == (1, 1)
    # the model that was checked on meta is the one that was filled: real, finite weights on the CPU
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model.mxfp8 != dequantize


def _largest_allocation(fn) -> int:
    """The most bytes any single torch op allocated while ``fn`` ran (ops nest: a parent counts its children's
    live allocations, so the largest is at least the largest temporary)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max([e.cpu_memory_usage for e in prof.events()] + [0])


CASES = {
    "float32": lambda n: torch.randn(n),
    "bfloat16": lambda n: torch.randn(n).bfloat16(),
    "float8_e4m3fn": lambda n: torch.randn(n).clamp(-400, 400).to(torch.float8_e4m3fn),
    "ue8m0 scales": lambda n: torch.randint(0, 255, (n,), dtype=torch.uint8),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_check_finite_temporaries_are_bounded_by_a_slice(kind, monkeypatch):
    chunk = 64 << 10
    monkeypatch.setattr(loader, "FINITE_CHUNK_BYTES", chunk)
    t = CASES[kind](1 << 20)
    assert t.numel() * t.element_size() >= 16 * chunk
    # A slice's temporaries are at most one copy in the tensor's dtype (isfinite's |x|) or one byte mask per value,
    # each no larger than the slice itself; a whole-tensor check (the old code) allocated >= 1 MiB here (a
    # full-size mask, and an int64 copy of it for .sum()).
    assert _largest_allocation(lambda: loader.check_finite(t, "t")) <= chunk


def _bad_count(t: torch.Tensor) -> int:
    try:
        loader.check_finite(t, "tensor 'x'")
    except CheckpointError as e:
        assert "tensor 'x' holds" in str(e) and "NaN or infinite value(s)" in str(e)
        return int(str(e).split(" holds ")[1].split()[0])
    return 0


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "row larger than a slice", "scalar"])
def test_check_finite_counts_every_bad_value_once_in_any_layout(layout, monkeypatch):
    monkeypatch.setattr(loader, "FINITE_CHUNK_BYTES", 64)  # 16 float32 values a slice
    base = torch.randn(600)
    base[::7], base[3::11], base[5::13] = float("nan"), float("inf"), -float("inf")
    base = base.view(3, 40, 5)
    t = {"contiguous": base, "transposed": base.transpose(0, 2), "row larger than a slice": base.transpose(1, 2),
         "scalar": base[0, 0, 0]}[layout]
    # oracle: the plain whole-tensor count
    assert _bad_count(t) == int((~torch.isfinite(t)).sum())
    assert int((~torch.isfinite(t)).sum()) > 0


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "uint8"])
def test_check_finite_counts_mxfp8_nan_codes_across_slices(dtype, monkeypatch):
    monkeypatch.setattr(loader, "FINITE_CHUNK_BYTES", 7)  # slices that do not divide the tensor
    codes = torch.randint(0, 255, (50, 3), dtype=torch.uint8)  # 255 excluded: no bad value yet
    if dtype == "float8_e4m3fn":
        codes &= 0x7E  # no S.1111.111 (NaN) code yet
    idx = torch.tensor([0, 11, 12, 149])
    codes.view(-1)[idx] = torch.tensor([0x7F, 0xFF, 0xFF, 0x7F], dtype=torch.uint8) if dtype == "float8_e4m3fn" else 255
    t = codes.view(torch.float8_e4m3fn) if dtype == "float8_e4m3fn" else codes
    assert _bad_count(t) == 4
    assert _bad_count(t.t()) == 4  # non-contiguous: cut along rows
