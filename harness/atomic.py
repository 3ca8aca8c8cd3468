"""Write a file so that readers see the old content or the new, never half of it.

The content goes to a temp file in the same directory, then ``os.replace``
renames it over the target (atomic on POSIX); on any failure the temp file
is removed. Readable by everyone (0644), like a normal file.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` to produce the content, then move it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_json(path: str | Path, doc, **dump_kw) -> Path:
    dump_kw.setdefault("indent", 1)
    return atomic_write_bytes(path, (json.dumps(doc, **dump_kw) + "\n").encode())
