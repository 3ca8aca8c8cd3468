"""GPU tier: ``python -m harness autobisect`` names a planted upstream regression by itself.

A vLLM source tree is built from the installed release's own Python files (one commit, tagged
``v<version>`` as the overlay expects), then four commits on top: three harmless ones (comments, a
new module nothing imports) and, third, a planted regression of our own in HYV4MTP's forward
(the ``hnorm`` output scaled by 1 + 2^-4 before ``eh_proj``: every draft step's hidden input
moves, the kind of slip a refactor of the MTP input path ships). A host baseline is recorded at
the release, then autobisect runs the real chain at each step: ``tools/vllm-overlay.sh`` over
the installed package (its compiled extensions reused) and ``bisect-check --baseline`` on one
side-by-side case. It must name the planted commit and a first divergent component, record every
step in the history, and leave the source tree as it was. Run it under each supported release
(its own PATH); about 1-2 minutes (a 0.9 GB overlay copy and one bisect-check per step).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_subprocess]

ROOT = Path(__file__).resolve().parents[2]
CASE = "tiny-k2-long"  # one side-by-side case of the bisect set: enough for a bug in HYV4MTP.forward
PLANTED_FROM = "previous_hidden_states = self.hnorm(previous_hidden_states)\n"
PLANTED_TO = "previous_hidden_states = self.hnorm(previous_hidden_states) * 1.0625\n"


def _git(repo, *args) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="hyv4", GIT_AUTHOR_EMAIL="hyv4@localhost", GIT_COMMITTER_NAME="hyv4",
               GIT_COMMITTER_EMAIL="hyv4@localhost")
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def _commit(repo, message: str) -> str:
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


def _source_tree(tmp_path) -> tuple[Path, str, str, dict]:
    """(tree, release tag, site, {step: sha}) with the planted regression among harmless commits."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    pkg = Path(list(spec.submodule_search_locations)[0])
    site = str(pkg.parent)
    import vllm
    tag = "v" + vllm.__version__.split("+")[0]
    src = tmp_path / "vllm-src"
    for py in pkg.rglob("*.py"):
        if "__pycache__" in py.parts:
            continue
        dest = src / "vllm" / py.relative_to(pkg)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(py, dest)
    subprocess.run(["git", "init", "-q", "-b", "main", str(src)], check=True)
    shas = {"release": _commit(src, f"vLLM {vllm.__version__} as installed")}
    _git(src, "tag", tag)
    mtp = src / "vllm" / "models" / "hy_v4" / "nvidia" / "mtp.py"
    text = mtp.read_text()
    assert text.count(PLANTED_FROM.strip()) == 1, f"{mtp}: the line the regression is planted on is not there once"
    with open(mtp, "a") as f:
        f.write("\n# harmless: a comment at the end of the file\n")
    shas["harmless-1"] = _commit(src, "mtp: a comment")
    model = src / "vllm" / "models" / "hy_v4" / "nvidia" / "model.py"
    model.write_text(model.read_text() + "\n# harmless: another comment\n")
    shas["harmless-2"] = _commit(src, "model: a comment")
    mtp.write_text(mtp.read_text().replace(PLANTED_FROM.strip(), PLANTED_TO.strip()))
    shas["planted"] = _commit(src, "mtp: scale the hidden-state input (planted regression)")
    # last: the bad end autobisect checks first, then git bisect needs two more steps (3 in all)
    (src / "vllm" / "_hyv4_unused.py").write_text('"""Nothing imports this module."""\n')
    shas["harmless-3"] = _commit(src, "add an unused module")
    return src, tag, site, shas


def test_autobisect_names_the_planted_commit(tmp_path, production_gate):
    src, tag, site, shas = _source_tree(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("HYV4_HISTORY", None)
    baseline = tmp_path / "baseline"
    rec = subprocess.run([sys.executable, "-m", "harness", "bisect-check", "--record-baseline", str(baseline),
                          "--case", CASE], cwd=ROOT, env=env, capture_output=True, text=True)
    production_gate(rec.returncode)
    assert rec.returncode == 0, rec.stdout[-3000:] + rec.stderr[-3000:]
    hist, report = tmp_path / "history.sqlite", tmp_path / "autobisect.json"
    run = subprocess.run([sys.executable, "-m", "harness", "autobisect", "--source", str(src), "--good", tag,
                          "--bad", "main", "--release-site", site, "--release-tag", tag, "--baseline", str(baseline),
                          "--case", CASE, "--history", str(hist), "--report", str(report),
                          "--work", str(tmp_path / "work")], cwd=ROOT, env=env, capture_output=True, text=True)
    print(run.stdout[-6000:])
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-3000:]
    doc = json.loads(report.read_text())
    assert doc["culprit"] == shas["planted"], doc
    assert doc["first_divergent"], doc  # the culprit's step named the component and its numbers
    assert f"culprit: {shas['planted']} mtp: scale the hidden-state input" in run.stdout
    with sqlite3.connect(hist) as c:
        steps = c.execute("SELECT vllm_commit, exit_code FROM runs WHERE kind = 'autobisect-step'").fetchall()
        rows = c.execute("SELECT count(*) FROM components").fetchone()[0]
    assert dict(steps)[shas["planted"]] == 1 and all(code in (0, 1) for _, code in steps), steps
    assert rows > 0
    assert _git(src, "rev-parse", "HEAD") == shas["harmless-3"]
    assert _git(src, "symbolic-ref", "--short", "HEAD") == "main"
    print(f"autobisect: {len(doc['steps'])} steps, {doc['seconds_per_step']} s per step, {doc['seconds']} s in all")
    # the seconds per step, kept where the tier keeps its reports (nightly: OUT_DIR/tier/reports), so
    # every GPU tier measures them (benchmarks/bench_autobisect.py --gpu runs this test alone)
    out = os.environ.get("HYV4_REPORT_DIR", "").strip()
    if out:
        import vllm

        from harness.atomic import atomic_write_json
        atomic_write_json(os.path.join(out, "autobisect_gpu.json"),
                          {"vllm": vllm.__version__, "steps": len(doc["steps"]),
                           "seconds_per_step": doc["seconds_per_step"], "seconds": doc["seconds"],
                           "per_step": doc["steps"]}, default=str)
