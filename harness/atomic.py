"""Write a file or a directory so that readers see the old content or the new, never half of it.

A file's content goes to a temp file in the same directory (``.NAME.<pid>.<random>.tmp``), then
``os.replace`` renames it over the target (atomic on POSIX); a directory is filled as
``NAME.tmp-<pid>`` and swapped in (the replaced one passes through ``NAME.old-<pid>``). On any
failure, SIGINT and SIGTERM included (``harness.exitcodes`` turns SIGTERM into an exception),
the temp file or directory is removed; leftovers of a run that was killed outright (SIGKILL,
power loss) carry its pid and are removed by the next write beside them once that pid is gone.

The target must be a regular file (or directory) or not exist yet: a device node, FIFO or
socket at the path is refused (``NotRegularFile``, exit 2), never replaced by a file. A
symbolic link is followed: the file or directory it points at is replaced, the link stays; a
link that points nowhere is refused. Files are readable by everyone (0644), like a normal file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from .exitcodes import CLIError

# the temp file beside NAME adds this many bytes to NAME: "." NAME "." <pid <= 7 digits> "." <8 random> ".tmp"
TEMP_NAME_OVERHEAD = 1 + 1 + 7 + 1 + 8 + 4
NAME_MAX = 255  # bytes of one path component (Linux, every common file system)


class NotRegularFile(OSError, CLIError):
    """The target exists and is not what the write produces (a device node, FIFO or socket for a
    file; anything but a directory for a directory), or is a symbolic link to nowhere. Bad input
    (exit 2) wherever it is raised, even by a write no argument check foresaw."""

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process (or not a pid at all): not ours to judge
    return True


def _resolve_target(path: Path, *, directory: bool) -> Path:
    """``path``, or where its symbolic link points; ``NotRegularFile`` for a target that must
    not be replaced (what ``stat`` says it is, following links)."""
    if path.is_symlink():
        real = Path(os.path.realpath(path))
        if not os.path.lexists(real) or real.is_symlink():
            raise NotRegularFile(errno.ENOENT, "a symbolic link that points nowhere", str(path))
        path = real
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return path
    if directory and not stat.S_ISDIR(st.st_mode):
        raise NotRegularFile(errno.ENOTDIR, "exists and is not a directory", str(path))
    if not directory and not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a device node" if stat.S_ISCHR(st.st_mode)
                or stat.S_ISBLK(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise NotRegularFile(errno.EEXIST, f"is {kind}; refusing to replace it with a file", str(path))
    return path


def clean_dead_leftovers(path: Path) -> None:
    """Remove the temp files and directories a killed run left beside ``path`` (their pid is
    gone): ``.NAME.<pid>.*.tmp``, ``NAME.tmp-<pid>``; ``NAME.old-<pid>`` (a replaced directory)
    is removed when NAME exists, else renamed back to NAME (the run died between the renames)."""
    parent, name = path.parent, path.name
    try:
        entries = os.listdir(parent)
    except OSError:
        return
    temp_file = re.compile(re.escape(f".{name}.") + r"(\d+)\.[^.]+\.tmp")
    temp_dir = re.compile(re.escape(name) + r"\.(tmp|old)-(\d+)")
    for entry in entries:
        m = temp_file.fullmatch(entry)
        d = temp_dir.fullmatch(entry)
        pid = int(m.group(1)) if m else int(d.group(2)) if d else None
        if pid is None or pid == os.getpid() or pid_alive(pid):
            continue
        leftover = parent / entry
        with contextlib.suppress(OSError):
            if m:
                leftover.unlink()
            elif d.group(1) == "old" and not os.path.lexists(path):
                os.replace(leftover, path)
            else:
                shutil.rmtree(leftover)


@contextlib.contextmanager
def _signals_held():
    """SIGINT and SIGTERM wait until the block ends (two renames that must both happen)."""
    held = {signal.SIGINT, signal.SIGTERM}
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    except (AttributeError, ValueError, OSError):  # not POSIX
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _missing_parents(parent: Path) -> list[Path]:
    return [p for p in (parent, *parent.parents) if not os.path.lexists(p)]


def _remove_created(created: list[Path]) -> None:
    for d in created:  # deepest first
        try:
            d.rmdir()
        except OSError:
            break


def atomic_write(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` to produce the content, then move it to ``path`` (or to the
    file ``path`` links to). Returns the path written.

    On failure nothing is left behind: neither the temp file nor the parent
    directories this call created."""
    path = _resolve_target(Path(path), directory=False)
    created = _missing_parents(path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_dead_leftovers(path)
    ok = False
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
        os.close(fd)
        try:
            write(tmp)
            os.chmod(tmp, 0o644)
            _resolve_target(path, directory=False)  # nothing else appeared there meanwhile
            os.replace(tmp, path)
            ok = True
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    finally:
        if not ok:
            _remove_created(created)
    return path


def atomic_write_dir(path: str | Path, fill: Callable[[Path], None], *, replace: bool = False) -> Path:
    """Call ``fill(tmp_dir)`` to produce a directory's files, then put it at ``path`` (or at the
    directory ``path`` links to). An existing non-empty directory is replaced only with
    ``replace`` (else ``FileExistsError``); the swap is two renames that SIGINT / SIGTERM
    cannot split. Returns the path written.

    If the replaced directory cannot be removed afterwards (a file in it is immutable, say),
    the new one is in place all the same: a warning on stderr names what is left."""
    path = _resolve_target(Path(path), directory=True)
    clean_dead_leftovers(path)  # first: it may put back a directory a killed run had moved aside
    if path.is_dir() and any(path.iterdir()) and not replace:
        raise FileExistsError(f"{path}: directory is not empty (use --force to replace it)")
    tmp = path.parent / f"{path.name}.tmp-{os.getpid()}"
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)
    created = _missing_parents(path.parent)
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_created(created)
        raise
    with _signals_held():  # from here on the new directory is installed, whatever arrives
        old = None
        try:
            if path.is_dir() and any(path.iterdir()):
                old = path.parent / f"{path.name}.old-{os.getpid()}"
                os.replace(path, old)
                try:
                    os.replace(tmp, path)
                except BaseException:
                    os.replace(old, path)  # the previous content back where it was
                    raise
            else:
                os.replace(tmp, path)  # an empty directory is replaced too
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            _remove_created(created)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
            if os.path.lexists(old):
                print(f"warning: {path} written; the directory it replaced could not be removed "
                      f"entirely: what is left of it is at {old}", file=sys.stderr)
    return path


# errno values that say the target path is wrong (the user's input: exit 2);
# any other write failure (disk full, quota, I/O error) is the machine's (exit 125)
_BAD_TARGET_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS,
                      errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP, errno.ETXTBSY}


def write_failure(target, exc: BaseException) -> Exception:
    """The contract error for a failed write of ``target``: ``CLIError`` (exit 2) when the
    path is unusable, ``CannotJudge`` (exit 125) when the machine failed (disk full,
    I/O error, safetensors' own ``SafetensorError``, which is not an ``OSError``)."""
    from .exitcodes import CannotJudge, CLIError

    if isinstance(exc, OSError):
        why = exc.strerror or str(exc) or exc.__class__.__name__
        if exc.errno in _BAD_TARGET_ERRNOS or isinstance(exc, (FileExistsError, IsADirectoryError,
                                                               NotADirectoryError, PermissionError,
                                                               NotRegularFile)):
            return CLIError(f"{target}: cannot write: {why}")
        return CannotJudge(f"{target}: write failed, nothing written: {why}")
    return CannotJudge(f"{target}: write failed, nothing written: {exc.__class__.__name__}: {exc}")


def write_errors() -> tuple[type, ...]:
    """The exception types a write can end with (``OSError`` and safetensors' error)."""
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover
        return (OSError,)
    return (OSError, SafetensorError)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_json(path: str | Path, doc, **dump_kw) -> Path:
    dump_kw.setdefault("indent", 1)
    return atomic_write_bytes(path, (json.dumps(doc, **dump_kw) + "\n").encode())
