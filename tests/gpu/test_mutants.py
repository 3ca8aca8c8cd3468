"""GPU tier: every catalogued mutant of vLLM's HYV4MTP must be caught by the
side-by-side verdict (harness.mutants; ``python -m harness mutants`` runs the
same catalogue as one command with a JSON report)."""

from __future__ import annotations

import json
import os

import pytest

from harness import mutants as M
pytestmark = pytest.mark.gpu  # gated by the root conftest (production must run here)

_OUT = os.environ.get("HYV4_GPU_OUT") or os.environ.get("OUT")
_CONTROLS: dict = {}


def _control(case_id: str) -> dict:
    if case_id not in _CONTROLS:
        _CONTROLS[case_id] = M.run_control(case_id)
    return _CONTROLS[case_id]


@pytest.mark.parametrize("name", [m.name for m in M.CATALOGUE])
def test_mutant_detected(name):
    m = M.BY_NAME[name]
    control = _control(m.case)
    assert control["passed"], f"control run of {m.case} fails unmutated: {control}"
    rec = M.run_mutant(m, control)
    if _OUT:
        os.makedirs(_OUT, exist_ok=True)
        with open(os.path.join(_OUT, "gpu_mutants.jsonl"), "a") as f:
            f.write(json.dumps({k: v for k, v in rec.items() if k != "traceback"}, default=str) + "\n")
    assert rec["outcome"] != "not-applicable", f"{name}: {rec.get('error')}"
    assert rec["detected"], f"{name} missed: {rec}"


@pytest.mark.parametrize("name", [m.name for m in M.GOLDEN_CATALOGUE])
def test_golden_mutant_caught_against_a_host_baseline(name, tmp_path, capsys, monkeypatch):
    """A golden-only planted bug (below the reference tolerance: only a golden or a baseline sees it)
    must make bisect-check exit 1 against a baseline of its case recorded on this host first, and
    must apply: a plant that applies to none of the cases is 125 (NOT JUDGED), never a pass."""
    from harness.cli import main

    m = M.BY_NAME[name]
    monkeypatch.delenv("HYV4_HISTORY", raising=False)
    baseline = tmp_path / "baseline"
    assert main(["bisect-check", "--case", m.case, "--record-baseline", str(baseline)]) == 0, \
        capsys.readouterr().out[-3000:]
    capsys.readouterr()
    code = main(["bisect-check", "--case", m.case, "--baseline", str(baseline), "--plant", name])
    out = capsys.readouterr().out
    assert "plant not applicable" not in out, out[-3000:]
    assert code == 1, out[-4000:]
    assert "first divergent" in out and m.component in out, out[-4000:]
