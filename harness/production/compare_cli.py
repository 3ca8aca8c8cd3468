"""``python -m harness compare`` and ``bisect-check`` on a GPU.

compare: one side-by-side case (preset:NAME with seeded weights, or a named
GPU case) -> per-component table, optional JSON report; exit 0 / 1.
bisect-check: a small default set of side-by-side cases plus the production
goldens recorded for this platform -> exit 0 (good) / 1 (mismatch) / 125
(cannot judge: the production path does not build here).
"""

from __future__ import annotations

import dataclasses

from harness.cli import EXIT_CANNOT_JUDGE, EXIT_MISMATCH, EXIT_OK, CLIError
from harness.report import write_report

DEFAULT_BISECT_CASES = ("tiny-k3-share", "tiny-k2-long", "tiny-k2-fused-layers")


def _case_for(args):
    from .side_by_side import GPU_CASES, GpuCase

    ckpt = args.ckpt or "preset:tiny"
    if ckpt in GPU_CASES:
        return GPU_CASES[ckpt]
    if ckpt.startswith("preset:"):
        return GpuCase(f"{ckpt[7:]}-seed{args.seed}", preset=ckpt[7:], seed=args.seed, steps=args.steps,
                       requests=2, tokens=160)
    raise CLIError(f"{ckpt}: compare takes preset:NAME or a GPU case id ({', '.join(GPU_CASES)}); "
                   "checkpoint directories run through the side-by-side module's --ckpt")


def _run(case):
    """(result, None) or (None, reason-it-cannot-judge)."""
    from .side_by_side import run_case

    try:
        from .runner import ProductionSession  # noqa: F401 - import errors mean no production path
    except Exception as exc:  # noqa: BLE001
        return None, f"production runner does not import: {exc.__class__.__name__}: {exc}"
    return run_case(case), None


def compare_command(args) -> int:
    if getattr(args, "tp", 1) != 1:
        raise CLIError("--tp > 1 is not wired into the production runner yet")
    case = _case_for(args)
    result, reason = _run(case)
    if reason:
        print(f"cannot judge: {reason}")
        return EXIT_CANNOT_JUDGE
    from .side_by_side import format_rows, versions

    print(format_rows(result))
    if args.report:
        result["_report"].meta.update(versions=versions(), case=dataclasses.asdict(case))
        write_report(args.report, {case.id: result["_report"]}, {"versions": versions()})
        print(f"report: {args.report}")
    return EXIT_OK if result["passed"] else EXIT_MISMATCH


def bisect_command(args) -> int:
    from .goldens_gpu import check_production_golden
    from .side_by_side import GPU_CASES, versions

    ids = args.case or list(DEFAULT_BISECT_CASES)
    unknown = [c for c in ids if c not in GPU_CASES]
    if unknown:
        raise CLIError(f"unknown case(s) {unknown}; known: {', '.join(GPU_CASES)}")
    reports, verdict = {}, EXIT_OK
    for cid in ids:
        result, reason = _run(GPU_CASES[cid])
        if reason:
            print(f"cannot judge: {reason}")
            return EXIT_CANNOT_JUDGE
        reports[f"side-by-side/{cid}"] = result["_report"]
        first = result["first_divergent"]
        print(f"{'ok  ' if result['passed'] else 'FAIL'} side-by-side {cid}" + ("" if result["passed"] else f": first divergent {first}"))
        verdict = verdict if result["passed"] else EXIT_MISMATCH
        golden = check_production_golden(cid, result["_prod"])
        if golden is None:
            print(f"     golden {cid}: no golden for this platform")
            continue
        reports[f"golden/{cid}"] = golden
        gfirst = golden.first_divergent
        print(f"{'ok  ' if golden.passed else 'FAIL'} golden {cid}" + ("" if golden.passed else f": first divergent {gfirst.name}"))
        verdict = verdict if golden.passed else EXIT_MISMATCH
    if args.report:
        write_report(args.report, reports, {"versions": versions()})
    return verdict
