"""CPU emulation of a side-by-side run with an FP8 KV cache, to estimate its tolerances.

Production with ``kv_cache_dtype`` fp8 stores the draft's latent as vLLM's fp8_ds_mla rows and
attends over what they read back (``reference.kv_cache``); the judge replays the EXACT reference
with the same FP8 cache. What is left between the two is production's bf16 arithmetic, now seen
through the FP8 rounding of the cached latent: an element of a bf16-noisy latent near an e4m3
rounding midpoint lands one e4m3 step away, a tile scale flips by 2 when its amax sits near a
power of two. This runs the reference with PRODUCTION numerics and the FP8 cache as the stand-in
for production (its rows packed by the reference's writer as ``attn.kv_cache_rows``), judges it
with ``judging.trace_judge.judge`` (bf16 tolerances, no FP8-KV widening) and prints per component the
max |d| vs EXACT and the atol needed at the table's rtol, next to the same run with a bf16 cache:
the starting point of ``harness.components.KV_CACHE_FP8_ATOL`` (2x the max |d|).

    python -m harness kv-fp8-emulation [--case ID ...] [--extra-seeds N]
"""

from __future__ import annotations

import argparse
import dataclasses

from harness.exitcodes import OneLineParser

import reference as R


def emulated_trace(case) -> dict:
    """The reference with PRODUCTION numerics and ``case.kv_cache_dtype``, shaped as a production trace."""
    from harness.production.case_inputs import case_inputs
    from harness.production.judging.fp8_emulation import as_production_trace
    from reference import kv_cache

    hf, _, weights = case_inputs(case)
    cfg = R.MTPConfig.from_hf_dict(hf)
    first = R.make_case(cfg, case.seed, case.requests, case.tokens)
    res = R.draft(cfg, weights, first, case.steps, num=R.PRODUCTION, kv_cache_dtype=case.kv_cache_dtype)
    trace = as_production_trace(cfg, R.flatten(res), case.steps)
    if kv_cache.canonical(case.kv_cache_dtype) == "fp8_ds_mla":
        for k in range(case.steps):
            trace[f"step{k}.attn.kv_cache_rows"] = kv_cache.pack_rows(trace[f"step{k}.attn.kv_c"],
                                                                     trace[f"step{k}.attn.k_pe"])
    return trace


def measure(case) -> dict:
    """{component: {"max_abs", "atol_needed", "passed"}} of the emulated run judged against EXACT."""
    from harness.components import tolerance_table
    from harness.production.judging.fp8_emulation import needed_atol
    from harness.production.judging.trace_judge import judge

    res = judge(case, emulated_trace(case), {}, tolerances=tolerance_table(case.quant))
    return needed_atol(res)


def main(argv=None) -> int:
    from harness import case_registry
    gpu_cases = case_registry.specs(kind="module", without="probe")

    ap = OneLineParser(prog="python -m harness kv-fp8-emulation", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", help="case id (default: every FP8-KV module case)")
    ap.add_argument("--extra-seeds", type=int, default=0, help="also run each case with seeds 40, 41, ...")
    args = ap.parse_args(argv)
    from harness.production.judging.fp8_emulation import check_case_args

    check_case_args(ap, args, gpu_cases)
    ids = args.case or [c.id for c in gpu_cases.values() if c.kv_cache_dtype != "auto"]
    agg: dict = {}
    for cid in ids:
        base = gpu_cases[cid]
        for case in [base] + [dataclasses.replace(base, id=f"{cid}-seed{s}", seed=s)
                              for s in range(40, 40 + args.extra_seeds)]:
            for kv in (case.kv_cache_dtype, "auto"):
                for comp, v in measure(dataclasses.replace(case, kv_cache_dtype=kv)).items():
                    a = agg.setdefault(kv, {}).setdefault(comp, {"max_abs": 0.0, "atol_needed": 0.0})
                    a["max_abs"] = max(a["max_abs"], v["max_abs"])
                    a["atol_needed"] = max(a["atol_needed"], v["atol_needed"])
            print(f"{case.id}: done", flush=True)
    comps = list(agg.get("auto", {}))
    print(f"{'component':22s} {'max|d| fp8 KV':>14s} {'atol needed':>12s} {'max|d| bf16 KV':>15s} {'atol needed':>12s}")
    for comp in comps:
        f, b = agg[next(k for k in agg if k != "auto")].get(comp, {}), agg["auto"][comp]
        print(f"{comp:22s} {f.get('max_abs', 0):14.3e} {f.get('atol_needed', 0):12.3e} "
              f"{b['max_abs']:15.3e} {b['atol_needed']:12.3e}")
    return 0

