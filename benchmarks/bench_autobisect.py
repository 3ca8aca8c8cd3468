#!/usr/bin/env python3
"""Seconds per autobisect step: the harness's own cost per step, and the real chain's on a GPU host.

    ./with-env python benchmarks/bench_autobisect.py [--commits 64] [--repeats 3]
        # CPU, any machine: a synthetic git history of N commits with a regression at 3/4, judged by a
        # stand-in command that answers at once (`--judge`); what is left is autobisect's own cost per
        # step (the step process, git's checkout, the history's write) and the whole bisect's wall time
    python benchmarks/bench_autobisect.py --gpu
        # GPU host (vLLM importable): the GPU test tests/gpu/test_autobisect_gpu.py (a source tree from
        # the installed vLLM, a planted regression among harmless commits, overlay + bisect-check per
        # step); prints its steps and seconds per step

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JUDGE = '#!/bin/sh\n[ -f BUG ] && exit 1\nexit 0\n'


def _repo(d: Path, n: int, bug: int) -> None:
    env = dict(os.environ, GIT_AUTHOR_NAME="b", GIT_AUTHOR_EMAIL="b@b", GIT_COMMITTER_NAME="b",
               GIT_COMMITTER_EMAIL="b@b")
    subprocess.run(["git", "init", "-q", "-b", "main", str(d)], check=True)
    for i in range(n):
        (d / "f.txt").write_text(f"{i}\n")
        if i == bug:
            (d / "BUG").write_text("x\n")
        subprocess.run(["git", "-C", str(d), "add", "-A"], check=True, env=env)
        subprocess.run(["git", "-C", str(d), "commit", "-q", "-m", f"commit {i}"], check=True, env=env)
    subprocess.run(["git", "-C", str(d), "tag", "good", "HEAD~" + str(n - 1)], check=True)


def cpu(commits: int, repeats: int) -> None:
    walls, per_step = [], []
    with tempfile.TemporaryDirectory(prefix="bench-autobisect-") as tmp:
        tmp = Path(tmp)
        _repo(tmp / "src", commits, bug=3 * commits // 4)
        judge = tmp / "judge.sh"
        judge.write_text(JUDGE)
        judge.chmod(0o755)
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("HYV4_HISTORY", None)
        for r in range(repeats):
            rep = tmp / f"r{r}.json"
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "harness", "autobisect", "--source", str(tmp / "src"),
                                  "--good", "good", "--bad", "main", "--judge", str(judge), "--history",
                                  str(tmp / "h.sqlite"), "--report", str(rep)], cwd=ROOT, env=env,
                                 capture_output=True, text=True)
            walls.append(time.perf_counter() - t0)
            if out.returncode != 0:
                print(out.stdout[-2000:], out.stderr[-2000:])
                raise SystemExit(f"autobisect exited {out.returncode}")
            doc = json.loads(rep.read_text())
            per_step += [s["seconds"] for s in doc["steps"]]
            steps = len(doc["steps"])
    print(f"autobisect over {commits} commits, stand-in judge, {repeats} run(s): {steps} steps each "
          f"(the bad end + git's {steps - 1})")
    print(f"  wall per bisect: median {statistics.median(walls):.2f} s (min {min(walls):.2f}, max {max(walls):.2f})")
    print(f"  wall per step:   {statistics.median(walls) / steps:.3f} s (the whole command over its steps)")
    print(f"  the stand-in judge itself per step: median {statistics.median(per_step):.3f} s")


def gpu() -> None:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu/test_autobisect_gpu.py", "-q", "-s",
                          "-p", "no:xdist", "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    text = out.stdout + out.stderr
    steps = re.findall(r"autobisect step (\w+) \((.*?)\): exit (\d+).*\(([\d.]+) s\)", text)
    for sha, subject, code, secs in steps:
        print(f"  step {sha} exit {code} {float(secs):6.1f} s  {subject}")
    m = re.search(r"autobisect: (\d+) steps, ([\d.]+) s per step, ([\d.]+) s in all", text)
    print(f"GPU autobisect test: pytest exit {out.returncode}, {wall:.1f} s wall (baseline recording included)")
    if m:
        print(f"  {m.group(1)} steps, {m.group(2)} s per step, {m.group(3)} s bisect")
    else:  # why: pytest's failure lines (its last line alone was a warning's)
        why = [ln for ln in text.splitlines() if ln.startswith(("E ", "FAILED", "ERROR"))][:12]
        print("  no figures (the test did not get that far):")
        print("\n".join("    " + ln[:300] for ln in why or text.strip().splitlines()[-12:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commits", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gpu", action="store_true")
    a = ap.parse_args()
    gpu() if a.gpu else cpu(a.commits, a.repeats)


if __name__ == "__main__":
    main()
