"""``python -m harness engine``'s arguments, checked before torch or vLLM is imported.

    python -m harness engine [--case ID ...] [--out DIR]      # exit 0 / 1 / 2 / 125 (harness.exitcodes)
    python -m harness engine --rejudge DIR [--out DIR2]       # CPU, no vLLM: re-judge saved runs

What an engine run does: ``harness/production/engine/session.py``'s docstring (build, load,
audit), ``taps.py`` (recording) and ``judge.py`` (replay, verdict, sweep, re-judge). Bad input is
exit 2 and a host that cannot run production is exit 125, both answered without importing torch
(~2.5 s of CPU); only then is ``harness.production.engine.generation_judge`` imported for the work; the
verdict lines and the reports are printed and written here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import traceback

from harness.atomic import atomic_write_json
from harness.exitcodes import EXIT_CANNOT_JUDGE, EXIT_MISMATCH, EXIT_OK
from harness.case_registry import specs as case_specs
from harness.production.engine.process import ENGINE_COMMAND


def main(argv=None) -> int:
    """Exit codes are ``harness.exitcodes``'s; an error is one line (``--debug``: with its traceback)."""
    from harness.exitcodes import OneLineParser, run_guarded

    ap = OneLineParser(prog="python -m harness engine", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", choices=sorted(case_specs(kind="engine")),
                    help="case id (default: all)")
    ap.add_argument("--out", default=None, help="directory for engine_mtp_<case>.json (default $HYV4_REPORT_DIR)")
    ap.add_argument("--rejudge", metavar="DIR", default=None,
                    help="re-judge the recordings engine_calls_<case>.* saved in DIR (CPU, no vLLM); "
                         "reports to --out as engine_mtp_<case>.rejudge.json")
    ap.add_argument("--mutant", action="append", default=None,
                    help="plant one of harness.production.engine.speculator_mutants.MUTANTS in vLLM's speculator "
                         "(in this process) before building the engine; default $HYV4_SPECULATOR_MUTANT. "
                         "With --sweep: repeatable, the mutants to sweep (default: the case's own, then the "
                         "capture-only ones whose eager twin it is)")
    ap.add_argument("--sweep", action="store_true",
                    help="with one --case: build its engine once and run a pristine generation, then per "
                         "speculator mutant a planted one and a pristine one again; engine_mtp_<case>.sweep.json; "
                         "exit 0 when every mutant fails named first (a capture-only one on its eager twin: passes) "
                         "and every pristine run passes, else 1")
    ap.add_argument("--history", default=None, metavar="PATH",
                    help="append each case's run to the run history at PATH (default $HYV4_HISTORY; "
                         "harness.history: several engine processes may append at once)")
    ap.add_argument("--debug", action="store_true", help="print tracebacks of errors")
    args = ap.parse_args(argv)
    return run_guarded(_main, args, debug=args.debug)


def check_out_dir(out: str | None, flag: str = "--out") -> None:
    """The report directory: absent (created) or a writable directory (``harness.input_checks``)."""
    from harness.input_checks import output_dir

    if out is not None:
        output_dir(flag, out)


def _main(args) -> int:
    from harness.exitcodes import CLIError
    from harness.production.engine.speculator_mutants import MUTANTS

    from harness.input_checks import environment

    environment()  # $HYV4_SPECULATOR_MUTANT, $HYV4_REPORT_DIR, $HYV4_ENGINE_KV_CACHE_GIB, ... named when bad
    check_out_dir(args.out)
    from harness.commands.history import history_path
    from harness.history.store import check_history

    args.history = history_path(args)
    if args.history:
        check_history(args.history)  # a file that is not a history: exit 2 before any engine is built
    env_mutant = os.environ.get("HYV4_SPECULATOR_MUTANT") or None
    mutants = args.mutant or ([env_mutant] if env_mutant and not args.sweep else [])
    for m in mutants:
        if m not in MUTANTS:
            from harness.exitcodes import listed
            raise CLIError(f"--mutant {listed([m])}: unknown speculator mutant; known: {listed(MUTANTS, 40)}")
    if args.sweep:
        if not args.case or len(args.case) != 1:
            raise CLIError("--sweep needs exactly one --case (its engine is built once)")
        at_build = [m for m in mutants if MUTANTS[m].at_build]
        if at_build:
            raise CLIError(f"--sweep --mutant {at_build[0]}: it patches graph capture, which runs while the engine "
                           "is built: plant it with --mutant alone (its own engine)")
        from harness.production.engine.speculator_mutants import sweep_mutants

        mutants = mutants or sweep_mutants(args.case[0])
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
        return rejudge_dir(args.rejudge, args.case, args.out, debug=args.debug)
    from harness.production.can_run import cannot_run_engine_reason

    reason = cannot_run_engine_reason()
    if reason:
        print(f"cannot judge: {reason}")
        if args.history:  # a check that did not run is in the history as such
            from harness.commands.history import record_report
            print(record_report(args.history, "engine", None, EXIT_CANNOT_JUDGE,
                                context={"first_line": f"cannot judge: {reason}"}))
        return EXIT_CANNOT_JUDGE
    return run_checked(args, mutants)


def _case_failed(title: str, exc: Exception, debug: bool) -> tuple[dict, int]:
    """(report, exit code) of a case that raised: one line (the traceback goes to the report)."""
    from harness.exitcodes import classify

    code, line = classify(exc)
    if debug:
        traceback.print_exception(exc)
    print(f"== {title}: ERROR {line}", flush=True)
    return {"case": title, "error": traceback.format_exc(), "exit_code": code}, code


def run_checked(args, mutants) -> int:
    """The engine command once its arguments are checked and production can run here
    (``main``): the sweep, or each case (one process per engine)."""
    from harness.exitcodes import CLIError
    from harness.production.engine.generation_judge import run_case, run_mutant_sweep, worst_exit_code

    out = args.out or os.environ.get("HYV4_REPORT_DIR") or None
    check_out_dir(out, "--out" if args.out else "$HYV4_REPORT_DIR")
    if args.sweep:
        try:
            doc = run_mutant_sweep(case_specs(kind="engine")[args.case[0]], mutants, out=out)
        except Exception as exc:  # noqa: BLE001 - a crash in vLLM: cannot judge (a load failure: 1)
            return _case_failed(args.case[0], exc, args.debug)[1]
        bad = [r["label"] for r in doc["runs"] if not r["ok"]]
        verdict = ("all as expected (caught and named first, or harmless on the eager twin), pristine runs pass"
                   if not bad else "NOT OK: " + ", ".join(bad))
        print(f"== {args.case[0]} sweep: {len(mutants)} mutant(s) on one engine, {verdict} ({doc['wall_s']:.0f} s)",
              flush=True)
        return EXIT_OK if not bad else EXIT_MISMATCH
    engine_cases = case_specs(kind="engine")
    ids = args.case or list(engine_cases)
    if len(ids) > 1:  # one engine per process: vLLM's distributed state and GPU memory are per process
        return worst_exit_code([subprocess.call([*ENGINE_COMMAND, "--case", cid]
                                                + (["--out", out] if out else [])
                                                + (["--debug"] if args.debug else [])
                                                + (["--history", args.history] if args.history else [])
                                                + (["--mutant", args.mutant] if args.mutant else [])) for cid in ids])
    codes = []
    for cid in ids:
        try:
            case = engine_cases[cid]
            if case.reload_seed is not None:  # weights updated in place (engine/reload.py)
                if args.mutant:
                    raise CLIError(f"--case {cid} --mutant: a reload case takes no planted speculator bug")
                from harness.production.engine.reload import run_reload_engine_case
                rep = run_reload_engine_case(case, out=out).to_report()
            else:
                rep = run_case(case, out=out, mutant=args.mutant).to_report()
        except Exception as exc:  # noqa: BLE001 - a crash in vLLM: cannot judge (a load failure: 1)
            rep, code = _case_failed(cid, exc, args.debug)
        else:
            code = _print_verdict(cid, rep)
        codes.append(code)
        if out:
            os.makedirs(out, exist_ok=True)
            atomic_write_json(os.path.join(out, f"engine_mtp_{cid}.json"), rep, default=str)
        if args.history and "case" in rep:
            from harness.commands.history import record_doc
            print(record_doc(args.history, "engine", rep, code), flush=True)
    return worst_exit_code(codes)


def rejudge_dir(src: str, case_ids, out: str | None, *, debug: bool = False) -> int:
    """Re-judge every saved recording ``engine_calls_<case>.*`` in ``src`` on CPU (no vLLM)."""
    import glob

    from harness.production.engine.generation_judge import rejudge, worst_exit_code

    from harness.exitcodes import CLIError

    if not os.path.isdir(src):
        raise CLIError(f"--rejudge {src}: not a directory")
    stems = sorted(p[: -len(".json")] for p in glob.glob(os.path.join(src, "engine_calls_*.json")))
    if case_ids:
        stems = [s for s in stems if os.path.basename(s)[len("engine_calls_"):] in case_ids]
    if not stems:
        print(f"cannot judge: no engine_calls_<case>.json in {src}")
        return EXIT_CANNOT_JUDGE
    codes = []
    for stem in stems:
        cid = os.path.basename(stem)[len("engine_calls_"):]
        try:
            rep = rejudge(stem).to_report()
        except Exception as exc:  # noqa: BLE001 - an unreadable recording: cannot judge
            rep, code = _case_failed(f"{cid} (rejudge)", exc, debug)
        else:
            code = _print_verdict(f"{cid} (rejudge)", rep)
        codes.append(code)
        if out:
            os.makedirs(out, exist_ok=True)
            atomic_write_json(os.path.join(out, f"engine_mtp_{cid}.rejudge.json"), rep, default=str)
    return worst_exit_code(codes)


def _print_verdict(title: str, rep: dict) -> int:
    from harness.production.engine.generation_judge import acceptance_disagreements, upstream_gap, verdict_problems

    problems = rep["problems"] if rep.get("problems") is not None else verdict_problems(rep)
    comp = rep.get("compilation") or {}
    if rep.get("drafter_mode") == "CUDA graphs":  # which configuration was judged, on the verdict line
        title += (f" [CUDA graphs: cudagraph_mode {comp.get('cudagraph_mode')}, compile {comp.get('compile_mode')}"
                  + (f"; {comp['compile_fallback']}" if comp.get("compile_fallback") else "") + "]")
    print(f"== {title}: PASS" if not problems else f"== {title}: FAIL: {problems[0]}", flush=True)
    for line in problems[1:12]:
        print("   problem:", line)
    if len(problems) > 12:
        print(f"   ... {len(problems) - 12} more problem(s) in the JSON report")
    for line in acceptance_disagreements(rep):
        print("   note (not in the verdict):", line)
    gap = upstream_gap(rep)
    if gap is not None and problems:
        print("   known vLLM gap:", gap[2])
    if rep.get("reload"):  # weights updated in place between two generations (engine/reload.py)
        r = rep["reload"]
        print(f"   reload: {r.get('reload_s', float('nan')):.2f} s, {r['compared']} tensors compared, "
              f"findings {r['findings'][:4]}, run 1 (set A) {'PASS' if r['run_a']['passed'] else 'FAIL'}")
    print("   counts:", json.dumps(rep["counts"]))
    if rep.get("acceptance"):
        print("   acceptance as vLLM counts it (accepted/drafted per request; over every verify step):",
              {k: f"{v['accepted']}/{v['drafted']} ({v['all_verify_steps']['accepted']}/"
                  f"{v['all_verify_steps']['drafted']})" for k, v in sorted(rep["acceptance"].items())})
    vsd = rep.get("vllm_spec_decode") or {}
    per = vsd.get("per_request")
    print("   vLLM's spec-decode counters (accepted/drafted per request):",
          {k: f"{v['accepted']}/{v['drafted']}" for k, v in per.items()} if isinstance(per, dict) else per,
          "totals:", vsd.get("totals"))
    print("   components (max |d|, calls out of tol):",
          {k: (round(v["max_abs"], 4), v.get("calls_out_of_tol")) for k, v in rep["components"].items()})
    print("   mismatch examples:", json.dumps(rep["mismatch_examples"][:3]))
    print("   replay errors:", rep["replay_errors"][:3], "tap errors:", [e[-300:] for e in rep["tap_errors"][:2]])
    print("   sharing:", json.dumps(rep.get("sharing")), "facts:", json.dumps(rep["facts"]))
    print("   timing:", {k: round(v, 1) for k, v in rep["timing_s"].items()}, flush=True)
    return EXIT_MISMATCH if problems else EXIT_OK
