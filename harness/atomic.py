"""Write a file so that readers see the old content or the new, never half of it.

The content goes to a temp file in the same directory, then ``os.replace``
renames it over the target (atomic on POSIX); on any failure the temp file
is removed. Readable by everyone (0644), like a normal file.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` to produce the content, then move it to ``path``.

    On failure nothing is left behind: neither the temp file nor the parent
    directories this call created."""
    path = Path(path)
    created = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    ok = False
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        try:
            write(tmp)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
            ok = True
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    finally:
        if not ok:
            for d in created:  # deepest first
                try:
                    d.rmdir()
                except OSError:
                    break
    return path


# errno values that say the target path is wrong (the user's input: exit 2);
# any other write failure (disk full, quota, I/O error) is the machine's (exit 125)
_BAD_TARGET_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EROFS,
                      errno.EEXIST, errno.ENAMETOOLONG}


def write_failure(target, exc: BaseException) -> Exception:
    """The contract error for a failed write of ``target``: ``CLIError`` (exit 2) when the
    path is unusable, ``CannotJudge`` (exit 125) when the machine failed (disk full,
    I/O error, safetensors' own ``SafetensorError``, which is not an ``OSError``)."""
    from .exitcodes import CannotJudge, CLIError

    if isinstance(exc, OSError):
        why = exc.strerror or str(exc) or exc.__class__.__name__
        if exc.errno in _BAD_TARGET_ERRNOS or isinstance(exc, (FileExistsError, IsADirectoryError,
                                                               NotADirectoryError, PermissionError)):
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
