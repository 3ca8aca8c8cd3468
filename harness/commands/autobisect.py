"""``python -m harness autobisect``: name the vLLM commit that broke a verdict, unattended.

    python -m harness autobisect --source ~/src/vllm --good v0.33.0 --bad HEAD \\
        --baseline /tmp/hyv4-baseline [--release-site SITE] [--history H] [--report R.json]

Each step lays the commit's Python files over a copy of an installed release's vLLM
(``tools/vllm-overlay.sh``: its compiled extensions kept; a commit whose compiled sources differ
is 125, skipped) and runs ``bisect-check`` on it (``--baseline DIR`` recorded at the good release);
``--judge CMD`` replaces both with a command of your own (run in the source tree at each commit;
it gets ``$AUTOBISECT_COMMIT`` and ``$AUTOBISECT_REPORT``, where a harness JSON report it writes
names the first divergent component). The bisect itself, the restore of the tree (Ctrl-C and
SIGTERM included) and the culprit's parsing: ``harness.history.bisect``. Every step is one run
in the history (kind ``autobisect-step``, labelled with the session, ``vllm_commit`` the commit).

Exit codes: 0 the culprit named (commit, subject, first divergent component and its numbers);
2 bad input (a tree that is not a clean git work tree, a bisect in progress, unknown refs, a bad
end that judges good, a judge that answers 2); 125 no single commit can be named (only skipped
commits left, the bad end cannot be judged, the bisect aborted); 130 / 143 interrupted (the tree
restored first).

``python -m harness autobisect-step --step CONFIG`` is the step ``git bisect run`` runs.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from harness.exitcodes import EXIT_CANNOT_JUDGE, EXIT_MISMATCH, EXIT_OK, EXIT_USAGE, CLIError, OneLineParser

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "tools" / "vllm-overlay.sh"
STEP_KIND = "autobisect-step"


def add_arguments(p) -> None:
    p.add_argument("--source", required=True, metavar="SRC", help="a vLLM git checkout (clean; restored afterwards)")
    p.add_argument("--good", required=True, metavar="REF", help="a commit that judges good (e.g. the release tag)")
    p.add_argument("--bad", default="HEAD", metavar="REF", help="a commit that judges bad (judged once first)")
    p.add_argument("--release-site", default=None, metavar="SITE",
                   help="site folder of the installed release whose compiled extensions each step reuses "
                        "(default: where this Python's vllm is installed)")
    p.add_argument("--release-tag", default=None, metavar="TAG",
                   help="the tag SITE was built from (default: v + its version; tools/vllm-overlay.sh)")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="bisect-check --baseline DIR at each step (record it at the good release first)")
    p.add_argument("--case", action="append", default=None, metavar="ID", help="bisect-check --case ID at each step")
    p.add_argument("--graphs", action="store_true", help="bisect-check --graphs at each step")
    p.add_argument("--judge", default=None, metavar="CMD",
                   help="a shell command judging each commit instead of overlay + bisect-check (0 good, 1 bad, "
                        "125 skip; anything else aborts); runs in SRC with $AUTOBISECT_COMMIT and "
                        "$AUTOBISECT_REPORT (a harness report written there names the culprit's first divergent "
                        "component)")
    p.add_argument("--work", default=None, metavar="DIR",
                   help="keep the overlay and each step's report here (default: a temporary folder, removed)")
    p.add_argument("--report", default=None, metavar="R.json", help="write the result (culprit, steps) as JSON")
    p.add_argument("--history", default=None, metavar="PATH",
                   help="record every step in the run history at PATH (default $HYV4_HISTORY)")


def _release_site(args) -> str:
    if args.release_site:
        return args.release_site
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise CLIError("--release-site: not given and this Python has no vllm installed")
    return str(Path(list(spec.submodule_search_locations)[0]).parent)


def _check(args) -> None:
    from harness import input_checks as check
    from harness.commands.history import history_path
    from harness.history.store import check_history

    if args.report is not None:
        check.output_file("--report", args.report)
    if args.work is not None:
        check.output_dir("--work", args.work)
    h = history_path(args)
    if h:
        check_history(h)
    if args.judge is None:
        site = _release_site(args)
        if not os.path.isdir(os.path.join(site, "vllm")):
            raise CLIError(f"--release-site {site}: no installed vllm/ package here")
        args.release_site = site
        if args.baseline is not None:
            from harness.goldens import baseline
            baseline.read_stamp(args.baseline)
    elif not args.judge.strip():
        raise CLIError("--judge is empty")
    elif args.baseline or args.case or args.graphs:
        raise CLIError("--judge replaces bisect-check: --baseline, --case and --graphs do not apply")


def cmd_autobisect(args) -> int:
    import tempfile
    import uuid

    from harness.commands.history import history_path
    from harness.history import bisect as B
    from harness.history.ingest import now_utc

    _check(args)
    B.preflight(args.source, args.good, args.bad)  # bad input before anything runs
    session = f"autobisect {now_utc()} {uuid.uuid4().hex[:8]}"
    tmp = None if args.work else tempfile.TemporaryDirectory(prefix="hyv4-autobisect-")
    work = Path(args.work or tmp.name).resolve()
    try:
        work.mkdir(parents=True, exist_ok=True)
        steps_file = work / "steps.jsonl"
        if steps_file.exists():
            steps_file.unlink()
        config = {"source": str(Path(args.source).resolve()), "work": str(work), "judge": args.judge,
                  "release_site": args.release_site, "release_tag": args.release_tag, "baseline": args.baseline,
                  "cases": args.case or [], "graphs": bool(args.graphs), "history": history_path(args),
                  "session": session, "python": sys.executable}
        cfg_path = work / "autobisect.json"
        cfg_path.write_text(json.dumps(config, indent=1))
        # -P: the step runs in the source tree, whose folders (vllm/ ...) must not come first on sys.path
        safe = ["-P"] if sys.version_info >= (3, 11) else []
        step = [sys.executable, *safe, "-m", "harness", "autobisect-step", "--step", str(cfg_path)]
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        print(f"autobisect: {args.source} {args.good}..{args.bad}, session {session!r}, "
              f"{'judge: ' + args.judge if args.judge else 'overlay on ' + str(args.release_site) + ' + bisect-check'}",
              flush=True)
        res = B.bisect(args.source, args.good, args.bad, step, env=env)
        steps = _read_steps(steps_file)
        return _conclude(args, res, steps, session)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _read_steps(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def first_divergent(doc: dict | None) -> str | None:
    """The first failing component of a harness report and its numbers (side-by-side cases, vs the
    reference, first; then golden / baseline parts; then the engine cases' first problem)."""
    if not isinstance(doc, dict):
        return None
    cases = doc.get("cases") if isinstance(doc.get("cases"), dict) else {}
    order = sorted(cases, key=lambda c: (0 if c.startswith("side-by-side/") else 1, list(cases).index(c)))
    for cid in order:
        rep = cases[cid]
        if not isinstance(rep, dict) or rep.get("passed") is not False:
            continue
        for c in rep.get("components") or []:
            if isinstance(c, dict) and c.get("passed") is False:
                tol = c.get("tolerance") or {}
                atol = tol.get("atol")
                nums = f"max|d| {c.get('max_abs', float('nan')):.3e}"
                if isinstance(atol, (int, float)) and atol > 0:
                    nums += f" vs atol {atol:.1e} (x{c.get('max_abs', 0) / atol:.3g})"
                if isinstance(c.get("mean_abs"), (int, float)):
                    nums += f", mean|d| {c['mean_abs']:.3e}"
                if c.get("note"):
                    nums += f", {c['note']}"
                return f"{cid}: {c.get('name')}: {nums}"
        return f"{cid}: first divergent {rep.get('first_divergent')}"
    for cid, e in sorted(((doc.get("meta") or {}).get("engine") or {}).items()):
        if isinstance(e, dict) and e.get("exit") == EXIT_MISMATCH:
            return f"engine {cid}: {(e.get('problems') or ['exit 1'])[0]}"
    return None


def _conclude(args, res, steps: list[dict], session: str) -> int:
    judged = [s for s in steps if s.get("exit") in (0, 1)]
    skipped = [s for s in steps if s.get("exit") == 125]
    per_step = (sum(s["seconds"] for s in steps) / len(steps)) if steps else None
    by_commit = {s["commit"]: s for s in steps}
    out = {"session": session, "source": str(args.source), "good": args.good, "bad": args.bad,
           "culprit": res.culprit, "subject": res.subject, "candidates": res.candidates,
           "bisect_run_exit": res.run_exit, "steps": steps, "seconds": round(res.seconds, 2),
           "seconds_per_step": None if per_step is None else round(per_step, 2), "log": res.log}
    code = EXIT_OK
    if res.culprit:
        step = by_commit.get(res.culprit) or {}
        doc = None
        if step.get("report") and os.path.isfile(step["report"]):
            try:
                doc = json.loads(Path(step["report"]).read_text())
            except (OSError, ValueError):
                doc = None
        first = first_divergent(doc)
        out["first_divergent"] = first
        print(f"culprit: {res.culprit} {res.subject}")
        unnamed = f"not named (the step wrote no report naming one; exit {step.get('exit')})"
        print(f"first divergent: {first or unnamed}")
    else:
        aborted = [s for s in steps if s.get("exit") not in (0, 1, 125)]
        if aborted:
            s = aborted[-1]
            line = (f"autobisect: the judge answered {s.get('exit')} at {s['commit'][:12]} ({s.get('subject')}): "
                    "the bisect stopped")
            code = EXIT_USAGE if s.get("exit") == EXIT_USAGE else EXIT_CANNOT_JUDGE
        elif res.candidates:
            line = ("cannot judge: only skipped commits left; the culprit is one of: "
                    + ", ".join(c[:12] for c in res.candidates))
            code = EXIT_CANNOT_JUDGE
        else:
            line = f"cannot judge: git bisect run ended {res.run_exit} without naming a commit"
            code = EXIT_CANNOT_JUDGE
        print(line)
        out["line"] = line
    print(f"steps: {len(steps)} ({len(judged)} judged, {len(skipped)} skipped)"
          + (f", {per_step:.1f} s per step" if per_step is not None else "") + f", {res.seconds:.1f} s in all")
    if args.report:
        from harness.atomic import atomic_write_json, write_errors, write_failure
        try:
            atomic_write_json(args.report, out, sort_keys=True)
        except write_errors() as exc:
            raise write_failure(f"--report {args.report}", exc) from exc
    return code


# ---- one step (what git bisect run runs) ---------------------------------------------------------


def _git(src, *a) -> str:
    return subprocess.run(["git", "-C", str(src), *a], capture_output=True, text=True).stdout.strip()


# Each step judges a vLLM tree other than the installed one, so it keeps vLLM's cache layer
# (VLLM_CACHE_ROOT) apart: vLLM's model-class cache (modelinfos/) holds one entry per class,
# keyed by a hash of the class's package files, and the harness's inspection marker lives
# beside it; a step sharing them rewrites both for its tree, and every later process of the
# installed tree on that root (a GPU tier's engines beside the bisect) then inspects the class
# again in a subprocess of its own (measured: 20 of them, about 15 CPU-s each, in one tier).
STEP_VLLM_CACHE = "vllm-cache"


def step_env(work: Path) -> dict:
    """The environment of a step's judge: this one, with vLLM's cache layer under the run's
    work folder (shared by its steps) and no run history (the step records its judge's run)."""
    env = dict(os.environ)
    env.pop("HYV4_HISTORY", None)
    env["VLLM_CACHE_ROOT"] = str(Path(work) / STEP_VLLM_CACHE)
    return env


def run_step(cfg: dict) -> int:
    """Judge the commit checked out in ``cfg['source']``; record it; answer git bisect run."""
    from harness.history.bisect import EXIT_ABORT
    from harness.history.store import verdict_of

    src, work = cfg["source"], Path(cfg["work"])
    sha, subject = _git(src, "rev-parse", "HEAD"), _git(src, "log", "-1", "--format=%s")
    steps_dir = work / "steps"
    steps_dir.mkdir(parents=True, exist_ok=True)
    report = steps_dir / f"{sha[:12]}.json"
    if report.exists():
        report.unlink()
    t0 = time.perf_counter()
    first_line, overlay_s = None, None
    env = step_env(work)
    if cfg.get("judge"):
        env.update(AUTOBISECT_REPORT=str(report), AUTOBISECT_COMMIT=sha)
        code = subprocess.call(["sh", "-c", cfg["judge"]], cwd=src, env=env)
    else:
        site = work / "site"
        t_overlay = time.perf_counter()
        ov = subprocess.run(["bash", str(OVERLAY), src, cfg["release_site"], str(site)]
                            + ([cfg["release_tag"]] if cfg.get("release_tag") else []),
                            capture_output=True, text=True)
        overlay_s = round(time.perf_counter() - t_overlay, 2)
        msg = (ov.stderr.strip() or ov.stdout.strip()).splitlines()
        first_line = msg[-1] if msg else None
        if first_line:
            print(first_line, flush=True)
        if ov.returncode != 0:
            code = EXIT_CANNOT_JUDGE if ov.returncode == EXIT_CANNOT_JUDGE else EXIT_USAGE
        else:
            env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)] + (
                [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
            cmd = [cfg.get("python") or sys.executable, "-m", "harness", "bisect-check", "--report", str(report)]
            if cfg.get("baseline"):
                cmd += ["--baseline", cfg["baseline"]]
            for c in cfg.get("cases") or []:
                cmd += ["--case", c]
            if cfg.get("graphs"):
                cmd.append("--graphs")
            print("+ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
            code = subprocess.call(cmd, cwd=str(ROOT), env=env)
    seconds = round(time.perf_counter() - t0, 2)
    if cfg.get("history"):
        from harness.commands.history import record_report
        try:
            print(record_report(cfg["history"], STEP_KIND, str(report) if report.exists() else None, code,
                                seconds=seconds, label=cfg.get("session"),
                                context={"vllm_commit": sha, "first_line": first_line},
                                identity={"commit": sha, "session": cfg.get("session")}), flush=True)
        except CLIError as exc:  # the history refused: the bisect goes on, said once per step
            print(f"warning: step not recorded: {exc}", flush=True)
    with open(work / "steps.jsonl", "a") as f:
        f.write(json.dumps({"commit": sha, "subject": subject, "exit": code, "seconds": seconds,
                            "overlay_s": overlay_s, "report": str(report) if report.exists() else None}) + "\n")
    answer = code if code in (EXIT_OK, EXIT_MISMATCH, EXIT_CANNOT_JUDGE) else EXIT_ABORT
    print(f"autobisect step {sha[:12]} ({subject[:70]}): exit {code}, {verdict_of(code)}"
          + (" -> abort" if answer == EXIT_ABORT else "") + f" ({seconds:.1f} s)", flush=True)
    return answer


def step_main(argv=None) -> int:
    ap = OneLineParser(prog="python -m harness autobisect-step")
    ap.add_argument("--step", required=True, metavar="CONFIG")
    a = ap.parse_args(argv)
    try:
        cfg = json.loads(Path(a.step).read_text())
    except (OSError, ValueError) as exc:
        print(f"autobisect step: {a.step}: {exc}", flush=True)
        return 128
    return run_step(cfg)

