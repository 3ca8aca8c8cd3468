"""Host baselines: the production goldens of the bisect set, recorded by the user on this host at a
known-good vLLM (``bisect-check --record-baseline DIR``) and judged at every later commit
(``bisect-check --baseline DIR``) exactly as the checked-in goldens are: the same files, encoding,
tolerances and check (``store.check(production_goldens.PRODUCTION, ...)``: a mismatch leaves the obtained
trace beside the baseline's file), under another root, written by the user.

    DIR/manifest.json                      {"cases": {...}, "baseline": STAMP}
    DIR/production/<case>.safetensors

The stamp holds the platform key (GPU, compute capability, torch, CUDA: ``platform_key``), which
a later run must match (else exit 2, one line naming DIR and the field), and the vLLM version and
commit it was recorded with, which a bisect varies and which are only reported.

Recording is all or nothing: every case is encoded and written into a temp directory beside DIR,
flushed to disk, then renamed onto DIR. A directory that exists is replaced only with ``force``
and only when it is a baseline (or empty); the old one stays whole until the new one is in place.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from harness.exitcodes import CLIError

STAMP = "baseline"
MANIFEST = "manifest.json"  # harness.goldens.store.MANIFEST (that module imports torch; this one checks flags)


def _stamp_of(path: Path) -> dict | None:
    """The baseline stamp of directory ``path``, or None when it is not a baseline directory."""
    from harness.input_checks import read_json

    try:  # bounded, regular files only (a FIFO would block, /dev/zero fill the memory)
        doc = read_json(f"{path / MANIFEST}", path / MANIFEST)
    except FileNotFoundError:
        return None
    except CLIError as exc:
        if os.path.isdir(path / MANIFEST) or not os.path.lexists(path / MANIFEST):
            return None
        raise CLIError(f"--baseline / --record-baseline {path}: {exc}") from None
    stamp = doc.get(STAMP) if isinstance(doc, dict) else None
    ok = (isinstance(stamp, dict) and isinstance(stamp.get("platform"), dict)
          and isinstance(stamp.get("cases"), list) and isinstance(doc.get("cases"), dict))
    return stamp if ok else None


def check_record_target(path: str | Path, force: bool) -> None:
    """CLIError (exit 2) when ``--record-baseline path`` cannot or may not be written: its parent
    is missing, or it exists (without ``force``; with it, when it is neither a baseline nor empty)."""
    p = Path(path)
    if not p.parent.is_dir():
        raise CLIError(f"--record-baseline {path}: directory {p.parent} does not exist")
    if not (p.exists() or p.is_symlink()):
        return
    if not force:
        raise CLIError(f"--record-baseline {path}: already exists; a baseline is never replaced "
                       "silently (--force replaces it)")
    if p.is_symlink() or not p.is_dir() or (_stamp_of(p) is None and any(p.iterdir())):
        raise CLIError(f"--record-baseline {path}: exists and is not a baseline directory; refusing to replace it")
    from harness.atomic import check_replaceable

    check_replaceable(p, True, f"--record-baseline {path}")  # only what the harness wrote is replaced


def read_stamp(path: str | Path) -> dict:
    """The stamp of baseline ``path``; CLIError (exit 2) naming it when it is not one."""
    p = Path(path)
    if not p.is_dir():
        raise CLIError(f"--baseline {path}: no such directory (record one at the good commit: "
                       f"bisect-check --record-baseline {path})")
    if not (p / MANIFEST).is_file():
        raise CLIError(f"--baseline {path}: not a baseline (no {MANIFEST})")
    stamp = _stamp_of(p)
    if stamp is None:
        raise CLIError(f"--baseline {path}: not a baseline ({MANIFEST} has no readable \"{STAMP}\" stamp)")
    return stamp


def check_platform(path: str | Path, now: dict) -> dict:
    """The stamp of baseline ``path`` when it was recorded on ``now``'s platform; else CLIError
    (exit 2), one line naming ``path`` and the first key field that differs."""
    from harness.goldens import platform_key

    stamp = read_stamp(path)
    bad = platform_key.mismatch(stamp["platform"], now)
    if bad is not None:
        field, there, here = bad
        raise CLIError(f"--baseline {path}: recorded on another platform: {field} {there!r} there, {here!r} here "
                       "(a baseline is judged only on the GPU, torch and CUDA it was recorded on)")
    return stamp


def record(path: str | Path, traces: dict[str, dict], force: bool = False) -> dict:
    """Record ``{case_id: production trace}`` as baseline ``path`` (all cases or nothing) -> its stamp."""
    from harness.goldens import store
    from harness.goldens import production as production_goldens

    from harness.atomic import atomic_write_dir

    target = Path(path)
    check_record_target(target, force)
    stamp = {"platform": production_goldens.platform(), "recorded_with": production_goldens.recorded_with(),
             "cases": list(traces), "harness": store.HARNESS_VERSION,
             "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def fill(tmp: Path) -> None:
        production_goldens.record_set(traces, tmp, manifest_extra={STAMP: stamp})
        _fsync_tree(tmp)

    # the project's one directory writer: a temp directory beside the target, swapped in by two
    # renames no signal splits, a dead run's leftovers cleaned by the next
    atomic_write_dir(target, fill, replace=force)
    _fsync_dir(target.resolve().parent)
    return stamp


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root`` (itself included) to disk."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


