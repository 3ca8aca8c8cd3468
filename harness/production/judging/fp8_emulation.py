"""CPU emulation of vLLM's block-FP8 production path, to estimate FP8 tolerances.

What vLLM 0.33 does on an SM90 GPU for an FP8 MTP checkpoint (read off
``Fp8LinearMethod``, ``kernels/linear/scaled_mm/deep_gemm.py``,
``utils/fp8_utils.py``, ``utils/deep_gemm.py``, ``fused_moe/oracle/fp8.py``):

* Every FP8 linear (fused_qkv_a_proj, q_b_proj, kv_b_proj, o_proj, indexer
  wq_b, shared experts) runs a W8A8 block GEMM: the bf16 activation is
  quantized per token and group of 128 input features to e4m3
  (s = amax/448, ``per_token_group_quant_fp8``), q_x . q_w accumulates in
  fp32 with s_x * s_w per 128-block, output bf16. e4m3 keeps 3 mantissa bits:
  each activation element moves by up to 2^-4 relative before the fp32
  accumulation.
* ``VLLM_USE_DEEP_GEMM_E8M0`` defaults to 1, so with DeepGEMM present
  ``is_deep_gemm_e8m0_used()`` is true on SM90 as well: activation scales are
  rounded up to powers of two (``FLOAT32_CEIL_UE8M0``) and, for checkpoints
  with float32 ``weight_scale_inv``, ``deepgemm_post_process_fp8_weight_block``
  re-quantizes the weight in place to UE8M0 block scales
  (``requant_weight_ue8m0_inplace``: dequant, s' = 2^ceil(log2(amax/448)),
  q' = e4m3(w/s')): one more e4m3 rounding of every weight element (2^-4
  relative), applied before MLA splits kv_b_proj into its bf16 W_UK/W_UV.
  UE8M0 checkpoints' scales are powers of two already (no re-quantization).
* The routed experts on Hopper with TP take the Triton fused-MoE backend:
  weights as stored (no re-quantization), activations (MoE input and the
  clamped SwiGLU output) per-token-group quantized the same way.
* Not FP8 in production: eh_proj, the router, linear_gate (kept bf16 by the
  synthetic checkpoints), the indexer weights_proj and wk (an FP8 wk is
  dequantized to bf16 at load; the reference weights already hold that), the
  LM head, and the absorbed-MLA bmm (bf16 W_UK/W_UV).

``Fp8Numerics`` is ``reference.PRODUCTION`` plus that activation quantization
in ``linear`` for the weights vLLM holds in FP8 (recognised by storage);
``emulate`` runs the reference's proposer loop with it, shapes the result
like a production trace and judges it with ``judging.trace_judge.judge`` against the
EXACT reference, which gives the max errors the FP8 tolerances start from.

    python -m harness fp8-emulation [--case ID ...] [--variant ...]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from harness.exitcodes import OneLineParser

import reference as R
from harness.production.judging.fp8_numerics import VARIANTS, Fp8Numerics, case_inputs_cached, production_weights

def as_production_trace(cfg: R.MTPConfig, trace: dict, steps: int) -> dict:
    """A reference trace shaped like what production's hooks capture.

    ``attn.topk`` = the indexer's rows each sparse step, the q scale folded into
    ``indexer.weights`` with the raw ``indexer.kw`` (k ; unscaled head weights) in
    bf16, and no ``indexer.scores`` / ``moe.routed`` (vLLM never materialises them).
    """
    fake = dict(trace)
    c0 = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
    for k in range(steps):
        if f"step{k}.indexer.topk" in fake:
            fake[f"step{k}.attn.topk"] = fake[f"step{k}.indexer.topk"]
        qs = fake.pop(f"step{k}.indexer.q_scale", None)
        if qs is not None:
            raw = (fake[f"step{k}.indexer.weights"] / (qs * c0)).to(torch.bfloat16)
            fake[f"step{k}.indexer.kw"] = torch.cat([fake[f"step{k}.indexer.k"].to(torch.bfloat16), raw], -1)
        for drop in ("indexer.scores", "moe.routed"):
            fake.pop(f"step{k}.{drop}", None)
    return fake


def emulated_production_trace(case, variant: str = "deepgemm-e8m0") -> dict:
    """The reference run with FP8 production numerics, shaped as a production trace."""
    hf, _, weights = case_inputs_cached(case)
    cfg = R.MTPConfig.from_hf_dict(hf)
    act_pow2, _ = VARIANTS[variant]
    pw, storages = production_weights(case, weights, variant)
    num = Fp8Numerics("production-fp8", torch.bfloat16, torch.float32, storages, act_pow2)
    first = R.make_case(cfg, case.seed, case.requests, case.tokens)
    res = R.draft(cfg, pw, first, case.steps, num=num)
    return as_production_trace(cfg, R.flatten(res), case.steps)


def emulate(case, variant: str = "deepgemm-e8m0", tolerances: dict | None = None) -> dict:
    """``judge.judge`` of the emulated FP8 production trace (rows carry the max errors)."""
    from harness.production.judging.trace_judge import judge
    return judge(case, emulated_production_trace(case, variant), {}, tolerances=tolerances)


def needed_atol(result) -> dict:
    """Per component: max |d| vs EXACT, and the atol that rtol (as set) would need."""
    out = {}
    ref, prod = result.reference, result.trace
    for row in result.rows:
        comp = row["key"].split(".", 1)[1]
        cur = out.setdefault(comp, {"max_abs": 0.0, "atol_needed": 0.0, "passed": True})
        cur["passed"] &= bool(row["passed"])
        if row["max_abs_vs_exact"] is not None:
            cur["max_abs"] = max(cur["max_abs"], row["max_abs_vs_exact"])
        key = row["key"]
        if comp in ("draft_token", "moe.topk_ids", "indexer.topk", "attn.topk"):
            pass  # ids: compared as sets / exactly, no atol
        elif row["rtol"] is not None and key in ref and key in result.trace_compared:
            a, e = result.trace_compared[key].double(), ref[key].double()
            if a.shape == e.shape and a.is_floating_point():
                fin = torch.isfinite(a) & torch.isfinite(e)
                if fin.any():
                    need = ((a - e).abs() - row["rtol"] * e.abs())[fin].max()
                    cur["atol_needed"] = max(cur["atol_needed"], float(need))
        if comp in ("indexer.topk", "attn.topk"):
            cur["tie_margin"] = max(cur.get("tie_margin", 0.0), _tie_margin(result, key))
    del prod
    return out


def _tie_margin(result, key: str) -> float:
    """Largest |score - k-th score| (fraction of the row max) of a member the two top-k sets do not share."""
    step = key.split(".", 1)[0]
    a, e = result.trace_compared.get(key), result.reference.get(key)
    sc = result.reference.get(f"{step}.indexer.scores")
    if a is None or e is None or sc is None or a.shape != e.shape:
        return 0.0
    worst = 0.0
    for r in range(e.shape[0]):
        sa = {int(i) for i in a[r].tolist() if i >= 0}
        se = {int(i) for i in e[r].tolist() if i >= 0}
        sym = sa ^ se
        if not sym:
            continue
        row = sc[r].double()
        kth = min(float(row[i]) for i in se) if se else 0.0
        worst = max(worst, max(abs(float(row[i]) - kth) for i in sym if 0 <= i < row.numel()))
    return worst


def sweep(case_ids, variants, extra_seeds: int = 0, log=print) -> dict:
    """Per quant and component, the max over cases, extra seeds and variants of
    (max |d|, atol needed at the table's rtol, top-k tie margin)."""
    from harness import case_registry
    gpu_cases = case_registry.specs(kind="module", without="probe")
    agg: dict = {}
    for cid in case_ids:
        base = gpu_cases[cid]
        cases = [base] + [dataclasses.replace(base, id=f"{cid}-seed{s}", seed=s)
                          for s in range(30, 30 + extra_seeds)]
        for case in cases:
            for variant in variants:
                res = emulate(case, variant)
                log(f"{case.id} [{variant}] judge {'PASS' if res.passed else 'FAIL'} "
                    f"(first divergent {res.first_divergent})")
                for comp, v in needed_atol(res).items():
                    a = agg.setdefault(base.quant, {}).setdefault(comp, {"max_abs": 0.0, "atol_needed": 0.0,
                                                                           "tie_margin": 0.0})
                    a["max_abs"] = max(a["max_abs"], v["max_abs"])
                    a["atol_needed"] = max(a["atol_needed"], v["atol_needed"])
                    a["tie_margin"] = max(a["tie_margin"], v.get("tie_margin", 0.0))
    return agg


def check_case_args(ap, args, gpu_cases) -> None:
    """The emulation tools' --case and --extra-seeds: bad input, one line and exit 2 (``ap.error``),
    before any case runs."""
    unknown = [c for c in (args.case or []) if c not in gpu_cases]
    if unknown:
        ap.error(f"--case: unknown case(s) {', '.join(unknown[:5])}; known: {', '.join(gpu_cases)}")
    if args.extra_seeds < 0:
        ap.error(f"--extra-seeds {args.extra_seeds}: must be 0 or more")


def main(argv=None) -> int:
    from harness import case_registry
    gpu_cases = case_registry.specs(kind="module", without="probe")
    ap = OneLineParser(prog="python -m harness fp8-emulation", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", help="case id (default: every FP8 case)")
    ap.add_argument("--variant", action="append", choices=list(VARIANTS), help="default: all")
    ap.add_argument("--extra-seeds", type=int, default=0, help="also run each case with seeds 30, 31, ...")
    ap.add_argument("--json", help="write the per-quant, per-component numbers here")
    args = ap.parse_args(argv)
    check_case_args(ap, args, gpu_cases)
    if args.json is not None:
        from harness import input_checks as check
        from harness.exitcodes import CLIError

        try:
            check.output_file("--json", args.json)
        except CLIError as exc:
            ap.error(str(exc))
    # the block-FP8 cases this emulation models (not compressed-tensors channel scales, not reloads)
    ids = args.case or [c.id for c in gpu_cases.values() if c.quant != "bf16" and c.reload_seed is None
                        and not c.quant.startswith("compressed-tensors")]
    agg = sweep(ids, args.variant or list(VARIANTS), args.extra_seeds)
    for quant, comps in agg.items():
        print(f"== {quant}: max over cases/seeds/variants (2x = the starting atol)")
        for comp, v in comps.items():
            print(f"  {comp:24s} max|d| {v['max_abs']:.3e}  atol needed at rtol {v['atol_needed']:.3e}"
                  f"  tie margin {v['tie_margin']:.3e}")
    if args.json:
        from harness.atomic import atomic_write_json

        atomic_write_json(args.json, agg)  # its folders made, all or nothing
    return 0

