"""What CUDA graphs cost the engine tier, on one GPU host (a benchmark, not a test).

    python benchmarks/bench_graphs.py [--case engine-graphs-accept-k3-share] [--runs 3] [--out DIR]

In one process: the graph-mode engine case is built (vLLM's default compilation configuration:
its CUDA-graph capture is part of the build), then judged ``--runs`` times on the same engine (the
warm cost of one graph-mode verdict: generate + replay), then once with the drafter forced eager
(what a failed graph run adds). Then, in a subprocess, the case's eager twin (same case, enforce_eager)
is built and judged once, for the build-time difference (capture and the graph-mode start-up).
Prints the figures and the ratios, each verdict's first line and the draft steps by graph mode;
DIR/bench_graphs.json keeps them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness.ci_speed.jit_cache import apply_jit_cache  # noqa: E402 - importable once ROOT is on sys.path

apply_jit_cache()  # $HYV4_JIT_CACHE before vLLM is imported, as `python -m harness` does (the eager twin inherits it)


def _eager_twin(case_id: str) -> dict:
    """Build + judge the case with ``graphs=False`` in its own process: (build_s, generate_s, passed)."""
    code = ("import dataclasses, json, sys, time\n"
            "from harness.case_registry import spec\n"
            "from harness.production.engine.generation_judge import generate_and_judge\n"
            "from harness.production.engine.session import build_session\n"
            f"case = dataclasses.replace(spec({case_id!r}, kind='engine'), graphs=False)\n"
            "t = time.perf_counter(); s = build_session(case, log=lambda *a, **k: None); b = time.perf_counter() - t\n"
            "t = time.perf_counter(); r = generate_and_judge(s, log=lambda *a, **k: None);"
            " g = time.perf_counter() - t\n"
            "print('RESULT', json.dumps({'build_s': b, 'judge_s': g, 'passed': r['passed'],"
            " 'problems': r['problems'][:2], 'generate_s': r['timing_s']['generate']}))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not line:
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-600:]}"}
    return json.loads(line[-1][len("RESULT "):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="engine-graphs-accept-k3-share")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from harness import case_registry
    engine_cases = case_registry.specs(kind="engine")
    if args.case not in engine_cases or not engine_cases[args.case].graphs:
        print(f"error: --case {args.case}: not a graph-mode engine case "
              f"({', '.join(c for c, e in engine_cases.items() if e.graphs)})", file=sys.stderr)
        return 2
    from harness.production.can_run import cannot_run_engine_reason
    reason = cannot_run_engine_reason()
    if reason:
        print(f"cannot judge: {reason}")
        return 125
    from harness.production.engine.generation_judge import generate_and_judge
    from harness.production.engine.session import build_session

    case = engine_cases[args.case]
    quiet = lambda *a, **k: None  # noqa: E731
    t = time.perf_counter()
    sess = build_session(case, log=quiet)
    build_s = time.perf_counter() - t
    runs = []
    for i in range(args.runs):
        t = time.perf_counter()
        rep = generate_and_judge(sess, log=quiet)
        runs.append({"judge_s": time.perf_counter() - t, "generate_s": rep["timing_s"]["generate"],
                     "passed": rep["passed"], "problems": rep["problems"][:3],
                     "graph_replays": rep.get("graph_replays"), "acceptance": {
                         k: f"{v['accepted']}/{v['drafted']}" for k, v in (rep.get("acceptance") or {}).items()},
                     "vllm_counters": (rep.get("vllm_spec_decode") or {}).get("per_request"),
                     "counts": {k: rep["counts"].get(k) for k in ("drafted", "compared", "ties", "mismatches",
                                                                  "topk_calls_beyond_ties", "bookkeeping_findings")}})
        print(f"graph run {i}: {'PASS' if rep['passed'] else 'FAIL: ' + rep['problems'][0][:300]} "
              f"({runs[-1]['judge_s']:.1f} s; generate {runs[-1]['generate_s']:.1f} s)", flush=True)
    t = time.perf_counter()
    eager = generate_and_judge(sess, log=quiet, eager_drafter=True)
    eager_row = {"judge_s": time.perf_counter() - t, "generate_s": eager["timing_s"]["generate"],
                 "passed": eager["passed"], "problems": eager["problems"][:3],
                 "acceptance": {k: f"{v['accepted']}/{v['drafted']}"
                                for k, v in (eager.get("acceptance") or {}).items()}}
    print(f"drafter forced eager: {'PASS' if eager['passed'] else 'FAIL: ' + eager['problems'][0][:300]} "
          f"({eager_row['judge_s']:.1f} s)", flush=True)
    del sess
    twin = _eager_twin(args.case)
    doc = {"case": dataclasses.asdict(case), "compilation": rep.get("compilation"), "versions": rep.get("versions"),
           "build_s": build_s, "runs": runs, "eager_drafter": eager_row, "eager_twin": twin}
    warm = [r["judge_s"] for r in runs[1:]] or [runs[0]["judge_s"]]
    print(f"compilation: {json.dumps(rep.get('compilation'))}")
    print(f"graph-mode build (incl. capture) {build_s:.1f} s; "
          f"eager twin build {twin.get('build_s', float('nan')):.1f} s "
          f"(ratio {build_s / twin['build_s']:.2f})" if "build_s" in twin else f"eager twin: {twin}")
    print(f"one graph-mode verdict warm: {min(warm):.1f}-{max(warm):.1f} s; first {runs[0]['judge_s']:.1f} s; "
          f"drafter-eager re-run {eager_row['judge_s']:.1f} s"
          + (f"; eager twin verdict {twin['judge_s']:.1f} s (ratio {min(warm) / twin['judge_s']:.2f})"
             if "judge_s" in twin else ""))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        from harness.atomic import atomic_write_json
        atomic_write_json(os.path.join(args.out, "bench_graphs.json"), doc, default=str)
    return 0 if all(r["passed"] for r in runs) and eager_row["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
