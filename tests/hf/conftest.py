"""HF cross-check tier (tests/hf, `pytest -m hf` in the requirements/hf.txt env)."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tiny tensors: intra-op threads only spin against other jobs on the 2 CI cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
