"""Mutation tests on CPU: vLLM's pure functions patched in process must be
flagged by the harness's reference-vs-vLLM cross-checks, and the catalogue
(``python -m harness mutants --list``) must be complete."""

from __future__ import annotations

import pytest

from harness import mutants as M
from harness.cli import main as cli_main


def test_catalogue_entries_complete():
    from harness.production.side_by_side import PRODUCTION_COMPONENTS

    assert len(M.CATALOGUE) >= 25
    assert len(M.BY_NAME) == len(M.CATALOGUE), "mutant names must be unique"
    for m in M.CATALOGUE:
        assert m.stands_for and m.component and m.case and callable(m.apply), m.name
        assert m.component in PRODUCTION_COMPONENTS, (m.name, m.component)
        assert M.case_by_id(m.case).id == m.case
        assert (m.cpu_apply is None) == (m.cpu_check is None), m.name
    groups = {m.group for m in M.CATALOGUE}
    assert {"loading", "attention", "indexer", "moe", "multistep", "tp"} <= groups


def test_list_subcommand(capsys):
    assert cli_main(["mutants", "--list"]) == 0
    out = capsys.readouterr().out
    for m in M.CATALOGUE:
        assert m.name in out


def test_unknown_mutant_is_usage_error(capsys):
    assert cli_main(["mutants", "--only", "no-such-mutant"]) == 2


def test_cannot_run_is_125(monkeypatch, capsys):
    from harness import runtime

    monkeypatch.setattr(runtime, "cannot_run_production_reason", lambda: "no CUDA device (test)")
    assert cli_main(["mutants", "--only", "sink-twice"]) == 125


vllm = pytest.importorskip("vllm", reason="vLLM is not installed")

CPU_MUTANTS = [m for m in M.CATALOGUE if m.cpu_apply is not None]


def _check(kind: str) -> list[str]:
    if kind == "rope":
        return M.rope_cross_check("default") + M.rope_cross_check("deepseek_yarn")
    return M.routing_cross_check(seed=0) + M.routing_cross_check(seed=1, experts=16, topk=4)


@pytest.mark.parametrize("kind", ["rope", "routing"])
def test_cross_checks_clean_unmutated(kind):
    assert _check(kind) == []


@pytest.mark.parametrize("name", [m.name for m in CPU_MUTANTS])
def test_cpu_mutant_flagged(name):
    m = M.BY_NAME[name]
    with m.cpu_apply():
        problems = _check(m.cpu_check)
    assert problems, f"{name}: the {m.cpu_check} cross-check did not flag the mutant"
    # the patch is undone: the cross-check is clean again
    assert _check(m.cpu_check) == []
