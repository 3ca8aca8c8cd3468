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
    """The GpuCase ``compare`` runs: preset:NAME (seeded weights) or a GPU case id."""
    from harness.presets import check_kernel_constraints, preset
    from reference import ConfigError, MTPConfig

    from .side_by_side import GPU_CASES, GpuCase

    ckpt = args.ckpt or "preset:tiny"
    if ckpt in GPU_CASES:
        case = GPU_CASES[ckpt]
    elif ckpt.startswith("preset:"):
        case = GpuCase(f"{ckpt[7:]}-seed{args.seed}", preset=ckpt[7:], seed=args.seed, steps=args.steps,
                       requests=2, tokens=160)
        try:
            preset(case.preset)
        except KeyError as exc:
            raise CLIError(str(exc.args[0])) from exc
    else:
        raise CLIError(f"{ckpt}: compare takes preset:NAME or a GPU case id ({', '.join(GPU_CASES)}); "
                       "checkpoint directories are not wired into compare yet")
    try:
        check_kernel_constraints(MTPConfig.from_hf_dict(case.hf_config()))
    except ConfigError as exc:
        raise CLIError(f"{ckpt}: {exc}") from exc
    return case


def validate_args(command: str, args) -> None:
    """CLIError (exit 2) for arguments no machine could run, before asking for a GPU."""
    if command == "compare_command":
        if getattr(args, "tp", 1) != 1:
            raise CLIError("--tp > 1 is not wired into the production runner yet")
        if args.steps < 1:
            raise CLIError("--steps must be >= 1")
        _case_for(args)
    elif command == "bisect_command":
        from .side_by_side import GPU_CASES

        unknown = [c for c in (args.case or []) if c not in GPU_CASES]
        if unknown:
            raise CLIError(f"unknown case(s) {unknown}; known: {', '.join(GPU_CASES)}")


def _run(case):
    """(result, None), or (None, reason) when production could not run the case.

    A crash while building, loading or running vLLM (a missing kernel, a
    refused config, a JIT failure) means "cannot judge" (exit 125), never
    "numeric mismatch": git bisect then skips the commit instead of blaming it.
    """
    from .side_by_side import run_case

    try:
        return run_case(case), None
    except Exception as exc:  # noqa: BLE001 - any production failure is reported, one line
        return None, f"production run of {case.id} failed: {exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def compare_command(args) -> int:
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
