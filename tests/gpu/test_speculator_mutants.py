"""GPU tier: planted bugs in vLLM's MTP speculator fail the engine verdict, named first.

Per engine case, one process builds the engine once (``python -m harness engine
--case C --sweep``): a pristine generation, then per mutant of
``harness.production.engine.speculator_mutants`` a planted generation (patched in this
process, restored after) and a pristine one again. Each planted run must fail with a first
problem naming the quantity it breaks; each pristine run must pass (so the restore is
checked by the verdict itself). One mutant also runs the way ``bisect-check`` passes it on
(``--mutant M``: planted before the engine is built, its own process, exit 1). The
pristine cases are ``test_engine_mtp.py``; ``python -m harness mutants --speculator`` runs
the catalogue through ``bisect-check``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness.production.engine.speculator_mutants import MUTANTS

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_subprocess]  # each engine checks the host itself

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = sorted({m.case for m in MUTANTS.values() if not m.at_build})


@pytest.fixture
def engine(tmp_path, production_gate):
    """``engine(args)``: ``python -m harness engine ARGS --out tmp_path``, gated (a host
    that cannot run production: a skip)."""
    def run(args: list[str]) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "harness", "engine", *args, "--out", str(tmp_path)]
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
    proc = engine(["--case", case, "--sweep"])
    path = tmp_path / f"engine_mtp_{case}.sweep.json"
    assert path.exists(), f"no sweep report (exit {proc.returncode}); stderr tail:\n{proc.stderr[-3000:]}"
    doc = json.loads(path.read_text())
    for r in doc["runs"]:
        _evidence({"case": case, "sweep": True, **{k: r.get(k) for k in ("label", "mutant", "passed", "ok")},
                   "problems": r["problems"][:3]})
    wanted = [n for n, m in MUTANTS.items() if m.case == case and not m.at_build]
    assert [r["mutant"] for r in doc["runs"] if r["mutant"]] == wanted
    assert len([r for r in doc["runs"] if r["mutant"] is None]) == len(wanted) + 1
    for r in doc["runs"]:
        if r["mutant"] is None:
            assert r["passed"], f"{r['label']}: a pristine run on the shared engine fails: {r['problems'][:3]}"
        else:
            assert not r["passed"], f"{r['mutant']} not caught: {r['counts']}"
            assert MUTANTS[r["mutant"]].expect in r["problems"][0], (r["mutant"], r["problems"][:3])
    assert proc.returncode == 0, proc.returncode


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
                                       for mode in ("graphs", "eager")])
def test_a_capture_only_mutant_fails_in_graph_mode_and_passes_eager(name, mode, tmp_path, engine):
    """Planted before the build (graph capture runs then): the graph-mode case exits 1, its first
    line saying graph replay differs from eager (the eager re-run of the same generation passes);
    the same bug under the eager twin passes. One engine process per item (xdist spreads them)."""
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
