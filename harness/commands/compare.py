"""``python -m harness compare`` on a GPU: one side-by-side case (a checkpoint directory,
preset:NAME with seeded weights, or a named GPU case; ``--tp N`` runs it on N GPUs and also
against TP = 1) -> per-component table, optional JSON report; exit 0 / 1. An engine case id runs
vLLM's own speculator end to end (``harness.production.engine.process``).

Here also what ``bisect-check`` (``bisect_check.py``) and its baseline (``record_baseline.py``) share
with it: the case of a ``compare``, and one case run in this process with its failure as one line
(``run_side_by_side``: a load failure is 1, any other crash 125).

No silent pass: a golden part that could not be judged prints ``NOT JUDGED: ...`` and is listed in
the report's ``not_judged``; ``compare`` keeps its exit code (``bisect-check`` exits 125 there).

Exit codes are ``harness.exitcodes``'s: a checkpoint directory is validated
by the loader before any GPU question (exit 2), and vLLM leaving a parameter
unloaded (``LoadAuditError``) is a bad commit (exit 1, naming the parameter).

Imports that pull in torch or vLLM stay inside the functions that need them (each says so): this
module is imported while the arguments are checked, before any host question.
"""

from __future__ import annotations

import dataclasses
import os

from harness import input_checks as check
from harness.exitcodes import EXIT_CANNOT_JUDGE, EXIT_MISMATCH, EXIT_OK, CLIError, first_line, load_failure_line
from harness.presets import check_kernel_constraints, preset
from harness.case_registry import ids as case_ids, specs as case_specs
from harness.case_specs import GpuCase
from harness.production.case_inputs import build_inputs
from harness.production.engine.process import run_engine_cases


PLANT_NOT_APPLIED = "plant not applicable:"  # run_side_by_side's note: the case ran as vLLM is
MAX_TP = 8      # GPUs of one host
MAX_STEPS = 32  # draft steps K
# --steps / --seed when neither is given: they shape a checkpoint directory's or a preset's case;
# a case id fixes its own, so they are refused there (exit 2), never dropped
DEFAULT_STEPS, DEFAULT_SEED = 2, 0



def _case_for(args):
    """The GpuCase ``compare`` runs: a checkpoint directory, preset:NAME (seeded weights) or a GPU case id
    (an engine case id: the id). The one mapping of ``compare``'s arguments to a case: ``--steps`` /
    ``--seed`` apply to a checkpoint directory or a preset; with a case id they are bad input."""
    from reference import ConfigError, MTPConfig  # imports torch: only once a case is being mapped

    ckpt = args.ckpt or "preset:tiny"
    module_cases, engine_cases = case_specs(kind="module", without="probe"), case_specs(kind="engine")
    given = [flag for flag, v in (("--steps", args.steps), ("--seed", args.seed)) if v is not None]
    if given and (ckpt in module_cases or ckpt in engine_cases):
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
        from harness.checkpoint.quant import quant_of_config  # imports torch
        case = GpuCase(f"ckpt-{os.path.basename(path.rstrip(os.sep))}-seed{seed}", ckpt_dir=path,
                       seed=seed, steps=steps, requests=2, tokens=160)
        try:
            case = dataclasses.replace(case, quant=quant_of_config(loaded.hf_config))
        except (OSError, ValueError) as exc:
            raise CLIError(f"{ckpt}/config.json: {exc}") from exc
    elif ckpt in module_cases:
        case = module_cases[ckpt]
    elif ckpt in engine_cases:
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
                       f"({', '.join([*module_cases, *engine_cases])})")
    tp = getattr(args, "tp", 1)
    try:
        cfg = MTPConfig.from_hf_dict(case.hf_config())
        if cfg.num_attention_heads % tp:
            raise ConfigError(f"--tp {tp} does not divide num_attention_heads {cfg.num_attention_heads}")
        check_kernel_constraints(cfg, quantized=case.quant != "bf16", tp=tp)
    except ConfigError as exc:
        raise CLIError(f"{ckpt}: {exc}") from exc
    return case


def _validated_checkpoint(path: str):
    """``load_checkpoint(path)``, once per directory and process (its CheckpointError is exit 2)."""
    from harness.checkpoint.loader import load_checkpoint  # imports torch

    if _VALIDATED.get("path") != path:
        _VALIDATED.clear()
        _VALIDATED.update(path=path, loaded=load_checkpoint(path))
    return _VALIDATED["loaded"]


_VALIDATED: dict = {}


def validate_args(args) -> None:
    """``compare``'s (and ``main``'s) CLIError (exit 2) for arguments no machine could run, before
    asking for a GPU."""
    report = getattr(args, "report", None)
    if report is not None:
        check.output_file("--report", report)
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


def _failure(what: str, exc: Exception) -> tuple[None, int, str]:
    """(None, exit code, one line) for an exception while vLLM built, loaded or ran a case.

    vLLM leaving a parameter unloaded (the post-load audit's ``LoadAuditError``)
    is a bad commit: exit 1, naming the parameter. Any other crash while
    building, loading or running vLLM (a missing kernel, a refused config, a
    JIT failure) means "cannot judge" (exit 125), never "numeric mismatch":
    git bisect then skips the commit instead of blaming it.
    """
    from harness.production.module.audit import LoadAuditError  # imports torch

    if isinstance(exc, LoadAuditError):
        return None, EXIT_MISMATCH, f"{load_failure_line(exc)} ({what})"
    return None, EXIT_CANNOT_JUDGE, f"cannot judge: {what} failed: {exc.__class__.__name__}: {first_line(exc)}"


def _inputs(case):
    """The ``CaseInputs`` of ``case``, built once for its run and its judge; a checkpoint directory's
    tensors are the ones ``_case_for`` already loaded and validated (not read again)."""
    return build_inputs(case, loaded=_validated_checkpoint(case.ckpt_dir) if case.ckpt_dir else None)


def run_side_by_side(case, plant: str | None = None):
    """(result, EXIT_OK, note), or (None, code, one line) when production failed on the case (``_failure``).

    ``plant``: a mutant of harness.mutants applied after loading; a case it does not apply to runs
    as vLLM is, and ``note`` says so (``PLANT_NOT_APPLIED`` starts it; else it is empty)."""
    from harness.production.module.side_by_side import run_case  # imports torch and, running, vLLM

    try:
        if plant is not None:
            from harness.mutants import MutantNotApplicable, run_planted  # imports torch
            try:
                return run_planted(case, plant), EXIT_OK, ""
            except MutantNotApplicable as exc:
                note = f"{PLANT_NOT_APPLIED} {plant} to {case.id} ({first_line(str(exc))[:160]}): judged as vLLM is"
                return run_case(case, inputs=_inputs(case)), EXIT_OK, note
        return run_case(case, inputs=_inputs(case)), EXIT_OK, ""
    except Exception as exc:  # noqa: BLE001 - any production failure is reported, one line
        return _failure(f"production run of {case.id}", exc)


def _run_tp(case, tp: int):
    """(run_case_tp result, EXIT_OK, "") or (None, code, one line): ``case`` at TP = ``tp`` on ``tp`` GPUs."""
    import torch  # the GPU side: after the arguments and the host were checked

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
            from harness.production.module.side_by_side import run_facts  # imports torch
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
        result, code, line = run_side_by_side(case)
        vs = None
        if result is None:
            print(line)
            return code
    from harness.goldens import store  # these import torch (a run is done by now)
    from harness.goldens.production import judge_golden, not_judged_line
    from harness.production.module.side_by_side import format_rows, run_facts, versions

    print(format_rows(result))
    reports = {case.id if tp == 1 else f"{case.id}/tp{tp}": result.comparison}
    if vs is not None:
        print(f"== TP={tp} vs TP=1 (step 0 components, draft tokens of every step): "
              f"{'PASS' if vs.passed else 'FAIL'}\n{vs.table()}")
        reports[f"{case.id}/tp{tp}-vs-tp1"] = vs
    golden_code, not_judged = EXIT_OK, []
    # the named case its golden was recorded from
    if case.id in case_ids(role="golden", kind="module") and case == _golden_case(case.id):
        if tp == 1:
            golden, golden_code, not_judged = judge_golden("golden", case.id, result.trace, store.ROOT)
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
    return case_specs(kind="module", without="probe").get(case_id)
