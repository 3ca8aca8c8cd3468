"""GPU-tier fixtures. Some files here also run on the CPU tier (e.g. test_side_by_side_judge)."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread_without_a_gpu():
    """Where no CUDA device is visible these tests run on the CPU tier: one intra-op thread, as
    tests/cpu/conftest.py sets (tiny tensors; extra threads only spin against the other CI jobs,
    measured 5-10x wall time on 2 busy cores). On a GPU host the thread count is left alone."""
    if torch.cuda.is_available():
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
