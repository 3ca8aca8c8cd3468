"""``python -m harness history`` (table, trend plots, drift), ``history merge``, ``history ingest``,
and the ``--history PATH`` of the commands that produce reports (``compare``, ``bisect-check``,
the engine command, the GPU tier's pytest run).

Every producer records through one function, ``record_report``: the JSON report the command wrote
(a temporary one when only ``--history`` was asked for) becomes one run (``harness.history.ingest``);
a command that ended before writing a report (cannot judge, bad input found late) is still one run,
with its exit code and no rows: a check that did not run is in the history as such, never as a pass.

Exit codes: 0; 1 ``--drift`` found something; 2 bad input (a history file that is not ours, damaged
or of a newer schema: refused, never overwritten); 125 ``--drift`` with too few runs to compare.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from harness.exitcodes import EXIT_CANNOT_JUDGE, EXIT_MISMATCH, EXIT_OK, CLIError

HISTORY_ENV = "HYV4_HISTORY"


def history_path(args) -> str | None:
    """``--history``, else ``$HYV4_HISTORY``, else None (empty means unset)."""
    return getattr(args, "history", None) or os.environ.get(HISTORY_ENV, "").strip() or None


def add_history_argument(p) -> None:
    p.add_argument("--history", default=None, metavar="PATH",
                   help="append this run to the run history (SQLite) at PATH, created if absent "
                        f"(default ${HISTORY_ENV}); a file that is not a history is refused, exit 2")


def _context() -> dict:
    """What the report does not say: the harness commit, the vLLM commit where vLLM is imported."""
    from harness.history.ingest import harness_commit, installed_vllm_commit

    return {"harness_commit": harness_commit(), "vllm_commit": installed_vllm_commit()}


def record_report(history: str, kind: str, report: str | None, code: int, *, started_at: str | None = None,
                  seconds: float | None = None, context: dict | None = None, label: str | None = None,
                  identity: dict | None = None) -> str:
    """Append the run that wrote ``report`` (absent: a run with its exit code only) to ``history``;
    the line to print."""
    from harness.history import ingest, store

    ctx = {**_context(), **(context or {})}
    doc = None
    if report and os.path.isfile(report):
        try:
            doc = ingest.read_json(report)
        except store.HistoryError as exc:
            doc, ctx["first_line"] = None, str(exc)
    if doc is None:
        doc = {"no_report": True, "kind": kind, "started_at": started_at or ingest.now_utc(), "pid": os.getpid(),
               "exit": code}
    return record_doc(history, kind, doc, code, source=report, started_at=started_at, seconds=seconds,
                      context=ctx, label=label, identity=identity)


def record_doc(history: str, kind: str, doc: dict, code: int, *, source: str | None = None,
               started_at: str | None = None, seconds: float | None = None, context: dict | None = None,
               label: str | None = None, identity: dict | None = None) -> str:
    """Append the run of the report ``doc`` (in memory) to ``history``; the line to print."""
    import json

    from harness.history import ingest, store

    ctx = context if context is not None else _context()
    doc = json.loads(json.dumps(doc, default=str))  # as the report file holds it: the same run id
    run = ingest.run_from_doc(doc, kind=kind, exit_code=code, source=source, started_at=started_at,
                              context=ctx, label=label, seconds=seconds, identity=identity)
    added = store.append(history, run)
    return (f"history {history}: run {run.run_id[:12]} ({kind}, {run.verdict}, {len(run.components)} component "
            f"row(s), {len(run.acceptance)} acceptance row(s))" + ("" if added else " already there"))


def with_history(kind: str, args, fn) -> int:
    """``fn()`` (a report-writing command), its run appended to ``--history`` / ``$HYV4_HISTORY``.
    The history is checked before ``fn`` runs (exit 2 for a file that is not one); when no
    ``--report`` was asked for, the report goes to a temporary file, ingested and removed."""
    from harness.history import ingest
    from harness.history.store import check_history

    path = history_path(args)
    if not path:
        return fn()
    check_history(path)
    tmp = None
    if getattr(args, "report", None) is None:
        tmp = tempfile.TemporaryDirectory(prefix="hyv4-history-")
        args.report = os.path.join(tmp.name, "report.json")
    started, t0 = ingest.now_utc(), time.perf_counter()
    code = None
    try:
        code = fn()
        return code
    finally:
        if code is not None:  # an exception (interrupt, unexpected error) records nothing
            try:
                print(record_report(path, kind, args.report, code, started_at=started,
                                    seconds=round(time.perf_counter() - t0, 2)), flush=True)
            finally:
                if tmp is not None:
                    tmp.cleanup()
        elif tmp is not None:
            tmp.cleanup()


# ---- the history command -------------------------------------------------------------------------


def add_arguments(p) -> None:
    p.add_argument("--history", default=None, metavar="PATH", help=f"the run history (default ${HISTORY_ENV})")
    p.add_argument("--platform", default=None,
                   help="only runs whose platform key contains this (GPU name, torch, CUDA)")
    p.add_argument("--release", default=None, help="only runs of this vLLM version (a prefix: 0.34 matches 0.34.0)")
    p.add_argument("--case", default=None, help="only rows of cases whose id contains this")
    p.add_argument("--since", default=None, metavar="DATE", help="only runs started on or after DATE (YYYY-MM-DD)")
    p.add_argument("--until", default=None, metavar="DATE", help="only runs started on or before DATE (YYYY-MM-DD)")
    p.add_argument("--last", type=int, default=None, metavar="N", help="only the last N runs (after the other filters)")
    p.add_argument("--kind", action="append", default=None,
                   help="only runs of this kind (bisect-check, compare, engine, gpu-tier, autobisect-step); repeatable")
    p.add_argument("--components", action="store_true",
                   help="also print one line per (case, component): latest max|d|, trailing median, ratio to atol")
    p.add_argument("--plots", default=None, metavar="DIR",
                   help="write trend plots (PNG) per case and per acceptance figure into DIR")
    p.add_argument("--drift", type=float, default=None, metavar="FACTOR",
                   help="report components whose max|d| moved by more than FACTOR against their trailing median "
                        "while within tolerance, and acceptance that fell; exit 1 when any (a gate)")
    p.add_argument("--window", type=int, default=7, metavar="N", help="--drift: the trailing runs the median is of")
    p.add_argument("--min-runs", type=int, default=1, metavar="N",
                   help="--drift: trailing runs a figure needs before it is judged")
    p.add_argument("--out", default=None, metavar="FILE", help="also write what is printed to FILE")
    sub = p.add_subparsers(dest="history_command", required=False, metavar="{merge,ingest}")
    m = sub.add_parser("merge", help="merge histories into one (idempotent: a run already there is not added)")
    m.add_argument("dest", metavar="DEST", help="the history to merge into (created if absent)")
    m.add_argument("sources", metavar="SRC", nargs="+", help="histories to merge from (left as they are)")
    i = sub.add_parser("ingest", help="append the run of each JSON report given (harness, engine report, or a "
                                      "GPU tier's output directory)")
    i.add_argument("reports", metavar="REPORT", nargs="+",
                   help="a --report JSON, an engine_mtp_<case>.json, or a directory a GPU tier wrote "
                        "(gpu_side_by_side.jsonl, engine_mtp_*.json)")
    i.add_argument("--history", dest="ingest_history", default=None, metavar="PATH",
                   help="the history to append to (same as history --history PATH; default $HYV4_HISTORY)")
    i.add_argument("--kind", dest="ingest_kind", default=None,
                   help="the run's kind (default: bisect-check for a harness report, engine, gpu-tier)")
    i.add_argument("--exit-code", type=int, default=None, help="the exit code of the run that wrote it")
    i.add_argument("--label", default=None, help="a label stored with the run (a nightly's id, ...)")
    i.add_argument("--vllm-commit", default=None, metavar="SHA",
                   help="the vLLM commit the run judged (a report says only the version)")
    i.add_argument("--harness-commit", default=None, metavar="SHA", help="the harness commit that wrote the report")


def _filters(args):
    from harness.history.store import Filters

    from harness import input_checks as check

    if args.last is not None:
        check.integer("--last", args.last, 1, 10 ** 6)
    for flag in ("since", "until"):
        v = getattr(args, flag)
        if v is not None:
            import datetime as dt
            try:
                dt.date.fromisoformat(v[:10])
            except ValueError:
                raise CLIError(f"--{flag} {v}: not a date (YYYY-MM-DD)") from None
    return Filters(platform=args.platform, release=args.release, case=args.case, since=args.since,
                   until=args.until, last=args.last, kinds=tuple(args.kind) if args.kind else None)


def cmd_history(args) -> int:
    sub = getattr(args, "history_command", None)
    if sub == "merge":
        return cmd_merge(args)
    if sub == "ingest":
        return cmd_ingest(args)
    from harness import input_checks as check

    path = history_path(args)
    if not path:
        raise CLIError(f"history: give --history PATH (or set ${HISTORY_ENV})")
    f = _filters(args)
    if args.drift is not None and not (1 < args.drift < float("inf")):
        raise CLIError(f"--drift {args.drift}: must be a finite factor > 1")
    check.integer("--window", args.window, 1, 1000)
    check.integer("--min-runs", args.min_runs, 1, 1000)
    if args.out is not None:
        check.output_file("--out", args.out)
    if args.plots is not None:
        check.output_dir("--plots", args.plots)
    from harness.history.store import open_history

    if not Path(path).exists():
        raise CLIError(f"--history {path}: no such history file")
    conn = open_history(path, readonly=True)
    out: list[str] = []
    say = out.append
    try:
        code = _show(conn, args, f, say)
    finally:
        conn.close()
    text = "\n".join(out)
    print(text)
    if args.out:
        from harness.atomic import atomic_write_bytes, write_errors, write_failure
        try:
            atomic_write_bytes(args.out, (text + "\n").encode())
        except write_errors() as exc:
            raise write_failure(f"--out {args.out}", exc) from exc
    return code


def _fmt(v, spec=".3e") -> str:
    return "-" if v is None else format(v, spec)


def _show(conn, args, f, say) -> int:
    import statistics

    from harness.history.store import rows_of, select_runs

    runs = select_runs(conn, f)
    say(f"{len(runs)} run(s) in {history_path(args)}"
        + (f" (filters: {', '.join(k + '=' + str(v) for k, v in vars(f).items() if v not in (None, (), False))})"
           if any(v not in (None, (), False) for v in vars(f).values()) else ""))
    ids = [r["run_id"] for r in runs]
    comps = rows_of(conn, "components", ids, f.case) if ids else []
    by_run: dict[str, list] = {}
    for c in comps:
        by_run.setdefault(c["run_id"], []).append(c)
    say(f"{'started (UTC)':20s} {'kind':15s} {'verdict':12s} {'vLLM':22s} {'commit':12s} {'rows':>5s} "
        f"{'worst max|d|/atol':34s} platform")
    from harness.history.drift import drift_value

    def judged_ratio(c):  # the value drift judges (settled rows where a golden has order-variant ones), / atol
        return drift_value(c) / c["atol"] if c.get("max_abs_settled") is not None and c.get("atol") else c["ratio"]

    for r in runs:
        rows = by_run.get(r["run_id"], [])
        ratios = [(ratio, c) for c in rows if (ratio := judged_ratio(c)) is not None]
        worst = max(ratios, key=lambda rc: rc[0]) if ratios else None
        w = (f"{worst[0]:.3g} {worst[1]['case_id'].split('/')[-1]} {worst[1]['component']}"[:34] if worst
             else "-")
        say(f"{(r['started_at'] or '')[:19]:20s} {r['kind']:15s} {r['verdict']:12s} {(r['vllm'] or '-')[:22]:22s} "
            f"{(r['vllm_commit'] or '-')[:12]:12s} {len(rows):5d} {w:34s} {r['platform']}")
    if args.components and runs:
        series: dict[tuple, list] = {}
        rank = {rid: i for i, rid in enumerate(ids)}
        for c in sorted(comps, key=lambda c: rank[c["run_id"]]):
            series.setdefault((c["case_id"], c["component"]), []).append(c)
        say("")
        say(f"{'case':40s} {'component':28s} {'runs':>4s} {'latest':>10s} {'median':>10s} {'ratio':>8s} ok")
        for (cid, comp), rows in sorted(series.items()):
            vals = [c["max_abs"] for c in rows if c["max_abs"] is not None]
            last = rows[-1]
            say(f"{cid[:40]:40s} {comp[:28]:28s} {len(rows):4d} {_fmt(last['max_abs']):>10s} "
                f"{_fmt(statistics.median(vals) if vals else None):>10s} {_fmt(last['ratio'], '.3g'):>8s} "
                f"{'-' if last['passed'] is None else 'ok' if last['passed'] else 'FAIL'}")
    accs = rows_of(conn, "acceptance", ids, f.case) if ids else []
    if accs:
        say("")
        say("acceptance (vLLM's definition), the case's sum per run, oldest first:")
        per_case: dict[str, list] = {}
        rank = {rid: i for i, rid in enumerate(ids)}
        for a in sorted(accs, key=lambda a: rank[a["run_id"]]):
            if a["request"] == "all":
                per_case.setdefault(a["case_id"], []).append(a)
        for cid, rows in sorted(per_case.items()):
            say(f"  {cid}: " + ", ".join(f"{a['accepted']}/{a['drafted']}" for a in rows[-12:]))
    if args.plots:
        from harness.history.plot import trend_plots
        paths = trend_plots(conn, args.plots, f)
        say(f"plots: {len(paths)} PNG(s) in {args.plots}")
    if args.drift is None:
        return EXIT_OK
    from harness.history.drift import find_drift

    findings = find_drift(conn, f, factor=args.drift, window=args.window, min_runs=args.min_runs)
    comparable = _comparable_platforms(conn, f, args.min_runs)
    say("")
    for x in findings:
        say(x.line())
    if findings:
        say(f"DRIFT: {len(findings)} finding(s) (factor {args.drift:g}, trailing median of up to {args.window} run(s))")
        return EXIT_MISMATCH
    if not comparable:
        say(f"NOT JUDGED: drift: no platform has {args.min_runs + 1} or more runs of one kind with rows to compare")
        return EXIT_CANNOT_JUDGE
    say(f"no drift (factor {args.drift:g}) on {comparable} series of runs (platform, kind)")
    return EXIT_OK


def _comparable_platforms(conn, f, min_runs: int) -> int:
    """How many platforms have enough runs with rows for the drift rule to judge."""
    import dataclasses

    from harness.history.drift import DEFAULT_EXCLUDED_KINDS
    from harness.history.store import rows_of, select_runs

    g = dataclasses.replace(f, last=None)
    if g.kinds is None:
        g.exclude_kinds = DEFAULT_EXCLUDED_KINDS
    runs = select_runs(conn, g)
    with_rows = {r["run_id"] for r in rows_of(conn, "components", [r["run_id"] for r in runs], f.case)}
    with_rows |= {r["run_id"] for r in rows_of(conn, "acceptance", [r["run_id"] for r in runs], f.case)}
    count: dict[tuple[str, str], int] = {}
    for r in runs:
        if r["run_id"] in with_rows:
            count[(r["platform"], r["kind"])] = count.get((r["platform"], r["kind"]), 0) + 1
    return sum(1 for n in count.values() if n >= min_runs + 1)


def cmd_merge(args) -> int:
    from harness.history.store import merge

    for s in args.sources:
        if not Path(s).exists():
            raise CLIError(f"history merge: {s}: no such history file")
    for src, added, there in merge(args.dest, args.sources):
        print(f"merged {src}: {added} run(s) added, {there} already in {args.dest}")
    return EXIT_OK


def cmd_ingest(args) -> int:
    from harness.history import ingest, store

    path = getattr(args, "ingest_history", None) or history_path(args)
    if not path:
        raise CLIError(f"history ingest: give --history PATH (or set ${HISTORY_ENV})")
    store.check_history(path)
    # only what the caller says: a report ingested elsewhere or later is not this checkout's run
    ctx = {"vllm_commit": args.vllm_commit, "harness_commit": args.harness_commit}
    runs = []
    for rep in args.reports:  # every report read before anything is written: a bad one is exit 2, nothing added
        if os.path.isdir(rep):
            lines, engines = ingest.read_tier_dir(rep)
            if not lines and not engines:
                raise CLIError(f"{rep}: no gpu_side_by_side.jsonl and no engine_mtp_*.json here")
            runs.append(ingest.run_from_tier(lines, engines, exit_code=args.exit_code, versions=None,
                                             started_at=ingest.file_time(rep), context=ctx, source=rep,
                                             label=args.label))
            continue
        doc = ingest.read_json(rep)
        fmt = ingest.report_kind(doc)
        if fmt == "unknown":
            raise CLIError(f"{rep}: neither a harness report ('cases') nor an engine report ('case', 'counts')")
        kind = args.ingest_kind or ("bisect-check" if fmt == "report" else "engine")
        runs.append(ingest.run_from_doc(doc, kind=kind, exit_code=args.exit_code, source=rep,
                                        started_at=ingest.file_time(rep), context=ctx, label=args.label))
    for run in runs:
        added = store.append(path, run)
        print(f"history {path}: run {run.run_id[:12]} from {run.source} ({run.kind}, {run.verdict}, "
              f"{len(run.components)} component row(s))" + ("" if added else ": already there"))
    return EXIT_OK


def record_tier(history: str, directories, exit_status: int, *, started_at: str | None = None,
                seconds: float | None = None) -> str | None:
    """Append the GPU tier's run (what its tests wrote into ``directories``: side-by-side lines and
    engine reports) to ``history``; None when its tests wrote nothing (no GPU test ran). The
    platform is the engine reports', else this host's (torch and vLLM imported here, on a GPU host)."""
    from harness.history import ingest, store

    lines, engines, seen = [], [], set()
    for d in directories:
        if d and os.path.isdir(d) and os.path.realpath(d) not in seen:
            seen.add(os.path.realpath(d))
            lo, en = ingest.read_tier_dir(d)
            lines += lo
            engines += en
    if not lines and not engines:
        return None
    versions = None
    if not any(isinstance(e.get("versions"), dict) for e in engines):
        try:
            from harness.goldens.platform_key import platform
            import vllm  # the version the tier judged
            versions = {**platform(), "vllm": vllm.__version__}
        except Exception:  # noqa: BLE001 - metadata: a run without it is still recorded
            versions = None
    ctx = _context()
    # pytest's exit status: 0 passed, 1 some test failed; anything else (interrupted, internal or
    # usage error, no tests) is no verdict
    code = {0: EXIT_OK, 1: EXIT_MISMATCH}.get(exit_status, EXIT_CANNOT_JUDGE)
    run = ingest.run_from_tier(lines, engines, exit_code=code, versions=versions, started_at=started_at,
                               context=ctx, source=", ".join(sorted(seen)), seconds=seconds)
    added = store.append(history, run)
    return (f"history {history}: GPU tier run {run.run_id[:12]} ({run.verdict}, {len(run.components)} component "
            f"row(s), {len(run.acceptance)} acceptance row(s))" + ("" if added else " already there"))
