"""Production goldens: vLLM's own trace of a GPU case, recorded on a known-good
vLLM and platform, checked with tolerances far tighter than the reference's.

They catch production drift that the reference tolerance (bf16 / FP8 noise)
would hide, e.g. a kernel change of one bf16 ulp. A golden belongs to its
platform (GPU model, compute capability, torch, CUDA: ``platform_key``), and is
judged on every vLLM version of it; on another platform there is no golden to
judge, and the callers say so ("NOT JUDGED"), never "ok". A host baseline
(``baseline.py``, ``bisect-check --record-baseline DIR``) is the same thing
under another root, recorded by the user at a known-good vLLM. Both are judged through the one
golden entry, ``store.check(PRODUCTION, case_id, prod, root=...)``: on a mismatch the obtained
trace is written beside the golden (``<case>.obtained.safetensors``) and a line names both files.

    python -m harness goldens record [--root DIR] [--case ID ...]   # 0: every case recorded
    python -m harness goldens check [--root DIR] [--case ID ...]    # 0 / 1 / 125 (not judged)
    python -m harness goldens list [--root DIR]                     # CPU: each golden's platform
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from harness.goldens import store
from harness.trace_compare import (INDEX_COMPONENTS, ComponentResult, Report, Tolerance, compare_traces,
                             index_rows_differing)
from harness.components import PRODUCTION_COMPONENTS
from harness.case_registry import ids as case_ids
from harness.goldens import platform_key
from harness.production.judging.trace_judge import derive_indexer
from harness.production.judging.tolerances import GPU_VS_REFERENCE

KIND = "production"
# The production goldens' cases are ``case_ids(role="golden", kind="module")`` (the same set as the
# default bisect's side-by-side cases, role bisect: tests/cpu/test_case_registry.py).
# Every component the side by side compares (the registry's PRODUCTION_COMPONENTS), so
# the first divergent component of a golden check names the cause (a k_norm LayerNorm no longer in
# fp32 surfaced only at attn.core when indexer.k was not stored). The indexer's
# q_scale / q_deq / head_weights are derived from the captured q_fp8, indexer.kw and folded
# weights exactly as the side by side derives them (harness.production.judging.trace_judge.derive_indexer).
STORED = PRODUCTION_COMPONENTS
# Steps with more rows than this store an evenly spaced subset of their per-token rows (each
# request's first and last row included; ``step{k}.golden_rows``): a kept row costs ~15 kB
# (every component), the two long cases' 317 step-0 rows would be ~5 MB each, and the goldens
# directory (reference goldens ~1.8 MB included) has to stay under 5 MB: 64 rows keep each long
# case near 1 MB (128 did for one long case, not for two). A golden's kept rows are stored with
# it, so goldens recorded under another cap are still judged at their own rows.
ROW_CAP = 64
ROWS = "golden_rows"
# indexer.q_deq = q_fp8 * q_scale is stored as the e4m3 values (1 byte each) and rebuilt exactly.
Q_FP8 = "indexer.q_fp8"
FORMAT = 2  # 1: 13 components, all rows (the first goldens); 2: STORED, rows capped
# Same platform, same inputs: the kernels should reproduce themselves. bf16
# values: any change is >= 1 ulp = 2^-8 relative, so rtol 2^-10 flags it;
# fp32 values (router logits, logits, top-k weights, indexer head weights and q
# scale): 1e-6 relative absorbs reduction-order jitter of split-K kernels, nothing
# more; q_deq (e4m3 x a power of two, rebuilt in float64) is judged like fp32: any
# e4m3 change is >= 2^-4 relative.
TIGHT = {
    "bf16": Tolerance(0.0, 2.0**-10, "none: any bf16 change is one ulp (2^-8) or more"),
    "fp32": Tolerance(1e-7, 1e-6, "fp32 reduction-order jitter only"),
}
# The MoE router GEMM is fp32, and vLLM computes it one of two ways on SM90: F.linear in fp32, or
# (batches of more than 32 rows, where the CUTLASS DSL is installed) a bf16x3 CuteDSL GEMM that
# splits the fp32 operand into two bf16 halves and drops the low x low product: each product keeps
# 16 of the operand's 24 bits, an error up to 2^-16 of sum |w x| per logit. A golden of one
# platform must accept either (which one runs depends on the batch and the release, not on a
# bug), so router logits, and the top-k weights derived from them, are judged at 2^-16 of the
# step's largest |value|: well above the bf16x3 change between two vLLM releases on one GPU
# (benchmarks/NOTES.md), and 2^-7 below a bf16 rounding of the logits or of the router weights, which still fail.
ROUTER_GEMM = ("moe.router_logits", "moe.topk_weights")
ROUTER_GEMM_RTOL = 2.0**-16
ROUTER_GEMM_WHY = ("fp32 router GEMM as vLLM's SM90 path runs it: F.linear or bf16x3 (16 operand bits per "
                   "product): 2^-16 of the step's largest |value|")


# Two runs of one case on one GPU differ in a few rows, all queries with a context longer than
# index_topk: attn.core by one bf16 ulp, propagated through that row's o_proj, router logits and
# MLP, with equal top-k sets (the figures: benchmarks/NOTES.md). The likely cause is the order in
# which FlashMLA sparse sums the selected keys (the top-k kernel's output order is not
# run-to-run stable). Such "order-variant" rows (position + 1 > index_topk) are
# therefore judged at the reference tolerance (GPU_VS_REFERENCE), and a routing
# or token flip there is reported, not failed; every other row keeps the tight
# tolerance, so a one-ulp kernel change in the short-context rows still fails.


def platform() -> dict:
    """This host's platform key (``platform_key.KEY_FIELDS``): what a golden must match to be judged."""
    return platform_key.platform()


def recorded_with() -> dict:
    """The installed vLLM's version and commit: stamped on a golden, never part of its key."""
    return platform_key.recorded_with()


def _step_comp(key: str) -> tuple[str, str]:
    step, comp = key.split(".", 1)
    return step, comp


def golden_view(case_id: str, prod: dict) -> dict:
    """The components of a production trace as the golden holds and compares them (CPU):
    every ``STORED`` component present, the derived indexer ones included."""
    view = {k: v.detach().cpu() for k, v in prod.items() if torch.is_tensor(v)}
    cfg = _config(case_id)
    if cfg is not None:
        derive_indexer(view, cfg, production=True)
    return {k: v for k, v in view.items() if k.startswith("step") and _step_comp(k)[1] in STORED}


def golden_rows(positions: torch.Tensor, cap: int | None = None) -> torch.Tensor | None:
    """Rows a step's golden keeps: None (all) up to ``cap`` rows, else at most ``cap`` rows,
    evenly spaced plus each request's first and last row (requests are runs of rising positions)."""
    cap = ROW_CAP if cap is None else cap
    pos = positions.long().flatten()
    t = pos.numel()
    if t <= cap:
        return None
    starts = [0] + (torch.nonzero(pos[1:] <= pos[:-1]).flatten() + 1).tolist()
    ends = [s - 1 for s in starts[1:]] + [t - 1]
    must = set(starts) | set(ends)
    even = torch.linspace(0, t - 1, cap - len(must)).round().long().tolist() if cap > len(must) else []
    return torch.tensor(sorted(must | set(even)))  # <= cap rows unless the requests' ends alone exceed it


def _rows_of(prod: dict) -> dict[str, torch.Tensor | None]:
    """{step: rows kept}, from each step's positions."""
    return {_step_comp(k)[0]: golden_rows(v) for k, v in prod.items() if k.endswith(".positions")}


def _n_tokens(prod: dict, step: str) -> int | None:
    pos = prod.get(f"{step}.positions")
    return None if pos is None else pos.numel()


def _take(v: torch.Tensor, rows: torch.Tensor | None, n_tokens: int | None) -> torch.Tensor:
    """Per-token tensors (first dimension = the step's tokens) at ``rows``; others unchanged."""
    if rows is None or n_tokens is None or v.dim() == 0 or v.shape[0] != n_tokens:
        return v
    return v[rows]


def _narrow(v: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 where that is exact (NaN kept); else float64."""
    if v.dtype != torch.float64:
        return v
    f = v.float()
    same = (f.double() == v) | (torch.isnan(v) & torch.isnan(f))
    return f if bool(same.all()) else v


def _encode(case_id: str, prod: dict) -> dict:
    """The tensors a golden file holds: the golden view at the kept rows, compactly typed."""
    view, rows = golden_view(case_id, prod), _rows_of(prod)
    out = {}
    for key, v in view.items():
        step, comp = _step_comp(key)
        n = _n_tokens(prod, step)
        if comp == "indexer.q_deq":
            q8 = prod.get(f"{step}.{Q_FP8}")
            if q8 is not None:  # the e4m3 values; store.write stores them in 1 byte
                out[f"{step}.{Q_FP8}"] = _take(q8.detach().cpu(), rows.get(step), n)
                continue
        v = _take(v, rows.get(step), n).contiguous()
        if comp in INDEX_COMPONENTS or comp == "draft_token":
            lo, hi = (int(v.min()), int(v.max())) if v.numel() else (0, 0)
            v = v.to(torch.int16 if -2**15 <= lo and hi < 2**15 else torch.int32)
        out[key] = _narrow(v).clone()  # own storage: safetensors refuses shared tensors (attn.topk is indexer.topk)
    for step, r in rows.items():
        if r is not None:
            out[f"{step}.{ROWS}"] = r.to(torch.int32)
    return out


def _decode(stored: dict) -> tuple[dict, dict]:
    """(the golden's components, {step: rows kept}) from a golden file's tensors (either format)."""
    view, rows, q8 = {}, {}, {}
    for key, v in stored.items():
        step, comp = _step_comp(key)
        if comp == ROWS:
            rows[step] = v.long()
        elif comp == Q_FP8:
            q8[step] = v
        else:
            view[key] = v
    for step, q in q8.items():
        scale = view.get(f"{step}.indexer.q_scale")
        if scale is not None:
            view[f"{step}.indexer.q_deq"] = q.double() * scale.double()[..., None]
    return view, rows


def stored_components(case_id: str, root: Path = store.ROOT) -> list[str]:
    """The components a recorded golden holds (after decoding), in dataflow order, without steps."""
    view, _ = _decode(store.load(KIND, case_id, root)[0])
    have = {_step_comp(k)[1] for k in view}
    return [c for c in STORED if c in have]


def _tolerances(stored: dict) -> dict:
    out = {}
    for key, v in stored.items():
        comp = key.split(".", 1)[1]
        if comp in ROUTER_GEMM and v.numel() and v.is_floating_point():
            scale = float(v.double().abs().max()) * ROUTER_GEMM_RTOL
            prev = out.get(comp)
            out[comp] = Tolerance(max(scale, prev.atol if prev else 0.0, TIGHT["fp32"].atol), TIGHT["fp32"].rtol,
                                  ROUTER_GEMM_WHY)
            continue
        out[comp] = TIGHT["fp32" if v.dtype in (torch.float32, torch.float64) else "bf16"]
    return out


def _golden(case_id: str, prod: dict, key: dict, vllm: dict) -> tuple[dict, dict]:
    """(the tensors, the manifest entry) of ``case_id``'s golden from production trace ``prod``."""
    return _encode(case_id, prod), {
        "case": case_id, "platform": key, "recorded_with": vllm, "versions": {**key, **vllm},
        "format": FORMAT, "row_cap": ROW_CAP,
        "components": [c for c in STORED if any(k.endswith("." + c) for k in golden_view(case_id, prod))],
        "tolerance": {**{k: [t.atol, t.rtol] for k, t in TIGHT.items()},
                      "router_gemm": {"components": list(ROUTER_GEMM), "of_largest_abs": ROUTER_GEMM_RTOL}}}


def record_set(traces: dict[str, dict], root: Path = store.ROOT, manifest_extra: dict | None = None) -> list[Path]:
    """Record the goldens of ``{case_id: production trace}`` under ``root``, stamped with this
    platform's key and vLLM: every tensor encoded before anything is written, the manifest last
    (``store.write_set``). One case on purpose: ``store.check(PRODUCTION, ..., regen=True)``."""
    key, vllm = platform(), recorded_with()
    cases = {cid: _golden(cid, prod, key, vllm) for cid, prod in traces.items()}
    return store.write_set(KIND, cases, root, manifest_extra)


def absent_reason(case_id: str, root: Path = store.ROOT) -> str | None:
    """Why ``case_id`` has no golden to judge under ``root`` on this platform, or None when it has."""
    entry = store.read_manifest(root)["cases"].get(f"{KIND}/{case_id}")
    if entry is None:
        return f"no golden of this case in {root}"
    now = platform()
    if platform_key.mismatch(entry.get("platform") or {}, now) is not None:
        return f"no golden for platform {platform_key.describe(now)}"
    return None


def _judge(case_id: str, prod: dict, tensors: dict, entry: dict, root: Path) -> Report:
    """Production trace ``prod`` vs the golden's ``tensors`` (results in dataflow order).
    Components the golden predates are not judged: ``meta["stale"]`` says so."""
    stored, rows = _decode(tensors)
    full = golden_view(case_id, prod)
    now, positions = {}, {}
    for step in sorted({_step_comp(k)[0] for k in full}):
        n, r = _n_tokens(prod, step), rows.get(step)
        if r is not None and (n is None or int(r.max()) >= n):
            rep = Report([ComponentResult(f"{step}.{ROWS}", False, None,
                                          note=f"golden rows up to {int(r.max())} but this run has {n} tokens: "
                                               f"the case's inputs changed since recording; re-record")])
            rep.meta.update(case=case_id, kind=KIND, root=str(root), recorded_with=_recorded_with(entry))
            return rep
        if n is not None:
            positions[f"{step}.positions"] = _take(prod[f"{step}.positions"].cpu(), r, n)
        for key in [k for k in full if k.startswith(step + ".")]:
            now[key] = _take(full[key], r, n)
    predates = sorted({_step_comp(k)[1] for k in now if k not in stored},
                      key=lambda c: STORED.index(c))
    for key in [k for k in now if k not in stored]:
        del now[key]
    tols = _tolerances(stored)
    report = compare_traces(now, stored, tols, components=STORED)
    index_topk = _index_topk(case_id)
    _settled_max_abs(report, now, stored, positions, index_topk)
    for r in report.results:
        comp = r.name.split(".", 1)[1]
        if r.passed or r.name not in now or now[r.name].shape != stored[r.name].shape:
            continue
        variant = _order_variant_rows(positions, r.name, stored[r.name].shape[0] if stored[r.name].dim() else 1,
                                      index_topk)
        if variant is None:
            continue
        if comp in INDEX_COMPONENTS or comp == "draft_token":
            n = stored[r.name].shape[0] if stored[r.name].dim() else 1  # draft tokens: one per row
            bad_rows = index_rows_differing(now[r.name].reshape(n, -1), stored[r.name].reshape(n, -1))
            loose_ok = True
        else:
            bad_rows = _rows_out_of_tolerance(now[r.name], stored[r.name], tols[comp])
            loose = GPU_VS_REFERENCE.get(comp)
            loose_ok = loose is not None and not _rows_out_of_tolerance(now[r.name], stored[r.name], loose)
        if bad_rows and loose_ok and all(bool(variant[i]) for i in bad_rows):
            kept = rows.get(_step_comp(r.name)[0])
            if kept is not None and len(variant) == kept.numel():  # name the step's rows, not the kept ones'
                bad_rows = kept[bad_rows].tolist()
            r.passed = True
            r.note = (f"{len(bad_rows)} of {len(variant)} {'kept ' if kept is not None else ''}rows differ, "
                      f"all order-variant (context > index_topk {index_topk}; rows {bad_rows[:6]}), "
                      f"within the reference tolerance")
    report.meta.update(case=case_id, kind=KIND, root=str(root), recorded_with=_recorded_with(entry))
    if predates:
        report.meta["stale"] = (f"golden recorded before {', '.join(predates)} was stored: re-record "
                                f"(python -m harness goldens record); those are not judged")
    return report


# production goldens through the one entry, ``store.check(PRODUCTION, case_id, prod, root=...)``:
# a golden applies only on the platform it was recorded on (``absent_reason``); the platform and
# vLLM are looked up when a golden is written (tests replace ``platform`` / ``recorded_with``)
PRODUCTION = store.GoldenKind(
    KIND, encode=lambda case_id, prod: _encode(case_id, prod),
    entry=lambda case_id, prod: _golden(case_id, prod, platform(), recorded_with())[1],
    judge=lambda *a: _judge(*a), absent=lambda case_id, root: absent_reason(case_id, root))


def judge_golden(label: str, case_id: str, prod: dict, root, table: bool = False) -> tuple[object, int, list[dict]]:
    """``case_id``'s production trace against its golden under ``root`` (the checked-in goldens, or
    a host baseline) through ``store.check``, its lines printed (``table``: the report's table
    first) -> (report or None, EXIT_OK / EXIT_MISMATCH of what was judged, the parts not judged:
    [{"part", "reason"}]). On a mismatch the obtained trace lies beside the golden; a line names both."""
    from harness.exitcodes import EXIT_MISMATCH, EXIT_OK

    checked = store.check(PRODUCTION, case_id, prod, root=root)
    golden = checked.report
    if golden is None:
        why = checked.absent or "no golden"
        print(not_judged_line(label, case_id, why))
        return None, EXIT_OK, [{"part": f"{label}/{case_id}", "reason": why}]
    if table:
        print(golden.table())
    first = golden.first_divergent
    print(f"{'ok  ' if golden.passed else 'FAIL'} {label} {case_id}"
          + ("" if golden.passed or first is None else f": first divergent {first.name}")
          + f" (recorded with {platform_key.describe_vllm(golden.meta.get('recorded_with'))})")
    if not checked.passed:
        print(f"     {checked.paths_line}")
    missing = []
    if golden.meta.get("stale"):
        print(not_judged_line(label, case_id, golden.meta["stale"]))
        missing.append({"part": f"{label}/{case_id}", "reason": golden.meta["stale"]})
    return golden, (EXIT_OK if golden.passed else EXIT_MISMATCH), missing


def _recorded_with(entry: dict) -> dict:
    """The vLLM a golden was recorded with (older entries: the vLLM field of their platform stamp)."""
    got = entry.get("recorded_with")
    if got:
        return dict(got)
    old = entry.get("platform") or {}
    return {"vllm": old.get("vllm"), "vllm_commit": None}


def _config(case_id: str):
    """The case's MTPConfig (None for a case id unknown among the registry's single-GPU module cases)."""
    import reference as R

    from harness import case_registry
    gpu_cases = case_registry.specs(kind="module", without="probe")

    case = gpu_cases.get(case_id)
    return None if case is None else R.MTPConfig.from_hf_dict(case.hf_config())


def _index_topk(case_id: str) -> int | None:
    from harness import case_registry
    gpu_cases = case_registry.specs(kind="module", without="probe")

    case = gpu_cases.get(case_id)
    return None if case is None else case.hf_config().get("index_topk")


def _order_variant_rows(prod: dict, key: str, n_rows: int, index_topk: int | None) -> torch.Tensor | None:
    """Per row of ``key``: does its query read keys through the top-k (position + 1 > index_topk)?

    Rows are the step's tokens, or (logits, draft tokens at step 0) each
    request's last token; None when the rows cannot be matched to positions.
    """
    pos = prod.get(f"{key.split('.', 1)[0]}.positions")
    if pos is None:
        return None
    pos = pos.long().flatten()
    if index_topk is None:
        return torch.zeros(n_rows, dtype=torch.bool)
    if n_rows != pos.numel():  # one row per request: its last token (requests are position-major runs)
        last = torch.cat([torch.nonzero(pos[1:] <= pos[:-1]).flatten(), torch.tensor([pos.numel() - 1])])
        if n_rows != last.numel():
            return None
        pos = pos[last]
    return pos + 1 > index_topk


def _settled_max_abs(report, now: dict, stored: dict, positions: dict, index_topk: int | None) -> None:
    """Each result's ``max_abs_settled``: its max |d| over the rows that are not order-variant, where
    some rows are (their keys are summed in an order that varies run to run, so their |d| against a
    golden jitters between runs of one commit; the run history's drift rule reads this value)."""
    for r in report.results:
        a, e = now.get(r.name), stored.get(r.name)
        if a is None or e is None or a.shape != e.shape or a.dim() == 0 or not a.is_floating_point():
            continue
        variant = _order_variant_rows(positions, r.name, e.shape[0], index_topk)
        if variant is None or not bool(variant.any()) or variant.numel() != e.shape[0]:
            continue
        d = (a.double() - e.double()).abs().reshape(e.shape[0], -1)[~variant]
        d = torch.nan_to_num(d, nan=float("inf"))
        r.max_abs_settled = float(d.max()) if d.numel() else 0.0


def _rows_out_of_tolerance(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> list[int]:
    a, e = actual.double(), expected.double()
    bad = (a - e).abs() > tol.atol + tol.rtol * e.abs()
    bad |= torch.isnan(a) != torch.isnan(e)
    if bad.dim() == 0:
        return [0] if bool(bad) else []
    return torch.nonzero(bad.reshape(bad.shape[0], -1).any(-1)).flatten().tolist()


def not_judged_line(label: str, case_id: str, reason: str) -> str:
    """The line a part that could not be judged prints: words a bisecting user cannot miss."""
    return f"NOT JUDGED: {label} {case_id} ({reason})"


def list_goldens(root: Path = store.ROOT) -> list[str]:
    """One line per production golden under ``root``: its platform key and the vLLM it was recorded with."""
    cases = store.read_manifest(root)["cases"]
    return [f"{key}: platform {platform_key.describe(platform_key.key_of(e.get('platform') or {}))}; "
            f"recorded with {platform_key.describe_vllm(_recorded_with(e))}"
            for key, e in sorted(cases.items()) if key.startswith(KIND + "/")]


def main(argv=None) -> int:
    """record / check / list (exit codes: ``harness.exitcodes``; check: 125 when a case has no
    golden for this platform, never 0)."""
    from harness.exitcodes import OneLineParser, run_guarded

    ap = OneLineParser(prog="python -m harness goldens", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=("record", "check", "list"))
    ap.add_argument("--case", action="append",
                    help=f"case id (default: {', '.join(case_ids(role='golden', kind='module'))})")
    ap.add_argument("--root", default=str(store.ROOT), help="goldens directory (default: the checked-in goldens/)")
    ap.add_argument("--debug", action="store_true", help="print the traceback of an error")
    args = ap.parse_args(argv)
    return run_guarded(_command, args, debug=args.debug)


def _command(args) -> int:
    from harness.ci_env import ci_is_set
    from harness.exitcodes import EXIT_CANNOT_JUDGE, EXIT_OK, CLIError, first_line, worst
    from harness import case_registry
    gpu_cases = case_registry.specs(kind="module", without="probe")
    from harness.production.can_run import cannot_run_production_reason

    root = Path(args.root)
    ids = args.case or list(case_ids(role="golden", kind="module"))
    unknown = [c for c in ids if c not in gpu_cases]
    if unknown:
        from harness.exitcodes import listed
        raise CLIError(f"--case: unknown case(s) {listed(unknown, 5)}; known: {listed(gpu_cases, 40)}")
    from harness import input_checks as check

    if args.action == "record":
        check.output_dir("--root", args.root)  # written all or nothing, after every case ran
    else:
        check.input_dir("--root", args.root)  # listed or judged against: it must be there
    if args.action == "list":
        for line in list_goldens(root) or [f"no production goldens in {root}"]:
            print(line)
        return EXIT_OK
    checked_in = root.resolve() == store.ROOT.resolve()
    if args.action == "record" and checked_in and ci_is_set():
        raise CLIError(f"record into {root} is refused when CI is set: the checked-in goldens are "
                       "re-recorded on purpose, by a person (or give --root DIR)")
    reason = cannot_run_production_reason()
    if reason:
        print(f"cannot judge: {reason}")
        return EXIT_CANNOT_JUDGE
    from harness.production.module.side_by_side import run_case

    if args.action == "record":  # every case run before anything is written: all recorded or none
        traces = {}
        for cid in ids:
            try:
                traces[cid] = run_case(gpu_cases[cid]).trace
            except Exception as exc:  # noqa: BLE001 - one line, nothing written
                print(f"cannot judge: production run of {cid} failed, nothing recorded: "
                      f"{exc.__class__.__name__}: {first_line(exc)}")
                return EXIT_CANNOT_JUDGE
        for path in record_set(traces, root):
            print(f"recorded {path}")
        print(f"recorded {len(traces)} production golden(s) for platform {platform_key.describe(platform())} "
              f"with {platform_key.describe_vllm(recorded_with())}"
              + (": review `git diff goldens/` before committing" if checked_in else f" under {root}"))
        return EXIT_OK
    status = EXIT_OK
    for cid in ids:
        _, code, not_judged = judge_golden("golden", cid, run_case(gpu_cases[cid]).trace, root, table=True)
        status = worst([status, code, *(EXIT_CANNOT_JUDGE for _ in not_judged)])
    return status

