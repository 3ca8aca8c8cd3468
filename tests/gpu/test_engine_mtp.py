"""GPU tier, engine level: ``vllm.LLM`` with MTP speculative decoding proposes the reference's draft tokens.

    python -m pytest -m gpu tests/gpu/test_engine_mtp.py -s        # -s: the engine's diagnostics live

Each case runs ``python -m harness engine --case ID`` in its own
process (one in-process engine per process: vLLM's distributed state and the
GPU memory it reserves are per process, and the module-level GPU tests of this
session share theirs): a tiny synthetic HY V4 target (dummy weights) + the
harness's seeded MTP weights loaded into the live ``HYV4MTP`` drafter, eager,
greedy generation on token-id prompts (one longer than index_topk), every
draft forward recorded and replayed by the float64 reference. The report JSON
(``engine_mtp_<case>.json``, with ``counts``) goes to ``$HYV4_REPORT_DIR`` when set.
A case the speculator mutants are swept on is judged the same way, from its sweep's
first pristine run (``test_speculator_mutants.py``: one engine built for both).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine_report_checks import check_engine_report  # tests/gpu (pytest's rootdir-relative import)
from harness import case_registry
from harness.production.engine.speculator_mutants import swept_cases

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_subprocess]  # the engine checks the host itself

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 900


@pytest.mark.parametrize("case_id", [c for c in case_registry.ids(kind="engine") if c not in swept_cases()])
def test_engine_draft_tokens_match_reference(case_id, tmp_path, production_gate):
    out = os.environ.get("HYV4_REPORT_DIR") or str(tmp_path)
    cmd = [sys.executable, "-m", "harness", "engine", "--case", case_id, "--out", out]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    print(proc.stdout[-30000:])
    print(proc.stderr[-15000:], file=sys.stderr)
    production_gate(proc.returncode)
    check_engine_report(case_id, out, proc.returncode, proc.stderr)
