"""CPU tier fixtures."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tiny tensors: intra-op threads only spin against the other CI jobs (3-5x wall time on 2 busy cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
