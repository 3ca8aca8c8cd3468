"""JSON reports: write, print, diff two, plot error per component.

A report file is ``{"cases": {case_id: Report.as_dict()}, "meta": {...}}``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .atomic import atomic_write, atomic_write_json
from .trace_compare import COMPONENTS, Report


def write_report(path: str | Path, reports: dict[str, Report], meta: dict | None = None) -> Path:
    """Atomically write the reports of several cases as one JSON file."""
    doc = {"meta": meta or {}, "cases": {cid: r.as_dict() for cid, r in reports.items()}}
    return atomic_write_json(path, doc, sort_keys=True)


def save_report(path: str | Path, reports: dict[str, Report], meta: dict | None = None) -> Path:
    """``write_report`` for a command's ``--report``: a failed write is one line (a bad path: 2,
    a full disk: 125; ``harness.atomic.write_failure``), nothing left behind."""
    from .atomic import write_errors, write_failure

    try:
        return write_report(path, reports, meta)
    except write_errors() as exc:
        raise write_failure(f"--report {path}", exc) from exc


# what format_table / diff / plot read from each component of a report
_COMPONENT_FIELDS = {"name": (str,), "passed": (bool,), "max_abs": (int, float), "max_rel": (int, float),
                     "similarity_gap": (int, float)}


def _fits_a_float(v) -> bool:
    """An int the table can print (a 401-digit one overflows a float)."""
    try:
        float(v)
    except (OverflowError, TypeError, ValueError):
        return False
    return True


def _printable(text: str) -> bool:
    """Encodable as UTF-8 (JSON's ``\\udcff`` escapes decode to lone surrogates, which are not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _short(v) -> str:
    text = repr(v) if not isinstance(v, int) or v.bit_length() < 200 else f"an int of {len(str(v))} digits"
    return text if len(text) <= 120 else text[:117] + "..."


def read_report(path: str | Path) -> dict:
    """The report at ``path``; ValueError naming the file (and the case/component/field) otherwise."""
    from .input_checks import MAX_JSON_BYTES, read_bytes

    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, not a JSON report")
    try:
        doc = json.loads(read_bytes(str(path), path, MAX_JSON_BYTES).decode())
    except FileNotFoundError as exc:
        raise ValueError(f"{path}: no such report") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the report: {getattr(exc, 'strerror', None) or exc}") from exc
    except (ValueError, RecursionError) as exc:  # bad JSON, a number past Python's digit limit, deep nesting
        why = (str(exc).splitlines() or [""])[0][:200]
        raise ValueError(f"{path}: not a JSON report ({exc.__class__.__name__}: {why})") from exc
    cases = doc.get("cases") if isinstance(doc, dict) else None
    if not isinstance(cases, dict) or not all(
            isinstance(c, dict) and isinstance(c.get("components"), list) for c in cases.values()):
        raise ValueError(f"{path}: not a harness report ('cases' must map case ids to reports with 'components')")
    for cid, rep in cases.items():
        if not _printable(cid):
            raise ValueError(f"{path}: case id {_short(cid)} is not text (a lone surrogate)")
        for j, c in enumerate(rep["components"]):
            if not isinstance(c, dict):
                raise ValueError(f"{path}: case {cid!r} component {j}: not an object")
            if isinstance(c.get("name"), str) and not _printable(c["name"]):
                raise ValueError(f"{path}: case {cid!r} component {j}: name {_short(c['name'])} is not text "
                                 "(a lone surrogate)")
            for field, types in _COMPONENT_FIELDS.items():
                v = c.get(field)
                if not isinstance(v, types) or (bool in types) != isinstance(v, bool) or (
                        float in types and not _fits_a_float(v)):
                    raise ValueError(f"{path}: case {cid!r} component {c.get('name', j)!r}: field {field!r} "
                                     f"is {_short(v)}, expected {' or '.join(t.__name__ for t in types)}"
                                     + (" within a float's range" if float in types else ""))
            for field in ("max_abs", "max_rel"):  # an error is a distance: never below 0 (NaN: a NaN output)
                if c[field] < 0:
                    raise ValueError(f"{path}: case {cid!r} component {c.get('name', j)!r}: field {field!r} "
                                     f"is {_short(c[field])}, expected >= 0 (an error's size)")
            tol = c.get("tolerance")
            if tol is not None and not (isinstance(tol, dict) and all(
                    isinstance(tol.get(k, 0), (int, float)) and not isinstance(tol.get(k, 0), bool)
                    and _fits_a_float(tol.get(k, 0)) and not tol.get(k, 0) < 0 for k in ("atol", "rtol"))):
                raise ValueError(f"{path}: case {cid!r} component {c['name']!r}: field 'tolerance' is {_short(tol)}")
    return doc


def _rows(doc: dict):
    for cid, rep in sorted(doc["cases"].items()):
        for c in rep["components"]:
            yield cid, c


def format_table(doc: dict) -> str:
    lines = [f"{'case':32s} {'component':26s} {'ok':4s} {'max_abs':>10s} {'max_rel':>10s} {'1-sim':>10s} {'atol':>8s}"]
    for cid, c in _rows(doc):
        tol = c.get("tolerance") or {}
        lines.append(f"{cid:32s} {c['name']:26s} {'ok' if c['passed'] else 'FAIL':4s} {c['max_abs']:10.3e} "
                     f"{c['max_rel']:10.3e} {c['similarity_gap']:10.3e} {tol.get('atol', 0):8.1e}")
    return "\n".join(lines)


def _dataflow_key(key: tuple[str, str]) -> tuple:
    """(case, step, position of the component in dataflow order) for ``step{k}.{component}``."""
    case, name = key
    step, _, comp = name.partition(".")
    order = COMPONENTS.index(comp) if comp in COMPONENTS else len(COMPONENTS)
    k = step[4:]
    return case, int(k) if k.isdigit() and len(k) <= 18 else -1, order, name


def diff(a: dict, b: dict, factor: float = 2.0) -> list[str]:
    """Components whose verdict changed or whose max_abs moved by more than ``factor``,
    in dataflow order (the first line is where the two runs start to differ)."""
    left = {(cid, c["name"]): c for cid, c in _rows(a)}
    right = {(cid, c["name"]): c for cid, c in _rows(b)}
    out = []
    for key in sorted(set(left) | set(right), key=_dataflow_key):
        x, y = left.get(key), right.get(key)
        label = f"{key[0]} {key[1]}"
        if x is None or y is None:
            out.append(f"{label}: only in {'B' if x is None else 'A'}")
            continue
        if x["passed"] != y["passed"]:
            out.append(f"{label}: {'ok' if x['passed'] else 'FAIL'} -> {'ok' if y['passed'] else 'FAIL'} "
                       f"(max_abs {x['max_abs']:.3e} -> {y['max_abs']:.3e})")
            continue
        ea, eb = x["max_abs"], y["max_abs"]
        if max(ea, eb) == 0:
            continue
        if min(ea, eb) == 0 or max(ea, eb) / min(ea, eb) > factor:
            out.append(f"{label}: max_abs {ea:.3e} -> {eb:.3e}")
    return out


def plot(doc: dict, png: str | Path) -> Path:
    """Log-scale max abs error per component (bars) with its atol (marker)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(_rows(doc))
    names = [f"{cid.split('-')[0]}:{c['name']}" for cid, c in rows]
    errs = [max(c["max_abs"], 1e-18) for _, c in rows]
    tols = [((c.get("tolerance") or {}).get("atol") or math.nan) for _, c in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.28 * len(rows)), 4.5))
    colors = ["tab:green" if c["passed"] else "tab:red" for _, c in rows]
    ax.bar(range(len(rows)), errs, color=colors)
    ax.plot(range(len(rows)), tols, "k_", markersize=12, label="atol")
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(names, rotation=90, fontsize=6)
    ax.set_ylabel("max |actual - expected|")
    ax.legend()
    fig.tight_layout()
    png = Path(png)
    try:
        atomic_write(png, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)
    return png
