"""The reference cases (kind "reference" of ``harness.case_registry``): which config, seed and
batch a case is. The records themselves live in the registry; this is their view by id."""

from __future__ import annotations

from .case_registry import Case, ids, specs

__all__ = ["Case", "CASES", "GOLDEN_CASES", "get_case"]

CASES: dict[str, Case] = specs(kind="reference")

GOLDEN_CASES = ids(role="golden", kind="reference")


def get_case(case_id: str) -> Case:
    if case_id not in CASES:
        raise KeyError(f"unknown case {case_id!r}; known: {', '.join(CASES)}")
    return CASES[case_id]
