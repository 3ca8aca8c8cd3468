"""The GPU tier's gate (the root conftest.py, ``harness.production.can_run.BackgroundCheck``): can
production run here is asked once per pytest process, in the background; a GPU test that runs
production in this process waits for the answer, a ``gpu_subprocess`` test starts without it, and
its subprocess's 125 is a skip only where that answer says production cannot run."""

from __future__ import annotations

import pathlib
import threading

import pytest

from harness.production import can_run

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def slow_check(monkeypatch):
    """The host check, held until ``release(answer)``: what it would say, or an exception to raise."""
    gate, answer, calls = threading.Event(), {}, []

    def check():
        calls.append(1)
        gate.wait(30)
        if isinstance(answer.get("v"), BaseException):
            raise answer["v"]
        return answer.get("v")

    def release(value):
        answer["v"] = value
        gate.set()
    release.calls = calls
    monkeypatch.setattr(can_run, "cannot_run_production_reason", check)
    yield release
    gate.set()


def test_the_check_runs_in_the_background_once(slow_check):
    bg = can_run.BackgroundCheck()
    assert not bg.started and not bg.done()
    bg.start()
    bg.start()  # once
    assert bg.started and not bg.done()
    slow_check("vLLM does not import: ImportError: x")
    assert bg.reason() == "vLLM does not import: ImportError: x" and bg.done()
    assert bg.reason() == "vLLM does not import: ImportError: x"
    assert len(slow_check.calls) == 1


def test_what_the_check_raised_is_raised_to_whoever_asks(slow_check):
    bg = can_run.BackgroundCheck()
    bg.start()
    slow_check(RuntimeError("CUDA driver initialisation failed"))
    with pytest.raises(RuntimeError, match="CUDA driver"):
        bg.reason()
    bg.wait()


class _Item:
    def __init__(self, *markers):
        self.markers = set(markers)

    def get_closest_marker(self, name):
        return name if name in self.markers else None


@pytest.fixture
def root_conftest(request, monkeypatch):
    """The root conftest as pytest loaded it, its check replaced by a fresh one for the test."""
    mod = request.config.pluginmanager.get_plugin(str(ROOT / "conftest.py"))
    assert mod is not None and hasattr(mod, "_HOST")
    monkeypatch.setattr(mod, "_HOST", can_run.BackgroundCheck())
    return mod


def test_a_subprocess_test_starts_before_the_answer_and_an_in_process_one_waits(root_conftest, slow_check):
    root_conftest._HOST.start()
    root_conftest.pytest_runtest_setup(_Item("gpu", "gpu_subprocess"))  # returns at once
    assert not root_conftest._HOST.done()
    slow_check("GPU capability 8.0: FlashMLA sparse and DeepGEMM need SM90+")
    with pytest.raises(pytest.skip.Exception, match="capability 8.0"):
        root_conftest.pytest_runtest_setup(_Item("gpu"))
    with pytest.raises(pytest.skip.Exception, match="capability 8.0"):  # once known, it gates at once
        root_conftest.pytest_runtest_setup(_Item("gpu", "gpu_subprocess"))
    root_conftest.pytest_runtest_setup(_Item("gpu", "cuda_only"))  # the reference on CUDA: not gated
    root_conftest.pytest_runtest_setup(_Item("slow"))


@pytest.mark.parametrize("answer, code, skipped", [
    ("no CUDA device", 125, True),  # the subprocess could not judge, and this host cannot run production
    (None, 125, False),  # it could not judge on a host that can: the test's to fail
    ("no CUDA device", 1, False),  # any verdict stands
    ("no CUDA device", 0, False),
])
def test_a_subprocess_cannot_judge_is_a_skip_only_where_production_cannot_run(
        answer, code, skipped, root_conftest, slow_check):
    root_conftest._HOST.start()
    slow_check(answer)
    gate = root_conftest.production_gate.__wrapped__()
    if skipped:
        with pytest.raises(pytest.skip.Exception, match=answer):
            gate(code)
    else:
        gate(code)


def test_nothing_waits_where_the_check_never_started(root_conftest, slow_check):
    """No GPU test collected on a GPU host (or none on this host): nothing to wait for, nothing skipped."""
    root_conftest.pytest_runtest_setup(_Item("gpu"))
    root_conftest.production_gate.__wrapped__()(125)
    assert not root_conftest._HOST.started
