import os

import pytest
import torch

os.environ.setdefault("TQDM_DISABLE", "1")
torch.set_num_threads(1)  # the CI machine has 2 cores; one thread per test process is fastest there


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
