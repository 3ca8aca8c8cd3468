"""Seeded synthetic weights: the one-stream draw (the goldens') against the per-tensor draw.

    ./with-env python benchmarks/bench_weights_draw.py [--preset real-dims] [--threads N]

Prints, in one run, the wall time of ``reference.random_weights`` with ``draw="stream"`` and
``draw="per-tensor"`` at one preset, the parameter count and the ratio. The per-tensor draw is
what ``real-dims-k2`` uses (harness.case_registry): its one serial stream of 1.8 G float64
draws was the GPU tier's critical path on the host CPU.
"""

from __future__ import annotations

import argparse
import gc
import math
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch

import reference as R
from harness.presets import preset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = R.MTPConfig.from_hf_dict(preset(a.preset))
    n = sum(math.prod(s) for s in R.shapes(cfg).values())
    print(f"preset {a.preset}: {n / 1e9:.3f} G parameters, {torch.get_num_threads()} threads, "
          f"{n * 8 / 2**30:.1f} GiB as float64")
    secs = {}
    for draw in ("stream", "per-tensor"):
        t = time.perf_counter()
        w = R.random_weights(cfg, 0, draw=draw)
        secs[draw] = time.perf_counter() - t
        del w
        gc.collect()
        print(f"  draw={draw:10s} {secs[draw]:8.2f} s")
    print(f"  stream / per-tensor: {secs['stream'] / secs['per-tensor']:.2f}x")


if __name__ == "__main__":
    main()
