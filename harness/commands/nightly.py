"""``python -m harness nightly OUT_DIR --history PATH``: the nightly GPU job, unattended.

1. the GPU tier (``.ci/gpu-tier``: warmup, then ``pytest -m gpu`` on xdist workers, goldens
   required), its run appended to the history by the pytest plugin (root ``conftest.py``);
2. ``bisect-check`` against the host baseline (``--baseline DIR``; without it the checked-in
   goldens), appended to the history;
3. the drift report (``history --drift FACTOR`` on this platform's runs) and the trend plots;
4. when the night failed (a verdict of 1) and ``--source`` gives a vLLM source tree: an
   ``autobisect`` between the last vLLM commit that judged good on this platform in the
   history and tonight's (the installed vLLM's commit, else the tree's HEAD), every step
   recorded, the culprit printed and written to ``OUT_DIR/autobisect.json``;
5. a copy of the history (``OUT_DIR/history.sqlite``, one self-contained file) and
   ``OUT_DIR/nightly.json``.

Everything a CI uploads is in OUT_DIR: ``log.txt`` (this command's lines), ``tier/`` (the tier's
logs, JUnit, its reports), ``bisect.json`` + ``bisect.log``, ``drift.txt``, ``plots/``,
``autobisect.json`` + ``autobisect.log``, ``history.sqlite``, ``nightly.json``.

Exit: 0 every verdict good and no drift; 1 a verdict failed or drift was found; 2 bad input;
125 nothing failed but something could not be judged (the tier or bisect-check answered 125).
Drift that cannot be judged yet (the first night on a platform) is said, not failed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from harness.exitcodes import EXIT_CANNOT_JUDGE, EXIT_MISMATCH, EXIT_OK, CLIError, worst

ROOT = Path(__file__).resolve().parents[2]


def add_arguments(p) -> None:
    p.add_argument("out_dir", metavar="OUT_DIR", help="where everything to upload is written")
    p.add_argument("--history", default=None, metavar="PATH",
                   help="the run history kept between nights (default $HYV4_HISTORY; required)")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="the host baseline bisect-check (and autobisect) judge against")
    p.add_argument("--workers", type=int, default=6, help="xdist workers of the GPU tier")
    p.add_argument("--skip-tier", action="store_true", help="only bisect-check, drift and autobisect")
    p.add_argument("--drift", type=float, default=3.0, metavar="FACTOR",
                   help="drift factor against the trailing median (history --drift)")
    p.add_argument("--source", default=None, metavar="SRC",
                   help="a vLLM git checkout: when the night fails, autobisect the day's commits in it")
    p.add_argument("--bad-ref", default=None, metavar="REF",
                   help="autobisect's bad end (default: the installed vLLM's commit, else SRC's HEAD)")
    p.add_argument("--release-site", default=None, metavar="SITE",
                   help="autobisect --release-site (default: where this Python's vllm is installed)")
    p.add_argument("--release-tag", default=None, metavar="TAG",
                   help="autobisect --release-tag (default: the installed vLLM's commit when it says one)")


class _Log:
    def __init__(self, path: Path):
        self.path = path

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


def _run(cmd, log_path: Path, say, env=None) -> int:
    """Run a step; its output streamed to the terminal and to ``log_path``."""
    from harness.history.bisect import run_streamed

    t0 = time.perf_counter()
    with open(log_path, "a") as f:
        def echo(line):
            print(line, flush=True)
            f.write(line + "\n")
        code, _ = run_streamed([str(c) for c in cmd], cwd=str(ROOT), env=env, echo=echo)
    say(f"=== exit {code} ({time.perf_counter() - t0:.0f} s): {' '.join(map(str, cmd[:6]))}")
    return code


def last_good_commit(history: str, platform: str, before: str | None = None) -> str | None:
    """The vLLM commit of the latest good run on ``platform`` (a nightly's kind) with one recorded."""
    from harness.history.store import open_history

    conn = open_history(history, readonly=True)
    try:
        sql = ("SELECT vllm_commit FROM runs WHERE platform = ? AND verdict = 'good' AND vllm_commit IS NOT NULL "
               "AND kind IN ('bisect-check', 'gpu-tier')" + (" AND started_at < ?" if before else "")
               + " ORDER BY started_at DESC, rowid DESC LIMIT 1")
        row = conn.execute(sql, (platform, before) if before else (platform,)).fetchone()
        return row[0] if row else None
    finally:
        conn.close()


def _run_of(history: str, source: str) -> dict | None:
    from harness.history.store import open_history

    conn = open_history(history, readonly=True)
    try:
        row = conn.execute("SELECT * FROM runs WHERE source = ? ORDER BY started_at DESC, rowid DESC LIMIT 1",
                           (source,)).fetchone()
        return dict(row) if row else None
    finally:
        conn.close()


def cmd_nightly(args) -> int:
    from harness import input_checks as check
    from harness.commands.history import history_path
    from harness.history.ingest import now_utc
    from harness.history.store import check_history, snapshot

    history = history_path(args)
    if not history:
        raise CLIError("nightly: give --history PATH (or set $HYV4_HISTORY): the record kept between nights")
    check.output_dir("OUT_DIR", args.out_dir)
    check_history(history)
    check.integer("--workers", args.workers, 1, 256)
    if not (1 < args.drift < float("inf")):
        raise CLIError(f"--drift {args.drift}: must be a finite factor > 1")
    if args.source is not None:
        if not os.path.isdir(args.source):
            raise CLIError(f"--source {args.source}: not a directory")
    if args.baseline is not None:
        from harness.goldens import baseline
        baseline.read_stamp(args.baseline)
    out = Path(args.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    history = str(Path(history).resolve())
    say = _Log(out / "log.txt")
    started = now_utc()
    say(f"nightly {started}: history {history}, OUT_DIR {out}")
    env = dict(os.environ, HYV4_HISTORY=history, PYTHONUNBUFFERED="1")
    summary: dict = {"started_at": started, "history": history}
    codes = {}
    py = sys.executable
    if not args.skip_tier:
        tier = out / "tier"
        reports = tier / "reports"
        reports.mkdir(parents=True, exist_ok=True)
        tier_env = dict(env, HYV4_GPU_OUT=str(reports), HYV4_REPORT_DIR=str(reports), HYV4_REQUIRE_GOLDENS="1")
        say("=== GPU tier (.ci/gpu-tier)")
        codes["tier"] = _run(["bash", ROOT / ".ci" / "gpu-tier", tier, args.workers], tier / "nightly.log", say,
                             env=tier_env)
    say("=== bisect-check" + (f" --baseline {args.baseline}" if args.baseline else " (checked-in goldens)"))
    bisect_json = out / "bisect.json"
    cmd = [py, "-m", "harness", "bisect-check", "--report", bisect_json, "--history", history]
    if args.baseline:
        cmd += ["--baseline", args.baseline]
    codes["bisect-check"] = _run(cmd, out / "bisect.log", say, env=env)
    run = _run_of(history, str(bisect_json))
    platform = run["platform"] if run else None
    summary.update(codes=codes, platform=platform, vllm=run and run["vllm"], vllm_commit=run and run["vllm_commit"])

    say(f"=== drift (factor {args.drift:g}) on {platform or 'every platform'}")
    drift_cmd = [py, "-m", "harness", "history", "--history", history, "--drift", args.drift, "--components",
                 "--plots", out / "plots", "--out", out / "drift.txt"]
    if platform:
        drift_cmd += ["--platform", platform]
    drift = _run(drift_cmd, out / "drift.log", say, env=env)
    summary["drift_exit"] = drift

    night = worst(codes.values())
    if night == EXIT_MISMATCH and args.source:
        summary["autobisect"] = _autobisect(args, history, platform, run, started, out, say, env)
    elif night == EXIT_MISMATCH:
        say("autobisect: not run (no --source vLLM tree given)")
    try:
        snapshot(history, out / "history.sqlite")
        say(f"history copied to {out / 'history.sqlite'}")
    except Exception as exc:  # noqa: BLE001 - the copy is an artifact: said, the verdict stands
        say(f"warning: history not copied: {exc}")
    code = worst([night, EXIT_MISMATCH if drift == EXIT_MISMATCH else EXIT_OK])
    if drift == EXIT_CANNOT_JUDGE:
        say("NOT JUDGED: drift (too few runs on this platform yet); the night's verdict stands without it")
    summary["exit"] = code
    from harness.atomic import atomic_write_json
    atomic_write_json(out / "nightly.json", summary, sort_keys=True, default=str)
    say(f"nightly: exit {code} (" + ", ".join(f"{k} {v}" for k, v in codes.items()) + f", drift {drift})")
    return code


def _autobisect(args, history, platform, run, started, out: Path, say, env) -> dict:
    good = last_good_commit(history, platform, before=started) if platform else None
    bad = args.bad_ref or (run or {}).get("vllm_commit") or "HEAD"
    if not good:
        say("NOT JUDGED: autobisect: no vLLM commit judged good on this platform in the history")
        return {"run": False, "why": "no good commit in the history"}
    say(f"=== autobisect {good[:12]}..{bad[:12] if len(bad) == 40 else bad} in {args.source}")
    cmd = [sys.executable, "-m", "harness", "autobisect", "--source", args.source, "--good", good, "--bad", bad,
           "--history", history, "--report", out / "autobisect.json", "--work", out / "autobisect"]
    if args.baseline:
        cmd += ["--baseline", args.baseline]
    if args.release_site:
        cmd += ["--release-site", args.release_site]
    tag = args.release_tag or (run or {}).get("vllm_commit")
    if tag:
        cmd += ["--release-tag", tag]
    code = _run(cmd, out / "autobisect.log", say, env=env)
    res = {"run": True, "exit": code, "good": good, "bad": bad}
    try:
        doc = json.loads((out / "autobisect.json").read_text())
        res.update(culprit=doc.get("culprit"), subject=doc.get("subject"), first_divergent=doc.get("first_divergent"))
    except (OSError, ValueError):
        pass
    return res
