"""Trend plots of the run history (PNG, matplotlib's Agg backend, pinned in requirements/ci.txt).

Per case: each component's max |d| over the selected runs, as the ratio to its atol where the
component has one (the line at 1 is the tolerance's absolute part), else max |d| itself, on a log
scale. Per engine case with acceptance: each request's rate, the case's sum and each draft
position's rate over the runs. The x axis is the run (its date and vLLM version).
"""

from __future__ import annotations

import re
from pathlib import Path

from harness.history.store import Filters, rows_of, select_runs

MAX_LINES = 40  # components per plot beyond which the legend is left off (the lines stay)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "case"


def _axis_labels(runs: list[dict]) -> list[str]:
    return [f"{(r['started_at'] or '')[:16].replace('T', ' ')}\n{r['vllm'] or '?'}" for r in runs]


def trend_plots(conn, out_dir, filters: Filters | None = None) -> list[Path]:
    """Write one PNG per case (components) and per engine case (acceptance) into ``out_dir``;
    the paths written, in case order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from harness.atomic import atomic_write

    f = filters or Filters()
    runs = select_runs(conn, f)
    if not runs:
        return []
    ids = [r["run_id"] for r in runs]
    x_of = {rid: i for i, rid in enumerate(ids)}
    labels = _axis_labels(runs)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig, name: str) -> None:
        path = out_dir / name
        try:
            atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
        finally:
            plt.close(fig)
        written.append(path)

    def axes(title: str, ylabel: str, log: bool):
        fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(runs) + 3), 4.8))
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.set_xticks(range(len(runs)))
        ax.set_xticklabels(labels, rotation=60, fontsize=6, ha="right")
        return fig, ax

    comps = rows_of(conn, "components", ids, f.case)
    by_case: dict[str, dict[str, list]] = {}
    for r in comps:
        if r["max_abs"] is None:
            continue
        by_case.setdefault(r["case_id"], {}).setdefault(r["component"], []).append(r)
    for cid, series in sorted(by_case.items()):
        use_ratio = all(r["ratio"] is not None for rows in series.values() for r in rows)
        fig, ax = axes(f"{cid}: {'max|d| / atol' if use_ratio else 'max|d|'} per component",
                       "max |d| / atol" if use_ratio else "max |d|", log=True)
        for comp, rows in sorted(series.items()):
            rows.sort(key=lambda r: x_of[r["run_id"]])
            ys = [max((r["ratio"] if use_ratio else r["max_abs"]), 1e-18) for r in rows]
            ax.plot([x_of[r["run_id"]] for r in rows], ys, marker=".", linewidth=0.8, label=comp)
            bad = [(x_of[r["run_id"]], y) for r, y in zip(rows, ys) if r["passed"] == 0]  # NULL: not judged
            if bad:
                ax.plot(*zip(*bad), "rx", markersize=8)
        if use_ratio:
            ax.axhline(1.0, color="k", linestyle="--", linewidth=0.8)
        if len(series) <= MAX_LINES:
            ax.legend(fontsize=5, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        save(fig, f"trend-{_safe(cid)}.png")

    accs = rows_of(conn, "acceptance", ids, f.case)
    poss = rows_of(conn, "acceptance_position", ids, f.case)
    cases = sorted({r["case_id"] for r in accs} | {r["case_id"] for r in poss})
    for cid in cases:
        fig, ax = axes(f"{cid}: acceptance (vLLM's definition) per request and per draft position", "rate",
                       log=False)
        lines: dict[str, list] = {}
        for r in accs:
            if r["case_id"] == cid and r["rate"] is not None:
                lines.setdefault(r["request"], []).append((x_of[r["run_id"]], r["rate"]))
        for r in poss:
            if r["case_id"] == cid and r["rate"] is not None:
                lines.setdefault(f"position {r['position']}", []).append((x_of[r["run_id"]], r["rate"]))
        for name, pts in sorted(lines.items()):
            pts.sort()
            style = "--" if name.startswith("position") else "-"
            ax.plot(*zip(*pts), style, marker=".", linewidth=1.0, label=name)
        ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        save(fig, f"acceptance-{_safe(cid)}.png")
    return written
