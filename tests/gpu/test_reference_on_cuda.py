"""The reference on CUDA (float64) equals the reference on CPU up to float64
summation order (cuBLAS vs CPU BLAS)."""

from __future__ import annotations

import pytest
import torch

from harness import case_registry
from reference import EXACT, draft

pytestmark = [pytest.mark.gpu, pytest.mark.cuda_only]  # torch + CUDA only: runs on a GPU host without vLLM


def test_reference_cuda_equals_cpu():
    case = case_registry.spec("tiny-moe-sink-elementwise", kind="reference")
    cfg, w, first = case.config(), case.weights(), case.first_step()
    cpu = draft(cfg, w, first, case.steps, EXACT)
    gpu = draft(cfg, {k: v.cuda() for k, v in w.items()}, first.to("cuda"), case.steps, EXACT)
    assert torch.equal(gpu.tokens.cpu(), cpu.tokens)
    for k, tr in enumerate(cpu.traces):
        for name, v in tr.items():
            # float64 with different reduction orders: ~1e-15 relative; 1e-9 leaves room
            # for the fp8 re-gridding to stay identical (it does when inputs agree to 1e-15).
            torch.testing.assert_close(gpu.traces[k][name].cpu(), v, rtol=1e-9, atol=1e-9, msg=f"step{k}.{name}")


@pytest.mark.parametrize("case_id", ["tiny-moe-sink-elementwise", "tiny-share-indexer"])
def test_side_by_side_replay_on_cuda_equals_cpu(case_id):
    """The side by side's replay (harness.production.judging.teacher_forcing, on the GPU by default where one is
    present) gives the CPU replay's trace to float64 rounding, on a trace laid out as
    production's (inputs, hidden states and top-k rows of a reference run)."""
    from reference import flatten

    from harness.production.judging.teacher_forcing import replay

    case = case_registry.spec(case_id, kind="reference")
    cfg, w, first = case.config(), case.weights(), case.first_step()
    prod = flatten(draft(cfg, w, first, case.steps, EXACT))
    cpu = replay(cfg, w, prod, first, case.steps, EXACT, device="cpu")
    gpu = replay(cfg, w, prod, first, case.steps, EXACT, device="cuda")
    assert set(gpu) == set(cpu)
    for k, v in cpu.items():
        assert gpu[k].device.type == "cpu"
        # the same rounding argument as above: float64 reduction order only
        torch.testing.assert_close(gpu[k], v, rtol=1e-9, atol=1e-9, msg=k)
