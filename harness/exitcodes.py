"""The one exit-code contract of every command, and the map from an exception to it.

    0    good: every component within tolerance
    1    bad: a numeric mismatch, or vLLM failed to load the checkpoint (the
         post-load audit found a parameter no checkpoint value reached):
         ``git bisect run`` blames the commit
    2    bad input: an argument, config.json or checkpoint the harness refuses;
         checked first, on any machine, before any GPU question
    125  cannot judge: no GPU, no vLLM, a missing kernel, a crash inside vLLM
         that is not a load problem, or an error the harness did not anticipate
         (``git bisect run`` skips the commit)
    130  interrupted by SIGINT (Ctrl-C), 143 by SIGTERM: ``interrupted`` in one line, the
         temp files of the write in progress removed (``harness.atomic``)

Every command reports an error as exactly one line (``error: ...`` for 2,
``vLLM load failed: ...`` for 1, ``cannot judge: ...`` for 125); ``--debug``
adds the traceback. ``harness.cli``, ``harness.commands.compare``,
``harness.production.engine`` and ``harness.mutants`` all go through here.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_CANNOT_JUDGE = 0, 1, 2, 125
# a signal ended the command (128 + the signal's number, as a shell reports it)
EXIT_SIGINT, EXIT_SIGTERM = 130, 143

# A load failure lists every unloaded parameter; the one line names the first
# few (enough to act on) and counts the rest.
_MAX_NAMED_PROBLEMS = 3


class CLIError(Exception):
    """An input problem reported as one line, exit 2."""


class CannotJudge(Exception):
    """The harness cannot reach a verdict here (exit 125); the message says why."""


class Terminated(BaseException):
    """SIGTERM, raised where the program is (like ``KeyboardInterrupt`` for SIGINT) so that
    every ``finally`` runs: the atomic writer removes its temp file or directory."""


def _raise_terminated(signum, frame):
    raise Terminated()


@contextlib.contextmanager
def signals_as_exceptions():
    """While the block runs (in the main thread), SIGTERM raises ``Terminated`` and SIGINT
    ``KeyboardInterrupt``; the previous handlers come back afterwards."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    # a signal the parent set to be ignored (nohup, a background job) stays ignored
    if previous[signal.SIGTERM] is not signal.SIG_IGN:
        signal.signal(signal.SIGTERM, _raise_terminated)
    if previous[signal.SIGINT] is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``error: ...``) and exit 2 like every bad input."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message}\n")


def one_line(text: str) -> str:
    """``text`` folded onto one line (newlines and indentation become ``; ``)."""
    parts = [p.strip() for p in str(text).splitlines() if p.strip()]
    return "; ".join(parts)


def first_line(text) -> str:
    """The first non-empty line of ``text`` (a crash message may carry a whole traceback)."""
    return next((p.strip() for p in str(text).splitlines() if p.strip()), "")


def _input_error_types() -> tuple[type, ...]:
    from reference.config import ConfigError

    from .checkpoint.errors import CheckpointError

    return CLIError, ConfigError, CheckpointError


def _is_load_failure(exc: BaseException) -> bool:
    import sys

    # never imported: nothing raised a LoadAuditError (and classifying costs no torch import)
    audit = sys.modules.get(f"{__package__}.production.module.audit")
    return audit is not None and isinstance(exc, audit.LoadAuditError)


def _is_golden_problem(exc: BaseException) -> bool:
    """A missing or corrupt stored golden: the harness's own data, so no verdict (125)."""
    from .goldens import GoldenError

    return isinstance(exc, GoldenError)


def load_failure_line(exc: BaseException) -> str:
    """``vLLM load failed: <param>: <problem>; ...`` naming the first parameters."""
    problems = getattr(exc, "problems", None)
    if not problems:
        lines = [p.strip() for p in str(exc).splitlines() if p.strip()]
        problems = [p for p in lines if not p.endswith("audit failed:")] or lines
    head = "; ".join(problems[:_MAX_NAMED_PROBLEMS])
    more = len(problems) - _MAX_NAMED_PROBLEMS
    return f"vLLM load failed: {head}" + (f" (+{more} more)" if more > 0 else "")


def classify(exc: BaseException) -> tuple[int, str]:
    """(exit code, the one line to print) for an exception that ended a command."""
    if isinstance(exc, _input_error_types()):
        return EXIT_USAGE, f"error: {one_line(exc)}"
    if _is_load_failure(exc):
        return EXIT_MISMATCH, load_failure_line(exc)
    if isinstance(exc, CannotJudge) or _is_golden_problem(exc):
        return EXIT_CANNOT_JUDGE, f"cannot judge: {one_line(exc)}"
    what = first_line(exc)
    return EXIT_CANNOT_JUDGE, (f"cannot judge: unexpected harness error: {exc.__class__.__name__}"
                               + (f": {what}" if what else "") + " (rerun with --debug for the traceback)")


def report(exc: BaseException, *, debug: bool = False) -> int:
    """Print ``exc`` as its one line (after the traceback with ``debug``) and return its exit code."""
    code, line = classify(exc)
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    # bad input and unexpected errors on stderr; "cannot judge" verdicts are the
    # command's answer and go to stdout like every other verdict
    stream = sys.stdout if isinstance(exc, CannotJudge) else sys.stderr
    print(line, file=stream, flush=True)
    return code


def run_guarded(fn, *args, debug: bool = False) -> int:
    """``fn(*args)`` as an exit code: its return value, or the code of what it raised.

    A return value outside the contract (a bug: None, a child's signal code) is 125,
    never 0 ("good") or 1 ("bad"). SIGINT is ``interrupted`` in one line and 130, SIGTERM
    the same and 143 (``signals_as_exceptions``: what was being written is removed first)."""
    try:
        with signals_as_exceptions():
            code = fn(*args)
    except (KeyboardInterrupt, Terminated) as exc:
        if debug:
            traceback.print_exception(exc, file=sys.stderr)
        term = isinstance(exc, Terminated)
        print(f"interrupted ({'SIGTERM' if term else 'SIGINT'}): nothing half-written is left", file=sys.stderr,
              flush=True)
        return EXIT_SIGTERM if term else EXIT_SIGINT
    except Exception as exc:  # noqa: BLE001 - every error becomes one line and a contract code
        return report(exc, debug=debug)
    if code not in (EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_CANNOT_JUDGE):
        print(f"cannot judge: the command ended with {code!r}, outside the exit-code contract", flush=True)
        return EXIT_CANNOT_JUDGE
    return code


def worst(codes) -> int:
    """The verdict of several cases: 2 if any input was bad, else 1 if any failed, else 125
    if any could not be judged (a code outside the contract, e.g. a killed child process,
    counts as that), else 0."""
    codes = list(codes)
    for c in (EXIT_USAGE, EXIT_MISMATCH):
        if c in codes:
            return c
    return EXIT_CANNOT_JUDGE if any(codes) else EXIT_OK
