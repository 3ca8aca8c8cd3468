"""Production goldens: vLLM's trace now vs the one recorded on a known-good vLLM on this platform
(GPU model, compute capability, torch, CUDA; any vLLM version: the golden names the one it was
recorded with). A golden missing for this platform is NOT JUDGED: a skip that says so, or with
``--require-goldens`` (.ci/gpu-nightly) a failure, never a pass."""

from __future__ import annotations

import pytest

from harness import case_registry
from harness.goldens import store
from harness.goldens.platform_key import describe_vllm
from harness.goldens.production import PRODUCTION, absent_reason, not_judged_line
from harness.production.module.side_by_side import run_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case_id", case_registry.ids(role="golden", kind="module"))
def test_production_matches_its_golden(case_id, update_goldens, require_goldens):
    why = None if update_goldens else absent_reason(case_id)
    if why is not None:
        line = not_judged_line("golden", case_id, why) + " (record one on purpose: --update-goldens)"
        if require_goldens:
            pytest.fail(line)
        pytest.skip(line)
    result = run_case(case_registry.spec(case_id, kind="module"))
    checked = store.check(PRODUCTION, case_id, result.trace, regen=update_goldens)
    if checked.regenerated:
        pytest.fail(f"production {checked.message}")
    report = checked.report
    recorded = f"golden recorded with {describe_vllm(report.meta.get('recorded_with'))}"
    assert checked.passed, f"{checked.message}\n{recorded}\n{report.table()}"
    if report.meta.get("stale"):  # the judged components passed; the rest of the golden was not judged
        line = not_judged_line("golden", case_id, report.meta["stale"])
        if require_goldens:
            pytest.fail(line)
        pytest.skip(line)
