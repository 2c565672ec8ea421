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
from tests.export_fixtures import fp8_artifact, mxfp8_artifact, mxfp8_checkpoint, tiny_artifact  # noqa: E402,F401


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_zero_scales_from_other_tests(monkeypatch):
    """Scale bytes 0 that one test's loads record (``mxfp8.note_zero_scales``, process-wide: the MXFP8 kernels then
    leave ``tl.dot_scaled``) must not steer another test's kernels: each test starts with a clean record."""
    from m3export.ops import mxfp8

    monkeypatch.setattr(mxfp8, "_zero_scales", {})
