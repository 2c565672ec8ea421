import os

import pytest
import torch

os.environ.setdefault("TQDM_DISABLE", "1")
if not torch.cuda.is_available():
    # Triton kernels imported from here on run in Triton's interpreter on CPU tensors (the conformance suite's
    # triton-interpret implementation); on a GPU machine they compile for the device.
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)  # the CI machine has 2 cores; one thread per test process is fastest there

# Session fixtures shared by every module from here, so each artifact is exported once per run (a module that
# imports a fixture function gets its own copy, exported again).
from tests.export_fixtures import (  # noqa: E402,F401
    bf16_artifact, fp8_artifact, fp16_trt_artifact, mxfp8_artifact, mxfp8_checkpoint, tiny_artifact, vl_artifact)


def pytest_addoption(parser):
    group = parser.getgroup("m3export kernels")
    group.addoption("--sparse-prefill", metavar="VARIANT",
                    help="run sparse-attention prefill launches that name no setting with "
                         "sparse_paged_attention.VARIANTS['prefill'][VARIANT] instead of the defaults (16-bit and FP8 "
                         "activations), to check a candidate with the GPU tests before it becomes the default")
    group.addoption("--sparse-prefill-fp32", metavar="VARIANT",
                    help="the same for fp32 activations (the `mini` model tests' dtype; FP32_PREFILL)")


_PREFILL_OPTIONS = {"--sparse-prefill": "prefill", "--sparse-prefill-fp32": "fp32"}


def pytest_configure(config):
    """An unknown ``--sparse-prefill(-fp32)`` name stops the run before any test, naming the known ones."""
    names = {o: config.getoption(o) for o in _PREFILL_OPTIONS}
    if any(names.values()):
        from m3export.plugins.kernels import sparse_paged_attention as spa

        for option, name in names.items():
            if name is not None and name not in spa.VARIANTS["prefill"]:
                raise pytest.UsageError(f"{option} {name!r}: not a sparse_paged_attention.VARIANTS['prefill'] name; "
                                        f"known: {', '.join(spa.VARIANTS['prefill'])}")


@pytest.fixture(autouse=True)
def _sparse_prefill_setting(request, monkeypatch):
    """``--sparse-prefill`` / ``--sparse-prefill-fp32``: the named VARIANTS entry for every prefill launch of that
    dtype class that names no setting, whatever the launch's size."""
    names = {kind: request.config.getoption(o) for o, kind in _PREFILL_OPTIONS.items()}
    if not any(names.values()):
        return
    from m3export.plugins.kernels import sparse_paged_attention as spa

    for kind, name in names.items():
        if name is None:
            continue
        setting = dict(spa.VARIANTS["prefill"][name])
        if kind == "fp32":
            monkeypatch.setattr(spa, "FP32_PREFILL", setting)
        else:
            monkeypatch.setitem(spa.DEFAULTS, "prefill", setting)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_zero_scales_from_other_tests(monkeypatch):
    """Scale bytes 0 that one test's loads record (``mxfp8.note_zero_scales``, process-wide: the MXFP8 kernels then
    leave ``tl.dot_scaled``) must not steer another test's kernels: each test starts with a clean record."""
    from m3export.ops import mxfp8

    monkeypatch.setattr(mxfp8, "_zero_scales", {})
