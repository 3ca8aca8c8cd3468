"""bisect-check's cost per vLLM release on one host, side by side (a benchmark, not a test).

    python benchmarks/bench_releases.py --out DIR --env 0.33.0=/tmp/vllm-0.33.0 --env 0.34.0=/tmp/vllm-0.34.0

For each release environment (a venv from the offline bundle, tools/offline-bundle/README.md),
in the order given, ``benchmarks/bench_gpu_tier.py --only bisect-cold,bisect`` under that
environment's python: ``bisect-check`` on a fresh host (an EMPTY JIT cache root per release) and
then warm on it. Prints each release's seconds and each later release's ratio to the
first; the per-release JSON stays in DIR/<release>/bench_gpu_tier.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = ("bisect-cold", "bisect")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--env", action="append", required=True, metavar="RELEASE=ENV_DIR")
    args = ap.parse_args(argv)
    rows = {}
    for spec in args.env:
        name, _, env_dir = spec.partition("=")
        python = pathlib.Path(env_dir) / "bin" / "python3"
        if not name or not python.exists():
            print(f"error: --env {spec}: want RELEASE=ENV_DIR with ENV_DIR/bin/python3", file=sys.stderr)
            return 2
        out = pathlib.Path(args.out) / name
        env = dict(os.environ, PATH=f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}")
        subprocess.run([str(python), str(ROOT / "benchmarks" / "bench_gpu_tier.py"), "--out", str(out),
                        "--only", ",".join(STEPS)], env=env, cwd=ROOT, check=False)
        try:
            rows[name] = json.loads((out / "bench_gpu_tier.json").read_text())
        except (OSError, ValueError) as exc:
            print(f"{name}: no figures ({exc})")
    first = next(iter(rows), None)
    print(f"{'release':10s} " + " ".join(f"{s:>14s}" for s in STEPS))
    for name, r in rows.items():
        cells = []
        for s in STEPS:
            v, base = (r.get(s) or {}).get("seconds"), (rows[first].get(s) or {}).get("seconds")
            ratio = f" ({v / base:.2f}x)" if name != first and isinstance(v, (int, float)) and base else ""
            cells.append(f"{v if v is not None else '-':>8}{ratio:>6}")
        print(f"{name:10s} " + " ".join(f"{c:>14s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
