"""``git bisect run`` on a source tree, driven from Python: start, run, name the culprit, and put
the tree back whatever happens.

``bisect(src, good, bad, step)``:

1. checks the tree first (``BisectError``, exit 2): a git work tree, no bisect in progress, no
   change to a tracked file (a bisect checks out other commits over it), both refs resolve and
   ``good`` is an ancestor of ``bad``;
2. judges ``bad`` once with ``step`` (git bisect never runs the bad end, and the culprit's
   numbers are wanted: when ``bad`` is the culprit, that run holds them); a bad end that judges
   good is ``BisectError`` (nothing to bisect), one that cannot be judged ``CannotJudge``;
3. ``git bisect start bad good`` and ``git bisect run step``: ``step`` answers 0 good, 1..127 bad,
   125 skip, 128 and above abort (the step command maps its judge's bad input and interrupts
   there); its output is streamed as it comes;
4. reads the culprit from git's answer (``<sha> is the first bad commit``), or the candidates when
   only skipped commits are left;
5. finally, in every case (an error, SIGINT, SIGTERM: ``harness.exitcodes`` raises them as
   exceptions): stops the running ``git bisect run`` and its step (their own process group),
   ``git bisect reset`` to the branch (or commit) checked out before, and checks that HEAD is
   back; a tree it could not restore is said in one line with the command to run.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time

from harness.exitcodes import CannotJudge, CLIError

EXIT_ABORT = 128  # what a step returns to make git bisect run stop (git: < 0 or >= 128 aborts)


class BisectError(CLIError):
    """A source tree or refs no bisect can run on (exit 2, one line)."""


@dataclasses.dataclass
class BisectResult:
    culprit: str | None  # the first bad commit's full sha
    subject: str | None
    candidates: list[str]  # when only skipped commits are left: every commit it could be
    run_exit: int | None  # git bisect run's exit status
    bad_end_exit: int | None  # the step's answer at the bad end
    log: str  # git bisect log, as it was before the reset
    output: list[str]  # what git bisect run printed (and the steps through it)
    seconds: float


def git(src, *args, check: bool = True, capture: bool = True) -> str:
    out = subprocess.run(["git", "-C", str(src), *args], capture_output=capture, text=True)
    if check and out.returncode != 0:
        raise BisectError(f"git {' '.join(args)} in {src}: {(out.stderr or out.stdout or '').strip()[:300]}")
    return (out.stdout or "").strip()


def _rev(src, ref: str, what: str) -> str:
    out = subprocess.run(["git", "-C", str(src), "rev-parse", "--verify", "-q", f"{ref}^{{commit}}"],
                         capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.strip():
        raise BisectError(f"{what} {ref}: no such commit in {src}")
    return out.stdout.strip()


def preflight(src, good: str, bad: str) -> dict:
    """What the bisect needs to start and to restore the tree; ``BisectError`` for a tree or refs
    it cannot run on."""
    if not os.path.isdir(src):
        raise BisectError(f"--source {src}: not a directory")
    inside = subprocess.run(["git", "-C", str(src), "rev-parse", "--is-inside-work-tree"], capture_output=True,
                            text=True)
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        raise BisectError(f"--source {src}: not a git work tree")
    git_dir = git(src, "rev-parse", "--absolute-git-dir")
    if os.path.exists(os.path.join(git_dir, "BISECT_START")):
        raise BisectError(f"--source {src}: a bisect is already in progress (finish it with `git -C {src} bisect "
                          "reset`)")
    dirty = git(src, "status", "--porcelain", "--untracked-files=no")
    if dirty:
        raise BisectError(f"--source {src}: tracked files have changes ({dirty.splitlines()[0].strip()}"
                          f"{', ...' if len(dirty.splitlines()) > 1 else ''}); commit or stash them first")
    good_sha, bad_sha = _rev(src, good, "--good"), _rev(src, bad, "--bad")
    if good_sha == bad_sha:
        raise BisectError(f"--good {good} and --bad {bad} are the same commit")
    anc = subprocess.run(["git", "-C", str(src), "merge-base", "--is-ancestor", good_sha, bad_sha])
    if anc.returncode != 0:
        raise BisectError(f"--good {good} is not an ancestor of --bad {bad}")
    branch = subprocess.run(["git", "-C", str(src), "symbolic-ref", "-q", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return {"orig": branch or git(src, "rev-parse", "HEAD"), "orig_sha": git(src, "rev-parse", "HEAD"),
            "good": good_sha, "bad": bad_sha, "git_dir": git_dir}


def _stop(proc: subprocess.Popen) -> None:
    """End ``proc`` and everything it started (its own process group): SIGTERM, then SIGKILL."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_streamed(cmd: list[str], *, cwd=None, env=None, echo=None) -> tuple[int, list[str]]:
    """Run ``cmd`` in a process group of its own, its output (stdout and stderr) printed as it
    comes and returned; stopped with its children when this process is interrupted."""
    echo = echo or (lambda line: print(line, flush=True))
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    lines: list[str] = []
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            echo(line)
        return proc.wait(), lines
    finally:
        _stop(proc)
        proc.stdout.close()


def restore(src, state: dict) -> str | None:
    """Put the tree back as it was before the bisect: None, or the one line saying what to do."""
    git_dir = state["git_dir"]

    def where() -> tuple[str, str]:
        head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        branch = subprocess.run(["git", "-C", str(src), "symbolic-ref", "-q", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        return head, branch

    def home() -> bool:
        head, branch = where()
        on_branch = state["orig"] == state["orig_sha"] or branch == state["orig"]
        return head == state["orig_sha"] and on_branch and not os.path.exists(os.path.join(git_dir, "BISECT_START"))

    if os.path.exists(os.path.join(git_dir, "BISECT_START")):
        subprocess.run(["git", "-C", str(src), "bisect", "reset", state["orig"]], capture_output=True, text=True)
    if not home():
        subprocess.run(["git", "-C", str(src), "checkout", "-q", state["orig"]], capture_output=True, text=True)
    if not home():
        return (f"warning: {src} is not restored to {state['orig']} (HEAD {where()[0][:12]}): run "
                f"`git -C {src} bisect reset {state['orig']}`")
    return None


_FIRST_BAD = re.compile(r"^([0-9a-f]{40}) is the first bad commit")
_SHA = re.compile(r"^([0-9a-f]{40})\b")


def parse_culprit(lines: list[str]) -> tuple[str | None, list[str]]:
    """(the first bad commit, the candidates when only skipped commits are left) from git bisect's output."""
    culprit, cands, in_cands = None, [], False
    for line in lines:
        m = _FIRST_BAD.match(line.strip())
        if m:
            culprit = m.group(1)
        if "first bad commit could be any of" in line:
            in_cands = True
            continue
        if in_cands:
            m = _SHA.match(line.strip())
            if m:
                cands.append(m.group(1))
            elif line.strip():
                in_cands = False
    return culprit, cands


def bisect(src, good: str, bad: str, step: list[str], *, env=None, echo=None, log=print) -> BisectResult:
    """Bisect ``good``..``bad`` in ``src`` with the command ``step`` (run in ``src`` at each commit);
    the tree is restored afterwards whatever happens (module doc)."""
    t0 = time.perf_counter()
    state = preflight(src, good, bad)
    bisect_log, run_exit, lines, bad_code = "", None, [], None
    try:
        git(src, "checkout", "-q", "--detach", state["bad"])
        log(f"autobisect: judging the bad end {state['bad'][:12]} first")
        bad_code, _ = run_streamed(step, cwd=src, env=env, echo=echo)
        if bad_code == 0:
            raise BisectError(f"--bad {bad} ({state['bad'][:12]}) judges good: nothing to bisect")
        if bad_code == 125:
            raise CannotJudge(f"--bad {bad} ({state['bad'][:12]}) cannot be judged (125): no culprit can be named")
        if bad_code >= EXIT_ABORT or bad_code < 0:
            raise CannotJudge(f"the step at --bad {bad} aborted (exit {bad_code})")
        git(src, "bisect", "start", state["bad"], state["good"])
        run_exit, lines = run_streamed(["git", "-C", str(src), "bisect", "run", *step], cwd=src, env=env, echo=echo)
        bisect_log = subprocess.run(["git", "-C", str(src), "bisect", "log"], capture_output=True,
                                    text=True).stdout
    finally:
        problem = restore(src, state)
        if problem:
            print(problem, file=sys.stderr, flush=True)
    culprit, cands = parse_culprit(lines)
    if culprit is None and not cands and run_exit == 0:
        # an adjacent good..bad pair: git names the bad end without running a step
        culprit = state["bad"] if git(src, "rev-list", "--count", f"{state['good']}..{state['bad']}") == "1" else None
    subject = git(src, "log", "-1", "--format=%s", culprit) if culprit else None
    return BisectResult(culprit, subject, cands, run_exit, bad_code, bisect_log, lines, time.perf_counter() - t0)
