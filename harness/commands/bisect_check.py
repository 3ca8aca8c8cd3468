"""``python -m harness bisect-check`` on a GPU: the verdict ``git bisect run`` reads.

A small default set of cases (``bisect_case_ids``: vLLM's own speculator in engine subprocesses,
``harness.production.engine.process``, beside the side-by-side cases run in this process), each
side-by-side case judged against the reference and against its production golden: the
checked-in goldens of this platform, or with ``--baseline DIR`` a host baseline recorded at the
good commit (``--record-baseline DIR``: ``record_baseline.py``) -> exit 0 (good) / 1 (mismatch) / 125
(cannot judge: the production path does not build here, or a golden part could not be judged).

No silent pass: a golden part that could not be judged (no golden for this platform, a case
the baseline lacks, components a golden predates) prints ``NOT JUDGED: ...`` and is listed in
the report's ``not_judged``; bisect-check then exits 125 unless a judged part failed (1), so
``git bisect run`` never calls a commit good on a check that did not run. ``--allow-unjudged``
makes that 0, with the line.

Imports that pull in torch or vLLM stay inside the functions that need them (each says so): this
module is imported while the arguments are checked, before any host question.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from harness import input_checks as check
from harness.case_registry import ids as case_ids, specs as case_specs
from harness.exitcodes import EXIT_CANNOT_JUDGE, EXIT_MISMATCH, EXIT_OK, CLIError, listed, worst
from harness.process_clock import process_age_s
from harness.production.engine import process as engine_process
from harness.production.engine.process import EngineRun, ThreadShare
from harness.goldens import baseline
from harness.goldens.platform_key import describe, describe_vllm

from .compare import PLANT_NOT_APPLIED, run_side_by_side

# The bisect's case lists, queries of harness.case_registry. The side-by-side cases (role bisect,
# kind module; also the goldens' set)
DEFAULT_BISECT_CASES = case_ids(role="bisect", kind="module")
# vLLM's own speculator (engine.py; role bisect, kind engine): drafts accepted at planned rates,
# index sharing, and the two-MTP-layer MultiModuleMTPSpeculator
DEFAULT_BISECT_ENGINE_CASES = case_ids(role="bisect", kind="engine")
# the speculator as vLLM serves it, in CUDA graphs (role graph-bisect): added by --graphs
GRAPH_BISECT_ENGINE_CASES = case_ids(role="graph-bisect", kind="engine")
# the configurations HY V4 is deployed with beyond the goldens' set, each by its cheapest case (role
# reference-bisect: an FP8 KV cache, a compressed-tensors FP8 checkpoint, the drafter's weights updated
# in place through vLLM's layerwise reload). In the default set because their warm cost, about a second
# each in the side-by-side thread while the engines are the critical path, keeps bisect-check within its
# 30 s (reports/STATUS.md). They have no production golden: judged against the reference only, the run
# says so, and a baseline does not record them. --compressed-tensors / --reload add theirs to --case's.
REFERENCE_ONLY_BISECT_CASES = case_ids(role="reference-bisect", kind="module")
CT_BISECT_CASES = case_ids(role="ct-bisect", kind="module")
RELOAD_BISECT_CASES = case_ids(role="reload-bisect", kind="module")


def bisect_case_ids(args) -> list[str]:
    """The case ids a bisect-check judges: ``--case`` or the default set (engine cases, the goldens'
    side-by-side cases, the reference-only representatives), plus ``--graphs``'s, and
    ``--compressed-tensors``'s and ``--reload``'s where ``--case`` left them out."""
    ids = list(args.case or [*DEFAULT_BISECT_ENGINE_CASES, *DEFAULT_BISECT_CASES, *REFERENCE_ONLY_BISECT_CASES])
    if getattr(args, "graphs", False):
        ids = [c for c in GRAPH_BISECT_ENGINE_CASES if c not in ids] + ids
    for flag, extra in (("compressed_tensors", CT_BISECT_CASES), ("reload", RELOAD_BISECT_CASES)):
        if getattr(args, flag, False):
            ids += [c for c in extra if c not in ids]
    return ids


def validate_args(args) -> None:
    """bisect-check's CLIError (exit 2) for arguments no machine could run, before asking for a GPU:
    --report, the case ids, --plant, the baseline flags."""
    report = getattr(args, "report", None)
    if report is not None:
        check.output_file("--report", report)
    known = [*case_specs(kind="module", without="probe"), *case_specs(kind="engine")]
    unknown = [c for c in (args.case or []) if c not in known]
    if unknown:
        raise CLIError(f"--case: unknown case(s) {listed(unknown, 5)}; known: {listed(known, 40)}")
    plant = getattr(args, "plant", None)
    if plant is not None:
        from harness.mutants import BY_NAME  # imports torch (the catalogue's patches)
        if plant not in BY_NAME:
            raise CLIError(f"--plant {listed([plant])}: unknown mutant; known: {listed(BY_NAME, 40)}")
    _validate_baseline_args(args)


def _validate_baseline_args(args) -> None:
    """bisect-check's baseline flags: CLIError (exit 2) for a combination or a directory no machine could use."""
    record, judge_dir = getattr(args, "record_baseline", None), getattr(args, "baseline", None)
    if record and judge_dir:
        raise CLIError("--record-baseline and --baseline: record at the good commit, judge with --baseline later")
    if getattr(args, "force", False) and not record:
        raise CLIError("--force applies to --record-baseline (it replaces an existing baseline)")
    if record:
        check.output_dir("--record-baseline", record)  # a name too long, /proc, a read-only parent: 2 here
        if getattr(args, "plant", None) is not None:
            raise CLIError("--plant and --record-baseline: a baseline records vLLM as it is, never a planted bug")
        if getattr(args, "allow_unjudged", False):
            raise CLIError("--allow-unjudged and --record-baseline: recording judges nothing against a golden")
        if not side_by_side_ids(args):
            raise CLIError("--record-baseline: no side-by-side case to record (engine cases have no baseline)")
        baseline.check_record_target(record, getattr(args, "force", False))
    if judge_dir:
        check.input_dir("--baseline", judge_dir)
        baseline.read_stamp(judge_dir)



def side_by_side_ids(args) -> list[str]:
    """bisect-check's side-by-side case ids (``--case`` or the default set), engine cases left out."""
    ids = bisect_case_ids(args)
    if getattr(args, "record_baseline", None) and not args.case:  # never judged against a baseline
        ids = [c for c in ids if c not in REFERENCE_ONLY_BISECT_CASES]
    engine_cases = case_specs(kind="engine")
    return [c for c in ids if c not in engine_cases]


def unjudged_verdict(verdict: int, not_judged: list[dict], allow_unjudged: bool) -> int:
    """bisect-check's exit code once parts could not be judged: a judged failure (1) or a run that
    could not be judged (125) stands; a pass with unjudged parts is 125 (``allow_unjudged``: 0),
    with a last line that says so."""
    if not not_judged:
        return verdict
    n = f"{len(not_judged)} part(s) of the verdict could not be judged (listed above)"
    if verdict != EXIT_OK:
        print(f"NOT JUDGED: {n}; the exit code ({verdict}) stands on the parts that were")
        return verdict
    if allow_unjudged:
        print(f"NOT JUDGED: {n}; exit 0 only because of --allow-unjudged: the judged parts passed")
        return EXIT_OK
    print(f"NOT JUDGED: {n}: exit 125, cannot judge (a bisect skips this commit; record a baseline at the "
          "good commit with --record-baseline DIR and judge with --baseline DIR, or --allow-unjudged for 0)")
    return EXIT_CANNOT_JUDGE


@dataclasses.dataclass
class SideBySide:
    """What bisect-check's side-by-side cases gave: reports, regime values, production traces."""
    reports: dict = dataclasses.field(default_factory=dict)
    regimes: dict = dataclasses.field(default_factory=dict)
    traces: dict = dataclasses.field(default_factory=dict)
    not_judged: list = dataclasses.field(default_factory=list)
    threads: dict = dataclasses.field(default_factory=dict)  # this process's torch threads: own, while engines ran
    verdict: int = EXIT_OK
    failed_line: str | None = None  # the one line of a case that did not run
    planted: list = dataclasses.field(default_factory=list)  # the cases a --plant mutant was applied to
    plant_notes: list = dataclasses.field(default_factory=list)  # why it was not, per case


def bisect_side_by_side(ids, plant, golden: tuple[str, object] | None, beside: list | None = None) -> SideBySide:
    """bisect-check's side-by-side cases, in this process, each against the reference and (``golden``:
    (label, root), None when recording) against its golden. A case that does not run ends the loop:
    a load failure is a bad commit (1), any other crash cannot judge (125). ``beside``: the engine
    subprocesses running meanwhile (this process takes its share of the CPU while they do)."""
    out = SideBySide()
    share = ThreadShare(beside or [])
    try:
        _side_by_side_cases(ids, plant, golden, out, share)
    finally:
        share.restore()
    out.threads = share.facts
    return out


def _side_by_side_cases(ids, plant, golden, out: SideBySide, share: ThreadShare) -> None:
    from harness.goldens.production import judge_golden  # these import torch
    from harness.production.module.side_by_side import format_regimes

    module_cases = case_specs(kind="module", without="probe")
    for cid in ids:
        share.update()
        t0 = time.perf_counter()
        result, code, line = run_side_by_side(module_cases[cid], plant)
        if result is None:
            out.verdict, out.failed_line = worst([out.verdict, code]), line
            return
        if plant is not None:
            if line.startswith(PLANT_NOT_APPLIED):
                print(line)
                out.plant_notes.append(line)
            else:
                out.planted.append(cid)
        out.reports[f"side-by-side/{cid}"] = result.comparison
        # seconds: this case in this process, all of it; timing_s: its production build / load / run and
        # the reference (replays and the free-running draft the regimes come from); the rest of seconds
        # is the inputs and the comparison (the golden check below is not in it)
        result.comparison.meta.update(regimes=result.regimes,
                                      model_kernel_paths=result.details.get("model_kernel_paths"),
                                      seconds=round(time.perf_counter() - t0, 2),
                                      timing_s=result.details.get("timing_s"))
        out.regimes[cid] = result.regimes
        first = result.first_divergent
        print(f"{'ok  ' if result.passed else 'FAIL'} side-by-side {cid}"
              + ("" if result.passed else f": first divergent {first}"))
        print(f"     regimes: {format_regimes(result.regimes)}")
        out.verdict = out.verdict if result.passed else EXIT_MISMATCH
        if golden is None:
            out.traces[cid] = result.trace
            continue
        if cid in REFERENCE_ONLY_BISECT_CASES:
            print(f"     {cid}: judged against the reference only (no production golden for this case)")
            continue
        label, root = golden
        report, code, missing = judge_golden(label, cid, result.trace, root)
        if report is not None:
            out.reports[f"{label}/{cid}"] = report
        out.not_judged += missing
        out.verdict = worst([out.verdict, code])


def bisect_engine_ids(args) -> list[str]:
    """The engine cases of a bisect-check (none when it records a baseline)."""
    if getattr(args, "record_baseline", None):
        return []
    engine_cases = case_specs(kind="engine")
    return [c for c in bisect_case_ids(args) if c in engine_cases]


def start_early(args) -> list[EngineRun]:
    """The subprocesses bisect-check starts before this process's own host checks (``cli._on_production``):
    its engines, each of which imports vLLM and checks the host itself, so that those
    seconds overlap this process's instead of following them (their end is the bisect's critical
    path). Its arguments are checked already; where the checks then fail, the caller stops them
    (``stop_engine_cases``). Even a lone engine gets a fixed KV size:
    this process creates its CUDA context during the checks, and vLLM's memory profiling fails
    when another process allocates GPU memory meanwhile."""
    engine_ids = bisect_engine_ids(args)
    side_by_side = [c for c in bisect_case_ids(args) if c not in engine_ids]
    return engine_process.start_engine_cases(engine_ids, gpu_shared=bool(side_by_side), fixed_kv=True)


def bisect_command(args, started: list[EngineRun] | None = None) -> int:
    """``started``: its engine subprocesses, when ``start_early`` started them (else started here);
    collected and stopped here either way. (``--record-baseline DIR`` is ``baseline.record_baseline_command``,
    which ``harness.cli`` runs instead.)"""
    t_entry = process_age_s()
    from harness.goldens import production as production_goldens  # these import torch: after the arguments
    from harness.goldens import store  # and the host were checked
    from harness.production.module.side_by_side import run_facts
    from harness.regimes import coverage, uncovered
    from harness.report import save_report

    engine_ids = bisect_engine_ids(args)
    ids = [c for c in bisect_case_ids(args) if c not in engine_ids]
    # the golden each case is judged against: a host baseline (refused, exit 2, when recorded on
    # another platform: before anything runs) or the checked-in goldens
    stamp = None
    if getattr(args, "baseline", None):
        stamp = baseline.check_platform(args.baseline, production_goldens.platform())
        golden = ("baseline", Path(args.baseline))
        print(f"baseline {args.baseline}: platform {describe(stamp['platform'])}, recorded with "
              f"{describe_vllm(stamp.get('recorded_with'))}")
    else:
        golden = ("golden", store.ROOT)
    # the speculator path: one engine per subprocess, started first (by start_early, before this
    # process's host checks) and running while this process runs the side-by-side cases on the same
    # GPU, collected (and printed) after them (a --plant mutant patches the module-level model only;
    # HYV4_SPECULATOR_MUTANT the speculator)
    if started is None:
        started = engine_process.start_engine_cases(engine_ids, gpu_shared=bool(ids))
    try:
        sbs = bisect_side_by_side(ids, getattr(args, "plant", None), golden, beside=started)
    except BaseException:
        engine_process.stop_engine_cases(started)
        raise
    t_side_by_side = process_age_s()
    engine, engine_verdict = engine_process.collect_engine_cases(started)
    timeline = _timeline(started, engine, checked=t_entry, side_by_side=t_side_by_side,
                         collected=process_age_s())
    verdict = worst([sbs.verdict, engine_verdict])
    if sbs.failed_line is not None:  # a side-by-side case did not run: its one line, then stop
        print(sbs.failed_line)
        return verdict
    missing = uncovered(sbs.regimes)
    if missing:  # a harness weakness, not a vLLM verdict: reported, the exit code stays vLLM's
        print(f"warning: no case of this run exercises the regime(s) {missing} (harness/regimes.py)")
    if args.report:
        save_report(args.report, sbs.reports, {
            **run_facts(), "engine": engine, "regimes": sbs.regimes, "torch_threads": sbs.threads,
            "timeline_s": timeline,
            "regime_coverage": coverage(sbs.regimes), "not_judged": sbs.not_judged,
            "golden_root": str(golden[1]), "baseline": stamp,
            **({"plant": {"name": args.plant, "applied_to": sbs.planted, "not_applied": sbs.plant_notes}}
               if getattr(args, "plant", None) else {})})
    verdict = unjudged_verdict(verdict, sbs.not_judged, getattr(args, "allow_unjudged", False))
    return plant_verdict(getattr(args, "plant", None), ids, sbs, verdict)


def plant_verdict(plant: str | None, ids: list[str], sbs: SideBySide, verdict: int) -> int:
    """A --plant self-test that planted nothing judged vLLM as it is: it cannot say whether the bug
    would be caught (125, whatever --allow-unjudged says), unless vLLM failed anyway (that stands)."""
    if plant is None or not ids or sbs.planted:
        return verdict
    print(f"NOT JUDGED: --plant {plant} applies to none of this run's side-by-side cases "
          f"({len(sbs.plant_notes)} listed above): vLLM was judged as it is"
          + ("" if verdict != EXIT_OK else "; exit 125, cannot judge the plant"))
    return EXIT_CANNOT_JUDGE if verdict == EXIT_OK else verdict


def _timeline(runs: list[EngineRun], engine: dict, **marks: float | None) -> dict:
    """Where the bisect's wall time went, in seconds of this process's life (``process_age_s``):
    ``marks`` (its host checks done, its side-by-side cases done, the engines collected) and each
    engine's span, from its start to its case's end (its own start-up and case seconds as it
    reported them; its exit is later by the report's write). Off Linux: empty."""
    out = {k: round(v, 2) for k, v in marks.items() if v is not None}
    if len(out) < len(marks):
        return {}
    for r in runs:
        t = (engine.get(r.case_id) or {}).get("timing_s") or {}
        if r.started_s is not None and "start_up" in t and "total" in t:
            out[f"engine {r.case_id}"] = [round(r.started_s, 2), round(r.started_s + t["start_up"] + t["total"], 2)]
    return out
