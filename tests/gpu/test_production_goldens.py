"""Production goldens: vLLM's trace now vs the one recorded on a known-good
vLLM on this platform (GPU model, torch, CUDA, vLLM)."""

from __future__ import annotations

import warnings

import pytest

from harness.production.goldens.goldens_gpu import GOLDEN_CASES, check_production_golden, has_golden, platform, record
from harness.production.cases import GPU_CASES
from harness.production.module.side_by_side import run_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case_id", GOLDEN_CASES)
def test_production_matches_its_golden(case_id, update_goldens):
    if not update_goldens and not has_golden(case_id):
        pytest.skip(f"no golden for this platform {platform()} (record one with --update-goldens): {case_id}")
    result = run_case(GPU_CASES[case_id])
    if update_goldens:
        record(case_id, result["_prod"])
        pytest.fail(f"production golden {case_id} rewritten: review `git diff goldens/`")
    report = check_production_golden(case_id, result["_prod"])
    if report.meta.get("stale"):
        warnings.warn(f"{case_id}: {report.meta['stale']}")
    assert report.passed, report.table()
