"""GPU tier: planted bugs in vLLM's MTP speculator fail the engine verdict, named first.

Per engine case, one process builds the engine once (``python -m harness engine
--case C --sweep``): a pristine generation, then per mutant of
``harness.production.engine.speculator_mutants`` a planted generation (patched in this
process, restored after) and a pristine one again. Each planted run must fail with a first
problem naming the quantity it breaks; each pristine run must pass (so the restore is
checked by the verdict itself). The first pristine run is the case's own engine run, recorded
and reported as ``harness engine --case C`` does, and judged in full here as
``test_engine_mtp.py`` judges the other cases (one engine built for both). One mutant also
runs the way ``bisect-check`` passes it on (``--mutant M``: planted before the engine is
built, its own process, exit 1). ``python -m harness mutants --speculator`` runs the
catalogue through ``bisect-check``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine_report_checks import check_engine_report  # tests/gpu (pytest's rootdir-relative import)
from harness.production.engine.speculator_mutants import MUTANTS, harmless_on, sweep_mutants, swept_cases

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_subprocess]  # each engine checks the host itself

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = swept_cases()


@pytest.fixture
def engine(tmp_path, production_gate):
    """``engine(args, out=tmp_path)``: ``python -m harness engine ARGS --out OUT``, gated (a host
    that cannot run production: a skip)."""
    def run(args: list[str], out=tmp_path) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "harness", "engine", *args, "--out", str(out)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        print(proc.stdout[-6000:])
        production_gate(proc.returncode)
        return proc
    return run


def _evidence(line: dict) -> None:
    out = os.environ.get("HYV4_GPU_OUT")
    if out:
        with open(os.path.join(out, "gpu_speculator_mutants.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")


@pytest.mark.parametrize("case", CASES)
def test_every_mutant_of_a_case_fails_named_first_on_one_engine(case, tmp_path, engine):
    # the pristine run's report and recording join the other engine cases' (the nightly keeps them)
    out = os.environ.get("HYV4_REPORT_DIR") or str(tmp_path)
    proc = engine(["--case", case, "--sweep"], out=out)
    path = os.path.join(out, f"engine_mtp_{case}.sweep.json")
    assert os.path.exists(path), f"no sweep report (exit {proc.returncode}); stderr tail:\n{proc.stderr[-3000:]}"
    with open(path) as f:
        doc = json.load(f)
    for r in doc["runs"]:
        _evidence({"case": case, "sweep": True, **{k: r.get(k) for k in ("label", "mutant", "passed", "ok")},
                   "problems": r["problems"][:3]})
    wanted = sweep_mutants(case)
    assert wanted and [r["mutant"] for r in doc["runs"] if r["mutant"]] == wanted
    assert len([r for r in doc["runs"] if r["mutant"] is None]) == len(wanted) + 1
    for r in doc["runs"]:
        if r["mutant"] is None:
            assert r["passed"], f"{r['label']}: a pristine run on the shared engine fails: {r['problems'][:3]}"
        elif harmless_on(r["mutant"], case):  # a capture-only bug on its eager twin: nothing to catch
            assert r["passed"], f"{r['mutant']}: a capture-only bug fails on eager {case}: {r['problems'][:3]}"
        else:
            assert not r["passed"], f"{r['mutant']} not caught: {r['counts']}"
            assert MUTANTS[r["mutant"]].expect in r["problems"][0], (r["mutant"], r["problems"][:3])
    check_engine_report(case, out, proc.returncode, proc.stderr)  # the first pristine run, in full


def test_a_mutant_planted_before_the_build_exits_1(tmp_path, engine):
    """The path ``bisect-check`` takes (``HYV4_SPECULATOR_MUTANT``: patched before the engine exists)."""
    name = "last-token-index-off-by-one"
    m = MUTANTS[name]
    proc = engine(["--case", m.case, "--mutant", name])
    path = tmp_path / f"engine_mtp_{m.case}.json"
    assert path.exists(), f"no report (exit {proc.returncode}); stderr tail:\n{proc.stderr[-3000:]}"
    rep = json.loads(path.read_text())
    _evidence({"mutant": name, "sweep": False, "exit": proc.returncode, "problems": rep.get("problems", [])[:3]})
    assert proc.returncode == 1, (proc.returncode, rep.get("problems", [])[:3])
    assert m.expect in rep["problems"][0], rep["problems"][:3]


@pytest.mark.parametrize("name,mode", [(n, mode) for n, m in MUTANTS.items() if m.passes_eager
                                       for mode in (("graphs", "eager") if m.at_build else ("graphs",))])
def test_a_capture_only_mutant_fails_in_graph_mode_and_passes_eager(name, mode, tmp_path, engine):
    """Planted before the build (graph capture runs then): the graph-mode case exits 1, its first
    line saying graph replay differs from eager (the eager re-run of the same generation passes);
    the same bug under the eager twin passes. One engine process per item (xdist spreads them).
    The eager half of a bug that patches generation, not capture (not ``at_build``), runs in the
    eager twin's sweep (planted on its live engine, which must pass)."""
    m = MUTANTS[name]
    case = m.case if mode == "graphs" else m.passes_eager
    proc = engine(["--case", case, "--mutant", name])
    path = tmp_path / f"engine_mtp_{case}.json"
    assert path.exists(), f"{case}: no report (exit {proc.returncode}); stderr tail:\n{proc.stderr[-3000:]}"
    rep = json.loads(path.read_text())
    problems = rep.get("problems", [])
    _evidence({"mutant": name, "case": case, "sweep": False, "exit": proc.returncode,
               "drafter_mode": rep.get("drafter_mode"), "graph_replays": rep.get("graph_replays"),
               "eager_rerun_passed": (rep.get("eager_rerun") or {}).get("passed"), "problems": problems[:3]})
    if mode == "graphs":
        assert proc.returncode == 1 and problems and m.expect in problems[0], problems[:3]
    else:
        assert proc.returncode == 0, problems[:3]
