import os

import pytest
import torch

# Two cores on CI: small tensors run fastest on one thread, and tests stay deterministic.
torch.set_num_threads(1)
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(autouse=True)
def _default_dtype():
    old = torch.get_default_dtype()
    yield
    torch.set_default_dtype(old)
