"""GPU tier: planted bugs in vLLM's MTP speculator fail the engine verdict, named first.

Each mutant of ``harness.production.engine.speculator_mutants`` patches vLLM's V2 speculator
in the engine's own process (``python -m harness.production.engine --case C --mutant M``)
and must exit 1 with a first problem naming the quantity it breaks; the pristine runs
are ``test_engine_mtp.py``. ``python -m harness.production.engine.speculator_mutants`` runs the
same catalogue through ``bisect-check``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness.production.engine.speculator_mutants import MUTANTS

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("name", list(MUTANTS))
def test_speculator_mutant_fails_named_first(name, tmp_path):
    m = MUTANTS[name]
    cmd = [sys.executable, "-m", "harness.production.engine", "--case", m.case, "--mutant", name,
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(proc.stdout[-6000:])
    path = os.path.join(str(tmp_path), f"engine_mtp_{m.case}.json")
    assert os.path.exists(path), f"no report (exit {proc.returncode}); stderr tail:\n{proc.stderr[-3000:]}"
    with open(path) as f:
        rep = json.load(f)
    out = os.environ.get("HYV4_GPU_OUT")
    if out:
        with open(os.path.join(out, "gpu_speculator_mutants.jsonl"), "a") as f:
            f.write(json.dumps({"mutant": name, "exit": proc.returncode, "problems": rep.get("problems", [])[:5]}) + "\n")
    assert proc.returncode == 1, (proc.returncode, rep.get("problems", [])[:3])
    assert m.expect in rep["problems"][0], rep["problems"][:3]
