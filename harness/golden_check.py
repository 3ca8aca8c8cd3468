"""Record and check reference goldens of the named cases."""

from __future__ import annotations

from reference import EXACT, draft, flatten

from . import goldens
from .cases import GOLDEN_CASES, get_case
from .compare import VS_GOLDEN_REFERENCE, Report, compare_traces

KIND = "reference"


def reference_trace(case_id: str) -> dict:
    case = get_case(case_id)
    result = draft(case.config(), case.weights(), case.first_step(), case.steps, EXACT)
    return flatten(result)


def check_case(case_id: str) -> Report:
    """The reference's trace now vs its stored golden (GoldenError if none)."""
    stored, _ = goldens.load(KIND, case_id)
    now = reference_trace(case_id)
    missing = sorted(set(stored) ^ set(now))
    report = compare_traces(now, stored, default=VS_GOLDEN_REFERENCE)
    report.meta["case"] = case_id
    if missing:
        report.meta["key_set_differs"] = missing[:10]
    return report


def record_case(case_id: str) -> None:
    case = get_case(case_id)
    goldens.write(KIND, case_id, reference_trace(case_id), {
        "case": case_id, "preset": case.preset, "overrides": [list(kv) for kv in case.overrides],
        "seed": case.seed, "requests": case.requests, "tokens": case.tokens, "steps": case.steps,
        "dtype": "float64", "tolerance": {"atol": VS_GOLDEN_REFERENCE.atol, "rtol": VS_GOLDEN_REFERENCE.rtol},
    })


def check_reference_goldens(verbose: bool = False, report: str | None = None) -> int:
    """0 when every golden case matches, 1 on a mismatch, else 125 when a golden is missing or
    corrupt (no verdict on that case: ``harness.exitcodes``). ``report``: the judged cases' reports
    as one JSON file (``harness.report``, as ``compare --report`` writes them)."""
    from .exitcodes import EXIT_CANNOT_JUDGE, worst

    status = 0
    reports = {}
    for cid in GOLDEN_CASES:
        try:
            rep = check_case(cid)
        except goldens.GoldenError as exc:
            print(f"cannot judge {cid}: {exc}")
            status = worst([status, EXIT_CANNOT_JUDGE])
            continue
        bad = rep.first_divergent
        ok = bad is None and "key_set_differs" not in rep.meta
        print(f"{'ok  ' if ok else 'FAIL'} {cid}: {len(rep.results)} components"
              + ("" if ok else f"; first divergent {bad.name if bad else rep.meta.get('key_set_differs')}"))
        if verbose and not ok:
            print(rep.table())
        status = worst([status, 0 if ok else 1])
        reports[cid] = rep
    if report:
        from .report import save_report
        save_report(report, reports, {"job": "reference vs goldens (no GPU)"})
    return status
