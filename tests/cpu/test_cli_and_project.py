"""The command line and the project's own promises (pins, exit codes).

Two commands run as real ``python -m harness`` subprocesses (the entry point, the
one-line-no-traceback contract, a GPU hidden by CUDA_VISIBLE_DEVICES); the rest
call ``harness.cli.main(argv)`` in process (what ``python -m harness`` runs), each
import of torch and the harness in a subprocess costing seconds of CPU.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file

from harness.cli import main as cli_main

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)


def run_without_gpu(*args):
    """The same command with every CUDA device hidden (the CPU-only machine's view)."""
    return run(*args, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


@pytest.fixture
def cli(capsys):
    """``cli(*args)``: ``harness.cli.main(args)`` in process -> .returncode, .stdout, .stderr
    (argparse's own exit counts as the return code)."""
    def call(*args):
        capsys.readouterr()
        try:
            code = cli_main([str(a) for a in args])
        except SystemExit as exc:
            code = exc.code
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)
    return call


@pytest.fixture
def cli_without_gpu(cli, monkeypatch):
    """``cli`` where torch sees no CUDA device (what CUDA_VISIBLE_DEVICES="" gives a process)."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return cli


def test_reference_command_writes_a_trace(tmp_path, cli):
    out = tmp_path / "t.safetensors"
    r = cli("reference", "preset:tiny", "--out", str(out),
            "--steps", "2", "--requests", "2", "--tokens", "3", "--seed", "4")
    assert r.returncode == 0, r.stderr
    assert "reference:" in r.stdout and "draft tokens" in r.stdout
    trace = load_file(str(out))
    assert {"step0.attn.core", "step1.logits", "step1.draft_token", "step0.input_ids"} <= set(trace)
    assert not list(tmp_path.glob(".*tmp"))


def test_reference_command_rejects_bad_input_in_one_line(tmp_path, cli):
    r = run("reference", "preset:nope", "--out", str(tmp_path / "x.safetensors"))  # the real entry point
    assert r.returncode == 2
    assert r.stderr.strip() == "error: unknown preset 'nope'; choose one of tiny, small, real-dims"
    r = cli("reference", "preset:tiny", "--out", str(tmp_path / "x.safetensors"), "--steps", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    # bad input is 2 before a device is asked about (was 125 on a host without CUDA)
    r = run("reference", "preset:tiny", "--out", str(tmp_path / "x.safetensors"), "--device", "cuda", "--steps", "0")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --steps, --requests, --tokens and --tp must be >= 1"
    assert not (tmp_path / "x.safetensors").exists()


def test_compare_cannot_judge_without_a_gpu():
    r = run_without_gpu("compare")
    assert r.returncode == 125
    assert r.stdout.strip() == "cannot judge: no CUDA device"


def test_compare_takes_a_checkpoint_directory_and_tp(tmp_path, cli_without_gpu):
    cli = cli_without_gpu  # in process, torch seeing no CUDA device
    ckpt = tmp_path / "ckpt"
    assert cli("synth", str(ckpt), "--preset", "tiny").returncode == 0
    # valid input, no GPU: cannot judge (after the arguments were checked)
    r = cli("compare", str(ckpt), "--steps", "2")
    assert r.returncode == 125 and r.stdout.strip() == "cannot judge: no CUDA device", r.stdout + r.stderr
    r = cli("compare", str(ckpt), "--tp", "2")
    assert r.returncode == 125, r.stdout + r.stderr
    # bad input: exit 2, one line naming the culprit, before any GPU question
    r = cli("compare", str(ckpt), "--tp", "3")
    assert r.returncode == 2 and "--tp 3 does not divide num_attention_heads 4" in r.stderr, r.stderr
    (tmp_path / "empty").mkdir()
    r = cli("compare", str(tmp_path / "empty"))
    assert r.returncode == 2 and "not a checkpoint directory (no config.json)" in r.stderr, r.stderr
    fp8 = tmp_path / "fp8"
    assert cli("synth", str(fp8), "--preset", "small", "--quant", "fp8").returncode == 0
    r = cli("compare", str(fp8), "--tp", "4")  # small: 8 heads; FP8 shards of 64 at TP=4
    assert r.returncode == 2 and "FP8 128x128 blocks need" in r.stderr, r.stderr


def test_pyproject_pins_match_ci_requirements():
    req = {line.split("==")[0]: line.strip() for line in (ROOT / "requirements/ci.txt").read_text().splitlines()
           if line.strip() and not line.startswith("#")}
    text = (ROOT / "pyproject.toml").read_text()
    block = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    deps = re.findall(r'"([^"]+)"', block)
    pinned = {d.split("==")[0]: d for d in deps}
    assert pinned == req
