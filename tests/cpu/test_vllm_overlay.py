"""tools/vllm-overlay.sh: a source commit's Python over a release's compiled vLLM package
(the bisect recipe's step on a source tree without a CUDA rebuild)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "tools" / "vllm-overlay.sh"


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


@pytest.fixture
def trees(tmp_path):
    src, rel = tmp_path / "src", tmp_path / "site"
    for d in (src / "vllm" / "sub", src / "csrc", rel / "vllm" / "sub"):
        d.mkdir(parents=True)
    (src / "vllm" / "__init__.py").write_text("X = 1\n")
    (src / "vllm" / "sub" / "gone.py").write_text("")
    (src / "csrc" / "k.cu").write_text("// kernel\n")
    _git(src, "init", "-q")
    _git(src, "add", "-A")
    _git(src, "commit", "-qm", "release")
    _git(src, "tag", "v0.1.0")
    (rel / "vllm" / "__init__.py").write_text("X = 1\n")
    (rel / "vllm" / "sub" / "gone.py").write_text("")
    (rel / "vllm" / "_version.py").write_text("__version__ = version = '0.1.0'\n")
    (rel / "vllm" / "_C.abi3.so").write_bytes(b"\x7fELF compiled")
    return src, rel, tmp_path / "out"


def _run(*args):
    return subprocess.run(["bash", str(OVERLAY), *map(str, args)], capture_output=True, text=True)


def test_python_changes_ride_on_the_release_binaries(trees):
    src, rel, out = trees
    (src / "vllm" / "__init__.py").write_text("X = 2\n")
    (src / "vllm" / "new.py").write_text("Y = 3\n")
    (src / "vllm" / "sub" / "gone.py").unlink()
    _git(src, "add", "-A")
    _git(src, "commit", "-qm", "python only")
    r = _run(src, rel, out)
    assert r.returncode == 0, r.stderr
    assert (out / "vllm" / "__init__.py").read_text() == "X = 2\n"
    assert (out / "vllm" / "new.py").read_text() == "Y = 3\n"
    assert not (out / "vllm" / "sub" / "gone.py").exists()
    assert (out / "vllm" / "_C.abi3.so").read_bytes() == b"\x7fELF compiled"
    assert (rel / "vllm" / "__init__.py").read_text() == "X = 1\n"  # the release stays as it was
    assert not list(out.parent.glob("out.tmp-*"))


def test_a_commit_that_changes_compiled_sources_cannot_be_judged_this_way(trees):
    src, rel, out = trees
    (src / "csrc" / "k.cu").write_text("// changed kernel\n")
    _git(src, "commit", "-qam", "kernel")
    r = _run(src, rel, out)
    assert r.returncode == 125 and "csrc/k.cu" in r.stderr and not out.exists()


@pytest.mark.parametrize("bad", ["src", "rel", "none"])
def test_bad_arguments_are_one_line_exit_2(trees, bad):
    src, rel, out = trees
    args = {"src": (src / "nope", rel, out), "rel": (src, rel / "nope", out), "none": ()}[bad]
    r = _run(*args)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
