"""The warmup's stamp (``hyv4-warm.json`` in the cache root): which steps it holds warm, for which
versions, each by a fingerprint of its definition (``--if-cold`` runs only the rest); and which
planted-bug runs a warmup wants. Torch-free."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

from . import jit_pack
from .jit_cache import JIT_CACHE_LAYOUT

STAMP = jit_pack.STAMP  # packed and restored with the layers it vouches for


# What a warmed step leaves in the root besides what its run compiled, by name: a step warmed
# before one was added lacks it, so it is not warm. "triton-launchers": the C launchers of the
# Triton kernels it compiled without launching (triton_launchers.build_pending_launchers).
STEP_LEAVES = ["triton-launchers"]


def _layers() -> list[str]:
    """The cache root's layers and what a step leaves there (``STEP_LEAVES``): a step warmed
    before a layer was added left that layer's kernels outside the root (the library's default
    folder), so it is not warm for this layout."""
    return sorted(JIT_CACHE_LAYOUT.values()) + STEP_LEAVES


def fingerprint(case) -> str:
    """A case's definition (a GpuCase or EngineCase dataclass) and the root's layers, hashed: its
    shapes are what was compiled, the layers where it went."""
    blob = json.dumps([dataclasses.asdict(case), _layers()], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def read_stamp(root: str) -> dict:
    """The root's stamp ({"versions": ..., "steps": {name: fingerprint}}); empty when absent or unreadable."""
    from ..exitcodes import CLIError
    from ..input_checks import read_json

    try:  # bounded, regular files only: a FIFO never blocks the run
        stamp = read_json(os.path.join(root, STAMP), os.path.join(root, STAMP))
        return stamp if isinstance(stamp, dict) and isinstance(stamp.get("steps"), dict) else {}
    except (OSError, ValueError, RecursionError, CLIError):
        return {}


def cold_steps(wanted: dict, stamp: dict, versions: dict) -> dict:
    """The steps of ``wanted`` ({name: fingerprint}) the stamp does not hold warm for ``versions``."""
    if stamp.get("versions") != versions:
        return dict(wanted)
    held = stamp.get("steps", {})
    return {name: fp for name, fp in wanted.items() if held.get(name) != fp}


def write_stamp(root: str, versions: dict, warmed: dict) -> None:
    """Add ``warmed`` ({name: fingerprint}) to the root's stamp (a stamp of other versions is replaced)."""
    from ..atomic import atomic_write_json

    import fcntl

    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, STAMP + ".lock"), "w") as lock:  # lanes stamp at the same time
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = read_stamp(root)
        steps = stamp.get("steps", {}) if stamp.get("versions") == versions else {}
        atomic_write_json(os.path.join(root, STAMP), {"versions": versions, "steps": {**steps, **warmed}})


def mutants_wanted(args) -> bool:
    """The planted bugs' production runs: with every module case (no --case, not --engine-only),
    or --mutants-only; never with --no-mutants."""
    if getattr(args, "no_mutants", False):
        return False
    return getattr(args, "mutants_only", False) or not (args.case or getattr(args, "engine_only", False))


def mutants_fingerprint() -> str:
    """What the mutants step depends on: the planted bugs the component registry names (torch-free)."""
    from ..components import REGISTRY

    names = sorted(n for c in REGISTRY for n in (*c.mutants, *c.golden_mutants))
    return hashlib.sha256(json.dumps([names, _layers()]).encode()).hexdigest()[:16]
