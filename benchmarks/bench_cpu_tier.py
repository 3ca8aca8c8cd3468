"""CPU tier wall time, serial and with xdist, in one run (a benchmark, not a test).

    ./with-env python benchmarks/bench_cpu_tier.py [--workers N] [--repeat R] [-- PYTEST_ARGS ...]

Runs the CPU tier as `.ci/run` does (`python -m pytest` from the repo root,
CI=true; the output is captured, not shown) in a subprocess, first serial (HYV4_PYTEST_WORKERS=0), then
with the default xdist workers (or --workers N), back to back, R times
alternating, and prints each wall time, the best of each and the ratio.
The issue's target: the CPU tier (.ci/run, cached environment, 2 cores)
<= 90 s. Wall times on shared cores move with what else runs: the load
average before and after each run is printed with it. Exit 1 if a run fails.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET_S = 90.0


def _load() -> str:
    try:
        return " ".join(pathlib.Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def run_tier(workers: str, pytest_args: list[str]) -> dict:
    env = {**os.environ, "CI": os.environ.get("CI", "true"), "HYV4_PYTEST_WORKERS": workers}
    load_before = _load()
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", *pytest_args], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    out = r.stdout + r.stderr
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    summary = next((ln.strip("= ") for ln in reversed(lines) if re.search(r"\d+ (passed|failed|error)", ln)),
                   lines[-1] if lines else "(no output)")
    m = re.search(r"created: (\d+)/\d+ workers", out)  # xdist's header line
    return {"workers": int(m.group(1)) if m else 0, "wall": wall, "rc": r.returncode, "summary": summary,
            "load": f"{load_before} -> {_load()}", "output": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="auto", help="xdist workers for the parallel run (default: the "
                    "project's default, HYV4_PYTEST_WORKERS=auto)")
    ap.add_argument("--repeat", type=int, default=1, help="serial/xdist pairs, alternating (default 1)")
    ap.add_argument("pytest_args", nargs="*", help="after --: extra pytest arguments for both runs")
    a = ap.parse_args(argv)
    print(f"CPU tier: python -m pytest {' '.join(a.pytest_args)} (repo root, CI=true); "
          f"{os.cpu_count()} CPUs, load average {_load()}", flush=True)
    runs: dict[str, list[dict]] = {"serial": [], "xdist": []}
    failed = False
    for i in range(a.repeat):
        for name, workers in (("serial", "0"), ("xdist", a.workers)):
            res = run_tier(workers, a.pytest_args)
            runs[name].append(res)
            print(f"  {name:6s} run {i + 1}: {res['wall']:7.1f} s  workers {res['workers'] or '-'}  "
                  f"load {res['load']}  {res['summary']}", flush=True)
            if res["rc"] != 0:
                failed = True
                print(res["output"][-3000:], file=sys.stderr)
    best = {k: min(r["wall"] for r in v) for k, v in runs.items()}
    print(f"serial  {best['serial']:.1f} s (best of {a.repeat})")
    print(f"xdist   {best['xdist']:.1f} s (best of {a.repeat}, {runs['xdist'][0]['workers'] or 'no'} workers)")
    print(f"ratio   serial / xdist = {best['serial'] / best['xdist']:.2f}")
    print(f"target  CPU tier <= {TARGET_S:.0f} s: serial {'met' if best['serial'] <= TARGET_S else 'NOT met'}, "
          f"xdist {'met' if best['xdist'] <= TARGET_S else 'NOT met'}")
    if failed:
        print("a run failed (output above): the times do not count", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
