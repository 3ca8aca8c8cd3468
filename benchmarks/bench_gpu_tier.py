"""The GPU tier's wall times on one host, against the targets in TARGETS (a benchmark, not a test).

    python benchmarks/bench_gpu_tier.py --out DIR [--workers 6] [--only STEP,STEP...] [--cache DIR] [--tests FILE]

Steps, in this order (each a subprocess, timed here; all of them by default):
  warmup-cold   `python -m harness warmup --lanes 4` into an EMPTY JIT cache root (DIR/jit-cache,
                wiped first): what a fresh host pays before the tier (the bundle install not counted)
  warmup-warm   the same again, every step re-run on the warm cache
  warmup-kept   `warmup --if-cold` on the warm cache: what .ci/gpu-tier pays on a host that
                kept its cache (the stamped steps are skipped)
  tier          `pytest -m gpu tests/gpu` on --workers xdist workers, warm (as .ci/gpu-tier): side by
                side, goldens, engine + speculator mutants, the module mutant catalogue (not TP);
                per-case times from its JUnit; --tests FILE: only the test ids listed there (e.g.
                tier-tests-7fd14de.txt, an older tier's tests: its figure like for like)
  main-cold     `python -m harness main` on its own EMPTY cache root (DIR/jit-main-cold, wiped first):
                the README's main job on a fresh host (the bundle install not counted)
  main          `python -m harness main` warm (the README's main job)
  bisect-cold   `python -m harness bisect-check` into the EMPTY JIT cache root (wiped first, as
                warmup-cold): what a fresh host pays for its first verdict; later steps reuse what
                it compiled, so run warmup-kept after it, not warmup-cold
  bisect        `python -m harness bisect-check` warm
  bisect-graphs `python -m harness bisect-check --graphs` warm: the default set plus the
                graph-mode engine case
  bisect-profile `bisect-check` warm under cProfile (benchmarks/profile_command.py): DIR/bisect-profile.txt
                ranks the main process's functions (its seconds include cProfile's overhead)
  draft-step    production vs the float64 reference ON THE SAME GPU per draft step, at the
                tiny / small / real-dims presets (benchmarks/bench_draft_step_gpu.py)
  cpu-tier      the CPU tier (`CI=true python -m pytest`, CUDA hidden) pinned to 2 cores with
                taskset where present: CI's machine has 2 cores
Results accumulate in DIR/bench_gpu_tier.json (a later run with --only adds to it, e.g.
when one call cannot hold every step), and the table printed at the end shows every
figure in that file with its target and ratio. The fresh-host figure is warmup-cold plus the
first tier run after it on that cache (a later tier finds what the first compiled; the file
keeps which steps ran on the cache since it was last emptied).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from harness.ci_speed.pytest_timeline import format_summary, summarize  # noqa: E402  (imports nothing heavy)

STEPS = ("warmup-cold", "bisect-cold", "warmup-warm", "warmup-kept", "tier", "main-cold", "main", "bisect",
         "bisect-graphs", "bisect-profile", "draft-step", "cpu-tier")
# the GPU tier's time targets, seconds (draft-step: the reference/production ratio); tier_cold_s
# (warmup from empty + tier) and bisect_warm_s are the figures vLLM 0.33.0 must not regress from
TARGETS = {"tier_cold_s": 214.0, "tier_warm_s": 120.0, "main_cold_s": 60.0, "main_warm_s": 20.0, "bisect_warm_s": 24.0,
           "cpu_tier_s": 90.0, "draft_step_ratio": 3.0}


def _run(cmd: list[str], log: pathlib.Path, env: dict) -> tuple[int, float]:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    return rc, time.perf_counter() - t0


def _junit_counts(path: pathlib.Path) -> dict[str, int]:
    """passed / failed / skipped over the JUnit's test cases (an error counts as failed)."""
    out = {"passed": 0, "failed": 0, "skipped": 0}
    for tc in ET.parse(path).getroot().iter("testcase"):
        kinds = {child.tag for child in tc}
        out["failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"] += 1
    return out


def _junit_cases(path: pathlib.Path) -> dict[str, float]:
    out = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        out[f"{tc.get('classname', '').rsplit('.', 1)[-1]}::{tc.get('name')}"] = float(tc.get("time") or 0)
    return out


def _bisect_timeline(report: pathlib.Path) -> dict | None:
    """The bisect report's ``meta.timeline_s`` (where its wall time went), if it wrote one."""
    try:
        return json.loads(report.read_text())["meta"].get("timeline_s")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--only", default=",".join(STEPS))
    ap.add_argument("--warmup-lanes", type=int, default=4, help="warmup --lanes (as .ci/gpu-tier; 1: serial)")
    ap.add_argument("--cache", help="JIT cache root (default OUT/jit-cache; warmup-cold wipes it)")
    ap.add_argument("--tests", metavar="FILE", help="tier: only these test ids (one per line, as pytest names them): "
                    "the tests an older tier had, timed like for like")
    a = ap.parse_args(argv)
    selected = None
    if a.tests:
        try:
            selected = [ln.strip() for ln in pathlib.Path(a.tests).read_text().splitlines()
                        if ln.strip() and not ln.lstrip().startswith("#")]
        except (OSError, UnicodeDecodeError) as exc:
            print(f"error: --tests {a.tests}: {exc.__class__.__name__}: {exc}", file=sys.stderr)
            return 2
        if not selected:
            print(f"error: --tests {a.tests}: no test id in it", file=sys.stderr)
            return 2
    steps = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in steps if s not in STEPS]
    if bad:
        print(f"error: --only {','.join(bad)}: unknown step; known: {','.join(STEPS)}", file=sys.stderr)
        return 2
    out = pathlib.Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cache = pathlib.Path(a.cache or out / "jit-cache").resolve()
    res_path = out / "bench_gpu_tier.json"
    res = json.loads(res_path.read_text()) if res_path.exists() else {}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYV4_JIT_CACHE": str(cache),
           "HYV4_ENGINE_KV_CACHE_GIB": os.environ.get("HYV4_ENGINE_KV_CACHE_GIB", "4")}
    py = sys.executable
    failed = []

    def record(key, rc, secs, **extra):
        res[key] = {"rc": rc, "seconds": round(secs, 1), **extra}
        res.setdefault("cache_since_empty", []).append(key)
        res_path.write_text(json.dumps(res, indent=1))
        print(f"{key}: exit {rc}, {secs:.1f} s", flush=True)
        if rc != 0:
            failed.append(key)

    for s in steps:
        # what ran on the cache since it was last emptied: a fresh host's figure is a cold warmup
        # and the FIRST tier after it (a second tier finds what the first compiled)
        since_cold = res.setdefault("cache_since_empty", [])
        if s in ("warmup-cold", "bisect-cold"):
            shutil.rmtree(cache, ignore_errors=True)
            since_cold.clear()
        if s in ("warmup-cold", "warmup-warm", "warmup-kept"):
            rep = out / f"{s}.json"
            rc, secs = _run([py, "-m", "harness", "warmup", "--report", str(rep), "--lanes", str(a.warmup_lanes),
                             *(["--if-cold"] if s == "warmup-kept" else [])], out / f"{s}.log", env)
            record(s, rc, secs, lanes=a.warmup_lanes,
                   steps=json.loads(rep.read_text())["steps"] if rep.exists() else None)
        elif s == "tier":
            junit = out / "tier-junit.xml"
            evidence = out / "tier-evidence"  # per-test JSON/JSONL: engine reports, mutant lines
            evidence.mkdir(exist_ok=True)
            # per process: start-up, collection, busy, idle (harness.ci_speed.pytest_timeline)
            timeline = out / "tier-timeline"
            shutil.rmtree(timeline, ignore_errors=True)
            tier_env = {"HYV4_GPU_OUT": str(evidence), "HYV4_REPORT_DIR": str(evidence), "HYV4_TIMELINE": str(timeline),
                        **env}
            rc, secs = _run([py, "-m", "pytest", "-m", "gpu", *(selected or ["tests/gpu"]), "-q",
                             "-p", "no:cacheprovider", "-rfE", "-n", str(a.workers), "--dist", "worksteal",
                             "--ignore=tests/gpu/test_multigpu.py",
                             f"--junitxml={junit}"], out / "tier.log", tier_env)
            record("tier", rc, secs, workers=a.workers, tests=a.tests and f"{len(selected)} listed in {a.tests}",
                   first_after_cold_warmup=since_cold == ["warmup-cold"],
                   cases=_junit_cases(junit) if junit.exists() else None,
                   counts=_junit_counts(junit) if junit.exists() else None,
                   timeline=summarize(str(timeline)) if timeline.is_dir() else None)
        elif s == "main-cold":
            cold_env = {**env, "HYV4_JIT_CACHE": str(out / "jit-main-cold")}
            shutil.rmtree(cold_env["HYV4_JIT_CACHE"], ignore_errors=True)
            rc, secs = _run([py, "-m", "harness", "main", "--report", str(out / "main-cold.json")],
                            out / "main-cold.log", cold_env)
            record("main-cold", rc, secs)
        elif s == "main":
            rc, secs = _run([py, "-m", "harness", "main", "--report", str(out / "main.json")], out / "main.log", env)
            record("main", rc, secs)
        elif s in ("bisect-cold", "bisect", "bisect-graphs"):
            rep = out / f"{s}.json"
            rc, secs = _run([py, "-m", "harness", "bisect-check", "--report", str(rep),
                             *(["--graphs"] if s == "bisect-graphs" else [])], out / f"{s}.log", env)
            record(s, rc, secs, timeline=_bisect_timeline(rep))
        elif s == "bisect-profile":
            rc, secs = _run([py, "benchmarks/profile_command.py", str(out / s), "bisect-check", "--report",
                             str(out / f"{s}.json")], out / f"{s}.log", env)
            record(s, rc, secs)
        elif s == "draft-step":
            for name, extra in (("tiny", []), ("small", []), ("real-dims", ["--requests", "2", "--tokens", "64"])):
                log = out / f"draft-step-{name}.log"
                rc, secs = _run([py, "benchmarks/bench_draft_step_gpu.py", "--preset", name, "--steps", "3",
                                 "--reference-repeats", "3", "--reference-device", "cuda", *extra], log, env)
                lines = [ln for ln in log.read_text().splitlines() if ln.startswith("{")]
                record(f"draft-step-{name}", rc, secs, **(json.loads(lines[-1]) if lines else {}))
        elif s == "cpu-tier":
            cpu_env = {**env, "CUDA_VISIBLE_DEVICES": "", "CI": "true"}
            pin = ["taskset", "-c", "0,1"] if shutil.which("taskset") else []
            rc, secs = _run([*pin, py, "-m", "pytest", "-q", "-n", "2"], out / "cpu-tier.log", cpu_env)
            record("cpu-tier", rc, secs, pinned_to_2_cores=bool(pin))
    print_table(res)
    return 1 if failed else 0


def print_table(res: dict) -> None:
    def sec(k):
        if k not in res or res[k]["rc"] != 0:
            return None
        counts = res[k].get("counts") or {}
        if counts.get("skipped") or counts.get("failed") or counts == {"passed": 0, "failed": 0, "skipped": 0}:
            return None  # a tier that skipped (no GPU, no vLLM) or failed tests is no tier figure
        return res[k]["seconds"]

    rows = []
    first = res.get("tier", {}).get("first_after_cold_warmup")
    if sec("warmup-cold") is not None and sec("tier") is not None and first:
        subset = f", {res['tier']['tests']}" if res["tier"].get("tests") else ""
        rows.append((f"GPU tier, fresh host (warmup cold + first tier{subset})", sec("warmup-cold") + sec("tier"),
                     "tier_cold_s"))
    kept = "warmup-kept" if sec("warmup-kept") is not None else "warmup-warm"
    if sec(kept) is not None and sec("tier") is not None:
        rows.append((f"GPU tier, kept cache ({kept} + tier)", sec(kept) + sec("tier"), "tier_warm_s"))
    for key, label, target in (("warmup-cold", "warmup, empty cache", None), ("warmup-warm", "warmup, warm", None),
                               ("warmup-kept", "warmup --if-cold, warm", None),
                               ("tier", "pytest -m gpu (xdist, first after warmup-cold)" if first
                                else "pytest -m gpu (warm, xdist)", None),
                               ("main-cold", "harness main, empty cache", "main_cold_s"),
                               ("main", "harness main, warm", "main_warm_s"),
                               ("bisect-cold", "bisect-check, empty cache", None),
                               ("bisect", "bisect-check, warm", "bisect_warm_s"),
                               ("bisect-graphs", "bisect-check --graphs, warm", None),
                               ("cpu-tier", "CPU tier (2 cores)", "cpu_tier_s")):
        if key in res:
            c = res[key].get("counts")
            counts = f", {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped" if c else ""
            rows.append((f"{label} (exit {res[key]['rc']}{counts})", res[key]["seconds"], target))
    print(f"\n{'figure':64s} {'seconds':>9s} {'target':>8s} {'ratio':>7s}")
    for label, v, target in rows:
        t = TARGETS.get(target)
        print(f"{label:64s} {v:9.1f} {t if t else '':>8} {'' if not t else f'{v / t:7.2f}'}")
    for name in ("tiny", "small", "real-dims"):
        r = res.get(f"draft-step-{name}")
        if r and "production_s_per_step" in r:
            ratio = r.get("ratio_reference_over_production")
            print(f"draft step {name:10s}: production {r['production_s_per_step'] * 1e3:8.2f} ms, reference "
                  f"({r.get('reference_device')}) {r.get('reference_s_per_step', float('nan')) * 1e3:8.2f} ms, "
                  f"ratio {ratio:.2f} (target <= {TARGETS['draft_step_ratio']:.0f})")
    for key in ("bisect-cold", "bisect", "bisect-graphs"):
        t = (res.get(key) or {}).get("timeline")
        if t:  # seconds of the bisect process's life; an engine: [its start, its case's end]
            marks = ", ".join(f"{k} {v}" if not isinstance(v, list) else f"{k} {v[0]}-{v[1]}" for k, v in
                              sorted(t.items(), key=lambda kv: kv[1] if not isinstance(kv[1], list) else kv[1][1]))
            print(f"{key} timeline (s): {marks}")
    tier = res.get("tier", {}).get("cases") or {}
    if tier:
        print("\nslowest GPU tests (warm, under xdist):")
        for name, t in sorted(tier.items(), key=lambda kv: -kv[1])[:12]:
            print(f"  {t:7.1f} s  {name}")
    if res.get("tier", {}).get("timeline"):
        print("\nGPU tier, per pytest process (harness.ci_speed.pytest_timeline):")
        print("\n".join("  " + ln for ln in format_summary(res["tier"]["timeline"])))


if __name__ == "__main__":
    sys.exit(main())
