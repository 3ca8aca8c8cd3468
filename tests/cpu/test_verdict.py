"""``harness.verdict.Verdict``: the module judge's typed record and its report, whose keys and order
are those the saved reports have always had (reports are compared across runs)."""

from __future__ import annotations

import json

import pytest

from harness import case_registry as reg
from harness.production.judging.fp8_emulation import emulate
from harness.verdict import Verdict

# the module judge's report keys, in order, as side_by_side.json / rejudge.json hold them
REPORT_KEYS = ["case", "quant", "passed", "first_divergent", "table", "rows", "audit", "attach_notes", "step_notes",
               "routing_ties", "router_self_check", "skipped", "layer_policy", "tokens", "timing_s",
               "reference_device", "fp8_kernels", "unquantized_modules", "model_kernel_paths", "regimes", "prod_keys"]


@pytest.fixture(scope="module")
def fp8_verdict() -> Verdict:
    """The module judge's verdict on an FP8 case (its FP8 emulation, CPU), made once for this file."""
    return emulate(reg.specs(kind="module", without="probe")[reg.ids(role="fp8", kind="module")[0]], "deepgemm-e8m0")


def test_the_module_judge_returns_a_verdict_whose_report_keeps_its_keys(fp8_verdict):
    v = fp8_verdict
    assert isinstance(v, Verdict) and v.kind == "module"
    rep = v.to_report()
    assert list(rep) == REPORT_KEYS
    assert rep["passed"] is v.passed and rep["first_divergent"] == v.first_divergent
    assert rep["rows"] is v.rows and rep["regimes"] is v.regimes
    assert v.trace and v.reference and v.trace_compared and v.comparison.results
    json.dumps(rep, default=str)  # JSON-able as written


def test_to_report_writes_the_typed_fields_under_their_keys():
    v = Verdict(kind="module", passed=False, first_divergent="step0.logits", rows=[{"key": "step0.logits"}],
                regimes={"r": 1}, details={"case": {"id": "c"}, "passed": None, "first_divergent": None,
                                           "rows": None, "regimes": None, "extra": 3})
    assert v.to_report() == {"case": {"id": "c"}, "passed": False, "first_divergent": "step0.logits",
                             "rows": [{"key": "step0.logits"}], "regimes": {"r": 1}, "extra": 3}


def test_the_gpu_side_by_side_evidence_line_is_written_from_a_verdict(fp8_verdict, tmp_path, monkeypatch):
    """The GPU test's evidence writer (active with ``HYV4_GPU_OUT``) takes what the judge returns: a
    ``Verdict``, written as its report. Only a GPU run reaches that test otherwise."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "gpu" / "test_side_by_side.py"
    spec = importlib.util.spec_from_file_location("_gpu_test_side_by_side", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "_OUT", str(tmp_path))
    v = fp8_verdict
    mod._record(v)
    line = json.loads((tmp_path / "gpu_side_by_side.jsonl").read_text().splitlines()[-1])
    assert list(line) == [k for k in REPORT_KEYS if not k.startswith("_")]
    assert line["passed"] == v.passed and line["case"]["id"] == v.details["case"]["id"]
