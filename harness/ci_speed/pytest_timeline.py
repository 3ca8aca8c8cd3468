"""Where a pytest run's wall time goes, per process (what the warm GPU tier was measured with).

With ``$HYV4_TIMELINE=DIR`` every pytest process of a run (the xdist controller and each
worker, or the one process without xdist) appends events to ``DIR/<who>.jsonl``: when the
process started (from ``/proc``, so the interpreter's and pytest's own start-up count), when
pytest configured it, when collection finished, each test's start and finish (in the
process that ran it), and the session's end. ``summarize`` turns the files into one line per
process: start-up, collection, busy seconds, idle seconds, and its last finish, all in seconds
from the earliest process start. The pytest plugin (``pytest_plugin``) registers ``Recorder``; the GPU tier's
benchmark (``benchmarks/bench_gpu_tier.py``) sets the variable and prints the summary.

    python -m harness ci timeline DIR     # the summary of a recorded run
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

from ..process_clock import process_start_epoch

ENV = "HYV4_TIMELINE"


class Recorder:
    """The pytest plugin: one JSONL file per process, one line per event, flushed at once
    (a killed run keeps what it recorded)."""

    def __init__(self, config, directory: str):
        wi = getattr(config, "workerinput", None)
        self.config = config
        self.who = str(wi.get("workerid", "worker")) if wi else "main"
        os.makedirs(directory, exist_ok=True)
        self._f = open(os.path.join(directory, f"{self.who}.jsonl"), "a", buffering=1)
        self._write("process", t=process_start_epoch())
        self._write("configured")

    def _write(self, event: str, **fields) -> None:
        fields.setdefault("t", time.time())
        self._f.write(json.dumps({"who": self.who, "event": event, **fields}) + "\n")

    def _runs_tests(self) -> bool:  # the xdist controller only relays its workers' reports
        return not self.config.pluginmanager.has_plugin("dsession")

    def pytest_collection_finish(self, session):
        self._write("collected", n=len(session.items))

    def pytest_runtest_logstart(self, nodeid, location):
        if self._runs_tests():
            self._write("start", nodeid=nodeid)

    def pytest_runtest_logfinish(self, nodeid, location):
        if self._runs_tests():
            self._write("finish", nodeid=nodeid)

    def pytest_sessionfinish(self, session):
        self._write("end")
        self._f.close()


def _finite_time(t) -> bool:
    """A seconds-since-the-epoch value this module can subtract (a 400-digit int is not)."""
    import math

    if isinstance(t, bool) or not isinstance(t, (int, float)):
        return False
    try:
        return math.isfinite(float(t))
    except OverflowError:
        return False


def summarize(directory: str) -> dict:
    """{"processes": {who: {...}}, "critical": who, "runs": n} from a recorded run: per process,
    seconds from the earliest recorded process start to its start, configure, collection and end;
    its tests, busy seconds (sum of test spans), idle seconds between its first test's start and its
    last finish, and the test it ran last. ``critical`` is the process whose last test finished
    last. Each process appends to its file, so a folder several pytest runs recorded into holds them
    all: ``runs`` counts them by the controller's (``main``) starts, and only the latest is summarized
    (the events from its start on; a worker file left by an earlier run only is not a process of it)."""
    from ..exitcodes import CLIError
    from ..input_checks import read_bytes

    events = []
    for p in sorted(pathlib.Path(directory).glob("*.jsonl")):
        try:  # bounded, regular files only: a FIFO would block for ever, /dev/zero fill the memory
            text = read_bytes(str(p), p, MAX_TIMELINE_BYTES).decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"not UTF-8 text ({exc.reason})" \
                if isinstance(exc, UnicodeDecodeError) else str(exc)
            raise CLIError(f"{p}: cannot read it: {why}") from exc
        for ln in text.splitlines():
            try:
                e = json.loads(ln)
            except (ValueError, RecursionError):
                continue  # a line cut by a kill
            if isinstance(e, dict) and isinstance(e.get("who"), str) and isinstance(e.get("event"), str) and (
                    e.get("t") is None or _finite_time(e["t"])) and (
                    e["event"] not in ("start", "finish") or isinstance(e.get("nodeid"), str)):
                events.append(e)  # anything else is not a record of ours
    mains = sorted(e["t"] for e in events if e["who"] == "main" and e["event"] == "process" and e.get("t"))
    if len(mains) > 1:  # the latest run: its controller starts before its workers, whose events follow
        events = [e for e in events if e.get("t") is not None and e["t"] >= mains[-1]]
    starts = [e["t"] for e in events if e.get("event") == "process" and e.get("t")]
    t0 = min(starts or [e["t"] for e in events if e.get("t")] or [0.0])
    procs: dict[str, dict] = {}
    open_tests: dict[tuple[str, str], float] = {}
    for e in sorted(events, key=lambda e: e.get("t") or 0.0):
        who, ev, t = e["who"], e["event"], e.get("t")
        p = procs.setdefault(who, {"tests": 0, "busy_s": 0.0})
        if t is None:
            continue
        rel = round(t - t0, 1)
        if ev in ("process", "configured", "collected", "end"):
            p[f"{ev}_s"] = rel
        elif ev == "start":
            open_tests[(who, e["nodeid"])] = t
            p.setdefault("first_test_s", rel)
        elif ev == "finish" and (who, e["nodeid"]) in open_tests:
            p["tests"] += 1
            p["busy_s"] += t - open_tests.pop((who, e["nodeid"]))
            p["last_finish_s"], p["last_test"] = rel, e["nodeid"]
    for p in procs.values():
        p["busy_s"] = round(p["busy_s"], 1)
        if "first_test_s" in p and "last_finish_s" in p:
            p["idle_s"] = round(p["last_finish_s"] - p["first_test_s"] - p["busy_s"], 1)
    ran = {w: p for w, p in procs.items() if "last_finish_s" in p}
    return {"processes": procs, "critical": max(ran, key=lambda w: ran[w]["last_finish_s"]) if ran else None,
            "runs": max(1, len(mains))}


MAX_TIMELINE_BYTES = 256 << 20  # one process's timeline: a line per test start and finish


def format_summary(summary: dict) -> list[str]:
    def f(p, k):
        return f"{p[k]:7.1f}" if k in p else "      -"

    lines = ["process   start  config collect  1st test  tests   busy   idle  last end   (s from the first start)"]
    if summary.get("runs", 1) > 1:
        lines[0] += f"; the latest of {summary['runs']} runs recorded here"
    for who in sorted(summary["processes"], key=lambda w: (w != "main", len(w), w)):
        p = summary["processes"][who]
        mark = "  <- critical" if who == summary["critical"] else ""
        lines.append(f"{who:8s}{f(p, 'process_s')}{f(p, 'configured_s')}{f(p, 'collected_s')}  "
                     f"{f(p, 'first_test_s')}  {p['tests']:5d}{p['busy_s']:7.1f}{f(p, 'idle_s')}"
                     f"  {f(p, 'last_finish_s')}{mark}")
    return lines


def _main(argv: list[str]) -> int:
    from ..exitcodes import CLIError

    if len(argv) != 1 or not pathlib.Path(argv[0]).is_dir():
        raise CLIError(f"usage: python -m harness ci timeline DIR (a directory of <who>.jsonl; got {argv!r})")
    summary = summarize(argv[0])
    if not summary["processes"]:
        raise CLIError(f"harness ci timeline: {argv[0]}: no <who>.jsonl events")
    print("\n".join(format_summary(summary)))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Exit codes are ``harness.exitcodes``'s: 0 printed, 2 a bad DIR or file (one line)."""
    from ..exitcodes import run_guarded

    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    return run_guarded(_main, [a for a in argv if a != "--debug"], debug=debug)

