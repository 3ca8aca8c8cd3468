"""Restored JIT caches dated so that ninja (FlashInfer's JIT builds) finds its outputs up to date.

FlashInfer runs ``ninja`` before every load, and ninja rebuilds an output when
  (a) the output file is older than an input (a source installed on this host after the pack was made);
  (b) ``.ninja_log`` records an output mtime older than an input;
  (c) ``.ninja_deps`` records an output mtime older than the output file ("stored deps info out of date").
Restored files dated ``now`` (a) leave (b) and (c) holding the packing host's times: on one H200 a
pack restored into the very root it was packed from, under the same Python environment, rebuilt
FlashInfer's FP8 block GEMM and sampling modules (two minutes of nvcc) for (c). So every restored
file is dated T0 and every output the two logs name T1 = T0 + 1 us, and both logs record T1: an
output is then newer than every input (the restored sources and headers at T0, the installed ones
before the restore began), and as new as the logs say. What decides the command (its hash names
absolute paths: the cache root and the Python environment) is left as it is: another path rebuilds.

Formats: ninja's build log ``# ninja log vN`` (N >= 5: start, end, mtime, output, command hash,
tab separated) and deps log ``# ninjadeps\\n`` version 4 (path records; deps records with the
output's 64-bit mtime), little-endian. A log of another version is left untouched (ninja then
rebuilds, as it would have). Times are ninja's ``TimeStamp``: nanoseconds on POSIX.
"""

from __future__ import annotations

import os
import struct
import time

from ..atomic import atomic_write_bytes

BUILD_LOG = ".ninja_log"
DEPS_LOG = ".ninja_deps"
_DEPS_SIGNATURE = b"# ninjadeps\n"
_DEPS_VERSION = 4
_OUTPUT_AFTER_INPUTS_NS = 1000  # T1 - T0: any positive gap orders inputs before outputs


def _build_log_outputs(path: str) -> list[str] | None:
    """The outputs ``.ninja_log`` at ``path`` names, or None when it is not a version ninja writes
    as (start, end, mtime, output, hash)."""
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        lines = f.read().splitlines()
    if not lines or not lines[0].startswith("# ninja log v"):
        return None
    try:
        if int(lines[0][len("# ninja log v"):]) < 5:
            return None
    except ValueError:
        return None
    outs = []
    for line in lines[1:]:
        fields = line.split("\t")
        if len(fields) != 5 or not fields[2].lstrip("-").isdigit():
            return None
        outs.append(fields[3])
    return outs


def _write_build_log(path: str, stamp_ns: int) -> None:
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        lines = f.read().splitlines()
    out = [lines[0]]
    for line in lines[1:]:
        fields = line.split("\t")
        fields[2] = str(stamp_ns)
        out.append("\t".join(fields))
    atomic_write_bytes(path, ("\n".join(out) + "\n").encode("utf-8", errors="surrogateescape"))


def _deps_log(path: str, stamp_ns: int) -> list[str] | None:
    """The outputs ``.ninja_deps`` at ``path`` records deps for, the file rewritten with every deps
    record's mtime set to ``stamp_ns``; None (the file left as it was): not version 4, or torn."""
    with open(path, "rb") as f:
        data = f.read()
    head = len(_DEPS_SIGNATURE)
    if data[:head] != _DEPS_SIGNATURE or len(data) < head + 4:
        return None
    if struct.unpack_from("<i", data, head)[0] != _DEPS_VERSION:
        return None
    buf = bytearray(data)
    paths: list[str] = []
    outs: list[str] = []
    at = head + 4
    while at < len(buf):
        if at + 4 > len(buf):
            return None
        (size,) = struct.unpack_from("<I", buf, at)
        is_deps, size = size >> 31, size & 0x7FFFFFFF
        body = at + 4
        if body + size > len(buf):
            return None
        if is_deps:
            if size < 12 or size % 4:
                return None
            (out_id,) = struct.unpack_from("<i", buf, body)
            if not 0 <= out_id < len(paths):
                return None
            outs.append(paths[out_id])
            struct.pack_into("<II", buf, body + 4, stamp_ns & 0xFFFFFFFF, (stamp_ns >> 32) & 0xFFFFFFFF)
        else:
            if size < 5:
                return None
            raw = bytes(buf[body:body + size - 4]).rstrip(b"\0")
            paths.append(raw.decode("utf-8", errors="surrogateescape"))
        at = body + size
    atomic_write_bytes(path, bytes(buf))
    return outs


def date_restored(trees: list[str], now_ns: int | None = None) -> dict[str, int]:
    """Date every file and folder under ``trees`` (links left alone) T0 and every output that a
    ``.ninja_log`` / ``.ninja_deps`` there names T1, both logs recording T1 (module docstring).
    Returns counts: files dated, ninja logs rewritten, outputs dated, logs left as they were."""
    t1 = time.time_ns() if now_ns is None else now_ns
    t0 = t1 - _OUTPUT_AFTER_INPUTS_NS
    counts = {"files": 0, "logs": 0, "outputs": 0, "logs_unknown": 0}
    build_dirs: list[str] = []
    for tree in trees:
        for dirpath, dirnames, filenames in os.walk(tree):
            for name in filenames + dirnames:
                path = os.path.join(dirpath, name)
                if not os.path.islink(path):
                    os.utime(path, ns=(t0, t0))
                    counts["files"] += 1
            if BUILD_LOG in filenames or DEPS_LOG in filenames:
                build_dirs.append(dirpath)
    for build_dir in build_dirs:
        outputs: set[str] = set()
        log_path, deps_path = os.path.join(build_dir, BUILD_LOG), os.path.join(build_dir, DEPS_LOG)
        if os.path.isfile(log_path) and not os.path.islink(log_path):
            named = _build_log_outputs(log_path)
            if named is None:
                counts["logs_unknown"] += 1
            else:
                outputs.update(named)
                _write_build_log(log_path, t1)
                counts["logs"] += 1
        if os.path.isfile(deps_path) and not os.path.islink(deps_path):
            named = _deps_log(deps_path, t1)  # read and rewritten with T1 in one pass (None: left as it was)
            if named is None:
                counts["logs_unknown"] += 1
            else:
                outputs.update(named)
                counts["logs"] += 1
        for out in outputs:
            path = out if os.path.isabs(out) else os.path.join(build_dir, out)
            if os.path.isfile(path) and not os.path.islink(path):
                os.utime(path, ns=(t1, t1))
                counts["outputs"] += 1
        for log in (log_path, deps_path):  # the logs themselves: written after the outputs
            if os.path.isfile(log) and not os.path.islink(log):
                os.utime(log, ns=(t1, t1))
    return counts


__all__ = ["date_restored"]
