"""``python -m harness compare`` and ``bisect-check`` on a GPU.

compare: one side-by-side case (a checkpoint directory, preset:NAME with
seeded weights, or a named GPU case; ``--tp N`` runs it on N GPUs and also
against TP = 1) -> per-component table, optional JSON report; exit 0 / 1.
bisect-check: a small default set of side-by-side cases (``BISECT_CASES``), each judged
against the reference and against its production golden: the checked-in goldens of this
platform, or with ``--baseline DIR`` a host baseline recorded at the good commit
(``--record-baseline DIR``) -> exit 0 (good) / 1 (mismatch) / 125 (cannot judge: the
production path does not build here, or a golden part could not be judged).

No silent pass: a golden part that could not be judged (no golden for this platform, a case
the baseline lacks, components a golden predates) prints ``NOT JUDGED: ...`` and is listed in
the report's ``not_judged``; bisect-check then exits 125 unless a judged part failed (1), so
``git bisect run`` never calls a commit good on a check that did not run. ``--allow-unjudged``
makes that 0, with the line. ``compare`` prints the same lines and keeps its exit code.

Exit codes are ``harness.exitcodes``'s: a checkpoint directory is validated
by the loader before any GPU question (exit 2), and vLLM leaving a parameter
unloaded (``LoadAuditError``) is a bad commit (exit 1, naming the parameter).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from harness.process_clock import process_age_s
from harness.exitcodes import EXIT_CANNOT_JUDGE, EXIT_MISMATCH, EXIT_OK, CLIError, first_line, load_failure_line, worst
from harness.case_registry import ids as case_ids
from harness.production.cases import BISECT_CASES
from harness.production.goldens.platform_key import describe, describe_vllm

# The bisect's case lists, views of harness.case_registry. The side-by-side cases (role bisect,
# kind module: harness.production.cases.BISECT_CASES, also the goldens' set)
DEFAULT_BISECT_CASES = BISECT_CASES
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


MAX_TP = 8      # GPUs of one host
MAX_STEPS = 32  # draft steps K
# --steps / --seed when neither is given: they shape a checkpoint directory's or a preset's case;
# a case id fixes its own, so they are refused there (exit 2), never dropped
DEFAULT_STEPS, DEFAULT_SEED = 2, 0


def _case_for(args):
    """The GpuCase ``compare`` runs: a checkpoint directory, preset:NAME (seeded weights) or a GPU case id
    (an engine case id: the id). The one mapping of ``compare``'s arguments to a case: ``--steps`` /
    ``--seed`` apply to a checkpoint directory or a preset; with a case id they are bad input."""
    import os

    from harness.presets import check_kernel_constraints, preset
    from reference import ConfigError, MTPConfig

    from harness.production.cases import GPU_CASES, GpuCase

    ckpt = args.ckpt or "preset:tiny"
    given = [flag for flag, v in (("--steps", args.steps), ("--seed", args.seed)) if v is not None]
    if given and (ckpt in GPU_CASES or ckpt in _engine_cases()):
        raise CLIError(f"{' and '.join(given)}: case {ckpt} fixes its own steps and seed; drop "
                       f"{'them' if len(given) > 1 else 'it'}, or give preset:NAME or a checkpoint directory")
    steps = DEFAULT_STEPS if args.steps is None else args.steps
    seed = DEFAULT_SEED if args.seed is None else args.seed
    if os.path.isdir(ckpt):
        if not os.path.isfile(os.path.join(ckpt, "config.json")):
            raise CLIError(f"{ckpt}: not a checkpoint directory (no config.json)")
        path = os.path.abspath(ckpt)
        # the whole checkpoint through the loader (config, index, every MTP tensor's
        # name, shape, dtype, finiteness, scales, duplicates across shards) before
        # any GPU question: a bad checkpoint is bad input (exit 2) on any machine
        loaded = _validated_checkpoint(path)
        from harness.checkpoint.quant import quant_of_config
        case = GpuCase(f"ckpt-{os.path.basename(path.rstrip(os.sep))}-seed{seed}", ckpt_dir=path,
                       seed=seed, steps=steps, requests=2, tokens=160)
        try:
            case = dataclasses.replace(case, quant=quant_of_config(loaded.hf_config))
        except (OSError, ValueError) as exc:
            raise CLIError(f"{ckpt}/config.json: {exc}") from exc
    elif ckpt in GPU_CASES:
        case = GPU_CASES[ckpt]
    elif ckpt in _engine_cases():
        return ckpt  # vLLM's own speculator, engine level (engine.py)
    elif ckpt.startswith("preset:"):
        case = GpuCase(f"{ckpt[7:]}-seed{seed}", preset=ckpt[7:], seed=seed, steps=steps,
                       requests=2, tokens=160)
        try:
            preset(case.preset)
        except KeyError as exc:
            raise CLIError(str(exc.args[0])) from exc
    else:
        raise CLIError(f"{ckpt}: compare takes a checkpoint directory, preset:NAME or a case id "
                       f"({', '.join([*GPU_CASES, *_engine_cases()])})")
    tp = getattr(args, "tp", 1)
    try:
        cfg = MTPConfig.from_hf_dict(case.hf_config())
        if cfg.num_attention_heads % tp:
            raise ConfigError(f"--tp {tp} does not divide num_attention_heads {cfg.num_attention_heads}")
        check_kernel_constraints(cfg, quantized=case.quant != "bf16", tp=tp)
    except ConfigError as exc:
        raise CLIError(f"{ckpt}: {exc}") from exc
    return case


def _engine_cases():
    from harness.production.engine.cases import ENGINE_CASES
    return ENGINE_CASES


def _validated_checkpoint(path: str):
    """``load_checkpoint(path)``, once per directory and process (its CheckpointError is exit 2)."""
    from harness.checkpoint.loader import load_checkpoint

    if _VALIDATED.get("path") != path:
        _VALIDATED.clear()
        _VALIDATED.update(path=path, loaded=load_checkpoint(path))
    return _VALIDATED["loaded"]


_VALIDATED: dict = {}


def validate_args(command: str, args) -> None:
    """CLIError (exit 2) for arguments no machine could run, before asking for a GPU."""
    import os

    from harness import input_checks as check

    report = getattr(args, "report", None)
    if report is not None:
        check.output_file("--report", report)
    if command == "compare_command":
        check.checkpoint(args.ckpt)
        if report is not None and os.path.isdir(args.ckpt):
            check.not_an_input("--report", report, args.ckpt)
        if getattr(args, "tp", 1) < 1:
            raise CLIError("--tp must be >= 1")
        if args.steps is not None and args.steps < 1:
            raise CLIError("--steps must be >= 1")
        check.integer("--tp", args.tp, 1, MAX_TP, "GPUs of one host")
        if args.steps is not None:
            check.integer("--steps", args.steps, 1, MAX_STEPS)
        if args.seed is not None:
            check.seed("--seed", args.seed)
        if isinstance(_case_for(args), str) and args.tp != 1:
            raise CLIError(f"--tp {args.tp}: applies to side-by-side cases; engine case {args.ckpt} runs at TP = 1")
        if args.tp != 1 and getattr(_case_for(args), "reload_seed", None) is not None:
            raise CLIError(f"--tp {args.tp}: reload case {args.ckpt} runs at TP = 1 (its reload is one process's)")
    elif command == "bisect_command":
        from harness.production.engine.cases import ENGINE_CASES
        from harness.production.cases import GPU_CASES

        from harness.exitcodes import listed

        unknown = [c for c in (args.case or []) if c not in GPU_CASES and c not in ENGINE_CASES]
        if unknown:
            raise CLIError(f"--case: unknown case(s) {listed(unknown, 5)}; known: "
                           f"{listed([*GPU_CASES, *ENGINE_CASES], 40)}")
        plant = getattr(args, "plant", None)
        if plant is not None:
            from harness.mutants import BY_NAME
            if plant not in BY_NAME:
                raise CLIError(f"--plant {listed([plant])}: unknown mutant; known: {listed(BY_NAME, 40)}")
        _validate_baseline_args(args)


def _validate_baseline_args(args) -> None:
    """bisect-check's baseline flags: CLIError (exit 2) for a combination or a directory no machine could use."""
    from harness.production.goldens import baseline

    record, judge_dir = getattr(args, "record_baseline", None), getattr(args, "baseline", None)
    if record and judge_dir:
        raise CLIError("--record-baseline and --baseline: record at the good commit, judge with --baseline later")
    if getattr(args, "force", False) and not record:
        raise CLIError("--force applies to --record-baseline (it replaces an existing baseline)")
    from harness import input_checks as check

    if record:
        check.output_dir("--record-baseline", record)  # a name too long, /proc, a read-only parent: 2 here
        if getattr(args, "plant", None) is not None:
            raise CLIError("--plant and --record-baseline: a baseline records vLLM as it is, never a planted bug")
        if getattr(args, "allow_unjudged", False):
            raise CLIError("--allow-unjudged and --record-baseline: recording judges nothing against a golden")
        if not _side_by_side_ids(args):
            raise CLIError("--record-baseline: no side-by-side case to record (engine cases have no baseline)")
        baseline.check_record_target(record, getattr(args, "force", False))
    if judge_dir:
        check.input_dir("--baseline", judge_dir)
        baseline.read_stamp(judge_dir)


def _side_by_side_ids(args) -> list[str]:
    """bisect-check's side-by-side case ids (``--case`` or the default set), engine cases left out."""
    from harness.production.engine.cases import ENGINE_CASES

    ids = bisect_case_ids(args)
    if getattr(args, "record_baseline", None) and not args.case:  # never judged against a baseline
        ids = [c for c in ids if c not in REFERENCE_ONLY_BISECT_CASES]
    return [c for c in ids if c not in ENGINE_CASES]


def _failure(what: str, exc: Exception) -> tuple[None, int, str]:
    """(None, exit code, one line) for an exception while vLLM built, loaded or ran a case.

    vLLM leaving a parameter unloaded (the post-load audit's ``LoadAuditError``)
    is a bad commit: exit 1, naming the parameter. Any other crash while
    building, loading or running vLLM (a missing kernel, a refused config, a
    JIT failure) means "cannot judge" (exit 125), never "numeric mismatch":
    git bisect then skips the commit instead of blaming it.
    """
    from harness.production.module.audit import LoadAuditError

    if isinstance(exc, LoadAuditError):
        return None, EXIT_MISMATCH, f"{load_failure_line(exc)} ({what})"
    return None, EXIT_CANNOT_JUDGE, f"cannot judge: {what} failed: {exc.__class__.__name__}: {first_line(exc)}"


def _inputs(case):
    """The ``CaseInputs`` of ``case``, built once for its run and its judge; a checkpoint directory's
    tensors are the ones ``_case_for`` already loaded and validated (not read again)."""
    from harness.production.cases import build_inputs

    return build_inputs(case, loaded=_validated_checkpoint(case.ckpt_dir) if case.ckpt_dir else None)


def _run(case, plant: str | None = None):
    """(result, EXIT_OK, ""), or (None, code, one line) when production failed on the case (``_failure``).

    ``plant``: a mutant of harness.mutants applied after loading (a case it
    does not apply to runs pristine)."""
    from harness.production.module.side_by_side import run_case

    try:
        if plant is not None:
            from harness.mutants import MutantNotApplicable, run_planted
            try:
                return run_planted(case, plant), EXIT_OK, ""
            except MutantNotApplicable:
                pass
        return run_case(case, inputs=_inputs(case)), EXIT_OK, ""
    except Exception as exc:  # noqa: BLE001 - any production failure is reported, one line
        return _failure(f"production run of {case.id}", exc)


def _run_tp(case, tp: int):
    """(run_case_tp result, EXIT_OK, "") or (None, code, one line): ``case`` at TP = ``tp`` on ``tp`` GPUs."""
    import torch

    from harness.production.tp.multigpu import TPWorkers, run_case_tp

    if torch.cuda.device_count() < tp:
        return None, EXIT_CANNOT_JUDGE, f"cannot judge: --tp {tp} needs {tp} GPUs, found {torch.cuda.device_count()}"
    try:
        with TPWorkers(tp) as workers:
            return run_case_tp(workers, case, inputs=_inputs(case)), EXIT_OK, ""
    except Exception as exc:  # noqa: BLE001 - any production failure is reported, one line
        return _failure(f"TP={tp} production run of {case.id}", exc)


def compare_command(args) -> int:
    from harness.report import save_report  # imports torch: not while the arguments are checked

    case = _case_for(args)
    tp = getattr(args, "tp", 1)
    if isinstance(case, str):  # an engine case: vLLM's speculator end to end
        if tp > 1:
            raise CLIError("--tp applies to side-by-side cases; engine cases run at TP = 1")
        engine, verdict = run_engine_cases([case])
        if args.report:
            from harness.production.module.side_by_side import run_facts
            save_report(args.report, {}, {**run_facts(), "engine": engine})
        return verdict
    if tp > 1:
        res, code, line = _run_tp(case, tp)
        if res is None:
            print(line)
            return code
        result, vs = res.parts["tpn"], res.parts["tp_vs_tp1"]
        result.comparison.meta.update(tp=tp, merge_rules=res.details["rules"])
    else:
        result, code, line = _run(case)
        vs = None
        if result is None:
            print(line)
            return code
    from harness import goldens
    from harness.production.goldens.goldens_gpu import GOLDEN_CASES, judge_golden, not_judged_line
    from harness.production.module.side_by_side import format_rows, run_facts, versions

    print(format_rows(result))
    reports = {case.id if tp == 1 else f"{case.id}/tp{tp}": result.comparison}
    if vs is not None:
        print(f"== TP={tp} vs TP=1 (step 0 components, draft tokens of every step): "
              f"{'PASS' if vs.passed else 'FAIL'}\n{vs.table()}")
        reports[f"{case.id}/tp{tp}-vs-tp1"] = vs
    golden_code, not_judged = EXIT_OK, []
    if case.id in GOLDEN_CASES and case == _golden_case(case.id):  # the named case its golden was recorded from
        if tp == 1:
            golden, golden_code, not_judged = judge_golden("golden", case.id, result.trace, goldens.ROOT)
            if golden is not None:
                reports[f"golden/{case.id}"] = golden
        else:
            why = "a golden holds the TP = 1 run; TP = N is judged against TP = 1 above"
            print(not_judged_line("golden", case.id, why))
            not_judged = [{"part": f"golden/{case.id}", "reason": why}]
    if not_judged:
        print(f"NOT JUDGED: {len(not_judged)} golden part(s) of this verdict could not be judged (above); "
              "compare's exit code is the judged parts' (bisect-check exits 125 here)")
    if args.report:
        result.comparison.meta.update(versions=versions(), case=dataclasses.asdict(case),
                                      model_kernel_paths=result.details.get("model_kernel_paths"))
        save_report(args.report, reports, {**run_facts(), "not_judged": not_judged})
        print(f"report: {args.report}")
    passed = result.passed and (vs is None or vs.passed) and golden_code == EXIT_OK
    return EXIT_OK if passed else EXIT_MISMATCH


def _golden_case(case_id: str):
    from harness.production.cases import GPU_CASES

    return GPU_CASES.get(case_id)


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
class _SideBySide:
    """What bisect-check's side-by-side cases gave: reports, regime values, production traces."""
    reports: dict = dataclasses.field(default_factory=dict)
    regimes: dict = dataclasses.field(default_factory=dict)
    traces: dict = dataclasses.field(default_factory=dict)
    not_judged: list = dataclasses.field(default_factory=list)
    threads: dict = dataclasses.field(default_factory=dict)  # this process's torch threads: own, while engines ran
    verdict: int = EXIT_OK
    failed_line: str | None = None  # the one line of a case that did not run


class _ThreadShare:
    """This process's torch threads while ``runs`` (engine subprocesses started beside it) compute:
    its share of the cores (``can_run.cpu_share``, as theirs; never more than it had), back to
    what it had once they have all exited (``update``, between cases) or the work ends
    (``restore``). A thread count the user set (``OMP_NUM_THREADS``) is left alone. Thread counts
    move float64 CPU sums in their last bits only; every tolerance is orders of magnitude above that."""

    def __init__(self, runs: list):
        import os

        from harness.production.can_run import THREAD_VARS, cpu_share
        self.runs, self.before, self.facts = runs, None, {}
        if runs and not os.environ.get(THREAD_VARS[0], "").strip():
            import torch
            self.before = torch.get_num_threads()
            torch.set_num_threads(min(self.before, cpu_share(len(runs) + 1)))
            self.facts = {"own": self.before, "beside_engines": torch.get_num_threads()}

    def update(self) -> None:
        if self.before is not None and all(r.proc.poll() is not None for r in self.runs):
            self.restore()

    def restore(self) -> None:
        if self.before is not None:
            import torch
            torch.set_num_threads(self.before)
            self.before = None


def _bisect_side_by_side(ids, plant, golden: tuple[str, object] | None, beside: list | None = None) -> _SideBySide:
    """bisect-check's side-by-side cases, in this process, each against the reference and (``golden``:
    (label, root), None when recording) against its golden. A case that does not run ends the loop:
    a load failure is a bad commit (1), any other crash cannot judge (125). ``beside``: the engine
    subprocesses running meanwhile (this process takes its share of the CPU while they do)."""
    out = _SideBySide()
    share = _ThreadShare(beside or [])
    try:
        _side_by_side_cases(ids, plant, golden, out, share)
    finally:
        share.restore()
    out.threads = share.facts
    return out


def _side_by_side_cases(ids, plant, golden, out: _SideBySide, share: _ThreadShare) -> None:
    from harness.production.cases import GPU_CASES
    from harness.production.goldens.goldens_gpu import judge_golden
    from harness.production.module.side_by_side import format_regimes

    for cid in ids:
        share.update()
        t0 = time.perf_counter()
        result, code, line = _run(GPU_CASES[cid], plant)
        if result is None:
            out.verdict, out.failed_line = worst([out.verdict, code]), line
            return
        out.reports[f"side-by-side/{cid}"] = result.comparison
        # seconds: this case in this process, all of it; timing_s: its production build / load / run and
        # the reference (replays and the free-running draft the regimes come from); the rest of seconds
        # is the inputs and the comparison (the golden check below is not in it)
        result.comparison.meta.update(regimes=result.regimes, model_kernel_paths=result.details.get("model_kernel_paths"),
                                      seconds=round(time.perf_counter() - t0, 2),
                                      timing_s=result.details.get("timing_s"))
        out.regimes[cid] = result.regimes
        first = result.first_divergent
        print(f"{'ok  ' if result.passed else 'FAIL'} side-by-side {cid}" + ("" if result.passed else f": first divergent {first}"))
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
    from harness.production.engine.cases import ENGINE_CASES

    if getattr(args, "record_baseline", None):
        return []
    return [c for c in bisect_case_ids(args) if c in ENGINE_CASES]


def start_early(command: str, args) -> list[_EngineRun]:
    """The subprocesses ``command`` starts before this process's own host checks (``cli._on_production``):
    bisect-check's engines, each of which imports vLLM and checks the host itself, so that those
    seconds overlap this process's instead of following them (their end is the bisect's critical
    path). Its arguments are checked already; where the checks then fail, the caller stops them
    (``stop_engine_cases``). Any other command: none. Even a lone engine gets a fixed KV size:
    this process creates its CUDA context during the checks, and vLLM's memory profiling fails
    when another process allocates GPU memory meanwhile."""
    if command != "bisect_command":
        return []
    engine_ids = bisect_engine_ids(args)
    side_by_side = [c for c in bisect_case_ids(args) if c not in engine_ids]
    return start_engine_cases(engine_ids, gpu_shared=bool(side_by_side), fixed_kv=True)


def bisect_command(args, started: list[_EngineRun] | None = None) -> int:
    """``started``: its engine subprocesses, when ``start_early`` started them (else started here);
    collected and stopped here either way."""
    t_entry = process_age_s()
    if getattr(args, "record_baseline", None):
        return record_baseline_command(args)
    from harness import goldens
    from harness.regimes import coverage, uncovered
    from harness.report import save_report

    from harness.production.goldens import baseline, goldens_gpu
    from harness.production.module.side_by_side import run_facts

    engine_ids = bisect_engine_ids(args)
    ids = [c for c in bisect_case_ids(args) if c not in engine_ids]
    # the golden each case is judged against: a host baseline (refused, exit 2, when recorded on
    # another platform: before anything runs) or the checked-in goldens
    stamp = None
    if getattr(args, "baseline", None):
        stamp = baseline.check_platform(args.baseline, goldens_gpu.platform())
        golden = ("baseline", Path(args.baseline))
        print(f"baseline {args.baseline}: platform {describe(stamp['platform'])}, recorded with "
              f"{describe_vllm(stamp.get('recorded_with'))}")
    else:
        golden = ("golden", goldens.ROOT)
    # the speculator path: one engine per subprocess, started first (by start_early, before this
    # process's host checks) and running while this process runs the side-by-side cases on the same
    # GPU, collected (and printed) after them (a --plant mutant patches the module-level model only;
    # HYV4_SPECULATOR_MUTANT the speculator)
    if started is None:
        started = start_engine_cases(engine_ids, gpu_shared=bool(ids))
    try:
        sbs = _bisect_side_by_side(ids, getattr(args, "plant", None), golden, beside=started)
    except BaseException:
        stop_engine_cases(started)
        raise
    t_side_by_side = process_age_s()
    engine, engine_verdict = collect_engine_cases(started)
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
            "golden_root": str(golden[1]), "baseline": stamp})
    return unjudged_verdict(verdict, sbs.not_judged, getattr(args, "allow_unjudged", False))


def _timeline(runs: list[_EngineRun], engine: dict, **marks: float | None) -> dict:
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


def record_baseline_command(args) -> int:
    """``bisect-check --record-baseline DIR``: run the side-by-side cases (each still judged against
    the reference, and said so) and record their production traces as baseline DIR, all or nothing:
    0 when every case was recorded; a case that does not run records nothing (its code: 1 / 125)."""
    from harness.atomic import write_errors, write_failure
    from harness.report import save_report

    from harness.production.goldens import baseline
    from harness.production.module.side_by_side import run_facts

    ids = _side_by_side_ids(args)
    left = [c for c in (args.case or DEFAULT_BISECT_ENGINE_CASES) if c not in ids]
    if left:
        print(f"engine case(s) {', '.join(left)}: not part of a baseline (vLLM's speculator is judged "
              "against its own expectations at every commit)")
    sbs = _bisect_side_by_side(ids, None, None)
    if sbs.failed_line is not None:
        print(sbs.failed_line)
        print(f"nothing recorded: {args.record_baseline} is unchanged")
        return sbs.verdict
    if sbs.verdict != EXIT_OK:
        print("warning: a side-by-side case failed against the reference at this commit: the baseline records "
              "this vLLM as it is (the reference part of every later verdict still judges it)")
    try:
        stamp = baseline.record(args.record_baseline, sbs.traces, force=getattr(args, "force", False))
    except write_errors() as exc:
        raise write_failure(f"--record-baseline {args.record_baseline}", exc) from exc
    print(f"recorded baseline {args.record_baseline}: {len(sbs.traces)} case(s) ({', '.join(sbs.traces)}), "
          f"platform {describe(stamp['platform'])}, {describe_vllm(stamp['recorded_with'])}; "
          f"judge later commits with: bisect-check --baseline {args.record_baseline}")
    if args.report:
        save_report(args.report, sbs.reports, {**run_facts(), "regimes": sbs.regimes,
                                                 "recorded_baseline": str(args.record_baseline)})
    return EXIT_OK


def run_engine_cases(case_ids) -> tuple[dict, int]:
    """Run engine cases (``python -m harness.production.engine``, one subprocess each, so
    every engine gets a fresh process, all at once) -> ({case: summary}, worst exit code).
    A planted speculator bug named by ``HYV4_SPECULATOR_MUTANT`` reaches the subprocesses."""
    return collect_engine_cases(start_engine_cases(case_ids))


@dataclasses.dataclass
class _EngineRun:
    case_id: str
    proc: object  # subprocess.Popen
    tmp: object  # tempfile.TemporaryDirectory: the report and the process's output
    started_s: float | None = None  # when, in seconds of this process's life (process_age_s)


def start_engine_cases(case_ids, *, gpu_shared: bool = False, fixed_kv: bool = False) -> list[_EngineRun]:
    """Start one engine subprocess per case, concurrently, and return at once. Several engines,
    or an engine next to this process's own side-by-side runs (``gpu_shared``), share the GPU:
    they get a fixed KV size (``HYV4_ENGINE_KV_CACHE_GIB``, 4 GiB unless set), which skips vLLM's
    memory profiling (it fails when another process allocates or frees meanwhile) and asks
    its start-up check for 0.1 of the GPU (harness.production.engine.session.engine_kwargs).
    They share the host's CPU too: each gets its share of the cores as torch threads
    (``can_run.cpu_share``; this process takes its own with ``_ThreadShare``). vLLM keeps a count
    set this way for serving, as it keeps any ``OMP_NUM_THREADS`` set outside it (unset, it drops
    its own process to 1 thread after loading); the GPU tier's engines run the same way, under
    their xdist worker's share."""
    import os
    import subprocess
    import sys
    import tempfile

    from harness.production.engine.cases import engine_env

    # the processes on this host's CPU at once: the engines, and this one when it runs cases too
    # fixed_kv: this process touches the GPU meanwhile without computing beside them (start_early)
    env = engine_env(gpu_shared or fixed_kv or len(case_ids) > 1,
                     computing=len(case_ids) + (1 if gpu_shared else 0))
    env.pop("HYV4_HISTORY", None)  # this command records its engines in its own run (harness.history)
    runs = []
    try:
        for cid in case_ids:
            tmp = tempfile.TemporaryDirectory(prefix="hyv4-engine-")
            with open(os.path.join(tmp.name, "output.txt"), "w") as log:
                proc = subprocess.Popen([sys.executable, "-m", "harness.production.engine", "--case", cid,
                                         "--out", tmp.name], stdout=log, stderr=subprocess.STDOUT, env=env)
            runs.append(_EngineRun(cid, proc, tmp, process_age_s()))
    except BaseException:
        stop_engine_cases(runs)
        raise
    return runs


def stop_engine_cases(runs: list[_EngineRun]) -> None:
    """Kill started engines (this process is failing) and remove their files."""
    for r in runs:
        if r.proc.poll() is None:
            r.proc.kill()
        r.proc.wait()
        r.tmp.cleanup()


def collect_engine_cases(runs: list[_EngineRun]) -> tuple[dict, int]:
    """Wait for started engines, print one line each (in case order) -> ({case: summary}, worst exit code)."""
    import json
    import os

    out, verdict = {}, EXIT_OK
    try:
        for r in runs:
            returncode = r.proc.wait()
            path = os.path.join(r.tmp.name, f"engine_mtp_{r.case_id}.json")
            rep = {}
            if os.path.isfile(path):
                with open(path) as f:
                    rep = json.load(f)
            code = returncode if returncode in (EXIT_OK, EXIT_MISMATCH) else EXIT_CANNOT_JUDGE
            problems = rep.get("problems") or []
            out[r.case_id] = {"exit": returncode, "problems": problems[:20], "acceptance": rep.get("acceptance"),
                              "counts": rep.get("counts"), "timing_s": rep.get("timing_s"),
                              "mutant": rep.get("mutant"), "drafter_mode": rep.get("drafter_mode"),
                              "compilation": rep.get("compilation"), "graph_replays": rep.get("graph_replays"),
                              "graph_facts": rep.get("graph_facts"), "graph_regimes": rep.get("graph_regimes"),
                              "components": rep.get("components")}
            label = r.case_id + (" [CUDA graphs]" if rep.get("drafter_mode") == "CUDA graphs" else "")
            if code == EXIT_OK:
                print(f"ok   engine {label}" + (f" (acceptance {_rates(rep)})" if rep.get("acceptance") else ""))
            elif code == EXIT_MISMATCH:
                print(f"FAIL engine {label}: {problems[0] if problems else 'exit 1, no report'}")
            else:
                with open(os.path.join(r.tmp.name, "output.txt"), errors="replace") as f:
                    tail = f.read().strip().splitlines()[-1:] or ["no output"]
                print(f"cannot judge: engine {r.case_id} exited {returncode}: {tail[0][:300]}")
            verdict = worst([verdict, code])
    finally:
        stop_engine_cases(runs)
    return out, verdict


def _rates(rep: dict) -> str:
    return ", ".join(f"{k}: {v['accepted']}/{v['drafted']}" for k, v in (rep.get("acceptance") or {}).items())
