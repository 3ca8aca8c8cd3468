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
    128+n  interrupted by signal n (``terminating_signals``: 130 SIGINT / Ctrl-C, 143 SIGTERM,
         129 SIGHUP, 131 SIGQUIT, 138 SIGUSR1, ...): ``interrupted (SIGNAME)`` in one line, the
         temp files of the write in progress removed (``harness.atomic``)
    141  stdout's reader went away (``... | head``): the command ends quietly, as other tools do;
         a stdout that cannot be written otherwise (``/dev/full``) is bad input (2), one line

Every command reports an error as exactly one line (``error: ...`` for 2,
``vLLM load failed: ...`` for 1, ``cannot judge: ...`` for 125); ``--debug``
adds the traceback. ``harness.cli``, ``harness.commands``, ``harness.production.engine`` and
``harness.mutants`` all go through here.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
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


class GoldenError(RuntimeError):
    """A golden is missing, corrupt or does not match its manifest (``harness.goldens.store``
    raises it): the harness's own data, so no verdict (125). Defined here, beside the contract
    that classifies it, so the contract imports nothing above it."""


class Terminated(BaseException):
    """A terminating signal other than SIGINT (SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, ...), raised where
    the program is (like ``KeyboardInterrupt`` for SIGINT) so that every ``finally`` runs: the
    atomic writer removes its temp file or directory. ``signum`` is the signal (exit 128 + it)."""

    def __init__(self, signum: int | None = None):
        import signal

        self.signum = int(signal.SIGTERM if signum is None else signum)
        super().__init__(self.signum)


class StreamGone(BaseException):
    """Writing to the command's stdout or stderr failed (a closed pipe, ``/dev/full``): raised through
    every ``except Exception`` of the command (its ``finally`` blocks still run), ended by
    ``run_guarded``: a closed pipe quietly (141, as other command-line tools end), any other
    failure as bad input naming the stream (2)."""

    def __init__(self, stream: str, exc: OSError):
        self.stream, self.exc = stream, exc
        super().__init__(f"{stream}: cannot write: {exc.strerror or exc}")


def signal_name(signum: int) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def terminating_signals() -> list[int]:
    """The signals whose default action ends the process and that arrive from outside (a shell, a
    job runner, ``kill``): handled as SIGTERM is. Faults (SIGSEGV, SIGBUS, SIGFPE, SIGILL), SIGABRT
    and SIGSYS are the process's own and cannot be recovered from in Python; SIGKILL and SIGSTOP
    cannot be caught. SIGPIPE is not among them: Python ignores it from start-up, so a write to a
    closed pipe raises EPIPE where it happens (``StreamGone`` for stdout) instead."""
    import signal

    names = ("SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGVTALRM",
             "SIGPROF", "SIGXCPU", "SIGXFSZ", "SIGIO", "SIGPOLL", "SIGPWR", "SIGSTKFLT")
    out = {int(getattr(signal, n)) for n in names if hasattr(signal, n)}
    if hasattr(signal, "SIGRTMIN") and hasattr(signal, "SIGRTMAX"):
        out.update(range(int(signal.SIGRTMIN), int(signal.SIGRTMAX) + 1))
    return sorted(out)


# ``signals_deferred``: how deep the current holds are, and the signals that arrived meanwhile
_HOLD = {"depth": 0, "pending": []}


def _raise_for(signum: int):
    import signal

    if signum == signal.SIGINT:
        raise KeyboardInterrupt()
    raise Terminated(signum)


def _on_signal(signum, frame):
    if _HOLD["depth"]:
        _HOLD["pending"].append(signum)
        return
    _raise_for(signum)


@contextlib.contextmanager
def signals_deferred():
    """A terminating signal that arrives while the block runs is raised when it ends (two renames
    that must both happen). Python runs every handler in the main thread whichever thread the
    kernel picked, so this holds where a thread mask (``pthread_sigmask``) of the main thread alone
    would not (torch's and vLLM's threads leave the signals unblocked)."""
    _HOLD["depth"] += 1
    try:
        yield
    finally:
        _HOLD["depth"] -= 1
        if not _HOLD["depth"] and _HOLD["pending"]:
            signum = _HOLD["pending"][0]
            _HOLD["pending"].clear()
            _raise_for(signum)


@contextlib.contextmanager
def signals_as_exceptions():
    """While the block runs (in the main thread), every terminating signal (``terminating_signals``)
    raises: SIGINT ``KeyboardInterrupt``, the others ``Terminated``; the previous handlers come
    back afterwards. Only a signal whose disposition is the default (or Python's own SIGINT
    handler) is taken over: one the parent set to be ignored (nohup, a background job) stays
    ignored, and one a library or test runner handles stays theirs."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for s in terminating_signals():
        try:
            h = signal.getsignal(s)
        except (ValueError, OSError):
            continue
        if h is signal.SIG_DFL or h is None or (s == signal.SIGINT and h is signal.default_int_handler):
            try:
                signal.signal(s, _on_signal)
            except (ValueError, OSError, RuntimeError):
                continue
            previous[s] = h
    try:
        yield
    finally:
        _HOLD["depth"] += 1  # no handler of ours raises while the previous ones come back
        try:
            for s, h in previous.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)
        finally:
            _HOLD["depth"] -= 1
            if not _HOLD["depth"]:
                _HOLD["pending"].clear()  # arrived as the command ended: its exit code is decided


class _GuardedStream:
    """``sys.stdout`` / ``sys.stderr`` while a command runs: a failed write or flush becomes
    ``StreamGone`` naming the stream (everything else is the stream's own)."""

    def __init__(self, stream, name: str):
        self._stream, self._name, self._active = stream, name, True

    def write(self, s):
        try:
            return self._stream.write(s)
        except OSError as exc:
            if not self._active:  # kept by a logger past the command: the stream's own error
                raise
            raise StreamGone(self._name, exc) from exc

    def flush(self):
        try:
            return self._stream.flush()
        except OSError as exc:
            if not self._active:
                raise
            raise StreamGone(self._name, exc) from exc

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def _streams_guarded():
    saved = sys.stdout, sys.stderr
    guards = [_GuardedStream(s, n) if s is not None else None for s, n in zip(saved, ("stdout", "stderr"))]
    sys.stdout, sys.stderr = guards
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        for g in guards:
            if g is not None:
                g._active = False


def _silence(stream) -> None:
    """Point ``stream``'s file descriptor at /dev/null and drop what it buffered: the exit's flush
    then finds nothing to fail on."""
    import os

    try:
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except (OSError, AttributeError, ValueError):
        pass
    try:
        stream.flush()
    except (OSError, ValueError):
        pass


def _say(line: str, stream) -> None:
    """Print one line; a stream that cannot take it (closed, full) is left alone."""
    try:
        print(line, file=stream, flush=True)
    except (OSError, ValueError):
        pass


# C0 and C1 control characters, the bidirectional overrides and lone surrogates (undecodable
# bytes of a file name): printed escaped, never raw to a terminal
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069"
                          "\ud800-\udfff]")


def printable(text) -> str:
    """``text`` with control characters (an ANSI escape sequence in a tensor name or path, say) and
    undecodable bytes escaped (``\\x1b``): what reaches the terminal is text, never a command."""
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                            else f"\\u{ord(m.group()):04x}", str(text))


def listed(names, limit: int = 8) -> str:
    """``a, b, c (+N more)``: a list a user gave or a catalogue, cut to ``limit`` names, each cut to
    80 characters (10,000 unknown names are not echoed back)."""
    names = [str(n) if len(str(n)) <= 80 else str(n)[:77] + "..." for n in names]
    more = len(names) - limit
    return ", ".join(names[:limit]) + (f" (+{more} more)" if more > 0 else "")


MAX_LINE = 2000  # characters of one error line; the rest is counted, not printed


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``error: ...``) and exit 2 like every bad input."""

    def error(self, message):
        # the message quotes the user's value: escaped (control characters) and cut (5000 digits)
        self.exit(EXIT_USAGE, _cut(printable(f"error: {self.prog}: {one_line(message)}")) + "\n")


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


# errno values of an OSError that say a path the user gave is wrong (too long, a loop of links, a
# file where a folder is needed, no permission): bad input naming the path, wherever it is raised
_BAD_PATH_ERRNOS = {errno.ENAMETOOLONG, errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM,
                    errno.EROFS}


def _bad_path(exc: BaseException) -> str | None:
    if isinstance(exc, OSError) and exc.errno in _BAD_PATH_ERRNOS and exc.filename is not None:
        name = exc.filename if isinstance(exc.filename, str) else os.fsdecode(exc.filename)
        shown = name if len(name) <= 200 else f"{name[:100]}...{name[-60:]} ({len(name)} characters)"
        return f"{shown}: {exc.strerror or exc}"
    return None


def _cut(line: str) -> str:
    if len(line) <= MAX_LINE:
        return line
    return f"{line[:MAX_LINE - 100]}... ({len(line) - MAX_LINE + 100} more characters)"


def classify(exc: BaseException) -> tuple[int, str]:
    """(exit code, the one line to print) for an exception that ended a command; the line has no
    control character (``printable``) and at most ``MAX_LINE`` characters."""
    code, line = _classify(exc)
    return code, _cut(printable(line))


def _classify(exc: BaseException) -> tuple[int, str]:
    if isinstance(exc, _input_error_types()):
        return EXIT_USAGE, f"error: {one_line(exc)}"
    if _is_load_failure(exc):
        return EXIT_MISMATCH, load_failure_line(exc)
    if isinstance(exc, CannotJudge) or _is_golden_problem(exc):
        return EXIT_CANNOT_JUDGE, f"cannot judge: {one_line(exc)}"
    bad = _bad_path(exc)
    if bad is not None:
        return EXIT_USAGE, f"error: {bad}"
    what = first_line(exc)
    return EXIT_CANNOT_JUDGE, (f"cannot judge: unexpected harness error: {exc.__class__.__name__}"
                               + (f": {what}" if what else "") + " (rerun with --debug for the traceback)")


def report(exc: BaseException, *, debug: bool = False) -> int:
    """Print ``exc`` as its one line (after the traceback with ``debug``) and return its exit code."""
    code, line = classify(exc)
    if debug:
        with contextlib.suppress(OSError, ValueError):
            traceback.print_exception(exc, file=sys.stderr)
    # bad input and unexpected errors on stderr; "cannot judge" verdicts are the
    # command's answer and go to stdout like every other verdict
    stream = sys.stdout if isinstance(exc, CannotJudge) else sys.stderr
    _say(line, stream)
    return code


EXIT_SIGPIPE = 141  # 128 + SIGPIPE: stdout's reader went away (``head``), as other tools end then


def run_guarded(fn, *args, debug: bool = False) -> int:
    """``fn(*args)`` as an exit code: its return value, or the code of what it raised.

    A return value outside the contract (a bug: None, a child's signal code) is 125,
    never 0 ("good") or 1 ("bad"). A terminating signal is ``interrupted (SIGNAME)`` in one line
    and 128 + its number: 130 for SIGINT, 143 for SIGTERM, 129 for SIGHUP...
    (``signals_as_exceptions``: what was being written is removed first). stdout closed by its
    reader ends the command quietly (141); stdout or stderr that cannot be written (``/dev/full``)
    is one line naming it, 2."""
    try:
        with _streams_guarded(), signals_as_exceptions():
            code = fn(*args)
            sys.stdout.flush()  # a full or closed stdout is found here, not at the process's exit
    except (KeyboardInterrupt, Terminated) as exc:
        if debug:
            with contextlib.suppress(OSError, ValueError):
                traceback.print_exception(exc, file=sys.stderr)
        signum = exc.signum if isinstance(exc, Terminated) else 2
        _say(f"interrupted ({signal_name(signum)}): nothing half-written is left", sys.stderr)
        return 128 + signum
    except StreamGone as exc:
        if debug:
            with contextlib.suppress(OSError, ValueError):
                traceback.print_exception(exc, file=sys.stderr)
        stream = sys.stdout if exc.stream == "stdout" else sys.stderr
        _silence(stream)
        if exc.exc.errno == errno.EPIPE:
            return EXIT_SIGPIPE
        if exc.stream == "stdout":
            _say(printable(f"error: {exc}"), sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - every error becomes one line and a contract code
        return report(exc, debug=debug)
    if code not in (EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_CANNOT_JUDGE):
        _say(f"cannot judge: the command ended with {code!r}, outside the exit-code contract", sys.stdout)
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
