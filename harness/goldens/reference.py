"""Reference goldens of the named cases: the reference's ``GoldenKind`` (how its trace is stored
and judged) and the no-GPU job that checks every case through ``store.check``."""

from __future__ import annotations

from pathlib import Path

from reference import EXACT, draft, flatten

from harness import case_registry
from harness.goldens import store
from harness.trace_compare import VS_GOLDEN_REFERENCE, Report, compare_traces

KIND = "reference"


def reference_trace(case_id: str) -> dict:
    case = case_registry.spec(case_id, kind="reference")
    result = draft(case.config(), case.weights(), case.first_step(), case.steps, EXACT)
    return flatten(result)


def _judge(case_id: str, now: dict, stored: dict, entry: dict, root: Path) -> Report:
    """The reference's trace now vs its stored golden: every component at the golden tolerance;
    keys only one side has are named in ``meta["key_set_differs"]`` (a failure too)."""
    missing = sorted(set(stored) ^ set(now))
    report = compare_traces(now, stored, default=VS_GOLDEN_REFERENCE)
    report.meta["case"] = case_id
    if missing:
        report.meta["key_set_differs"] = missing[:10]
    return report


def _entry(case_id: str, trace: dict) -> dict:
    case = case_registry.spec(case_id, kind="reference")
    return {"case": case_id, "preset": case.preset, "overrides": [list(kv) for kv in case.overrides],
            "seed": case.seed, "requests": case.requests, "tokens": case.tokens, "steps": case.steps,
            "dtype": "float64", "tolerance": {"atol": VS_GOLDEN_REFERENCE.atol, "rtol": VS_GOLDEN_REFERENCE.rtol}}


# stored as traced (goldens' own compact typing of e4m3 values applies); every golden applies
REFERENCE = store.GoldenKind(KIND, encode=lambda case_id, trace: dict(trace), entry=_entry, judge=_judge)


def check_case(case_id: str, *, root=None, regen: bool = False) -> store.Checked:
    """The reference's trace of ``case_id`` now through ``store.check`` (GoldenError if no golden;
    ``regen``: written as the golden, on purpose)."""
    return store.check(REFERENCE, case_id, reference_trace(case_id), root=root, regen=regen)


def check_reference_goldens(verbose: bool = False, report: str | None = None) -> int:
    """0 when every golden case matches, 1 on a mismatch (the obtained trace written beside the
    golden, both paths printed), else 125 when a golden is missing or corrupt (no verdict on that
    case: ``harness.exitcodes``). ``report``: the judged cases' reports as one JSON file
    (``harness.report``, as ``compare --report`` writes them)."""
    from harness.exitcodes import EXIT_CANNOT_JUDGE, worst

    status = 0
    reports = {}
    for cid in case_registry.ids(role="golden", kind="reference"):
        try:
            checked = check_case(cid)
        except store.GoldenError as exc:
            print(f"cannot judge {cid}: {exc}")
            status = worst([status, EXIT_CANNOT_JUDGE])
            continue
        rep, ok = checked.report, checked.passed
        bad = rep.first_divergent
        print(f"{'ok  ' if ok else 'FAIL'} {cid}: {len(rep.results)} components"
              + ("" if ok else f"; first divergent {bad.name if bad else rep.meta.get('key_set_differs')}"))
        if not ok:
            print(f"     {checked.paths_line}")
        if verbose and not ok:
            print(rep.table())
        status = worst([status, 0 if ok else 1])
        reports[cid] = rep
    if report:
        from harness.report import save_report
        save_report(report, reports, {"job": "reference vs goldens (no GPU)"})
    return status
