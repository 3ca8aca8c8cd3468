"""Wall time of one production draft step (vLLM HYV4MTP, module level) on the GPU.

    python benchmarks/bench_draft_step_gpu.py [--preset tiny] [--requests 8] [--tokens 64] [--steps 3]
        [--reference-repeats N]

With --reference-repeats N > 0 it also times the float64 reference
(``reference.draft``, on the CPU or with --reference-device cuda on the same GPU) on the same case in the same run and
prints the ratio reference / production per draft run (all K steps). With --reference-only
only the reference is timed (a host without vLLM: no production figure, no ratio).

Times ``ProductionSession.run`` for all K steps (metadata build by vLLM's
builders + forward + logits + argmax + host round trips between steps), twice:
without hooks (``record=False``: the production figure) and with the
component hooks that copy every component to the CPU (what a side-by-side run
costs). Per-step figures are the run time / K. Figures and ratio come from
one process, one run of this script.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch

import reference as R
from harness.checkpoint.names import to_checkpoint
from harness.presets import preset


def _production(a, hf, cfg, first, weights) -> dict:
    """Production's run time for all K steps, without and with the component hooks."""
    from harness.production.module.runner import ProductionSession

    sess = ProductionSession(hf, num_speculative_tokens=a.steps, max_num_batched_tokens=4096)
    sess.load(to_checkpoint(cfg, weights))
    sess.run(first, a.steps)  # warm-up: JIT kernels, workspaces

    def timed(record: bool) -> list[float]:
        times = []
        for _ in range(a.repeats):
            torch.cuda.synchronize()
            t = time.perf_counter()
            sess.run(first, a.steps, record=record)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return times

    times = timed(False)
    hooked = timed(True)
    med = sorted(times)[len(times) // 2]
    return {"run_s_min": min(times), "run_s_median": med, "production_s_per_step": med / a.steps,
            "run_with_hooks_s_median": sorted(hooked)[len(hooked) // 2]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--reference-repeats", type=int, default=0)
    ap.add_argument("--reference-device", choices=("cpu", "cuda"), default="cpu",
                    help="where the float64 reference runs (cuda: the same GPU as production)")
    ap.add_argument("--reference-only", action="store_true",
                    help="time only the reference (a host without vLLM; no production figure, no ratio)")
    a = ap.parse_args(argv)
    if a.reference_only:
        a.reference_repeats = max(a.reference_repeats, 3)
    hf = preset(a.preset)
    cfg = R.MTPConfig.from_hf_dict(hf)
    first = R.make_case(cfg, 0, a.requests, a.tokens)
    weights = R.random_weights(cfg, 0, draw="per-tensor")  # the values do not matter here; the draw is faster
    out = {"preset": a.preset, "tokens_step0": int(first.input_ids.numel()), "steps": a.steps,
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    if not a.reference_only:
        out.update(_production(a, hf, cfg, first, weights))

    if a.reference_repeats > 0:
        ref_times = []
        dev = a.reference_device
        w_dev = {k: v.to(dev) for k, v in weights.items()}
        first_dev = first.to(dev)
        if dev == "cuda":
            R.draft(cfg, w_dev, first_dev, a.steps, R.EXACT)  # warm-up: cuBLAS handles, allocator
        for _ in range(a.reference_repeats):
            if dev == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            R.draft(cfg, w_dev, first_dev, a.steps, R.EXACT)
            if dev == "cuda":
                torch.cuda.synchronize()
            ref_times.append(time.perf_counter() - t)
        out.update(reference_s_median=sorted(ref_times)[len(ref_times) // 2],
                   reference_s_per_step=sorted(ref_times)[len(ref_times) // 2] / a.steps,
                   reference_device=dev, reference_threads=torch.get_num_threads(),
                   ratio_reference_over_production=(sorted(ref_times)[len(ref_times) // 2] / out["run_s_median"]
                                                    if "run_s_median" in out else None))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
