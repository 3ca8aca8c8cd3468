"""The drift rule: what moved in the latest run against the runs before it, before it fails.

For each platform (a component's numbers belong to its GPU and toolchain) and kind of run (a
night's GPU tier and its bisect-check are two series), the latest selected run that has rows is
compared with the runs of that platform and kind before it (at most ``window`` of them, at least
``min_runs``):

- a component that passed in the latest run is a finding when its max |d| moved by more than
  ``factor`` against the median of its trailing values (grew or shrank; from exactly 0 to
  anything, or back, counts as moved): the error is moving while every tolerance still holds;
- an acceptance figure (per request, the case's sum, per draft position) is a finding when it
  fell below its trailing median at all: the engine cases are deterministic, and acceptance is
  what users of speculative decoding watch.

A component that failed in the latest run is not drift: its verdict already says so.
"""

from __future__ import annotations

import dataclasses
import statistics

from harness.history.store import Filters, rows_of, select_runs

# autobisect's steps judge other commits than the nights': not part of a trend
DEFAULT_EXCLUDED_KINDS = ("autobisect-step",)


@dataclasses.dataclass
class Finding:
    kind: str  # "component" or "acceptance"
    platform: str
    case_id: str
    name: str  # the component, "request i" / "all", or "position j"
    latest: float
    median: float
    runs: int  # how many trailing values the median is of
    run_id: str
    started_at: str
    vllm: str | None
    detail: str = ""

    def line(self) -> str:
        if self.kind == "component":
            if self.median == 0 or self.latest == 0:
                moved = f"from {self.median:.3e} to {self.latest:.3e}"
            else:
                r = self.latest / self.median
                moved = f"x{r:.3g}" if r >= 1 else f"/{1 / r:.3g}"
            return (f"drift: {self.case_id} {self.name}: max|d| {self.latest:.3e} vs trailing median "
                    f"{self.median:.3e} of {self.runs} run(s) ({moved}), still within tolerance{self.detail} "
                    f"[vLLM {self.vllm or '?'}, {self.started_at}, {self.platform}]")
        return (f"drift: {self.case_id} acceptance {self.name}: {self.latest:.4f} fell from trailing median "
                f"{self.median:.4f} of {self.runs} run(s){self.detail} [vLLM {self.vllm or '?'}, {self.started_at}, "
                f"{self.platform}]")


def _moved(latest: float, median: float, factor: float) -> bool:
    if median == 0 or latest == 0:
        return latest != median
    return max(latest / median, median / latest) > factor


def drift_value(row) -> float | None:
    """The value a component's drift is judged on: its max |d| over the rows settled run to run where
    the run recorded one (a golden / baseline comparison: rows whose context exceeds index_topk are
    summed in an order that varies between runs of one commit, within tolerance: measured 0 vs
    1.95e-3 for tiny-k2-long's attn.core in two runs on one H200), else its max |d|."""
    settled = row.get("max_abs_settled")
    return settled if settled is not None else row["max_abs"]


def find_drift(conn, filters: Filters | None = None, *, factor: float, window: int = 7,
               min_runs: int = 1) -> list[Finding]:
    """The findings of the latest run of each platform among the runs ``filters`` selects."""
    f = dataclasses.replace(filters or Filters())
    if f.kinds is None and not f.exclude_kinds:
        f.exclude_kinds = DEFAULT_EXCLUDED_KINDS
    last = f.last
    f.last = None
    runs = select_runs(conn, f)
    by_platform: dict[tuple[str, str], list[dict]] = {}
    for r in runs:  # a night's tier and its bisect-check are two series of runs, each judged
        by_platform.setdefault((r["platform"], r["kind"]), []).append(r)
    findings: list[Finding] = []
    for (platform, _kind), plat_runs in sorted(by_platform.items()):
        if last:
            plat_runs = plat_runs[-last:]
        ids = [r["run_id"] for r in plat_runs]
        comps = rows_of(conn, "components", ids, f.case)
        accs = rows_of(conn, "acceptance", ids, f.case)
        poss = rows_of(conn, "acceptance_position", ids, f.case)
        with_rows = {r["run_id"] for r in comps} | {r["run_id"] for r in accs}
        ordered = [r for r in plat_runs if r["run_id"] in with_rows]
        if len(ordered) < 1 + min_runs:
            continue
        latest, before = ordered[-1], ordered[:-1]
        rank = {r["run_id"]: i for i, r in enumerate(before)}

        def series(rows, key, value):
            now, past = {}, {}
            for row in rows:
                k = key(row)
                v = value(row)
                if v is None:
                    continue
                if row["run_id"] == latest["run_id"]:
                    now[k] = row
                elif row["run_id"] in rank:
                    past.setdefault(k, []).append((rank[row["run_id"]], v))
            for k, vals in past.items():
                vals.sort()
                past[k] = [v for _, v in vals[-window:]]
            return now, past

        common = dict(platform=platform, run_id=latest["run_id"], started_at=latest["started_at"],
                      vllm=latest["vllm"])
        now, past = series(comps, lambda r: (r["case_id"], r["component"]), drift_value)
        for (cid, comp), row in sorted(now.items()):
            vals = past.get((cid, comp), [])
            if not row["passed"] or len(vals) < min_runs:
                continue
            med = statistics.median(vals)
            value = drift_value(row)
            if _moved(value, med, factor):
                detail = (f" ({row['ratio']:.2g} of atol {row['atol']:.1e})" if row.get("ratio") is not None
                          else "")
                if row.get("max_abs_settled") is not None:
                    detail += f"; order-variant rows left out (all rows: max|d| {row['max_abs']:.3e})"
                findings.append(Finding("component", case_id=cid, name=comp, latest=value, median=med,
                                        runs=len(vals), detail=detail, **common))
        for rows, key, label in ((accs, lambda r: (r["case_id"], r["request"]), str),
                                 (poss, lambda r: (r["case_id"], r["position"]), lambda p: f"position {p}")):
            now, past = series(rows, key, lambda r: r["rate"])
            for (cid, name), row in sorted(now.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
                vals = past.get((cid, name), [])
                if len(vals) < min_runs:
                    continue
                med = statistics.median(vals)
                if row["rate"] < med - 1e-12:
                    findings.append(Finding("acceptance", case_id=cid, name=label(name), latest=row["rate"],
                                            median=med, runs=len(vals),
                                            detail=f" ({row['accepted']}/{row['drafted']})", **common))
    return findings
