"""The judge's value comparisons on a bisect case's trace: the finiteness check, old against new.

    ./with-env python benchmarks/bench_compare.py [--case tiny-k2-long] [--repeats 5]

The reference's trace of the case (float64, CPU) is the expected side; the actual side is the
same trace rounded through bf16, as production's trace is. Timed in one process, on the same
tensors, best of --repeats:
  compare_traces, finiteness by a sum per tensor (``trace_compare.finite_everywhere``, as shipped)
  compare_traces, finiteness by ``torch.isfinite(t).all()`` (the check it replaced)
  the judge's per-key max |d| (``trace_judge._max_abs``), all-finite fast path / always masked (as before)
and the ratios. Every variant must give the same results (checked here, and property-tested in
tests/cpu/test_compare_finite_fast_path.py). The judge runs these on the GPU host's CPU, beside
the engine subprocesses of a bisect-check.

    --contend N   the same, while N other processes keep every core busy with torch's own thread
                  pool (a bisect-check's engine subprocesses do); then once more with this process
                  at one torch thread: what oversubscription costs the judge, and what a smaller
                  pool gives back
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="tiny-k2-long")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--contend", type=int, default=0, metavar="N")
    args = ap.parse_args(argv)

    import torch

    import reference as R
    from harness import case_registry, trace_compare
    from harness.production.case_inputs import case_inputs
    from harness.production.judging import trace_judge

    gpu_cases = case_registry.specs(kind="module", without="probe")
    from harness.production.judging.tolerances import tolerances_for

    case = gpu_cases[args.case]
    hf, _, weights = case_inputs(case)
    cfg = R.MTPConfig.from_hf_dict(hf)
    first = R.make_case(cfg, case.seed, case.requests, case.tokens)
    ref = {k: v for k, v in R.flatten(R.draft(cfg, weights, first, case.steps, num=R.EXACT)).items()
           if v.is_floating_point()}
    prod = {k: v.to(torch.bfloat16).double() for k, v in ref.items()}
    tols = tolerances_for(case.quant)
    elements = sum(v.numel() for v in ref.values())

    def measure(label: str) -> bool:
        new_s, new_rep = best(lambda: trace_compare.compare_traces(prod, ref, tols))
        trace_compare.finite_everywhere = old_check
        try:
            old_s, old_rep = best(lambda: trace_compare.compare_traces(prod, ref, tols))
        finally:
            trace_compare.finite_everywhere = shipped
        same = [dataclasses.asdict(r) for r in new_rep.results] == [dataclasses.asdict(r) for r in old_rep.results]
        keys = sorted(ref)
        new_m, new_vals = best(lambda: [trace_judge._max_abs(prod[k], ref[k]) for k in keys])
        trace_judge.finite_everywhere = lambda t: False
        try:
            old_m, old_vals = best(lambda: [trace_judge._max_abs(prod[k], ref[k]) for k in keys])
        finally:
            trace_judge.finite_everywhere = shipped
        same_m = new_vals == old_vals
        print(f"{label}: torch threads {torch.get_num_threads()}")
        print(f"  compare_traces  isfinite(t).all(): {old_s * 1e3:8.1f} ms   sum check: {new_s * 1e3:8.1f} ms   "
              f"ratio {old_s / new_s:.2f}   same results: {same}")
        print(f"  max |d| per key masked:            {old_m * 1e3:8.1f} ms   fast path: {new_m * 1e3:8.1f} ms   "
              f"ratio {old_m / new_m:.2f}   same results: {same_m}")
        return same and same_m

    def best(fn):
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t)
        return min(times), out

    shipped = trace_compare.finite_everywhere

    def old_check(t):
        return bool(torch.isfinite(t).all())

    print(f"case {case.id}: {len(ref)} float components, {elements} elements (float64); best of {args.repeats}")
    ok = measure("alone")
    if args.contend:
        import subprocess

        spin = ("import time, torch\n"
                "a = torch.randn(512, 512, dtype=torch.float64)\n"
                "while True: (a @ a).sum(); a.abs().max()\n")
        procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(args.contend)]
        try:
            time.sleep(8)  # the spinners' imports done (torch), their pools running
            ok &= measure(f"beside {args.contend} busy processes")
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            ok &= measure(f"beside {args.contend} busy processes, one thread here")
            torch.set_num_threads(threads)
        finally:
            for p in procs:
                p.kill()
                p.wait()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
