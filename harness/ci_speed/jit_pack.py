"""The JIT cache root packed for the next host: a folder of parts keyed by what decides the compiled bytes.

    python -m harness warmup --pack DIR        # on a warmed GPU host: DIR/part.00 ..., SHA256SUMS, MANIFEST
    python -m harness warmup --restore DIR     # on the next one, before anything compiles

A bare GPU host spends most of its time to a first verdict in nvcc, rebuilding kernels whose
bytes another host of the same stack already built. ``write_pack`` tars the cache root's JIT
layers (``NOT_PACKED`` aside: bytecode and the package map belong to their host) with the
warmup stamp, gzips the stream and splits it into parts of at most ``PART_BYTES`` (as
``tools/offline-bundle/make-bundle.sh`` splits the vLLM bundle: ``verify.sh`` checks both), with
``SHA256SUMS`` and ``MANIFEST`` (``kind=hyv4-jit-cache``, the key's fields, then what is only
informative: the GPU's name, parts, bytes). The key (``KEY_FIELDS``) is every version that
decides the compiled bytes; ``host_versions`` reads them on a GPU host, ``cache_key`` takes them
as a dict (how the CPU tests inject them).

``restore`` refuses a pack of another key in one line naming the differing fields (the pack is
not used; warmup then compiles as on a bare host), and a pack that is malformed, truncated or
tampered with (``MANIFEST``, ``SHA256SUMS``, a part) with ``CLIError`` (exit 2) before anything
is unpacked. It unpacks into a temp folder inside the root (the same file system), checks that
the packed copy of the key is the ``MANIFEST``'s, then renames each layer into place with the
terminating signals held: a run that fails or is interrupted leaves the root as it was (its
temp folder removed, or, after a SIGKILL, removed by the next restore). A layer the root holds
already (the host's own kernels) is kept, never mixed with the pack's; the pack's stamp
(``hyv4-warm.json``) becomes the root's only when every layer came from the pack, so
``--if-cold`` skips exactly the steps whose kernels are there.

Imports no torch except in ``host_versions`` (CUDA's version and the GPU's compute capability).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import tarfile
import zlib
from pathlib import Path

from ..exitcodes import CannotJudge, CLIError, printable
from .jit_cache import BYTECODE_VAR, JIT_CACHE_LAYOUT, PACKAGE_MAP_VAR, jit_cache_env

KIND = "hyv4-jit-cache"
FORMAT = "1"
# The key: every version that decides the bytes a JIT layer holds. Each library keys its own
# cache entries by some of these, but not all of them by all (FlashInfer's and tvm-ffi's modules
# by name and source, not by the CUDA they were built with), so a pack of any other key is
# refused whole. field -> where ``host_versions`` reads it.
KEY_FIELDS = {
    "vllm": "distribution vllm (its torch.compile artefacts, custom ops, vendored DeepGEMM)",
    "flashinfer": "distribution flashinfer-python (its JIT modules: FP8 block GEMM, sampling, rope)",
    "triton": "distribution triton (fused MoE and vLLM's Triton kernels)",
    "deep_gemm": "distribution deep-gemm, else the DeepGEMM vendored in vLLM (vllm.third_party.deep_gemm)",
    "cutlass_dsl": "distribution nvidia-cutlass-dsl (the CuTe DSL kernels: router GEMMs)",
    "tvm_ffi": "distribution apache-tvm-ffi (FlashInfer's FFI extensions)",
    "humming": "distribution humming-kernels (its launcher and nvrtc helper)",
    "torch": "torch.__version__ (inductor; the ABI of every extension)",
    "cuda": "torch.version.cuda",
    "python": "the interpreter's major.minor (inductor's and the extensions' Python ABI)",
    "capability": "torch.cuda.get_device_capability(), e.g. 9.0: the GPU architecture the kernels are for",
}
INFO_FIELDS = ("gpu", "parts", "bytes", "files", "root", "prefix")  # in MANIFEST too, not part of the key
ABSENT = "none"  # a package that is not installed: a key value like any other
PART_BYTES = 50_000_000  # as the vLLM bundle's parts: one plus the working tree fits a 64 MiB transfer
MAX_PARTS = 100  # part.00 .. part.99, as the bundle's
MANIFEST = "MANIFEST"
SUMS = "SHA256SUMS"
KEY_MEMBER = ".hyv4-jit-key"  # the key's lines, packed first: a MANIFEST swapped beside the parts is caught
STAMP = "hyv4-warm.json"  # the warmup stamp (harness.ci_speed.warmup): which steps the layers hold warm
RESTORE_TMP = ".hyv4-jit-restore.tmp-"  # + pid, inside the cache root
GZIP_LEVEL = 6  # kernels compress about as well at 6 as at 9, in a fraction of the time


def cache_key(versions: dict) -> dict[str, str]:
    """The key of a cache built with ``versions`` ({field: version} for every ``KEY_FIELDS``
    field; more is ignored): the fields in ``KEY_FIELDS``' order, each a non-empty string of
    printable characters without ``=`` (MANIFEST holds ``field=value`` lines)."""
    missing = [f for f in KEY_FIELDS if f not in versions]
    if missing:
        raise ValueError(f"the JIT cache key needs {', '.join(missing)}")
    key = {}
    for field in KEY_FIELDS:
        value = str(versions[field]).strip()
        if not value or not value.isprintable() or "=" in value:
            raise ValueError(f"the JIT cache key's {field} is not a version: {value!r}")
        key[field] = value
    return key


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def key_differences(packed: dict, here: dict) -> list[str]:
    """``field X there, Y here`` for each key field in which ``packed`` and ``here`` differ."""
    return [f"{f} {packed.get(f, '?')} there, {here.get(f, '?')} here" for f in KEY_FIELDS
            if packed.get(f) != here.get(f)]


def _distribution(name: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return ABSENT


def _deep_gemm_version() -> str:
    """A deep-gemm distribution's version, else the ``__version__`` line of the DeepGEMM vLLM's
    wheel vendors (read from its source, found without importing vLLM or it: importing it loads
    its CUDA extension, importing vLLM costs seconds)."""
    own = _distribution("deep-gemm")
    if own != ABSENT:
        return own
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")  # a top-level package's spec: not imported
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return ABSENT
    source = os.path.join(list(spec.submodule_search_locations)[0], "third_party", "deep_gemm", "__init__.py")
    try:
        with open(source, encoding="utf-8", errors="replace") as f:
            m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
    except OSError:
        return ABSENT
    return f"vendored-{m.group(1)}" if m else "vendored"


def host_versions() -> dict[str, str]:
    """This GPU host's ``KEY_FIELDS`` (and the GPU's name): the installed packages' versions and
    torch's CUDA and device. ``CannotJudge`` (125) without torch or a CUDA device: the
    architecture the kernels are for is then unknown."""
    import sys

    try:
        import torch
    except ImportError as exc:
        raise CannotJudge(f"the JIT cache key needs torch: {exc}") from None
    if not torch.cuda.is_available():
        raise CannotJudge("the JIT cache key needs the GPU's compute capability: no CUDA device here")
    major, minor = torch.cuda.get_device_capability()
    return {"vllm": _distribution("vllm"), "flashinfer": _distribution("flashinfer-python"),
            "triton": _distribution("triton"), "deep_gemm": _deep_gemm_version(),
            "cutlass_dsl": _distribution("nvidia-cutlass-dsl"), "tvm_ffi": _distribution("apache-tvm-ffi"),
            "humming": _distribution("humming-kernels"), "torch": torch.__version__,
            "cuda": str(torch.version.cuda or ABSENT), "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
            "capability": f"{major}.{minor}", "gpu": torch.cuda.get_device_name(0)}


def _key_text(key: dict) -> str:
    return f"kind={KIND}\nformat={FORMAT}\nkey={key_digest(key)}\n" + "".join(f"{f}={v}\n" for f, v in key.items())


# ---- writing ----

class _PartWriter:
    """A write-only stream cut into ``dest/part.NN`` files of at most ``part_bytes`` each, hashed as written."""

    def __init__(self, dest: Path, part_bytes: int):
        self.dest, self.part_bytes = dest, part_bytes
        self.sums: list[tuple[str, str]] = []  # (name, sha256) of each closed part
        self.total = 0
        self._f = self._hash = None
        self._left = 0

    def _next(self) -> None:
        self._close_part()
        if len(self.sums) >= MAX_PARTS:
            raise CLIError(f"the packed cache needs more than {MAX_PARTS} parts of {self.part_bytes} bytes; "
                           "give a larger --part-bytes")
        self._f = open(self.dest / f"part.{len(self.sums):02d}", "wb")
        self._hash, self._left = hashlib.sha256(), self.part_bytes

    def _close_part(self) -> None:
        if self._f is not None:
            self._f.close()
            self.sums.append((os.path.basename(self._f.name), self._hash.hexdigest()))
            self._f = None

    def write(self, data) -> int:
        view = memoryview(data)
        while view:
            if self._f is None or self._left == 0:
                self._next()
            chunk = view[:self._left]
            self._f.write(chunk)
            self._hash.update(chunk)
            self._left -= len(chunk)
            self.total += len(chunk)
            view = view[len(chunk):]
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._close_part()


# Not packed: Python's bytecode (ROOT/pycache) is keyed by each source's path on this host, is
# rebuilt by the next host's first process in seconds, and is the largest layer (~70 MiB for
# torch and transformers alone). Likewise the package map (ROOT/python-metadata,
# keyed by this host's sys.path), which the next host's first import recomputes.
NOT_PACKED = {BYTECODE_VAR, PACKAGE_MAP_VAR}


def packed_layers(root: str) -> dict[str, str]:
    """{layer folder name: its path} of the layers a pack holds (``NOT_PACKED`` aside)."""
    env = jit_cache_env(root)
    return {JIT_CACHE_LAYOUT[var]: path for var, path in env.items() if var not in NOT_PACKED}


def write_pack(root: str, dest: str, key: dict, part_bytes: int = PART_BYTES, info: dict | None = None) -> dict:
    """Pack cache root ``root``'s layers and stamp into folder ``dest`` (replaced when the harness
    wrote it: ``harness.atomic.atomic_write_dir``) for ``key`` (``cache_key``); ``info``: further
    MANIFEST lines (the GPU's name). Returns MANIFEST's fields."""
    from ..atomic import atomic_write_dir

    key = cache_key(key)
    root = os.path.abspath(os.path.expanduser(root))
    meta: dict = {}

    def fill(tmp: Path) -> None:
        key_text = _key_text(key)
        out = _PartWriter(tmp, part_bytes)
        files = 0
        try:
            with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=GZIP_LEVEL, mtime=0) as gz, \
                    tarfile.open(fileobj=gz, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                member = tarfile.TarInfo(KEY_MEMBER)
                member.size = len(key_text.encode())
                tar.addfile(member, _BytesReader(key_text.encode()))
                if os.path.isfile(os.path.join(root, STAMP)):
                    tar.add(os.path.join(root, STAMP), arcname=STAMP)
                for name, path in packed_layers(root).items():
                    if os.path.isdir(path):
                        tar.add(path, arcname=name)  # links stored as links, never followed
                        files += sum(len(fs) for _, _, fs in os.walk(path))
        finally:
            out.close()
        (tmp / SUMS).write_text("".join(f"{digest}  {name}\n" for name, digest in out.sums))
        meta.update({**key, "gpu": (info or {}).get("gpu", "?"), "parts": str(len(out.sums)),
                     "bytes": str(out.total), "files": str(files), "root": root,
                     "prefix": (info or {}).get("prefix", sys.prefix)})
        extra = "".join(f"{f}={printable(meta[f]).replace(chr(10), ' ')}\n" for f in INFO_FIELDS)
        (tmp / MANIFEST).write_text(key_text + extra)

    atomic_write_dir(dest, fill, replace=True)
    return meta


class _BytesReader:
    def __init__(self, data: bytes):
        self._data, self._at = data, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._data) if n is None or n < 0 else self._at + n
        out, self._at = self._data[self._at:end], min(end, len(self._data))
        return out


# ---- reading ----

MAX_MANIFEST_BYTES = 64 << 10


def read_manifest(pack: str) -> dict[str, str]:
    """PACK/MANIFEST as {field: value}; ``CLIError`` (one line naming it) when it is missing,
    not a JIT cache's, of another format, or lacks a key field."""
    from ..input_checks import read_bytes

    path = os.path.join(pack, MANIFEST)
    what = printable(path)
    try:
        raw = read_bytes(what, path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CLIError(f"{what}: missing; a packed JIT cache has part.NN, {SUMS} and {MANIFEST} "
                       "(python -m harness warmup --pack)") from None
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise CLIError(f"{what}: not UTF-8 text; not a packed JIT cache's") from None
    fields = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        name, eq, value = line.partition("=")
        if not eq or not name:
            raise CLIError(f"{what} line {n}: not field=value: {printable(line[:80])}")
        fields.setdefault(name.strip(), value.strip())
    if fields.get("kind") != KIND:
        raise CLIError(f"{what}: kind={printable(fields.get('kind', ''))[:40]}, not {KIND}: not a packed JIT cache "
                       "(a vLLM bundle's parts?)")
    if fields.get("format") != FORMAT:
        raise CLIError(f"{what}: format {printable(fields.get('format', '?'))[:20]}; this harness reads format "
                       f"{FORMAT} (pack it again with this harness)")
    try:
        key = cache_key(fields)
    except ValueError as exc:
        raise CLIError(f"{what}: {exc}") from None
    if fields.get("key") != key_digest(key):
        raise CLIError(f"{what}: key={printable(fields.get('key', ''))[:40]} is not the digest of its fields "
                       f"({key_digest(key)}): edited by hand?")
    return fields


def verify_parts(pack: str) -> list[str]:
    """The part paths, in order, once each matches PACK/SHA256SUMS (``sha256sum`` format, one
    line a part, numbered part.00, part.01, ... without a gap, no unlisted part.* beside them:
    the rules of ``tools/offline-bundle/verify.sh``); else ``CLIError`` naming the part."""
    from ..input_checks import read_bytes

    sums = os.path.join(pack, SUMS)
    what = printable(sums)
    try:
        text = read_bytes(what, sums, 1 << 20).decode("utf-8", errors="replace")
    except FileNotFoundError:
        raise CLIError(f"{what}: missing; ship it with the parts") from None
    listed = []
    for n, line in enumerate((ln.rstrip("\r") for ln in text.splitlines() if ln.strip()), 1):
        m = re.fullmatch(r"([0-9a-fA-F]{64}) [ *]?(part\.\d+)", line)
        if not m:
            raise CLIError(f"{what} line {n} is not '<sha256>  part.NN': {printable(line[:100])}")
        expect = f"part.{len(listed):02d}"
        if m.group(2) != expect:
            raise CLIError(f"{what} lists {m.group(2)} where {expect} belongs (a part left out of the list?)")
        listed.append((m.group(2), m.group(1).lower()))
    if not listed:
        raise CLIError(f"{what} lists no parts")
    names = {name for name, _ in listed}
    stray = sorted(e for e in os.listdir(pack) if e.startswith("part.") and e not in names)
    if stray:
        raise CLIError(f"{printable(os.path.join(pack, stray[0]))}: not listed in {SUMS} (left over from another "
                       "pack? remove it)")
    paths = []
    for name, digest in listed:
        path = os.path.join(pack, name)
        h = hashlib.sha256()
        try:
            with open(path, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise CLIError(f"{printable(path)}: not a regular file")
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        except FileNotFoundError:
            raise CLIError(f"{printable(path)}: missing (listed in {SUMS})") from None
        except OSError as exc:
            raise CLIError(f"{printable(path)}: cannot read it: {exc.strerror or exc}") from None
        if h.hexdigest() != digest:
            raise CLIError(f"{printable(path)}: corrupt or truncated: sha256 {h.hexdigest()[:12]}... != {SUMS} "
                           f"{digest[:12]}... (ship it again)")
        paths.append(path)
    return paths


class _PartsReader:
    """The parts, read one after the other as one stream."""

    def __init__(self, paths: list[str]):
        self._paths, self._f = list(paths), None

    def read(self, n: int = -1) -> bytes:
        while True:
            if self._f is None:
                if not self._paths:
                    return b""
                self._f = open(self._paths.pop(0), "rb")
            data = self._f.read(n if n is not None and n >= 0 else -1)
            if data:
                return data
            self._f.close()
            self._f = None

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def _layer_holds_files(path: str) -> bool:
    """Anything but empty folders under ``path`` (a file, a link), or ``path`` itself not a folder."""
    if os.path.lexists(path) and (os.path.islink(path) or not os.path.isdir(path)):
        return True
    for dirpath, dirs, files in os.walk(path):
        if files or any(os.path.islink(os.path.join(dirpath, d)) for d in dirs):
            return True
    return False


def _remove_dead_temps(root: str) -> None:
    """The temp folders of restores killed outright (their pid is gone)."""
    from ..atomic import pid_alive

    with contextlib.suppress(OSError):
        for entry in os.listdir(root):
            if entry.startswith(RESTORE_TMP) and entry[len(RESTORE_TMP):].isdigit():
                pid = int(entry[len(RESTORE_TMP):])
                if pid != os.getpid() and not pid_alive(pid):
                    shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


def restore(pack: str, root: str, here: dict) -> tuple[str, str]:
    """Restore packed cache ``pack`` into cache root ``root`` for this host's key ``here``
    (``cache_key``). Returns (outcome, one line): ``"restored"``, ``"held"`` (the root holds
    every layer already: nothing to do), or ``"refused"`` (another key: the pack is not used).
    A malformed, truncated or tampered pack is ``CLIError`` (exit 2), nothing unpacked."""
    from ..atomic import atomic_write_json, signals_held
    from ..input_checks import read_json

    here = cache_key(here)
    fields = read_manifest(pack)
    packed = cache_key(fields)
    where = printable(pack)
    diff = key_differences(packed, here)
    if diff:
        return "refused", (f"{where}: packed for another key ({'; '.join(diff)}); not used: the kernels are "
                           "compiled here")
    root = os.path.abspath(os.path.expanduser(root))
    layers = packed_layers(root)
    todo = [name for name, path in layers.items() if not _layer_holds_files(path)]
    if not todo:
        return "held", f"{where}: not restored: cache root {printable(root)} holds every layer already"
    parts = verify_parts(pack)
    os.makedirs(root, exist_ok=True)
    _remove_dead_temps(root)
    tmp = os.path.join(root, f"{RESTORE_TMP}{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp)
    try:
        _unpack(parts, tmp, set(layers), where)
        try:
            with open(os.path.join(tmp, KEY_MEMBER), encoding="utf-8", errors="replace") as f:
                inner = f.read()
        except OSError:
            inner = None
        if inner != _key_text(packed):
            raise CLIError(f"{where}/{MANIFEST} is not the key packed in these parts (a MANIFEST of another "
                           "pack beside them?)")
        kept = sorted(set(layers) - set(todo))
        stamp = None
        if not kept and os.path.isfile(os.path.join(tmp, STAMP)):
            try:
                stamp = read_json(f"{where}: its {STAMP}", os.path.join(tmp, STAMP))
            except CLIError:
                stamp = None
        with signals_held():  # every layer in place, or none
            moved = []
            try:
                for name in todo:
                    src, dst = os.path.join(tmp, name), layers[name]
                    if not os.path.isdir(src):
                        continue
                    if os.path.isdir(dst) and not os.path.islink(dst):
                        shutil.rmtree(dst)  # empty folders only (checked above)
                    os.replace(src, dst)
                    moved.append(name)
            except BaseException:
                for name in moved:
                    with contextlib.suppress(OSError):
                        os.replace(layers[name], os.path.join(tmp, name))
                raise
            if isinstance(stamp, dict):  # the pack's steps are warm here only when every layer is the pack's
                stamp["restored"] = {"key": key_digest(packed), "from": os.path.abspath(pack)}
                atomic_write_json(os.path.join(root, STAMP), stamp)
            elif not kept:  # every layer is the pack's, which holds no stamp: no step is warm
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(root, STAMP))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    from .ninja_times import date_restored

    try:
        date_restored([layers[name] for name in moved])
        dated = ""
    except OSError as exc:  # the layers are in place; ninja may rebuild what it cannot see as up to date
        dated = f"; not dated for ninja ({exc.__class__.__name__}: {printable(str(exc))[:120]}): FlashInfer may rebuild"
    line = (f"{where}: restored {len(moved)} layer(s) ({fields.get('parts', '?')} parts, "
            f"{int(fields.get('bytes', 0) or 0) / 2**20:.0f} MiB, key {key_digest(packed)}) into {printable(root)}")
    if kept:
        line += (f"; kept this root's own {', '.join(kept)} (its stamp too: --if-cold runs the steps again, "
                 "compiling only what is missing)")
    line += dated
    packed_root = fields.get("root")
    if packed_root and os.path.abspath(packed_root) != root:
        line += (f"; packed from cache root {printable(packed_root)}: FlashInfer's ninja builds name their "
                 "absolute paths and rebuild under another root (restore into that path to reuse them)")
    packed_prefix = fields.get("prefix")
    if packed_prefix and os.path.abspath(packed_prefix) != os.path.abspath(sys.prefix):
        line += (f"; packed under the Python environment {printable(packed_prefix)}, this is "
                 f"{printable(sys.prefix)}: FlashInfer's ninja commands name its include paths and rebuild "
                 "under another (install the bundle into that path to reuse them)")
    return "restored", line



def _unpack(parts: list[str], dest: str, layers: set[str], where: str) -> None:
    """Untar the gzip stream of ``parts`` into ``dest``: only the key, the stamp and the layers,
    through tarfile's ``data`` filter (no absolute path, nothing outside ``dest``, no device
    node, links only to inside); anything else is ``CLIError``."""
    allowed = layers | {KEY_MEMBER, STAMP}
    stream = _PartsReader(parts)
    try:
        with gzip.GzipFile(fileobj=stream, mode="rb") as gz, tarfile.open(fileobj=gz, mode="r|") as tar:
            for member in tar:
                top = member.name.split("/", 1)[0]
                if top not in allowed:
                    raise CLIError(f"{where}: holds {printable(member.name[:80])}, not a layer of the JIT cache")
                tar.extract(member, dest, filter="data")
            while gz.read(1 << 20):  # to the stream's end: gzip checks its CRC there (tar stops before)
                pass
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error, ValueError) as exc:
        raise CLIError(f"{where}: the parts do not unpack ({exc.__class__.__name__}: "
                       f"{printable(str(exc).splitlines()[0] if str(exc) else '')[:160]})") from None
    except OSError as exc:  # writing the layers: a full disk is the machine's (125), a bad path the user's
        from ..atomic import write_failure

        raise write_failure(dest, exc) from None
    finally:
        stream.close()


def restore_logged(pack: str, root: str, log=print) -> dict:
    """``restore`` for this host's key, its line logged as ``warmup: LINE``; the report's
    ``restore`` entry (outcome, line, seconds)."""
    import time

    t0 = time.perf_counter()
    outcome, line = restore(pack, root, host_versions())
    log(f"warmup: {line}", flush=True)
    return {"outcome": outcome, "line": line, "seconds": round(time.perf_counter() - t0, 2)}


def restore_with_bytecode(pack: str, root: str | None) -> dict:
    """``warmup --restore-only`` (the install's restore): ``restore_logged`` while the root's
    bytecode layer is compiled beside it (``jit_cache.precompile_bytecode``, all cores, in a thread:
    its ``compileall`` is a subprocess), so the first command after an install finds both. The
    bytecode is this host's, never packed. The restore's line is printed last (install.sh quotes
    it); a restore that raises (bad pack, no GPU) still waits for the compile and leaves no root
    this call made."""
    import threading

    from . import jit_cache

    compiled: list = []
    worker = None
    fresh_root = bool(root) and not os.path.lexists(root)
    if root:  # the layer apply_jit_cache would name (a PYTHONPYCACHEPREFIX set outside wins); this
        # process's own imports are left where they were (a failed restore then leaves no root behind)
        prefix = os.environ.get(BYTECODE_VAR) or jit_cache_env(root)[BYTECODE_VAR]
        worker = threading.Thread(target=lambda: compiled.extend(jit_cache.precompile_bytecode(prefix=prefix)),
                                  daemon=True)
        worker.start()
    lines: list = []
    try:
        restored = restore_logged(pack, root, log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    except BaseException:
        if worker is not None:
            worker.join()
        if fresh_root:
            shutil.rmtree(root, ignore_errors=True)
        raise
    if worker is not None:
        worker.join()
    for line in lines:
        print(line, flush=True)
    restored["bytecode_dirs"] = len(compiled)
    return restored


__all__ = ["KEY_FIELDS", "cache_key", "host_versions", "key_differences", "read_manifest", "restore",
           "restore_logged", "restore_with_bytecode", "verify_parts", "write_pack"]
