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

from harness.exitcodes import EXIT_CANNOT_JUDGE, EXIT_MISMATCH, EXIT_OK, CLIError, first_line, load_failure_line, worst

# Together these exercise every regime of harness/regimes.py above its threshold
# (tests/cpu/test_regimes.py): tiny-k3-share index sharing, K = 3 and a heavy sink;
# tiny-k2-long contexts beyond index_topk and routing near-ties; tiny-k2-clamp-headwise
# the routed SwiGLU clamp, the headwise gate, fused experts and layers naming;
# tiny-k2-fp8-ue8m0-fused-scale-long a block-FP8 checkpoint as stored (e4m3 weights, UE8M0
# scales, fused experts with `.scale` names): vLLM's FP8 loading, FP8 GEMMs and UE8M0 paths,
# a regression class the bf16 cases cannot see (FP8 tolerances, no production golden).
DEFAULT_BISECT_CASES = ("tiny-k3-share", "tiny-k2-long", "tiny-k2-clamp-headwise", "tiny-k2-fp8-ue8m0-fused-scale-long")
# vLLM's own speculator (engine.py): drafts accepted at planned rates, index sharing,
# and the two-MTP-layer MultiModuleMTPSpeculator
DEFAULT_BISECT_ENGINE_CASES = ("engine-accept-k3-share", "engine-accept-k2-two-layers")


MAX_TP = 8      # GPUs of one host
MAX_STEPS = 32  # draft steps K


def _case_for(args):
    """The GpuCase ``compare`` runs: a checkpoint directory, preset:NAME (seeded weights) or a GPU case id."""
    import os

    from harness.presets import check_kernel_constraints, preset
    from reference import ConfigError, MTPConfig

    from harness.production.cases import GPU_CASES, GpuCase

    ckpt = args.ckpt or "preset:tiny"
    if os.path.isdir(ckpt):
        if not os.path.isfile(os.path.join(ckpt, "config.json")):
            raise CLIError(f"{ckpt}: not a checkpoint directory (no config.json)")
        path = os.path.abspath(ckpt)
        # the whole checkpoint through the loader (config, index, every MTP tensor's
        # name, shape, dtype, finiteness, scales, duplicates across shards) before
        # any GPU question: a bad checkpoint is bad input (exit 2) on any machine
        loaded = _validated_checkpoint(path)
        from harness.checkpoint.quant import quant_of_config
        case = GpuCase(f"ckpt-{os.path.basename(path.rstrip(os.sep))}-seed{args.seed}", ckpt_dir=path,
                       seed=args.seed, steps=args.steps, requests=2, tokens=160)
        try:
            case = dataclasses.replace(case, quant=quant_of_config(loaded.hf_config))
        except (OSError, ValueError) as exc:
            raise CLIError(f"{ckpt}/config.json: {exc}") from exc
    elif ckpt in GPU_CASES:
        case = GPU_CASES[ckpt]
    elif ckpt in _engine_cases():
        return ckpt  # vLLM's own speculator, engine level (engine.py)
    elif ckpt.startswith("preset:"):
        case = GpuCase(f"{ckpt[7:]}-seed{args.seed}", preset=ckpt[7:], seed=args.seed, steps=args.steps,
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
        if args.steps < 1:
            raise CLIError("--steps must be >= 1")
        check.integer("--tp", args.tp, 1, MAX_TP, "GPUs of one host")
        check.integer("--steps", args.steps, 1, MAX_STEPS)
        check.seed("--seed", args.seed)
        if isinstance(_case_for(args), str) and args.tp != 1:
            raise CLIError(f"--tp {args.tp}: applies to side-by-side cases; engine case {args.ckpt} runs at TP = 1")
    elif command == "bisect_command":
        from harness.production.engine.cases import ENGINE_CASES
        from harness.production.cases import GPU_CASES

        unknown = [c for c in (args.case or []) if c not in GPU_CASES and c not in ENGINE_CASES]
        if unknown:
            raise CLIError(f"unknown case(s) {unknown}; known: {', '.join([*GPU_CASES, *ENGINE_CASES])}")
        plant = getattr(args, "plant", None)
        if plant is not None:
            from harness.mutants import BY_NAME
            if plant not in BY_NAME:
                raise CLIError(f"--plant {plant}: unknown mutant; known: {', '.join(BY_NAME)}")


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
        return run_case(case), EXIT_OK, ""
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
            return run_case_tp(workers, case), EXIT_OK, ""
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
            from harness.production.module.side_by_side import versions
            save_report(args.report, {}, {"versions": versions(), "engine": engine})
        return verdict
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
    from harness.production.module.side_by_side import format_rows, versions

    print(format_rows(result))
    reports = {case.id if tp == 1 else f"{case.id}/tp{tp}": result["_report"]}
    if vs is not None:
        print(f"== TP={tp} vs TP=1 (step 0 components, draft tokens of every step): "
              f"{'PASS' if vs.passed else 'FAIL'}\n{vs.table()}")
        reports[f"{case.id}/tp{tp}-vs-tp1"] = vs
    if args.report:
        result["_report"].meta.update(versions=versions(), case=dataclasses.asdict(case))
        save_report(args.report, reports, {"versions": versions()})
        print(f"report: {args.report}")
    return EXIT_OK if result["passed"] and (vs is None or vs.passed) else EXIT_MISMATCH


def _bisect_side_by_side(ids, plant) -> tuple[dict, dict, int, str | None]:
    """bisect-check's side-by-side cases and their production goldens, in this process ->
    (reports, regime values, verdict, the one line of a case that did not run, else None:
    a load failure is a bad commit (1), any other crash cannot judge (125))."""
    from harness.production.cases import GPU_CASES
    from harness.production.goldens.goldens_gpu import check_production_golden
    from harness.production.module.side_by_side import format_regimes

    reports, regime_values, verdict = {}, {}, EXIT_OK
    for cid in ids:
        result, code, line = _run(GPU_CASES[cid], plant)
        if result is None:
            return reports, regime_values, worst([verdict, code]), line
        reports[f"side-by-side/{cid}"] = result["_report"]
        result["_report"].meta["regimes"] = result["regimes"]
        regime_values[cid] = result["regimes"]
        first = result["first_divergent"]
        print(f"{'ok  ' if result['passed'] else 'FAIL'} side-by-side {cid}" + ("" if result["passed"] else f": first divergent {first}"))
        print(f"     regimes: {format_regimes(result['regimes'])}")
        verdict = verdict if result["passed"] else EXIT_MISMATCH
        golden = check_production_golden(cid, result["_prod"])
        if golden is None:
            print(f"     golden {cid}: no golden for this platform")
            continue
        reports[f"golden/{cid}"] = golden
        gfirst = golden.first_divergent
        print(f"{'ok  ' if golden.passed else 'FAIL'} golden {cid}" + ("" if golden.passed else f": first divergent {gfirst.name}"))
        if golden.meta.get("stale"):
            print(f"     golden {cid}: {golden.meta['stale']}")
        verdict = verdict if golden.passed else EXIT_MISMATCH
    return reports, regime_values, verdict, None


def bisect_command(args) -> int:
    from harness.regimes import coverage, uncovered
    from harness.report import save_report

    from harness.production.engine.cases import ENGINE_CASES
    from harness.production.module.side_by_side import versions

    ids = args.case or [*DEFAULT_BISECT_ENGINE_CASES, *DEFAULT_BISECT_CASES]
    engine_ids = [c for c in ids if c in ENGINE_CASES]
    ids = [c for c in ids if c not in ENGINE_CASES]
    # the speculator path: one engine per subprocess, started first and running while this
    # process runs the side-by-side cases on the same GPU, collected (and printed) after them
    # (a --plant mutant patches the module-level model only; HYV4_SPECULATOR_MUTANT the speculator)
    started = start_engine_cases(engine_ids, gpu_shared=bool(ids))
    try:
        reports, regime_values, verdict, failed_line = _bisect_side_by_side(ids, getattr(args, "plant", None))
    except BaseException:
        stop_engine_cases(started)
        raise
    engine, engine_verdict = collect_engine_cases(started)
    verdict = worst([verdict, engine_verdict])
    if failed_line is not None:  # a side-by-side case did not run: its one line, then stop
        print(failed_line)
        return verdict
    missing = uncovered(regime_values)
    if missing:  # a harness weakness, not a vLLM verdict: reported, the exit code stays vLLM's
        print(f"warning: no case of this run exercises the regime(s) {missing} (harness/regimes.py)")
    if args.report:
        save_report(args.report, reports, {"versions": versions(), "engine": engine, "regimes": regime_values,
                                             "regime_coverage": coverage(regime_values)})
    return verdict


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


def start_engine_cases(case_ids, *, gpu_shared: bool = False) -> list[_EngineRun]:
    """Start one engine subprocess per case, concurrently, and return at once. Several engines,
    or an engine next to this process's own side-by-side runs (``gpu_shared``), share the GPU:
    they get a fixed KV size (``HYV4_ENGINE_KV_CACHE_GIB``, 4 GiB unless set), which skips vLLM's
    memory profiling (it fails when another process allocates or frees meanwhile) and asks
    its start-up check for 0.1 of the GPU (harness.production.engine.run.engine_kwargs)."""
    import os
    import subprocess
    import sys
    import tempfile

    from harness.production.engine.run import ENGINE_KV_GIB_ENV

    env = dict(os.environ)
    if (gpu_shared or len(case_ids) > 1) and not env.get(ENGINE_KV_GIB_ENV, "").strip():
        env[ENGINE_KV_GIB_ENV] = "4"
    runs = []
    try:
        for cid in case_ids:
            tmp = tempfile.TemporaryDirectory(prefix="hyv4-engine-")
            with open(os.path.join(tmp.name, "output.txt"), "w") as log:
                proc = subprocess.Popen([sys.executable, "-m", "harness.production.engine", "--case", cid,
                                         "--out", tmp.name], stdout=log, stderr=subprocess.STDOUT, env=env)
            runs.append(_EngineRun(cid, proc, tmp))
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
                              "mutant": rep.get("mutant")}
            if code == EXIT_OK:
                print(f"ok   engine {r.case_id}" + (f" (acceptance {_rates(rep)})" if rep.get("acceptance") else ""))
            elif code == EXIT_MISMATCH:
                print(f"FAIL engine {r.case_id}: {problems[0] if problems else 'exit 1, no report'}")
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
