"""Running the catalogue on the GPU: build, load, plant, run, judge
(``harness.production.module.side_by_side``), with an unmutated control per case; the
``python -m harness mutants`` command."""

from __future__ import annotations

import gc
import json
import os
import time
import traceback

import torch

from harness.atomic import atomic_write_json
from harness.verdict import Verdict

from .base import Ctx, Mutant, MutantNotApplicable
from .catalogue import BY_NAME, CATALOGUE, GOLDEN_CATALOGUE, format_list, select


def case_by_id(case_id: str):
    """The module case a mutant runs on: one of the registry's single-GPU module cases (the one list
    of cases; a case only the mutants use is declared there too)."""
    from harness.case_registry import spec

    return spec(case_id, kind="module", without="probe")


def _run(case, mutant: Mutant | None, *, judged: bool = True) -> tuple[dict, list[str]]:
    """Build, load, apply ``mutant`` (None: control), run, judge (as side_by_side.run_case);
    ``judged=False``: the production run only.

    A mutant's ``build_patch`` is active while the model is built and loaded; the post-load
    audit's ``LoadAuditError`` then propagates (``bisect-check --plant``: exit 1 naming the module)."""
    import contextlib

    from harness.production.module import side_by_side as sbs

    def around_run(sess, run):
        ctx = Ctx(sess)
        try:
            if mutant is not None:
                mutant.apply(ctx)
                torch.cuda.synchronize()
            try:
                return run()
            except MutantNotApplicable:
                raise
            except Exception as exc:
                raise _RunRaised(exc) from exc
        finally:
            ctx.restore()

    patch = mutant.build_patch() if mutant is not None and mutant.build_patch is not None \
        else contextlib.nullcontext()
    inputs = sbs.build_inputs(case)  # one build for the run and its judge
    with patch:
        prod, info = sbs.run_production_side(case, around_run=around_run, inputs=inputs)
    if not judged:
        return {}, []
    return sbs.judge(case, prod, info, inputs=inputs), []


def warm_catalogue() -> dict:
    """Every planted bug's production run, unjudged (``python -m harness warmup``): a bug that
    changes what vLLM compiles (a routing constant baked into a torch.compile'd graph, say) would
    otherwise compile it during the tier. A run that raises is what the judged run reports, not a
    host that cannot warm: counted, never raised. -> {"ran": n, "raised": [names]}."""
    raised = []
    for m in (*CATALOGUE, *GOLDEN_CATALOGUE):
        try:
            _run(case_by_id(m.case), m, judged=False)
        except Exception:  # noqa: BLE001 - judged by the tier, not here
            raised.append(m.name)
        _free()
    return {"ran": len(CATALOGUE) + len(GOLDEN_CATALOGUE), "raised": raised}


def run_planted(case, name: str) -> Verdict:
    """``harness.production.judging.trace_judge`` of ``case`` run with mutant ``name`` planted
    (``bisect-check --plant``).

    Raises MutantNotApplicable when the mutant has nothing to act on in this case, _RunRaised
    when production raised after the mutant was applied.
    """
    return _run(case, BY_NAME[name])[0]


class _RunRaised(Exception):
    """The production run raised after the mutant was applied."""


def _failing(result: Verdict) -> list[str]:
    return [r["key"] for r in result.rows if not r["passed"]]


def _component(key: str | None) -> str | None:
    return key.split(".", 1)[1] if key and key.startswith("step") else key


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_control(case_id: str) -> dict:
    t0 = time.perf_counter()
    rec = {"case": case_id}
    try:
        res, _ = _run(case_by_id(case_id), None)
        rec.update(passed=bool(res.passed), first_divergent=res.first_divergent, failing=_failing(res))
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        inner = exc.__cause__ if isinstance(exc, _RunRaised) else exc
        rec.update(passed=False, error=f"{type(inner).__name__}: {inner}", traceback=traceback.format_exc())
    rec["wall_s"] = round(time.perf_counter() - t0, 2)
    _free()
    return rec


def _is_load_failure(exc: BaseException) -> bool:
    from harness.production.module.audit import LoadAuditError
    return isinstance(exc, LoadAuditError)


def run_mutant(m: Mutant, control: dict | None = None) -> dict:
    """One mutant on its case: outcome detected / missed / not-applicable / error / inconclusive."""
    t0 = time.perf_counter()
    rec = {**m.row(), "detected": False}
    control_ok = control is None or bool(control.get("passed"))
    try:
        res, _ = _run(case_by_id(m.case), m)
        fails = _failing(res)
        comps = sorted({_component(k) for k in fails})
        rec.update(first_divergent=res.first_divergent, failing=fails,
                   expected_flagged=m.component in comps, failing_components=comps,
                   first_divergent_component=_component(res.first_divergent))
        if res.passed:
            rec["outcome"] = "missed"
        elif control_ok:
            rec.update(outcome="detected", detected=True)
        else:
            rec["outcome"] = "inconclusive (control failed)"
    except MutantNotApplicable as exc:
        rec.update(outcome="not-applicable", error=str(exc))
    except _RunRaised as exc:
        inner = exc.__cause__
        rec["error"] = f"{type(inner).__name__}: {inner}"
        rec["traceback"] = traceback.format_exc()
        if control_ok:
            rec.update(outcome="detected (raised)", detected=True)
        else:
            rec["outcome"] = "inconclusive (raised; control failed)"
    except Exception as exc:  # noqa: BLE001 - build/load/judge trouble: not attributable
        if m.build_patch is not None and _is_load_failure(exc):  # the planted build bug failed the load
            rec["error"] = f"{type(exc).__name__}: {exc}"
            rec.update(outcome="detected (load failed)", detected=True) if control_ok else \
                rec.update(outcome="inconclusive (load failed; control failed)")
            rec["wall_s"] = round(time.perf_counter() - t0, 2)
            _free()
            return rec
        rec.update(outcome="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    rec["wall_s"] = round(time.perf_counter() - t0, 2)
    _free()
    return rec


def run_catalogue(mutants: list[Mutant], *, report: str | None = None, control: bool = True,
                  log=print, budget_s: float | None = None) -> dict:
    """Controls (one unmutated run per case used) then each mutant; the report is rewritten as it goes.
    With ``budget_s``, nothing new starts once that many seconds have passed (outcome "not-run")."""
    t_start = time.perf_counter()

    def over() -> bool:
        return budget_s is not None and time.perf_counter() - t_start > budget_s

    out: dict = {"controls": {}, "mutants": [], "budget_s": budget_s}
    try:
        from harness.production.module.side_by_side import versions
        out["versions"] = versions()
    except Exception as exc:  # noqa: BLE001
        out["versions"] = {"error": str(exc)}

    def save():
        if report:
            os.makedirs(os.path.dirname(os.path.abspath(report)), exist_ok=True)
            atomic_write_json(report, out, default=str)

    if control:
        for cid in dict.fromkeys(m.case for m in mutants):
            if over():
                out["controls"][cid] = {"case": cid, "passed": False, "error": "not run: --budget-s spent"}
                continue
            c = run_control(cid)
            out["controls"][cid] = c
            log(f"control {cid}: {'PASS' if c['passed'] else 'FAIL'} {c.get('first_divergent') or c.get('error') or ''}"
                f" ({c['wall_s']}s)")
            save()
    for m in mutants:
        if over():
            out["mutants"].append({**m.row(), "detected": False, "outcome": "not-run",
                                   "error": "--budget-s spent", "wall_s": 0.0})
            log(f"{m.name:26s} not-run (budget spent)")
            continue
        r = run_mutant(m, out["controls"].get(m.case))
        out["mutants"].append(r)
        log(f"{m.name:26s} {r['outcome']:24s} expected {m.component:20s} first "
            f"{r.get('first_divergent')} ({r['wall_s']}s){'  ' + r['error'][:200] if r.get('error') else ''}")
        save()
    n = len(out["mutants"])
    det = sum(r["detected"] for r in out["mutants"])
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    out["summary"] = {"selected": n, "detected": det,
                      "missed": [r["name"] for r in out["mutants"] if r["outcome"] == "missed"],
                      "not_applicable": [r["name"] for r in out["mutants"] if r["outcome"] == "not-applicable"],
                      "other": [r["name"] for r in out["mutants"]
                                if not r["detected"] and r["outcome"] not in ("missed", "not-applicable")]}
    save()
    log(f"mutants: {det}/{n} detected; summary {json.dumps(out['summary'])}")
    return out


def mutants_command(args) -> int:
    """Exit codes are ``harness.exitcodes``'s: 0 every selected mutant detected, 1 one missed,
    2 bad arguments (checked first), 125 production cannot run here."""
    from harness.production import can_run
    from harness.exitcodes import EXIT_CANNOT_JUDGE, EXIT_MISMATCH, EXIT_OK, CLIError

    if getattr(args, "speculator", False):  # planted bugs in vLLM's speculator, through bisect-check
        from harness.production.engine import speculator_mutants as S

        if args.list:
            print("\n".join(f"{m.name:30s} {m.case:30s} first line names {m.expect!r}: {m.what}"
                            for m in S.MUTANTS.values()))
            return EXIT_OK
        unknown = [n for n in (args.only or []) if n not in S.MUTANTS]
        if unknown:
            from harness.exitcodes import listed
            raise CLIError(f"--only: unknown speculator mutant(s) {listed(unknown, 5)}; known: {listed(S.MUTANTS, 40)}")
        reason = can_run.cannot_run_engine_reason()
        if reason:
            print(f"cannot judge: {reason}")
            return EXIT_CANNOT_JUDGE
        doc = S.run_catalogue(args.only, report=args.report, log=lambda x: print(x, flush=True))
        s = doc["summary"]
        return EXIT_OK if s["caught"] == s["named_first"] == s["mutants"] and s["controls_ok"] else EXIT_MISMATCH
    if args.list:
        print(format_list())
        return EXIT_OK
    try:
        chosen = select(args.only)
    except KeyError as exc:
        raise CLIError(exc.args[0]) from exc
    if args.budget_s is not None and not (0 < args.budget_s < float("inf")):
        raise CLIError(f"--budget-s {args.budget_s}: must be a finite number of seconds > 0")
    if args.report and os.path.isdir(args.report):
        raise CLIError(f"--report {args.report}: is a directory; give a .json file path")
    reason = can_run.cannot_run_production_reason()
    if reason:
        print(f"cannot judge: {reason}")
        return EXIT_CANNOT_JUDGE
    out = run_catalogue(chosen, report=args.report, control=not args.no_control,
                        log=lambda s: print(s, flush=True), budget_s=args.budget_s)
    return EXIT_OK if out["summary"]["detected"] == out["summary"]["selected"] else EXIT_MISMATCH
