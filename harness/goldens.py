"""Stored goldens: safetensors per case + ``goldens/manifest.json``.

Reference goldens hold the exact reference's trace of a named case; they
catch drift of the harness itself. A missing or corrupt golden is a failure,
never regenerated silently. ``update`` writes atomically (temp file +
os.replace), and callers still fail the run so a person reviews the diff.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .atomic import atomic_write, atomic_write_json

# HYV4_GOLDENS_ROOT points a run at another goldens tree (e.g. production
# goldens just recorded on a GPU host, before they are reviewed into the repo).
ROOT = Path(os.environ.get("HYV4_GOLDENS_ROOT") or Path(__file__).resolve().parent.parent / "goldens")
MANIFEST = "manifest.json"
HARNESS_VERSION = "0.1.0"


class GoldenError(RuntimeError):
    """A golden is missing, corrupt or does not match its manifest."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _compact(t: torch.Tensor, name: str) -> torch.Tensor:
    """Store e4m3-valued components in 1 byte (exact); everything else as is."""
    t = t.detach().cpu().contiguous()
    if name.endswith("indexer.q_fp8"):
        return t.to(torch.float8_e4m3fn)
    return t


def read_manifest(root: Path = ROOT) -> dict:
    """The manifest (``{"cases": {kind/case_id: entry}}``); GoldenError naming it when malformed."""
    path = root / MANIFEST
    if not path.exists():
        return {"cases": {}}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise GoldenError(f"{path}: not a readable JSON manifest ({exc.__class__.__name__})") from exc
    cases = doc.get("cases") if isinstance(doc, dict) else None
    if not isinstance(cases, dict) or not all(isinstance(e, dict) for e in cases.values()):
        raise GoldenError(f"{path}: not a goldens manifest (needs \"cases\": an object of case entries)")
    return doc


def write(kind: str, case_id: str, trace: dict, meta: dict, root: Path = ROOT) -> Path:
    """Write ``trace`` as golden ``{kind}/{case_id}.safetensors`` and record it in the manifest."""
    return write_set(kind, {case_id: (trace, meta)}, root)[0]


def write_set(kind: str, cases: dict[str, tuple[dict, dict]], root: Path = ROOT,
              manifest_extra: dict | None = None) -> list[Path]:
    """Write several goldens ``{case_id: (trace, meta)}`` of ``kind``, then the manifest once.

    Each file is replaced atomically and the manifest (with ``manifest_extra``'s top-level keys)
    last: a reader sees the old manifest until every file of the set is in place; a crash
    between the two leaves a file the old manifest's sha256 refuses (GoldenError), never a
    golden silently mixed from two recordings."""
    paths, entries = [], {}
    for case_id, (trace, meta) in cases.items():
        path = root / kind / f"{case_id}.safetensors"
        tensors = {k: _compact(v, k) for k, v in trace.items()}
        atomic_write(path, lambda tmp, tensors=tensors: save_file(tensors, tmp))
        entry = dict(meta)
        entry.update(file=str(path.relative_to(root)), sha256=_sha256(path),
                     versions={"harness": HARNESS_VERSION, "torch": torch.__version__,
                               "python": platform.python_version(), **meta.get("versions", {})})
        entries[f"{kind}/{case_id}"] = entry
        paths.append(path)
    manifest = read_manifest(root)
    manifest["cases"].update(entries)
    manifest.update(manifest_extra or {})
    atomic_write_json(root / MANIFEST, manifest, sort_keys=True)
    return paths


def load(kind: str, case_id: str, root: Path = ROOT) -> tuple[dict, dict]:
    """(tensors, manifest entry); GoldenError when missing, unlisted or corrupt."""
    key = f"{kind}/{case_id}"
    entry = read_manifest(root)["cases"].get(key)
    path = root / kind / f"{case_id}.safetensors"
    if entry is None:
        env = os.environ.get("HYV4_GOLDENS_ROOT")
        if env and root == ROOT and not (root / MANIFEST).is_file():  # a mistyped root, not a missing golden
            raise GoldenError(f"$HYV4_GOLDENS_ROOT {env}: no {MANIFEST} there (not a goldens tree)")
        raise GoldenError(f"no golden {key} in {root / MANIFEST}: record it with --update-goldens (on purpose)")
    if not path.exists():
        raise GoldenError(f"golden file {path} is missing (listed in the manifest)")
    digest = _sha256(path)
    if digest != entry.get("sha256"):
        raise GoldenError(f"golden file {path} is corrupt or edited: sha256 {digest} != manifest {entry.get('sha256')}")
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types
        raise GoldenError(f"golden file {path} does not parse: {exc}") from exc
    return {k: (v.to(torch.float64) if v.dtype == torch.float8_e4m3fn else v) for k, v in tensors.items()}, entry
