"""Write a file or a directory so that readers see the old content or the new, never half of it.

A file's content goes to a temp file in the same directory (``.NAME.<pid>.<random>.tmp``), then
``os.replace`` renames it over the target (atomic on POSIX); a directory is filled as
``NAME.tmp-<pid>`` and swapped in (the replaced one passes through ``NAME.old-<pid>``). On any
failure, every terminating signal included (``harness.exitcodes`` turns them into exceptions),
the temp file or directory is removed; leftovers of a run that was killed outright (SIGKILL,
power loss) carry its pid and are removed by the next write beside them once that pid is gone.

A directory written here holds ``MARKER``, the list of the files the harness put in it: a
non-empty directory is replaced (``--force``) only when that list covers everything in it, and a
replaced directory loses only what the list names, so nothing the harness did not write is ever
removed (``synth ~/ --force`` is refused, naming what is in the way). One writer of a directory at
a time (``flock`` on ``.NAME.lock`` beside it): a second one is refused at once (exit 2).

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


# the file every directory written here holds: which files the harness put in it. A directory is
# replaced (``--force``) or a leftover of a dead run removed only as far as this list goes
MARKER = ".hyv4-harness-written.json"
MARKER_KIND = "hyv4-mtp-harness directory"


class InTheWay(FileExistsError, CLIError):
    """A directory write refused (exit 2): the target holds what the harness did not write, or
    another process is writing it now. The message names what is in the way."""

    def __init__(self, message: str):
        super().__init__(errno.EEXIST, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _listing(root: Path) -> dict[str, str]:
    """{relative path: "file" | "dir" | "other"} of everything under ``root`` (links not followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            try:
                mode = os.lstat(p).st_mode
            except OSError:
                continue
            out[rel] = "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
    return out


def _write_marker(root: Path) -> None:
    listing = _listing(root)
    doc = {"written_by": MARKER_KIND, "files": sorted(k for k, v in listing.items() if v == "file"),
           "dirs": sorted(k for k, v in listing.items() if v == "dir")}
    (root / MARKER).write_text(json.dumps(doc, indent=1) + "\n")


def _marker_of(root: Path) -> tuple[set[str], set[str]] | None:
    """(files, dirs) the harness wrote into ``root``, from its marker; None without a readable one."""
    p = root / MARKER
    try:
        st = os.lstat(p)
        if not stat.S_ISREG(st.st_mode) or st.st_size > (16 << 20):
            return None
        doc = json.loads(p.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not (isinstance(doc, dict) and doc.get("written_by") == MARKER_KIND and isinstance(doc.get("files"), list)
            and all(isinstance(f, str) for f in doc["files"])):
        return None
    dirs = doc.get("dirs") if isinstance(doc.get("dirs"), list) else []
    return set(doc["files"]), {d for d in dirs if isinstance(d, str)}


def _not_ours(root: Path) -> list[str]:
    """What in directory ``root`` the harness did not write (sorted; empty: all of it is ours)."""
    owned = _marker_of(root)
    if owned is None:  # no walk of what may be a whole home directory: its names are the answer
        return sorted(os.listdir(root))
    files, dirs = owned
    alien = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            rel = str((Path(dirpath) / name).relative_to(root))
            try:
                mode = os.lstat(Path(dirpath) / name).st_mode
            except OSError:
                continue
            ok = (stat.S_ISREG(mode) and rel in files) or (stat.S_ISDIR(mode) and rel in dirs) or rel == MARKER
            if not ok:
                alien.append(rel)
        # a folder the harness did not write is named once, not walked
        dirnames[:] = [d for d in dirnames if str((Path(dirpath) / d).relative_to(root)) in dirs
                       and not os.path.islink(os.path.join(dirpath, d))]
    return sorted(alien)


def _shown(names: list[str], limit: int = 5) -> str:
    from .exitcodes import listed, printable

    return printable(listed(names, limit))


def check_replaceable(path: str | Path, replace: bool, what: str | None = None) -> None:
    """``InTheWay`` (exit 2) when writing directory ``path`` would remove anything the harness did
    not write: a non-empty directory without ``replace``; with it, a directory that lacks the
    harness's marker or holds files the marker does not list (``synth ~/ --force``, a git
    repository, a file added to a checkpoint by hand). Nothing is touched."""
    from .exitcodes import printable

    p = Path(path)
    what = what or str(p)
    try:
        if not p.is_dir() or not any(p.iterdir()):
            return
    except OSError:
        return  # the write itself names it
    if not replace:
        raise InTheWay(f"{printable(what)}: directory is not empty (use --force to replace it)")
    alien = _not_ours(p)
    if alien:
        why = ("has no " + MARKER + " (it was not written by the harness)" if _marker_of(p) is None
               else "holds files the harness did not write")
        raise InTheWay(f"{printable(what)}: {why}: {_shown(alien)}; --force replaces only a directory the "
                       "harness wrote; move them away or write elsewhere")


def _remove_ours(root: Path) -> list[str]:
    """Remove what the harness wrote in ``root`` (its marker's files and folders), then ``root``
    when nothing else is left; returns what is left (names the harness did not write)."""
    owned = _marker_of(root)
    if owned is None:
        return [str(root)] if os.path.lexists(root) else []
    # only names that are inside ``root`` now and of the kind the marker says: a marker that lists
    # ``../x`` or a folder now a link to elsewhere removes nothing outside
    listing = _listing(root)
    files = {k for k in owned[0] if listing.get(k) == "file"}
    dirs = {k for k in owned[1] if listing.get(k) == "dir"}
    for rel in sorted(files):
        with contextlib.suppress(OSError):
            (root / rel).unlink()
    with contextlib.suppress(OSError):
        (root / MARKER).unlink()
    for rel in sorted(dirs, key=lambda d: -d.count(os.sep)):  # deepest first
        with contextlib.suppress(OSError):
            (root / rel).rmdir()
    with contextlib.suppress(OSError):
        root.rmdir()
    return sorted(_listing(root)) if os.path.lexists(root) else []


def clean_dead_leftovers(path: Path) -> None:
    """Remove the temp files and directories a killed run left beside ``path`` (their pid is
    gone): ``.NAME.<pid>.*.tmp``, ``NAME.tmp-<pid>`` (when it holds the harness's marker, written
    first thing); ``NAME.old-<pid>`` (a replaced directory) loses what the harness wrote in it when
    NAME exists, else is renamed back to NAME (the run died between the renames). A directory of
    that name the harness did not make, and a file someone else put in an old one, stay."""
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
            elif d.group(1) == "old":
                _remove_ours(leftover)
            elif _marker_of(leftover) is not None:  # a temp directory the harness made (its marker from the start)
                shutil.rmtree(leftover)


@contextlib.contextmanager
def signals_held():
    """Terminating signals wait until the block ends (two renames that must both happen): held
    for the main thread (``pthread_sigmask``) and, where ``harness.exitcodes`` handles them, for
    every thread (its handler defers them)."""
    from .exitcodes import signals_deferred, terminating_signals

    held = set(terminating_signals())
    with signals_deferred():
        try:
            old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
        except (AttributeError, ValueError, OSError):  # not POSIX
            old = None
        try:
            yield
        finally:
            if old is not None:  # a signal held for this thread arrives now, and waits for the block's end
                signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def _dir_lock(path: Path):
    """One writer of directory ``path`` at a time: an exclusive ``flock`` on ``.NAME.lock`` beside
    it (removed by its holder, released by the kernel if the holder dies). A second writer is
    ``InTheWay`` (exit 2) at once, naming the pid that holds the lock: nothing is replaced
    silently and nobody waits for ever."""
    import fcntl

    from .exitcodes import printable

    lock = path.parent / f".{path.name}.lock"
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0),
                         0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise InTheWay(f"{printable(lock)}: a symbolic link where the harness keeps its lock; "
                               "move it away") from None
            raise
        st = os.fstat(fd)
        content = os.pread(fd, 64, 0) if stat.S_ISREG(st.st_mode) and st.st_size <= 32 else None
        if content is None or not re.fullmatch(rb"\d*", content.strip()):
            os.close(fd)  # someone else's file, never truncated or removed
            raise InTheWay(f"{printable(lock)}: in the way of the harness's lock (a lock file holds a pid "
                           "and nothing else); move it away")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = content.decode().strip() or "?"
            os.close(fd)
            raise InTheWay(f"{printable(path)}: another process (pid {holder}) is writing it now; nothing "
                           "was written (run one writer at a time)") from None
        except OSError:  # a file system without flock (some network mounts): written unserialised
            break
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino  # not a lock file its holder just removed
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)


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
    directory ``path`` links to), with ``MARKER`` listing them. Returns the path written.

    An existing non-empty directory is replaced only with ``replace`` and only when the harness
    wrote all of it (``check_replaceable``: its marker lists everything in it), checked again
    just before the swap (a file written into it meanwhile is never deleted: ``InTheWay``). One
    writer at a time (``_dir_lock``). The swap is two renames no terminating signal splits; the
    replaced directory then loses what the harness wrote, and anything else found in it stays,
    named by a warning on stderr."""
    path = _resolve_target(Path(path), directory=True)
    created = _missing_parents(path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with _dir_lock(path):
            _write_dir_locked(path, fill, replace, created)
    except BaseException:
        _remove_created(created)
        raise
    return path


def _write_dir_locked(path: Path, fill, replace: bool, created: list[Path]) -> None:
    from .exitcodes import printable

    clean_dead_leftovers(path)  # first: it may put back a directory a killed run had moved aside
    check_replaceable(path, replace)
    tmp = path.parent / f"{path.name}.tmp-{os.getpid()}"
    if os.path.lexists(tmp):
        if _marker_of(tmp) is None:
            raise InTheWay(f"{printable(tmp)}: in the way of the harness's temp directory (it holds no "
                           f"{MARKER}); move it away")
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        _write_marker(tmp)  # from the start: a killed run's temp directory is known as the harness's
        fill(tmp)
        _write_marker(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    with signals_held():  # from here on the new directory is installed, whatever arrives
        old = None
        try:
            check_replaceable(path, replace)  # again: nothing was written into it during the fill
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
            raise
        if old is not None:
            left = _remove_ours(old)
            if left:
                print(printable(f"warning: {path} written; the directory it replaced could not be removed "
                                f"entirely: what is left of it is at {old} ({_shown(left)})"), file=sys.stderr)


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
