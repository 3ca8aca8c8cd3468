"""Reference vs vLLM's production ``HYV4MTP``: run one case both ways and compare.

    python -m harness side-by-side [--case ID ...] [--fp8] [--modelopt] [--compressed-tensors] [--reload]
                                   [--out DIR] [--save-traces]
    python -m harness side-by-side --rejudge DIR [--out DIR2]   # CPU: re-judge saved traces

``--fp8`` selects the FP8-checkpoint cases (role "fp8" of ``harness.case_registry``),
``--compressed-tensors`` the compressed-tensors ones (role "compressed-tensors"), ``--reload`` the
weights-updated-in-place ones (role "reload", ``module/reload.py``); tolerances are
``tolerances.tolerances_for(case.quant)``.
A case's ``upstream_gaps`` (a known vLLM gap it exists to show) fails with the gap named first.

The verdict (``harness.production.judging.trace_judge``) is against the EXACT (float64) reference with
``tolerances_for(quant)``; the table also shows the max abs error against the reference run
with PRODUCTION numerics (bf16 storage, fp32 accumulation), which isolates
kernel/ordering noise from the spec.
Exit codes: 0 all cases pass, 1 a numeric mismatch, 125 cannot judge (no GPU/vLLM).

May import: vLLM (lazily), ``reference``, ``harness``, ``harness.production.case_inputs``,
``harness.production.judging`` and the rest of ``harness.production.module``.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import time
import traceback

import torch

from harness.atomic import atomic_write_json
from harness.exitcodes import CannotJudge, CLIError, OneLineParser, first_line, printable, run_guarded
from harness import case_registry
from harness.case_specs import GpuCase
from harness.production.case_inputs import CaseInputs, _case_from_dict, build_inputs, reload_set_b
from harness.production.judging.trace_judge import judge
from harness.verdict import Verdict


def run_case(case: GpuCase, *, session_kw: dict | None = None, inputs: CaseInputs | None = None) -> Verdict:
    """Run ``case`` on production, replay the reference on its inputs, compare: the verdict (tensors included).
    ``inputs``: the case's ``CaseInputs`` where the caller built them (else built here, once).
    A reload case (``reload_seed``) runs ``module.reload.run_reload_case``."""
    if case.reload_seed is not None:
        from harness.production.module.reload import run_reload_case
        return run_reload_case(case, session_kw=session_kw)
    inputs = inputs if inputs is not None else build_inputs(case)
    return judge(case, *run_production_side(case, session_kw=session_kw, inputs=inputs), inputs=inputs)


def run_production_side(case: GpuCase, *, session_kw: dict | None = None, around_run=None,
                        inputs: CaseInputs | None = None) -> tuple[dict, dict]:
    """Build, load and run ``case`` on vLLM's HYV4MTP: (production trace, run info for the judge).

    ``around_run(sess, run)``, where given, runs the loaded session: it calls ``run()`` (the K
    draft steps) and returns its trace, e.g. with a planted bug applied around it (``harness.mutants``).
    ``inputs``: the case's ``CaseInputs`` (else built here)."""
    from harness.production.module.runner import ProductionSession

    inputs = inputs if inputs is not None else build_inputs(case)
    hf, ckpt, first = inputs.hf_config, inputs.checkpoint, inputs.first
    t0 = time.perf_counter()
    sess = ProductionSession(hf, num_speculative_tokens=case.steps,
                             **{"kv_cache_dtype": case.kv_cache_dtype, **(session_kw or {})})
    t_build = time.perf_counter() - t0
    sess.load(ckpt, strict=not case.known_audit)
    unquantized = check_expected_unquantized(case, sess.model)
    t_load = time.perf_counter() - t0 - t_build
    def run() -> dict:
        out = sess.run(first, case.steps)
        torch.cuda.synchronize()
        return out
    prod = around_run(sess, run) if around_run is not None else run()
    t_run = time.perf_counter() - t0 - t_build - t_load
    info = {"audit": sess.audit_problems, "attach_notes": sess.attach_notes,
            "step_notes": [dataclasses.asdict(n) for n in sess.notes],
            "timing_s": {"build": t_build, "load": t_load, "run": t_run},
            "unquantized_modules": unquantized}
    try:  # the router GEMM tiers and attention backends this model picked
        from harness.production.kernel_paths import model_paths
        info["model_kernel_paths"] = model_paths(sess.model)
    except Exception as exc:  # noqa: BLE001 - notes must not cost the verdict
        info["model_kernel_paths"] = {"error": f"{exc.__class__.__name__}: {exc}"}
    if case.quant != "bf16":
        try:
            info["fp8_kernels"] = fp8_kernel_notes(sess.model)
        except Exception as exc:  # noqa: BLE001 - notes must not cost the verdict
            info["fp8_kernels"] = {"error": f"{exc.__class__.__name__}: {exc}"}
    return prod, info


def check_expected_unquantized(case: GpuCase, model) -> dict | None:
    """{module: quant method} of the modules ``case.expect_unquantized`` names (None: it names none).

    The proof a case went through its config's exclusion path: each named module must be built
    with an ``Unquantized*`` method. One built quantized is a load failure (exit 1, naming it);
    one that does not exist means the case no longer describes this vLLM (cannot judge)."""
    if not case.expect_unquantized:
        return None
    from harness.production.module import audit

    methods = audit.module_quant_methods(model)
    absent = [m for m in case.expect_unquantized if m not in methods]
    if absent:
        raise CannotJudge(f"{case.id}: expected unquantized module(s) {absent} have no quant method in this "
                          f"vLLM's HYV4MTP (the case's module names are out of date)")
    bad = [f"{m}: {case.id} expects vLLM to build it unquantized (the checkpoint's exclusion), "
           f"built with {methods[m]}" for m in case.expect_unquantized if not audit.is_unquantized_method(methods[m])]
    if bad:
        raise audit.LoadAuditError(bad)
    return {m: methods[m] for m in case.expect_unquantized}


def upstream_gap_of(case: GpuCase, problems: list[str]):
    """The case's ``upstream_gaps`` entry the first of ``problems`` names, or None."""
    first = problems[0] if problems else ""
    return next((tuple(g) for g in case.upstream_gaps if g[0] in first), None)


def fp8_kernel_notes(model) -> dict:
    """Which FP8 kernels production picked (for the report): linear kernel classes,
    the MoE backend, the DeepGEMM UE8M0 switch and the weight/scale dtypes after loading."""
    notes: dict = {k: os.environ.get(k) for k in ("VLLM_USE_DEEP_GEMM_E8M0", "VLLM_USE_DEEP_GEMM",
                                                  "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER")}
    try:
        from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used, is_deep_gemm_supported
        notes["deep_gemm_supported"] = bool(is_deep_gemm_supported())
        notes["deep_gemm_e8m0_used"] = bool(is_deep_gemm_e8m0_used())
    except Exception as exc:  # noqa: BLE001 - notes only
        notes["deep_gemm"] = f"{exc.__class__.__name__}: {exc}"
    layers = {}
    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if qm is None:
            continue
        d = {"method": type(qm).__name__}
        if hasattr(qm, "fp8_linear"):
            d["kernel"] = type(qm.fp8_linear).__name__
        if hasattr(qm, "fp8_backend"):
            d["backend"] = str(getattr(qm.fp8_backend, "value", qm.fp8_backend))
        for pname, p in mod.named_parameters(recurse=False):
            if "scale" in pname or p.dtype == torch.float8_e4m3fn:
                d[pname] = str(p.dtype).removeprefix("torch.")
        layers[name] = d
    notes["layers"] = layers
    return notes


def format_rows(result: Verdict) -> str:
    lines = [f"== {result.details['case']['id']}: {'PASS' if result.passed else 'FAIL'}"
             f" (first divergent: {result.first_divergent})",
             f"{'component':28s} {'ok':4s} {'|d| exact':>10s} {'|d| prodnum':>11s} {'1-sim':>9s} {'mism%':>6s}  note"]
    for r in result.rows:
        pn = r["max_abs_vs_prodnum"]
        lines.append(f"{r['key']:28s} {'ok' if r['passed'] else 'FAIL':4s} {r['max_abs_vs_exact']:10.3e} "
                     f"{(pn if pn is not None else float('nan')):11.3e} {r['sim_gap']:9.2e} "
                     f"{r['mismatch_pct']:6.2f}  {r['note']}")
    return "\n".join(lines)


def format_regimes(values: dict) -> str:
    """One line: the thresholded regimes' values (harness/regimes.py), '!' where below the threshold."""
    from harness.regimes import REGIMES

    cells = [f"error={values['error']}"] if "error" in values else []
    for name, regime in REGIMES.items():
        v = values.get(name)
        if regime.threshold is None or v is None:
            continue
        cells.append(f"{name}={v:.3g}" + ("" if v >= regime.threshold else "!"))
    return " ".join(cells)


def versions(*, import_vllm: bool = True) -> dict:
    """torch, vLLM, CUDA and the GPU (name, capability). ``import_vllm=False``: vLLM's version read
    without importing it, where it can be (``vllm_compat.vllm_version_unimported``)."""
    from harness.production import vllm_compat

    vllm_version = None if import_vllm else vllm_compat.vllm_version_unimported()
    v = {"torch": torch.__version__, "vllm": vllm_version or vllm_compat.vllm_version(), "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name(0)
        v["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return v


def run_facts() -> dict:
    """Every report's metadata: versions, and the optional kernel paths vLLM found here."""
    from harness.production.kernel_paths import host_paths, judged_without
    try:  # metadata: never costs a verdict already reached
        paths = host_paths()
        without = judged_without(paths).strip()
    except Exception as exc:  # noqa: BLE001
        paths, without = {"error": f"{exc.__class__.__name__}: {exc}"}, ""
    return {"versions": versions(), "kernel_paths": paths, "judged_without": without}


def _flush(pending: dict, out: str, n: int) -> None:
    """Write collected production traces ({case}/{key}) to one safetensors file."""
    from safetensors.torch import save_file
    save_file(dict(pending), os.path.join(out, f"prod-traces-{n:02d}.safetensors"))
    pending.clear()


def _trace_tensors(cid: str, prod: dict) -> dict:
    """{case}/{key} -> an own contiguous CPU copy (safetensors refuses shared storage)."""
    return {f"{cid}/{k}": v.detach().cpu().contiguous().clone() for k, v in prod.items()
            if torch.is_tensor(v)}


MAX_SAVED_TRACE_BYTES = 4 << 30  # one saved production trace file (tens of MiB for the harness's cases)


def load_saved_traces(out_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    """{case id: production trace} from the prod-traces-*.safetensors files of ``out_dir``."""
    from safetensors.torch import load as load_bytes

    from harness.input_checks import read_bytes

    traces: dict[str, dict] = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "prod-traces-*.safetensors"))):
        # read whole, bounded, regular files only (a FIFO blocks, a truncated mmapped file is a SIGBUS)
        try:
            tensors = load_bytes(read_bytes(path, path, MAX_SAVED_TRACE_BYTES))
        except Exception as exc:  # noqa: BLE001 - safetensors' parse errors have no common base: bad input
            raise CLIError(f"{printable(path)}: not a safetensors file ({first_line(str(exc))[:160]})") from None
        for key, v in tensors.items():
            if "/" not in key:
                raise CLIError(f"{printable(path)}: tensor {printable(key)[:80]!r} is not named CASE/COMPONENT: "
                               "not a saved production trace")
            cid, k = key.split("/", 1)
            traces.setdefault(cid, {})[k] = v
    return traces


def rejudge(in_dir: str, out_dir: str | None = None, case_ids=None) -> tuple[int, list[dict]]:
    """Re-run the reference + judge on CPU for production traces saved by ``--save-traces``.

    Reads ``side_by_side.json`` (case definitions, audit and step notes) and the
    ``prod-traces-*.safetensors`` of ``in_dir``; writes ``rejudge.json`` into
    ``out_dir`` (default ``in_dir``). Returns (exit code, results).
    """
    from harness.input_checks import read_json

    where = os.path.join(in_dir, "side_by_side.json")
    summary = read_json(where, where)
    if not isinstance(summary, dict):
        raise CLIError(f"{printable(where)}: not a saved side-by-side summary")
    entries = summary.get("cases", [])
    if not isinstance(entries, list):
        raise CLIError(f"{printable(where)}: 'cases' is not a list: not a saved side-by-side summary")
    for i, entry in enumerate(entries):  # each one checked before anything is judged
        case_dict = entry.get("case") if isinstance(entry, dict) else None
        if not isinstance(case_dict, dict) or not isinstance(case_dict.get("id"), str):
            raise CLIError(f"{printable(where)}: cases[{i}] holds no case with an id: not a saved side-by-side summary")
    traces = load_saved_traces(in_dir)
    results, worst = [], 0
    for i, entry in enumerate(entries):
        cid = entry["case"]["id"]
        if case_ids and cid not in case_ids:
            continue
        if "error" in entry or cid not in traces:
            print(f"== {cid}: no saved production trace ({'error in the GPU run' if 'error' in entry else 'missing'})")
            results.append({"case": entry["case"], "error": "no saved production trace"})
            worst = max(worst, 1)
            continue
        try:
            case = _case_from_dict(entry["case"])
        except (TypeError, ValueError) as exc:  # a field this harness does not know, or a value outside its set
            raise CLIError(f"{printable(where)}: cases[{i}] ({printable(cid)[:60]}): "
                           f"{first_line(str(exc))[:200]}") from None
        if case.reload_seed is not None:  # a reload case saves its second run's trace: set B's
            case = reload_set_b(case)
        info = {k: entry.get(k) for k in ("audit", "attach_notes", "step_notes", "fp8_kernels")
                if entry.get(k) is not None}
        info["timing_s"] = {}
        res = judge(case, traces[cid], info)
        print(format_rows(res), flush=True)
        print("routing ties:", res.details["routing_ties"], "router self-check:", res.details["router_self_check"],
              "tokens:", res.details["tokens"], flush=True)
        results.append(res.to_report())
        if not res.passed:
            worst = max(worst, 1)
    if not results:
        print(f"nothing to re-judge in {in_dir}")
        return 125, results
    out_dir = out_dir or in_dir
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "rejudge.json"), "w") as f:
        json.dump({"source": os.path.abspath(in_dir), "versions": summary.get("versions"),
                   "cases": results}, f, indent=1, default=str)
    return worst, results


def main(argv=None) -> int:
    gpu_cases, probe_cases = (case_registry.specs(kind="module", without="probe"),
                              case_registry.specs(role="probe", kind="module"))
    fp8_ids, modelopt_ids, ct_ids, reload_ids = (case_registry.ids(role=r, kind="module")
                                                 for r in ("fp8", "modelopt", "compressed-tensors", "reload"))
    ap = OneLineParser(prog="python -m harness side-by-side", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", help=f"case id (default: all of {', '.join(gpu_cases)})")
    ap.add_argument("--fp8", action="store_true", help=f"the FP8 cases ({', '.join(fp8_ids)})")
    ap.add_argument("--modelopt", action="store_true",
                    help=f"the ModelOpt FP8_PB_WO cases ({', '.join(modelopt_ids)})")
    ap.add_argument("--compressed-tensors", action="store_true",
                    help=f"the compressed-tensors FP8 cases ({', '.join(ct_ids)})")
    ap.add_argument("--reload", action="store_true",
                    help=f"the weights-updated-in-place cases ({', '.join(reload_ids)})")
    ap.add_argument("--out", default=None, help="directory for side_by_side.json (default $OUT or out)")
    ap.add_argument("--save-traces", action="store_true", help="also write production traces (safetensors)")
    ap.add_argument("--rejudge", metavar="DIR", help="CPU only: re-judge the traces a --save-traces run wrote "
                    "into DIR (writes rejudge.json into --out, default DIR)")
    args = ap.parse_args(argv)
    ids = list(args.case or [])
    unknown = [c for c in ids if c not in gpu_cases and c not in probe_cases]
    if unknown:  # bad input: said before the GPU question, on any machine (exit 2)
        ap.error(f"--case: unknown case(s) {', '.join(unknown[:5])}; known: {', '.join([*gpu_cases, *probe_cases])}")
    from harness import input_checks as check

    try:  # bad input: one line, exit 2, before the GPU question
        if args.rejudge:
            check.input_dir("--rejudge", args.rejudge)
        if args.out is not None:
            check.output_dir("--out", args.out)
    except CLIError as exc:
        ap.error(str(exc))
    if args.fp8:
        ids += [c for c in fp8_ids if c not in ids]
    if args.modelopt:
        ids += [c for c in modelopt_ids if c not in ids]
    if args.compressed_tensors:
        ids += [c for c in ct_ids if c not in ids]
    if args.reload:
        ids += [c for c in reload_ids if c not in ids]
    if args.rejudge:
        return run_guarded(lambda: rejudge(args.rejudge, args.out, ids or None)[0])
    out = args.out or os.environ.get("OUT", "out")
    from harness.production.can_run import cannot_run_production_reason
    reason = cannot_run_production_reason()
    if reason:
        print(f"cannot judge: {reason}")
        return 125
    os.makedirs(out, exist_ok=True)
    ids = ids or list(gpu_cases) + list(probe_cases)
    summary = {**run_facts(), "cases": []}
    print(json.dumps(summary["versions"]))
    worst = 0
    pending: dict = {}
    n_files = 0
    for cid in ids:
        case = gpu_cases.get(cid) or probe_cases[cid]
        try:
            res = run_case(case)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next case
            tb = traceback.format_exc()
            gap = upstream_gap_of(case, list(getattr(exc, "problems", None) or []))
            if gap is not None:  # the known vLLM gap the case exists to show: named, not a harness error
                print(f"== {cid}: FAIL (known vLLM gap): {exc.problems[0]}\n   known vLLM gap: {gap[1]}", flush=True)
                summary["cases"].append({"case": dataclasses.asdict(case), "error": tb, "upstream_gap": list(gap),
                                         "problems": list(exc.problems)})
                worst = max(worst, 1)
                continue
            print(f"== {cid}: ERROR {exc.__class__.__name__}: {exc}\n{tb}", flush=True)
            summary["cases"].append({"case": dataclasses.asdict(case), "error": tb})
            worst = max(worst, 1)
            continue
        print(format_rows(res), flush=True)
        d = res.details
        print("notes:", json.dumps(d["step_notes"]), d["attach_notes"], flush=True)
        print("routing ties:", d["routing_ties"], "router self-check (step, bad rows, rows):",
              d["router_self_check"], "skipped:", d["skipped"], flush=True)
        if d.get("fp8_kernels"):
            print("fp8 kernels:", json.dumps(d["fp8_kernels"]), flush=True)
        if d.get("reload"):
            r = d["reload"]
            print("reload:", r["path"], f"({r['reload_s']:.2f} s), {r['compared']} tensors compared;",
                  f"stale/differing: {r['stale'][:6]}", "run 1 (set A):", "PASS" if r["run_a"]["passed"]
                  else f"FAIL at {r['run_a']['first_divergent']}", flush=True)
        if d.get("layer_policy"):
            print("layer policy (max |d| of final_norm):", d["layer_policy"], flush=True)
        print("tokens:", d["tokens"], "timing", {k: round(v, 2) for k, v in d["timing_s"].items()}, flush=True)
        print("regimes:", format_regimes(res.regimes), flush=True)
        if args.save_traces:  # one file per case, written now: a later crash or timeout keeps it
            pending.update(_trace_tensors(cid, res.trace))
            _flush(pending, out, n_files)
            n_files += 1
        summary["cases"].append(res.to_report())
        if not res.passed:
            worst = max(worst, 1)
        # write as we go: a later case that kills the process leaves the earlier ones judged
        atomic_write_json(os.path.join(out, "side_by_side.json"), summary, default=str)
    if args.save_traces and pending:
        _flush(pending, out, n_files)
    atomic_write_json(os.path.join(out, "side_by_side.json"), summary, default=str)
    return worst

