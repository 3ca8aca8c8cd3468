"""Time per draft step of the reference at tiny, small and real HY V4 dimensions.

    ./with-env python benchmarks/bench_reference_step.py [--tokens 16] [--requests 2] [--dtype float64]

Prints, per preset, the wall time of step 0 (every request's tokens) and of
one decode step (one token per request), median of --repeats runs, and the
ratio to the tiny preset, on CPU and, where CUDA is present, on the GPU too
(float64 either way; ``--devices`` picks).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch

from harness.presets import preset
from reference import DraftCache, MTPConfig, draft, make_case, numerics_by_name, random_weights


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(name: str, tokens: int, requests: int, repeats: int, dtype: str,
               device: str = "cpu") -> tuple[float, float]:
    hf = preset(name)
    cfg = MTPConfig.from_hf_dict(hf)
    w = {k: v.to(device) for k, v in random_weights(cfg, 0).items()}
    first = make_case(cfg, 0, requests, tokens).to(device)
    num = numerics_by_name(dtype)
    draft(cfg, w, first, 2, num, cache=DraftCache())  # warm-up (lazy init, allocator)
    step0, decode = [], []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        draft(cfg, w, first, 1, num, cache=DraftCache())
        _sync(device)
        t1 = time.perf_counter()
        draft(cfg, w, first, 2, num, cache=DraftCache())
        _sync(device)
        t2 = time.perf_counter()
        step0.append(t1 - t0)
        decode.append((t2 - t1) - (t1 - t0))
    return statistics.median(step0), max(statistics.median(decode), 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", choices=("float64", "production"), default="float64")
    ap.add_argument("--presets", nargs="*", default=["tiny", "small", "real-dims"])
    ap.add_argument("--devices", nargs="*", default=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {args.dtype}, "
          f"{args.requests} requests x ~{args.tokens} tokens")
    print(f"{'device':6s} {'preset':10s} {'step0 s':>10s} {'decode s':>10s} {'step0/tiny':>11s}")
    for device in args.devices:
        base = None
        for name in args.presets:
            s0, d = time_steps(name, args.tokens, args.requests, args.repeats, args.dtype, device)
            base = base or s0
            print(f"{device:6s} {name:10s} {s0:10.3f} {d:10.3f} {s0 / base:11.1f}")


if __name__ == "__main__":
    main()
