"""The command line and the project's own promises (pins, exit codes)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

from safetensors.torch import load_file

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)


def run_without_gpu(*args):
    """The same command with every CUDA device hidden (the CPU-only machine's view)."""
    return run(*args, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def test_reference_command_writes_a_trace(tmp_path):
    out = tmp_path / "t.safetensors"
    r = run("reference", "preset:tiny", "--out", str(out), "--steps", "2", "--requests", "2", "--tokens", "3", "--seed", "4")
    assert r.returncode == 0, r.stderr
    assert "reference:" in r.stdout and "draft tokens" in r.stdout
    trace = load_file(str(out))
    assert {"step0.attn.core", "step1.logits", "step1.draft_token", "step0.input_ids"} <= set(trace)
    assert not list(tmp_path.glob(".*tmp"))


def test_reference_command_rejects_bad_input_in_one_line(tmp_path):
    r = run("reference", "preset:nope", "--out", str(tmp_path / "x.safetensors"))
    assert r.returncode == 2
    assert r.stderr.strip() == "error: unknown preset 'nope'; choose one of tiny, small, real-dims"
    r = run("reference", "preset:tiny", "--out", str(tmp_path / "x.safetensors"), "--steps", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_compare_cannot_judge_without_a_gpu():
    r = run_without_gpu("compare")
    assert r.returncode == 125
    assert r.stdout.strip() == "cannot judge: no CUDA device"


def test_pyproject_pins_match_ci_requirements():
    req = {line.split("==")[0]: line.strip() for line in (ROOT / "requirements/ci.txt").read_text().splitlines()
           if line.strip() and not line.startswith("#")}
    text = (ROOT / "pyproject.toml").read_text()
    block = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    deps = re.findall(r'"([^"]+)"', block)
    pinned = {d.split("==")[0]: d for d in deps}
    assert pinned == req
