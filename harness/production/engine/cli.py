"""``python -m harness.production.engine``'s arguments, checked before torch or vLLM is imported.

    python -m harness.production.engine [--case ID ...] [--out DIR]      # exit 0 / 1 / 2 / 125 (harness.exitcodes)
    python -m harness.production.engine --rejudge DIR [--out DIR2]       # CPU, no vLLM: re-judge saved runs

What an engine run does: ``harness/production/engine/run.py``'s docstring. Bad input is exit 2
and a host that cannot run production is exit 125, both answered without importing torch
(~2.5 s of CPU); only then is ``run`` imported for the work.
"""

from __future__ import annotations

import argparse
import os

from harness.production.engine.cases import ENGINE_CASES


def main(argv=None) -> int:
    """Exit codes are ``harness.exitcodes``'s; an error is one line (``--debug``: with its traceback)."""
    from harness.exitcodes import OneLineParser, run_guarded

    ap = OneLineParser(prog="python -m harness.production.engine", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", choices=sorted(ENGINE_CASES),
                    help="case id (default: all)")
    ap.add_argument("--out", default=None, help="directory for engine_mtp_<case>.json (default $HYV4_REPORT_DIR)")
    ap.add_argument("--rejudge", metavar="DIR", default=None,
                    help="re-judge the recordings engine_calls_<case>.* saved in DIR (CPU, no vLLM); "
                         "reports to --out as engine_mtp_<case>.rejudge.json")
    ap.add_argument("--mutant", action="append", default=None,
                    help="plant one of harness.production.engine.speculator_mutants.MUTANTS in vLLM's speculator "
                         "(in this process) before building the engine; default $HYV4_SPECULATOR_MUTANT. "
                         "With --sweep: repeatable, the mutants to sweep (default: every mutant of the case)")
    ap.add_argument("--sweep", action="store_true",
                    help="with one --case: build its engine once and run a pristine generation, then per "
                         "speculator mutant a planted one and a pristine one again; engine_mtp_<case>.sweep.json; "
                         "exit 0 when every mutant fails named first and every pristine run passes, else 1")
    ap.add_argument("--debug", action="store_true", help="print tracebacks of errors")
    args = ap.parse_args(argv)
    return run_guarded(_main, args, debug=args.debug)


def check_out_dir(out: str | None, flag: str = "--out") -> None:
    """The report directory: absent (created) or a writable directory (``harness.input_checks``)."""
    from harness.input_checks import output_dir

    if out is not None:
        output_dir(flag, out)


def _main(args) -> int:
    from harness.exitcodes import EXIT_CANNOT_JUDGE, CLIError
    from harness.production.engine.speculator_mutants import MUTANTS

    from harness.input_checks import environment

    environment()  # $HYV4_SPECULATOR_MUTANT, $HYV4_REPORT_DIR, $HYV4_ENGINE_KV_CACHE_GIB, ... named when bad
    check_out_dir(args.out)
    env_mutant = os.environ.get("HYV4_SPECULATOR_MUTANT") or None
    mutants = args.mutant or ([env_mutant] if env_mutant and not args.sweep else [])
    for m in mutants:
        if m not in MUTANTS:
            raise CLIError(f"--mutant {m}: unknown speculator mutant; known: {', '.join(MUTANTS)}")
    if args.sweep:
        if not args.case or len(args.case) != 1:
            raise CLIError("--sweep needs exactly one --case (its engine is built once)")
        at_build = [m for m in mutants if MUTANTS[m].at_build]
        if at_build:
            raise CLIError(f"--sweep --mutant {at_build[0]}: it patches graph capture, which runs while the engine "
                           "is built: plant it with --mutant alone (its own engine)")
        mutants = mutants or [n for n, m in MUTANTS.items() if m.case == args.case[0] and not m.at_build]
        if not mutants:
            raise CLIError(f"--sweep --case {args.case[0]}: no speculator mutant targets this case")
    elif len(mutants) > 1:
        raise CLIError("--mutant given more than once: one engine per planted bug, or --sweep")
    args.mutant = None if args.sweep else (mutants[0] if mutants else None)
    if args.rejudge is not None:
        if not args.rejudge.strip():
            raise CLIError("--rejudge is empty; give the directory of the saved recordings")
        if args.sweep:
            raise CLIError("--rejudge and --sweep: choose one")
        from harness.production.engine.run import rejudge_dir

        return rejudge_dir(args.rejudge, args.case, args.out, debug=args.debug)
    from harness.production.can_run import cannot_run_engine_reason

    reason = cannot_run_engine_reason()
    if reason:
        print(f"cannot judge: {reason}")
        return EXIT_CANNOT_JUDGE
    from harness.production.engine.run import run_checked

    return run_checked(args, mutants)
