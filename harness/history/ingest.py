"""A JSON report -> one run of the history (``harness.history.store.Run``): the one ingest every
producer goes through.

What it reads (each format as its producer writes it):

- a harness report (``compare`` / ``bisect-check`` ``--report``, ``harness.report.write_report``):
  ``cases`` -> one component row per (case, component) with max |d|, mean |d|, max rel, the
  tolerance and the verdict; ``meta.versions`` -> the platform key and the vLLM version;
  ``meta.engine`` (bisect-check's engine cases) -> acceptance and engine components;
- an engine report (``engine_mtp_<case>.json``, ``python -m harness engine``): its
  ``components`` (max |d| over the draft calls), ``acceptance`` (per request, vLLM's definition),
  ``versions``, ``timing_s``;
- the GPU tier's side-by-side lines (``gpu_side_by_side.jsonl``, one module verdict per line:
  ``rows`` with ``max_abs_vs_exact``, ``atol``, ``rtol``).

Acceptance per draft position j: over the counted verify steps of a case's requests, the steps
whose accepted prefix is longer than j, out of those that drafted position j (each verify step
drafts ``num_speculative_tokens``, or what vLLM's ``per_step_drafted`` says).

The run's id is a hash of the report's content and kind: the same report ingested twice (by the
command that wrote it and by the GPU tier's sweep, or in two merged histories) is one run.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import re
import socket
import subprocess
from pathlib import Path

from harness.history.store import Run, verdict_of

ROOT = Path(__file__).resolve().parents[2]


def now_utc() -> str:
    """Now, ISO 8601 UTC to the microsecond: runs of one process (a test's three ``bisect-check``
    calls) can start within one second, and the history orders runs by this string."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds")


def harness_commit() -> str | None:
    """This checkout's commit (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def normalize_commit(commit) -> str | None:
    """A git commit as git reads it: setuptools-scm's ``g<sha>`` (vLLM's ``_version.commit_id``)
    without its ``g``."""
    if not isinstance(commit, str) or not commit.strip():
        return None
    c = commit.strip()
    if re.fullmatch(r"g[0-9a-f]{7,40}", c):
        c = c[1:]
    return c


def installed_vllm_commit() -> str | None:
    """The commit the vLLM this Python would import says it was built from (its ``_version.py``,
    read as text: vLLM is not imported), or None."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "_version.py"
    try:
        m = re.search(r"commit_id\s*=\s*['\"]([^'\"]+)['\"]", path.read_text())
    except OSError:
        return None
    return normalize_commit(m.group(1)) if m else None


def run_id(doc, kind: str) -> str:
    blob = json.dumps({"kind": kind, "doc": doc}, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def _num(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _ratio(max_abs, atol) -> float | None:
    m, a = _num(max_abs), _num(atol)
    if m is None or a is None or a <= 0:
        return None
    return m / a


def component_rows(case_id: str, rep: dict) -> list[dict]:
    """Rows of one case of a harness report (``harness.trace_compare.Report.as_dict``)."""
    out = []
    for c in rep.get("components") or []:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            continue
        tol = c.get("tolerance") if isinstance(c.get("tolerance"), dict) else {}
        out.append({"case_id": case_id, "component": c["name"], "max_abs": _num(c.get("max_abs")),
                    "mean_abs": _num(c.get("mean_abs")), "max_rel": _num(c.get("max_rel")),
                    "atol": _num(tol.get("atol")), "rtol": _num(tol.get("rtol")),
                    "ratio": _ratio(c.get("max_abs"), tol.get("atol")),
                    "passed": int(bool(c.get("passed"))), "note": (c.get("note") or None),
                    "max_abs_settled": _num(c.get("max_abs_settled"))})
    return out


def verdict_rows(case_id: str, rep: dict) -> list[dict]:
    """Rows of one module verdict (``Verdict.to_report()``: ``rows`` of ``report_rows``)."""
    out = []
    for r in rep.get("rows") or []:
        if not isinstance(r, dict) or not isinstance(r.get("key"), str):
            continue
        out.append({"case_id": case_id, "component": r["key"], "max_abs": _num(r.get("max_abs_vs_exact")),
                    "mean_abs": None, "max_rel": _num(r.get("max_rel")), "atol": _num(r.get("atol")),
                    "rtol": _num(r.get("rtol")), "ratio": _ratio(r.get("max_abs_vs_exact"), r.get("atol")),
                    "passed": int(bool(r.get("passed"))), "note": (r.get("note") or None)})
    return out


def engine_component_rows(case_id: str, comps, problems) -> list[dict]:
    """An engine case's components (max |d| over its draft calls). They are diagnostics: the case's
    verdict judges its draft tokens (its own "verdict" row), and MoE routing ties are not masked in
    them, so a component with calls past its tolerance is recorded as not judged (passed NULL, the
    count in its note), never as a failure of a run whose verdict is good; drift judges the rest."""
    out = []
    for name, c in sorted((comps or {}).items()):
        if not isinstance(c, dict):
            continue
        bad = c.get("calls_out_of_tol")
        out.append({"case_id": case_id, "component": name, "max_abs": _num(c.get("max_abs")), "mean_abs": None,
                    "max_rel": None, "atol": None, "rtol": None, "ratio": None,
                    "passed": None if bad else 1,
                    "note": (f"diagnostic: {bad} draft call(s) past the tolerance (routing ties not masked)"
                             if bad else None)})
    if problems is not None:  # the engine's verdict as a row of its own: its first problem, named
        out.append({"case_id": case_id, "component": "verdict", "max_abs": None, "mean_abs": None, "max_rel": None,
                    "atol": None, "rtol": None, "ratio": None, "passed": int(not problems),
                    "note": (str(problems[0])[:500] if problems else None)})
    return out


def acceptance_rows(case_id: str, acc, counts) -> tuple[list[dict], list[dict]]:
    """(per request rows plus "all", per draft position rows) of an engine case's ``acceptance``."""
    if not isinstance(acc, dict) or not acc:
        return [], []
    k = (counts or {}).get("num_speculative_tokens") if isinstance(counts, dict) else None
    req, pos_acc, pos_drafted = [], {}, {}
    total_a = total_d = 0
    for name, a in sorted(acc.items()):
        if not isinstance(a, dict):
            continue
        acc_n, dr_n = a.get("accepted"), a.get("drafted")
        if isinstance(acc_n, int) and isinstance(dr_n, int):
            total_a, total_d = total_a + acc_n, total_d + dr_n
        req.append({"case_id": case_id, "request": name, "accepted": acc_n, "drafted": dr_n,
                    "rate": _num(a.get("rate")) if a.get("rate") is not None else (
                        acc_n / dr_n if isinstance(acc_n, int) and dr_n else None)})
        per_step = a.get("per_step") or []
        steps = len(per_step)
        per_drafted = [k] * steps if isinstance(k, int) and k > 0 else (
            [dr_n // steps] * steps if steps and isinstance(dr_n, int) else [])
        for n_acc, n_dr in zip(per_step, per_drafted):
            if not isinstance(n_acc, int) or not isinstance(n_dr, int):
                continue
            for j in range(n_dr):
                pos_drafted[j] = pos_drafted.get(j, 0) + 1
                pos_acc[j] = pos_acc.get(j, 0) + (1 if n_acc > j else 0)
    if req:
        req.append({"case_id": case_id, "request": "all", "accepted": total_a, "drafted": total_d,
                    "rate": total_a / total_d if total_d else None})
    pos = [{"case_id": case_id, "position": j, "accepted": pos_acc[j], "drafted": pos_drafted[j],
            "rate": pos_acc[j] / pos_drafted[j] if pos_drafted[j] else None} for j in sorted(pos_drafted)]
    return req, pos


def timing_rows(case_id: str, timing) -> list[dict]:
    return [{"case_id": case_id, "phase": str(k), "seconds": _num(v)} for k, v in sorted((timing or {}).items())
            if _num(v) is not None] if isinstance(timing, dict) else []


def _platform(versions) -> dict:
    v = versions if isinstance(versions, dict) else {}
    return {"gpu": v.get("gpu"), "capability": v.get("capability"), "torch": v.get("torch"), "cuda": v.get("cuda"),
            "vllm": v.get("vllm"), "vllm_commit": normalize_commit(v.get("vllm_commit"))}


def _engine_case(run: Run, cid: str, e: dict) -> None:
    """An engine case's rows into ``run`` (``e``: a summary in bisect-check's meta, or a whole engine report)."""
    run.components += engine_component_rows(cid, e.get("components"), e.get("problems"))
    req, pos = acceptance_rows(cid, e.get("acceptance"), e.get("counts"))
    run.acceptance += req
    run.positions += pos
    run.timings += timing_rows(cid, e.get("timing_s"))


def report_kind(doc) -> str:
    """Which producer's format ``doc`` is: "report" (harness report), "engine" or "unknown"."""
    if isinstance(doc, dict) and isinstance(doc.get("cases"), dict):
        return "report"
    if isinstance(doc, dict) and isinstance(doc.get("counts"), dict) and "case" in doc:
        return "engine"
    return "unknown"


def run_from_doc(doc, *, kind: str, exit_code: int | None = None, source: str | None = None,
                 started_at: str | None = None, context: dict | None = None, label: str | None = None,
                 seconds: float | None = None, identity: dict | None = None) -> Run:
    """One run from a report ``doc``. ``context`` overrides what the report says of the platform
    and versions (``vllm_commit`` of an autobisect step: the source commit, which an overlay's
    installed ``_version.py`` does not know), adds ``harness_commit`` / ``host``. ``identity``:
    what makes the run another one although its report may be the same (an autobisect step's
    commit and session), hashed with the report into the run's id."""
    context = dict(context or {})
    fmt = report_kind(doc)
    versions = (doc.get("meta") or {}).get("versions") if fmt == "report" else (
        doc.get("versions") if isinstance(doc, dict) else None)
    plat = _platform(versions)
    plat.update({k: v for k, v in context.items() if k in plat and v is not None})
    plat["vllm_commit"] = normalize_commit(plat["vllm_commit"])
    inferred = exit_code is None
    if exit_code is None and fmt == "engine":
        exit_code = doc.get("exit_code", 0 if doc.get("passed") else 1 if doc.get("problems") else None)
    elif exit_code is None and fmt == "report":
        exit_code = infer_exit(doc)
    rid = run_id({"doc": doc, "identity": identity} if identity else doc, kind)
    run = Run(run_id=context.get("run_id") or rid, started_at=started_at or now_utc(), kind=kind,
              verdict=verdict_of(exit_code), exit_code=exit_code, source=source, label=label, seconds=seconds,
              harness_commit=context.get("harness_commit"), host=context.get("host") or socket.gethostname(),
              **plat)
    if fmt == "report":
        meta = doc.get("meta") or {}
        for cid, rep in sorted(doc["cases"].items()):
            if isinstance(rep, dict):
                run.components += component_rows(cid, rep)
                run.timings += timing_rows(cid, (rep.get("meta") or {}).get("timing_s"))
                secs = _num((rep.get("meta") or {}).get("seconds"))
                if secs is not None:
                    run.timings.append({"case_id": cid, "phase": "seconds", "seconds": secs})
        for cid, e in sorted((meta.get("engine") or {}).items()):
            if isinstance(e, dict):
                _engine_case(run, f"engine/{cid}", e)
        for k, v in sorted((meta.get("timeline_s") or {}).items()):
            if _num(v) is not None:
                run.timings.append({"case_id": "", "phase": f"timeline {k}", "seconds": _num(v)})
        run.extra = {k: meta[k] for k in ("not_judged", "judged_without", "baseline", "golden_root") if meta.get(k)}
        failed = next(((cid, r.get("first_divergent")) for cid, r in sorted(doc["cases"].items())
                       if isinstance(r, dict) and r.get("passed") is False), None)
        if failed:
            run.extra["first_failing"] = f"{failed[0]}: {failed[1]}"
    elif fmt == "engine":
        case = doc.get("case")
        cid = case.get("id") if isinstance(case, dict) else str(case)
        _engine_case(run, f"engine/{cid}", doc)
        if doc.get("problems"):
            run.extra = {"first_failing": f"engine/{cid}: {doc['problems'][0]}"}
    for k in ("first_line",):
        if context.get(k):
            run.extra[k] = context[k]
    if inferred and exit_code is not None:
        run.extra["exit_inferred"] = True  # read off the report, not the command's exit status
    return run


def infer_exit(doc: dict) -> int | None:
    """The exit code a harness report implies (``history ingest`` without ``--exit-code``): 1 when a
    case or an engine case failed, 125 when one could not be judged or a part was not judged, 0
    when every case passed; None for a report without cases."""
    cases = [r for r in doc["cases"].values() if isinstance(r, dict)]
    engines = [e for e in ((doc.get("meta") or {}).get("engine") or {}).values() if isinstance(e, dict)]
    if not cases and not engines:
        return None
    if any(r.get("passed") is False for r in cases) or any(e.get("exit") == 1 for e in engines):
        return 1
    if any(e.get("exit") not in (0, 1) for e in engines) or (doc.get("meta") or {}).get("not_judged"):
        return 125
    return 0


def run_from_tier(jsonl_lines: list[dict], engine_reports: list[dict], *, exit_code: int | None,
                  versions: dict | None, started_at: str | None = None, context: dict | None = None,
                  source: str | None = None, label: str | None = None, seconds: float | None = None) -> Run:
    """One run of the GPU tier: its side-by-side verdicts (``gpu_side_by_side.jsonl``) and its engine
    reports, under the platform ``versions`` (taken from an engine report when not given)."""
    if not versions:
        versions = next((r.get("versions") for r in engine_reports if isinstance(r.get("versions"), dict)), None)
    doc = {"jsonl": jsonl_lines, "engine": engine_reports}
    ctx = dict(context or {})
    plat = _platform(versions)
    plat.update({k: v for k, v in ctx.items() if k in plat and v is not None})
    plat["vllm_commit"] = normalize_commit(plat["vllm_commit"])
    run = Run(run_id=ctx.get("run_id") or run_id(doc, "gpu-tier"), started_at=started_at or now_utc(),
              kind="gpu-tier", verdict=verdict_of(exit_code), exit_code=exit_code, source=source, label=label,
              seconds=seconds, harness_commit=ctx.get("harness_commit"),
              host=ctx.get("host") or socket.gethostname(), **plat)
    for line in jsonl_lines:
        case = line.get("case")
        cid = case.get("id") if isinstance(case, dict) else str(case)
        rows = verdict_rows(f"side-by-side/{cid}", line)
        have = {(r["case_id"], r["component"]) for r in run.components}
        run.components += [r for r in rows if (r["case_id"], r["component"]) not in have]
        run.timings += timing_rows(f"side-by-side/{cid}", line.get("timing_s"))
    for rep in engine_reports:
        case = rep.get("case")
        cid = case.get("id") if isinstance(case, dict) else str(case)
        _engine_case(run, f"engine/{cid}", rep)
    return run


def read_json(path) -> dict:
    """A report file's JSON, or ``HistoryError`` naming it."""
    from harness.history.store import HistoryError

    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise HistoryError(f"{path}: no such report") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HistoryError(f"{path}: cannot read the report: {getattr(exc, 'strerror', None) or exc}") from None
    except (ValueError, RecursionError) as exc:
        raise HistoryError(f"{path}: not a JSON report ({exc.__class__.__name__})") from None


def read_tier_dir(directory) -> tuple[list[dict], list[dict]]:
    """(side-by-side lines, engine reports) a GPU tier wrote into ``directory`` (its
    ``$HYV4_GPU_OUT`` / ``$HYV4_REPORT_DIR``); a line or report that does not parse is skipped."""
    d = Path(directory)
    lines, engines = [], []
    p = d / "gpu_side_by_side.jsonl"
    if p.is_file():
        for raw in p.read_text(errors="replace").splitlines():
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            if isinstance(obj, dict):
                lines.append(obj)
    for q in sorted(d.glob("engine_mtp_*.json")):
        if q.name.endswith((".rejudge.json", ".sweep.json")):
            continue
        try:
            obj = json.loads(q.read_text())
        except (OSError, ValueError):
            continue
        if report_kind(obj) == "engine":
            engines.append(obj)
    return lines, engines


def file_time(path) -> str:
    """A report file's modification time (ISO UTC): when the run that wrote it ended."""
    t = os.stat(path).st_mtime
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).isoformat(timespec="microseconds")
