"""``python -m harness compare`` and ``bisect-check`` on a GPU.

compare: one side-by-side case (a checkpoint directory, preset:NAME with
seeded weights, or a named GPU case; ``--tp N`` runs it on N GPUs and also
against TP = 1) -> per-component table, optional JSON report; exit 0 / 1.
bisect-check: a small default set of side-by-side cases plus the production
goldens recorded for this platform -> exit 0 (good) / 1 (mismatch) / 125
(cannot judge: the production path does not build here).

Exit codes are ``harness.exitcodes``'s: a checkpoint directory is validated
by the loader before any GPU question (exit 2), and vLLM leaving a parameter
unloaded (``LoadAuditError``) is a bad commit (exit 1, naming the parameter).
"""

from __future__ import annotations

import dataclasses

from harness.exitcodes import EXIT_CANNOT_JUDGE, EXIT_MISMATCH, EXIT_OK, CLIError, first_line, load_failure_line
from harness.report import write_report

DEFAULT_BISECT_CASES = ("tiny-k3-share", "tiny-k2-long", "tiny-k2-fused-layers")


def _case_for(args):
    """The GpuCase ``compare`` runs: a checkpoint directory, preset:NAME (seeded weights) or a GPU case id."""
    import os

    from harness.checkpoint.quant import quant_of_config
    from harness.presets import check_kernel_constraints, preset
    from reference import ConfigError, MTPConfig

    from .side_by_side import GPU_CASES, GpuCase

    ckpt = args.ckpt or "preset:tiny"
    if os.path.isdir(ckpt):
        if not os.path.isfile(os.path.join(ckpt, "config.json")):
            raise CLIError(f"{ckpt}: not a checkpoint directory (no config.json)")
        path = os.path.abspath(ckpt)
        # the whole checkpoint through the loader (config, index, every MTP tensor's
        # name, shape, dtype, finiteness, scales, duplicates across shards) before
        # any GPU question: a bad checkpoint is bad input (exit 2) on any machine
        loaded = _validated_checkpoint(path)
        case = GpuCase(f"ckpt-{os.path.basename(path.rstrip(os.sep))}-seed{args.seed}", ckpt_dir=path,
                       seed=args.seed, steps=args.steps, requests=2, tokens=160)
        try:
            case = dataclasses.replace(case, quant=quant_of_config(loaded.hf_config))
        except (OSError, ValueError) as exc:
            raise CLIError(f"{ckpt}/config.json: {exc}") from exc
    elif ckpt in GPU_CASES:
        case = GPU_CASES[ckpt]
    elif ckpt.startswith("preset:"):
        case = GpuCase(f"{ckpt[7:]}-seed{args.seed}", preset=ckpt[7:], seed=args.seed, steps=args.steps,
                       requests=2, tokens=160)
        try:
            preset(case.preset)
        except KeyError as exc:
            raise CLIError(str(exc.args[0])) from exc
    else:
        raise CLIError(f"{ckpt}: compare takes a checkpoint directory, preset:NAME or a GPU case id "
                       f"({', '.join(GPU_CASES)})")
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
    from harness.checkpoint.loader import load_checkpoint

    if _VALIDATED.get("path") != path:
        _VALIDATED.clear()
        _VALIDATED.update(path=path, loaded=load_checkpoint(path))
    return _VALIDATED["loaded"]


_VALIDATED: dict = {}


def validate_args(command: str, args) -> None:
    """CLIError (exit 2) for arguments no machine could run, before asking for a GPU."""
    import os

    report = getattr(args, "report", None)
    if report and os.path.isdir(report):
        raise CLIError(f"--report {report}: is a directory; give a .json file path")
    if command == "compare_command":
        if getattr(args, "tp", 1) < 1:
            raise CLIError("--tp must be >= 1")
        if args.steps < 1:
            raise CLIError("--steps must be >= 1")
        _case_for(args)
    elif command == "bisect_command":
        from .side_by_side import GPU_CASES

        unknown = [c for c in (args.case or []) if c not in GPU_CASES]
        if unknown:
            raise CLIError(f"unknown case(s) {unknown}; known: {', '.join(GPU_CASES)}")


def _failure(what: str, exc: Exception) -> tuple[None, int, str]:
    """(None, exit code, one line) for an exception while vLLM built, loaded or ran a case.

    vLLM leaving a parameter unloaded (the post-load audit's ``LoadAuditError``)
    is a bad commit: exit 1, naming the parameter. Any other crash while
    building, loading or running vLLM (a missing kernel, a refused config, a
    JIT failure) means "cannot judge" (exit 125), never "numeric mismatch":
    git bisect then skips the commit instead of blaming it.
    """
    from .audit import LoadAuditError

    if isinstance(exc, LoadAuditError):
        return None, EXIT_MISMATCH, f"{load_failure_line(exc)} ({what})"
    return None, EXIT_CANNOT_JUDGE, f"cannot judge: {what} failed: {exc.__class__.__name__}: {first_line(exc)}"


def _run(case):
    """(result, EXIT_OK, ""), or (None, code, one line) when production failed on the case (``_failure``)."""
    from .side_by_side import run_case

    try:
        return run_case(case), EXIT_OK, ""
    except Exception as exc:  # noqa: BLE001 - any production failure is reported, one line
        return _failure(f"production run of {case.id}", exc)


def _run_tp(case, tp: int):
    """(run_case_tp result, EXIT_OK, "") or (None, code, one line): ``case`` at TP = ``tp`` on ``tp`` GPUs."""
    import torch

    from .multigpu import TPWorkers, run_case_tp

    if torch.cuda.device_count() < tp:
        return None, EXIT_CANNOT_JUDGE, f"cannot judge: --tp {tp} needs {tp} GPUs, found {torch.cuda.device_count()}"
    try:
        with TPWorkers(tp) as workers:
            return run_case_tp(workers, case), EXIT_OK, ""
    except Exception as exc:  # noqa: BLE001 - any production failure is reported, one line
        return _failure(f"TP={tp} production run of {case.id}", exc)


def compare_command(args) -> int:
    case = _case_for(args)
    tp = getattr(args, "tp", 1)
    if tp > 1:
        res, code, line = _run_tp(case, tp)
        if res is None:
            print(line)
            return code
        result, vs = res["tpn"], res["tp_vs_tp1"]
        result["_report"].meta.update(tp=tp, merge_rules=res["rules"])
    else:
        result, code, line = _run(case)
        vs = None
        if result is None:
            print(line)
            return code
    from .side_by_side import format_rows, versions

    print(format_rows(result))
    reports = {case.id if tp == 1 else f"{case.id}/tp{tp}": result["_report"]}
    if vs is not None:
        print(f"== TP={tp} vs TP=1 (step 0 components, draft tokens of every step): "
              f"{'PASS' if vs.passed else 'FAIL'}\n{vs.table()}")
        reports[f"{case.id}/tp{tp}-vs-tp1"] = vs
    if args.report:
        result["_report"].meta.update(versions=versions(), case=dataclasses.asdict(case))
        _write_report(args.report, reports, {"versions": versions()})
        print(f"report: {args.report}")
    return EXIT_OK if result["passed"] and (vs is None or vs.passed) else EXIT_MISMATCH


def _write_report(path, reports, meta) -> None:
    """``write_report``; a failed write is one line (a bad path: 2, a full disk: 125), nothing left behind."""
    from harness.atomic import write_errors, write_failure

    try:
        write_report(path, reports, meta)
    except write_errors() as exc:
        raise write_failure(f"--report {path}", exc) from exc


def bisect_command(args) -> int:
    from .goldens_gpu import check_production_golden
    from .side_by_side import GPU_CASES, versions

    ids = args.case or list(DEFAULT_BISECT_CASES)
    reports, verdict = {}, EXIT_OK
    for cid in ids:
        result, code, line = _run(GPU_CASES[cid])
        if result is None:  # a load failure is a bad commit (1), any other crash cannot judge (125)
            print(line)
            return code
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
        _write_report(args.report, reports, {"versions": versions()})
    return verdict
