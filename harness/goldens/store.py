"""Stored goldens: safetensors per case + ``goldens/manifest.json``, and ``check``, the one entry
every golden goes through (reference goldens, production goldens, host baselines).

Reference goldens hold the exact reference's trace of a named case; they catch drift of the
harness itself. Production goldens (``harness.goldens``) hold vLLM's own trace. What
differs between kinds (how a trace is encoded, judged, and whether a golden applies on this
platform) is a ``GoldenKind``; the files, the manifest and what happens on a mismatch are here.

``check(kind, case_id, obtained)`` loads ``ROOT/kind/case_id.safetensors`` and judges the
obtained trace against it. On a mismatch the obtained trace, encoded as the golden would hold it,
is written beside the expected file (``case_id.obtained.safetensors``, atomically, git-ignored),
so the two can be compared or the obtained one reviewed; the result's ``message`` names both
paths and the first divergent component. With ``regen`` the expected file is written on purpose
(``--update-goldens``, production goldens' ``record``), and callers still fail so a person reviews the
diff. A missing or corrupt golden is a ``GoldenError``, never regenerated silently; an obtained
file is never a golden (``load``, ``write_set`` and the manifest refuse or skip it).
"""

from __future__ import annotations

import hashlib
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from harness.atomic import atomic_write, atomic_write_json, write_errors
from harness.exitcodes import GoldenError  # defined with the exit-code contract, which classifies it (125)

if TYPE_CHECKING:
    from harness.trace_compare import Report

# HYV4_GOLDENS_ROOT points a run at another goldens tree (e.g. production
# goldens just recorded on a GPU host, before they are reviewed into the repo).
ROOT = Path(os.environ.get("HYV4_GOLDENS_ROOT") or Path(__file__).resolve().parents[2] / "goldens")
MANIFEST = "manifest.json"
HARNESS_VERSION = "0.1.0"
SUFFIX = ".safetensors"
# beside NAME.safetensors, what a failed check obtained (pytest-regressions' NAME.obtained.EXT)
OBTAINED = ".obtained"




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


def golden_path(kind: str, case_id: str, root: Path = ROOT) -> Path:
    """Where golden ``kind/case_id`` lives under ``root``."""
    return Path(root) / kind / f"{case_id}{SUFFIX}"


def obtained_path(kind: str, case_id: str, root: Path = ROOT) -> Path:
    """Where a failed check of ``kind/case_id`` writes the trace it obtained (beside the golden)."""
    return Path(root) / kind / f"{case_id}{OBTAINED}{SUFFIX}"


def is_obtained(name: str | Path) -> bool:
    """Whether ``name`` (a file name, path, case id or manifest key) names an obtained trace,
    ``*.obtained`` or ``*.obtained.*``: never a golden."""
    base = Path(str(name)).name
    return base.endswith(OBTAINED) or f"{OBTAINED}." in base


def _not_obtained(kind: str, case_id: str) -> None:
    if is_obtained(case_id):
        raise GoldenError(f"{kind}/{case_id}: an obtained trace (written by a failed check), never a golden")


def _save(path: Path, trace: dict, metadata: dict | None = None) -> Path:
    """Write ``trace`` (compactly typed) as safetensors file ``path``, atomically."""
    tensors = {k: _compact(v, k) for k, v in trace.items()}
    return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


# one golden file: a trace of the harness's cases is kilobytes to a few MiB
MAX_GOLDEN_BYTES = 1 << 30


def _golden_bytes(path: Path) -> bytes:
    """The whole golden file, read once (hashed and parsed from memory: no memory map a truncation
    could turn into a SIGBUS); a FIFO, device or oversized file is a GoldenError, never a wait."""
    from harness.exitcodes import CLIError
    from harness.input_checks import read_bytes

    try:
        return read_bytes(f"golden file {path}", path, MAX_GOLDEN_BYTES)
    except (CLIError, OSError) as exc:
        raise GoldenError(str(exc) if isinstance(exc, CLIError) else f"golden file {path}: {exc}") from exc


def read_manifest(root: Path = ROOT) -> dict:
    """The manifest (``{"cases": {kind/case_id: entry}}``); GoldenError naming it when malformed."""
    path = root / MANIFEST
    if not path.exists():
        return {"cases": {}}
    from harness.exitcodes import CLIError
    from harness.input_checks import read_json

    try:  # bounded, regular files only (a FIFO never blocks the check)
        doc = read_json(str(path), path)
    except (CLIError, OSError) as exc:
        raise GoldenError(f"{path}: not a readable JSON manifest ({exc})") from exc
    cases = doc.get("cases") if isinstance(doc, dict) else None
    if not isinstance(cases, dict) or not all(isinstance(e, dict) for e in cases.values()):
        raise GoldenError(f"{path}: not a goldens manifest (needs \"cases\": an object of case entries)")
    # an entry naming an obtained trace (a hand edit) is not a golden: skipped, and dropped on the next write
    doc["cases"] = {k: e for k, e in cases.items() if not is_obtained(k) and not is_obtained(e.get("file", ""))}
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
    for case_id in cases:
        _not_obtained(kind, case_id)
    for case_id, (trace, meta) in cases.items():
        path = golden_path(kind, case_id, root)
        _save(path, trace)
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
    _not_obtained(kind, case_id)
    entry = read_manifest(root)["cases"].get(key)
    path = golden_path(kind, case_id, root)
    if entry is None:
        env = os.environ.get("HYV4_GOLDENS_ROOT")
        if env and root == ROOT and not (root / MANIFEST).is_file():  # a mistyped root, not a missing golden
            raise GoldenError(f"$HYV4_GOLDENS_ROOT {env}: no {MANIFEST} there (not a goldens tree)")
        raise GoldenError(f"no golden {key} in {root / MANIFEST}: record it with --update-goldens (on purpose)")
    if not os.path.lexists(path):
        raise GoldenError(f"golden file {path} is missing (listed in the manifest)")
    data = _golden_bytes(path)
    digest = hashlib.sha256(data).hexdigest()
    if digest != entry.get("sha256"):
        raise GoldenError(f"golden file {path} is corrupt or edited: sha256 {digest} != manifest {entry.get('sha256')}")
    try:
        from safetensors.torch import load as load_bytes

        tensors = load_bytes(data)
    except Exception as exc:  # safetensors raises several types
        raise GoldenError(f"golden file {path} does not parse: {exc}") from exc
    return {k: (v.to(torch.float64) if v.dtype == torch.float8_e4m3fn else v) for k, v in tensors.items()}, entry


@dataclass(frozen=True)
class GoldenKind:
    """What ``check`` needs to know about one kind of golden (its directory under the root)."""

    name: str
    # (case_id, obtained trace) -> the tensors a golden of it holds (the obtained file holds them too)
    encode: Callable[[str, dict], dict]
    # (case_id, obtained trace) -> its manifest entry (written only when recording on purpose)
    entry: Callable[[str, dict], dict]
    # (case_id, obtained trace, stored tensors, manifest entry, root) -> the report, results in dataflow order
    judge: Callable[[str, dict, dict, dict, Path], Report]
    # (case_id, root) -> why no golden of this kind applies here (not judged), or None when one does;
    # None: every golden applies, and a missing one is ``load``'s GoldenError
    absent: Callable[[str, Path], str | None] | None = None


@dataclass
class Checked:
    """What ``check`` found for one case."""

    kind: str
    case_id: str
    expected: Path
    report: Report | None = None  # None: not judged (``absent``) or recorded (``regenerated``)
    absent: str | None = None  # why no golden applies here
    obtained: Path | None = None  # the obtained trace, written beside ``expected`` on a mismatch
    obtained_error: str | None = None  # why it could not be written (the verdict stands)
    regenerated: bool = False

    @property
    def passed(self) -> bool:
        """Judged, every component within tolerance and the same trace keys as the golden."""
        rep = self.report
        return rep is not None and rep.passed and not rep.meta.get("key_set_differs")

    @property
    def first_divergent(self) -> str | None:
        """The first divergent component's key (dataflow order), else the keys only one side has."""
        rep = self.report
        if rep is None or self.passed:
            return None
        bad = rep.first_divergent
        return bad.name if bad is not None else f"key set {rep.meta.get('key_set_differs')}"

    @property
    def verdict(self):
        """The golden judge's verdict as every judge gives it (``harness.verdict.Verdict``, kind
        "golden"): rows from the component comparison, the message as its note. None when nothing
        was judged (no golden applies here, or it was just recorded)."""
        from harness.verdict import Verdict

        rep = self.report
        if rep is None:
            return None
        rows = [r.as_dict() for r in rep.results]
        return Verdict(kind="golden", passed=self.passed, first_divergent=self.first_divergent, rows=rows,
                       notes=[self.message], comparison=rep,
                       details={"case": self.case_id, "golden": str(self.expected), "passed": None,
                                "first_divergent": None, "rows": None,
                                "obtained": None if self.obtained is None else str(self.obtained)})

    @property
    def paths_line(self) -> str | None:
        """``expected PATH; obtained PATH`` after a mismatch, else None."""
        if self.report is None or self.passed:
            return None
        got = self.obtained if self.obtained is not None else f"not written ({self.obtained_error})"
        return f"expected {self.expected}; obtained {got}"

    @property
    def message(self) -> str:
        """What a failing test or command says: the verdict, then (on a mismatch) both paths."""
        key = f"{self.kind}/{self.case_id}"
        if self.regenerated:
            return f"golden {key} written on purpose: {self.expected} (review the diff before committing)"
        if self.report is None:
            return f"golden {key} not judged: {self.absent}"
        if self.passed:
            return f"golden {key} matches {self.expected}"
        return (f"golden {key} differs: first divergent {self.first_divergent}\n"
                f"  expected: {self.expected}\n  obtained: "
                + (str(self.obtained) if self.obtained is not None else f"not written ({self.obtained_error})"))


def check(kind: GoldenKind, case_id: str, obtained: dict, *, root: Path | str | None = None,
          regen: bool = False) -> Checked:
    """Judge ``obtained`` (a trace of ``case_id``) against golden ``kind/case_id`` under ``root``
    (default: ``ROOT``).

    - ``regen``: record ``obtained`` as the golden, on purpose (the manifest entry too), and judge
      nothing: ``Checked.regenerated``.
    - no golden applies on this platform (``kind.absent`` says why): not judged, ``Checked.absent``;
      a golden that is missing or corrupt raises ``GoldenError`` (no verdict: exit 125).
    - a match: nothing written (an obtained file a former mismatch left beside it is removed).
    - a mismatch: the obtained trace, encoded as the golden holds it, written atomically beside
      the expected file as ``case_id.obtained.safetensors``; ``Checked.message`` names both. A
      failed write is reported in the message and never changes the verdict.
    """
    root = ROOT if root is None else Path(root)
    expected, beside = golden_path(kind.name, case_id, root), obtained_path(kind.name, case_id, root)
    out = Checked(kind.name, case_id, expected)
    if regen:
        write_set(kind.name, {case_id: (kind.encode(case_id, obtained), kind.entry(case_id, obtained))}, root)
        beside.unlink(missing_ok=True)
        out.regenerated = True
        return out
    if kind.absent is not None:
        out.absent = kind.absent(case_id, root)
        if out.absent is not None:
            return out
    stored, entry = load(kind.name, case_id, root)
    out.report = kind.judge(case_id, obtained, stored, entry, root)
    if out.passed:
        try:
            beside.unlink(missing_ok=True)
        except OSError:  # a read-only tree: the stale file stays, the verdict is the same
            pass
        return out
    try:
        _save(beside, kind.encode(case_id, obtained),
              metadata={"obtained_for": str(expected.relative_to(root)), "case": case_id, "kind": kind.name})
        out.obtained = beside
    except write_errors() as exc:
        out.obtained_error = f"{exc.__class__.__name__}: {exc}"
    return out
