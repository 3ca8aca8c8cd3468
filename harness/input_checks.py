"""Bad input any machine can see, answered before any GPU, torch or vLLM question (exit 2).

One checker for every command: output paths (a file or a directory: empty, a directory where
a file is wanted, a device node / FIFO / socket, a folder that is a file, a name too long, a
folder not writable), bounded integer flags, the checkpoint argument, and the environment
variables ``harness/env_vars.py`` documents. Each check raises ``CLIError`` with one line naming the flag
or variable. Imports no torch (each check is a ``stat`` or a comparison).
"""

from __future__ import annotations

import json
import math
import os
import stat

from .atomic import NAME_MAX, TEMP_NAME_OVERHEAD
from .exitcodes import CLIError

SEED_MAX = 2 ** 64 - 1  # torch.manual_seed / Generator.manual_seed refuse more (an unsigned 64-bit seed)


def _kind(mode: int) -> str:
    return ("a directory" if stat.S_ISDIR(mode) else "a device node" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a regular file"
            if stat.S_ISREG(mode) else "not a regular file")


def _stat(what: str, path: str) -> os.stat_result | None:
    """``os.stat(path)`` (links followed), None when nothing is there; a path that cannot be
    looked up at all (name too long, a loop of links, no permission) is ``CLIError``."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise CLIError(f"{what}: a symbolic link that points nowhere") from None
        return None
    except NotADirectoryError:
        raise CLIError(f"{what}: a folder on the path is a file, not a directory") from None
    except OSError as exc:
        raise CLIError(f"{what}: {exc.strerror or exc}") from None


def _check_names(what: str, path: str, last_overhead: int) -> None:
    parts = [p for p in path.split(os.sep) if p]
    for i, part in enumerate(parts):
        limit = NAME_MAX - (last_overhead if i == len(parts) - 1 else 0)
        if len(os.fsencode(part)) > limit:
            raise CLIError(f"{what}: the name {part[:40]}... is {len(os.fsencode(part))} bytes; "
                           f"at most {limit} fit")


def _check_parent(what: str, path: str) -> None:
    """The nearest existing folder above ``path`` is a directory this user can write into."""
    parent = os.path.dirname(os.path.abspath(path))
    while True:
        st = _stat(what, parent)
        if st is not None:
            break
        up = os.path.dirname(parent)
        if up == parent:
            return
        parent = up
    if not stat.S_ISDIR(st.st_mode):
        raise CLIError(f"{what}: {parent} is {_kind(st.st_mode)}, not a directory")
    _probe(what, parent)


def _probe(what: str, directory: str) -> None:
    """Can a file be created in ``directory``? Asked of the file system itself (a temp file made
    and removed at once): permissions, a read-only mount, /proc or /sys answer as a write would
    (``os.access`` says yes to root everywhere)."""
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".hyv4-probe-")
    except OSError as exc:
        raise CLIError(f"{what}: cannot write in directory {directory}: {exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(probe)


def output_file(flag: str, path) -> None:
    """A file the command will write (``harness.atomic.atomic_write``): refused when empty, a
    directory or other non-regular file, under a file, with a name too long or in a folder
    this user cannot write."""
    path = "" if path is None else os.fspath(path)
    what = f"{flag} {path}"
    if not path.strip():
        raise CLIError(f"{flag} is empty; give a file path")
    _not_a_directory_path(flag, path)
    _check_names(what, path, TEMP_NAME_OVERHEAD)
    st = _stat(what, path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise CLIError(f"{what}: is {_kind(st.st_mode)}; give a regular file path (a device node, FIFO or "
                       "socket is never written through or replaced)" if not stat.S_ISDIR(st.st_mode)
                       else f"{what}: is a directory; give a file path")
    _check_parent(what, path)


def _not_a_directory_path(flag: str, path: str) -> None:
    """A file path that ends with a separator (``--out new.out/``) names a directory: the write
    would make a file where the user asked for a folder."""
    if path.endswith(os.sep) or path.endswith(os.sep + ".") or path.endswith(os.sep + ".."):
        raise CLIError(f"{flag} {path}: ends with {os.sep}, a directory path; give a file path")


def output_dir(flag: str, path) -> None:
    """A directory the command will create or write into: refused when empty, an existing
    non-directory, under a file, with a name too long or in a folder this user cannot write."""
    path = "" if path is None else os.fspath(path)
    what = f"{flag} {path}"
    if not path.strip():
        raise CLIError(f"{flag} is empty; give a directory")
    _check_names(what, path, len(".tmp-") + 7)
    st = _stat(what, path)
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            raise CLIError(f"{what}: exists and is not a directory (it is {_kind(st.st_mode)})")
        _probe(what, path)
        return
    _check_parent(what, path)


def replaceable_dir(flag: str, path) -> None:
    """``output_dir``, and not a directory whose replacement would take the caller's world with
    it: ``/``, the current directory or one above it (``synth . --force``)."""
    output_dir(flag, path)
    real = os.path.realpath(os.fspath(path))
    cwd = os.path.realpath(os.getcwd())
    if real == os.sep or cwd == real or cwd.startswith(real.rstrip(os.sep) + os.sep):
        where = "/" if real == os.sep else "the current directory or above it"
        raise CLIError(f"{flag} {os.fspath(path)}: is {where}; give a new or dedicated directory")


def not_an_input(flag: str, out, *inputs) -> None:
    """``out`` would not replace one of the command's inputs: an input file itself (``report A.json
    --plot A.json``), or an existing file inside an input directory (a checkpoint's shard)."""
    if out is None:
        return
    real = os.path.realpath(os.fspath(out))
    for src in inputs:
        if src is None or not os.path.exists(src):
            continue
        root = os.path.realpath(os.fspath(src))
        inside = os.path.isdir(root) and real.startswith(root.rstrip(os.sep) + os.sep) and os.path.exists(real)
        if real == root or inside:
            raise CLIError(f"{flag} {os.fspath(out)}: would replace the input {os.fspath(src)}"
                           + (f" ({os.path.relpath(real, root)})" if inside else "") + "; write it elsewhere")


def input_file(flag: str, path) -> None:
    """A file the command reads: it exists and is a regular file."""
    path = "" if path is None else os.fspath(path)
    if not path.strip():
        raise CLIError(f"{flag} is empty; give a file path")
    st = _stat(f"{flag} {path}", path)
    if st is None:
        raise CLIError(f"{flag} {path}: no such file")
    if not stat.S_ISREG(st.st_mode):
        raise CLIError(f"{flag} {path}: is {_kind(st.st_mode)}, not a regular file")


def input_dir(flag: str, path) -> None:
    """A directory the command reads: it can be looked up and is a directory."""
    path = "" if path is None else os.fspath(path)
    if not path.strip():
        raise CLIError(f"{flag} is empty; give a directory")
    _check_names(f"{flag} {path}", path, 0)
    st = _stat(f"{flag} {path}", path)
    if st is None:
        raise CLIError(f"{flag} {path}: no such directory")
    if not stat.S_ISDIR(st.st_mode):
        raise CLIError(f"{flag} {path}: is {_kind(st.st_mode)}, not a directory")


# what a JSON file the harness reads may weigh (reports, manifests, recordings' summaries):
# megabytes at most; more is not one of ours (or /dev/zero)
MAX_JSON_BYTES = 64 << 20


def read_bytes(what: str, path, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them; ``CLIError`` naming
    ``what`` otherwise. Opened without blocking (a FIFO would wait for a writer for ever) and
    checked on the open descriptor: a FIFO, device (``/dev/zero``), socket or directory is
    refused before a byte is read, a file larger than the bound is refused by its size, and one
    that grows while it is read stops at the bound. ``FileNotFoundError`` passes through."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CLIError(f"{what}: cannot read it: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CLIError(f"{what}: is {_kind(st.st_mode)}, not a regular file; refusing to read it")
        if st.st_size > max_bytes:
            raise CLIError(f"{what}: {st.st_size} bytes, more than the {max_bytes} a file of this kind may hold")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise CLIError(f"{what}: grew past {max_bytes} bytes while it was read")
        return b"".join(chunks)
    except OSError as exc:
        raise CLIError(f"{what}: cannot read it: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def read_json(what: str, path, max_bytes: int = MAX_JSON_BYTES):
    """``read_bytes`` parsed as JSON; ``CLIError`` naming ``what`` for text that is not UTF-8 or
    not JSON, a number past Python's int-string limit, or nesting deeper than the parser follows."""
    raw = read_bytes(what, path, max_bytes)
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CLIError(f"{what}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise CLIError(f"{what}: nested deeper than a JSON parser follows") from None
    except ValueError as exc:  # bad JSON, or an integer of more digits than Python converts
        raise CLIError(f"{what}: not valid JSON ({(str(exc).splitlines() or [''])[0][:120]})") from None


def integer(flag: str, value: int, low: int, high: int, why: str = "") -> None:
    """``low <= value <= high``, else ``CLIError`` stating the bound (and why it is there)."""
    if not low <= value <= high:
        raise CLIError(f"{flag} {value if len(str(value)) <= 40 else str(value)[:20] + '...'}: must be within "
                       f"{low}..{high}" + (f" ({why})" if why else ""))


def seed(flag: str, value: int) -> None:
    integer(flag, value, 0, SEED_MAX, "torch's seeds are unsigned 64-bit")


def number(flag: str, value: float, low: float, high: float) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise CLIError(f"{flag} {value}: must be a finite number within {low}..{high}")


def checkpoint(value) -> None:
    """The CKPT_DIR argument: never empty (an unset shell variable must not mean a preset), never
    ``-`` (a checkpoint is a directory, not a stream)."""
    if value is None:
        return
    if not str(value).strip():
        raise CLIError("CKPT_DIR is empty (an unset variable?); give a checkpoint directory, preset:NAME or a case id")
    if value == "-":
        raise CLIError("CKPT_DIR '-': a checkpoint cannot be read from stdin; give a directory, preset:NAME "
                       "or a case id")
    if not str(value).startswith("preset:"):
        _stat(f"CKPT_DIR {value}", str(value))  # a name too long, a loop of links, no permission


# ---- the environment variables harness/env_vars.py documents -------------------------------

def _env_dir(name: str, value: str) -> None:
    output_dir(f"${name}", value)


def _env_existing_dir(name: str, value: str) -> None:
    st = _stat(f"${name} {value}", value)
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise CLIError(f"${name} {value}: " + ("no such directory" if st is None
                                              else f"is {_kind(st.st_mode)}, not a directory"))


def _env_goldens_root(name: str, value: str) -> None:
    """A goldens tree: a directory holding a ``manifest.json`` file (checked here, once, in one
    line; its content is the goldens' own check)."""
    _env_existing_dir(name, value)
    manifest = os.path.join(value, "manifest.json")
    st = _stat(f"${name} {value}", manifest)
    if st is None or not stat.S_ISREG(st.st_mode):
        raise CLIError(f"${name} {value}: " + ("no manifest.json there (not a goldens tree)" if st is None
                                              else f"its manifest.json is {_kind(st.st_mode)}, not a file"))


def _env_history(name: str, value: str) -> None:
    """A history file: a regular file or nothing yet, in a directory that exists (what it holds is
    checked where it is opened: ``harness.history.store``)."""
    st = _stat(f"${name} {value}", value)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise CLIError(f"${name} {value}: is {_kind(st.st_mode)}, not a history file")
    parent = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(parent):
        raise CLIError(f"${name} {value}: directory {parent} does not exist")


def _env_choice(*choices: str, exact: bool = False):
    def check(name: str, value: str) -> None:
        if (value if exact else value.strip().lower()) not in choices:
            raise CLIError(f"${name}={value!r}: must be one of {', '.join(repr(c) for c in choices)}")
    return check


def _env_gib(name: str, value: str) -> None:
    try:
        gib = float(value)
    except ValueError:
        gib = float("nan")
    if not (math.isfinite(gib) and 0 < gib <= 4096):
        raise CLIError(f"${name}={value!r}: must be a number of GiB within (0, 4096]")


def _env_speculator_mutant(name: str, value: str) -> None:
    from .production.engine.speculator_mutants import MUTANTS

    if value not in MUTANTS:
        raise CLIError(f"${name}={value!r}: unknown speculator mutant; known: {', '.join(MUTANTS)}")


def _env_workers(name: str, value: str) -> None:
    v = value.strip().lower()
    if v in ("", "auto", "0", "off", "no", "serial"):
        return
    if not v.isdigit() or len(v) > 4 or int(v) > 256:  # (a 5000-digit value is past Python's int limit)
        raise CLIError(f"${name}={value!r}: must be a number of workers within 0..256, auto or 0")


# name -> check of its value (an empty value means unset for every one of them)
ENVIRONMENT = {
    "HYV4_JIT_CACHE": _env_dir,
    "HYV4_HISTORY": _env_history,
    "HYV4_PACKAGE_MAP_CACHE": _env_dir,  # empty turns the layer off: an empty value is not checked
    "HYV4_REPORT_DIR": _env_dir,
    "HYV4_TIMELINE": _env_dir,
    "HYV4_GOLDENS_ROOT": _env_goldens_root,
    "HYV4_ENGINE_KV_CACHE_GIB": _env_gib,
    "HYV4_ENGINE_JIT_WARMUP": _env_choice("0", "1", exact=True),
    "HYV4_SPECULATOR_MUTANT": _env_speculator_mutant,
    "HYV4_REFERENCE_DEVICE": _env_choice("cpu", "cuda"),
    "HYV4_MODEL_INFO_PREFETCH": _env_choice("0", "1", exact=True),
    "HYV4_PYTEST_WORKERS": _env_workers,
    "HYV4_WORKER_TEARDOWN": _env_choice("0", "1", exact=True),
    "HYV4_ALLOW_MISSING_KERNELS": _env_choice("0", "1", exact=True),
    "HYV4_REQUIRE_GOLDENS": _env_choice("0", "1", exact=True),
}


def environment(names=None, env=None) -> int:
    """Check the documented variables (``names``: all of ``ENVIRONMENT``) that are set and not
    empty; ``CLIError`` naming the first bad one. Returns 0 (``run_guarded`` reads it)."""
    env = os.environ if env is None else env
    for name in names or ENVIRONMENT:
        value = env.get(name)
        if not value:
            continue
        ENVIRONMENT[name](name, value)
    return 0
