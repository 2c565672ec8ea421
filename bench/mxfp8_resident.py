"""Resident bytes of an MXFP8 model against its checkpoint's bytes, at the ``mini`` (128 experts) and ``full`` dims.

MXFP8 bring-up keeps E4M3 weights with their UE8M0 scales on the device (``load_model`` does not dequantise unless
asked, and the MoE / linear kernels read the bytes as stored), so the model should occupy what the checkpoint
stores; a bf16 dequantisation at load would take about twice. Computed on the ``meta`` device from the model
definition and the checkpoint writer's tensor plan (no weights are built); the H200 check of the same on a real
(synthetic) MXFP8 checkpoint is ``tests/test_kernels_moe.py::test_gpu_mxfp8_checkpoint_stays_mxfp8_and_generates``.

  python bench/mxfp8_resident.py        # table + bench/results/mxfp8_resident.json
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_file import RESULTS, write_results  # noqa: E402  (bench/results_file.py)

from m3export.checkpoint.layout import Layout  # noqa: E402
from m3export.checkpoint.loader import build_empty  # noqa: E402
from m3export.checkpoint.writer import planned_tensors  # noqa: E402
from m3export.config import preset  # noqa: E402


def nbytes(dtype: torch.dtype, shape) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def main() -> int:
    rows = []
    for name, cfg in (("mini, 128 experts", dataclasses.replace(preset("mini"), num_local_experts=128).validate()),
                      ("full", preset("full"))):
        n_mtp = cfg.num_mtp_modules
        ckpt = sum(nbytes(dt, shape) for _, dt, shape in planned_tensors(cfg, Layout("original", cfg), "mxfp8",
                                                                          n_mtp))
        resident = {}
        for label, mxfp8 in (("mxfp8", True), ("bf16", False)):
            model = build_empty(cfg, torch.bfloat16, "meta", mxfp8=mxfp8, num_mtp_modules=n_mtp)
            resident[label] = sum(p.numel() * p.element_size() for p in model.parameters())
        rows.append(dict(model=name, checkpoint_bytes=ckpt, resident_mxfp8_bytes=resident["mxfp8"],
                         resident_bf16_bytes=resident["bf16"]))
    write_results(rows, RESULTS / "mxfp8_resident.json")
    print(f"{'model':20} {'checkpoint GB':>14} {'resident MXFP8 GB':>18} {'if dequantised to bf16 GB':>26}")
    for r in rows:
        print(f"{r['model']:20} {r['checkpoint_bytes'] / 1e9:>14.1f} {r['resident_mxfp8_bytes'] / 1e9:>18.1f} "
              f"{r['resident_bf16_bytes'] / 1e9:>26.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
