"""How strongly a case exercises each numeric regime (a regime never exercised hides bugs).

A regime is a property of (config, weights, inputs), measured by running the
float64 reference (``reference.draft``, EXACT) under ``reference.probes``:

  routed_clamp_frac          routed-expert SwiGLU elements (token x chosen expert x unit) where
                             vLLM's clamp binds: gate > L or |up| > L (``silu(min(g, L)) *
                             clamp(u, -L, L)``, fused_moe ``silu_and_mul_with_clamp``); 0 when
                             swiglu_limit is off, None without routed experts
  sink_mass_mean             mean over (query, head) of exp(sink) / (sum_j exp(logit_j) + exp(sink))
  topk_selecting_rows_frac   indexer rows whose context (position + 1) exceeds index_topk, i.e.
                             the top-k actually drops keys
  routing_near_tie_rows      rows whose k-th and (k+1)-th expert choice scores (sigmoid + bias)
                             lie within ROUTING_TIE_MARGIN: the rows a small routing bug flips
  indexer_ue8m0_rounded_frac indexer q / k FP8 groups whose UE8M0 scale 2^ceil(log2(amax/448))
                             differs from the fp32 scale amax/448
  weight_ue8m0_rounded_frac  (FP8 checkpoints only) 128x128 blocks of the FP8 weights whose
                             fp32 scale is not a power of two: UE8M0 re-quantization moves them
  index_share_steps          draft steps that reuse step 0's compacted top-k rows
  draft_steps                K
  headwise_gate_rows /       query rows through a headwise / elementwise output gate
  elementwise_gate_rows
  kv_fp8_scale_spread_frac   cached latent rows whose 4 fp8_ds_mla tile scales (powers of two,
                             reference.kv_cache.tile_scales) are not all equal: where they are,
                             a reader taking another tile's scale, or one per row, reads right

``measure(case)`` runs the reference on CPU (tiny cases: well under a second);
``harness.production.judging.trace_judge`` measures the same numbers from its free-running
reference run, so every side-by-side / bisect report carries them.
``uncovered(measured)`` names the regimes no case of a set exercises above
its threshold (tests/cpu/test_regimes.py holds the default bisect set to it).
"""

from __future__ import annotations

import dataclasses

import torch

import reference as R
from reference import kv_cache, probes
from reference.fp8 import E4M3_MAX, ue8m0_round_up
from reference.indexer import QUANT_GROUP
from reference.moe import clamp_limit


@dataclasses.dataclass(frozen=True)
class Regime:
    threshold: float | None  # a case set covers the regime when some case reaches it; None: reported only
    why: str


# Production noise on the router logits (tolerances.GPU_VS_REFERENCE["moe.router_logits"].atol,
# 4e-2) moves a choice score by at most 0.25 * 4e-2 (sigmoid' <= 1/4) on each of the two experts:
# a margin below 2 * 0.25 * 4e-2 = 2e-2 can swap them. The judge masks such rows as ties.
ROUTING_TIE_MARGIN = 2 * 0.25 * 4e-2

REGIMES: dict[str, Regime] = {
    "routed_clamp_frac": Regime(0.05, "a clamp-off bug passes where no activation reaches "
                                "swiglu_limit; at >= 5 % clamped elements (L = 1.5 in tiny) removing the "
                                "clamp moves mlp.out by > 10x its tolerance (measured on CPU)"),
    "routed_clamp_gate_frac": Regime(None, "the gate clamp (upper side only) alone"),
    "routed_clamp_up_frac": Regime(None, "the up clamp (both sides) alone"),
    "sink_mass_mean": Regime(0.05, "dropping the sink scales a head's core by 1/(1 - p): with p >= 5 % "
                             "on average the change exceeds attn.core's rtol 3e-2 on many rows"),
    "sink_mass_max": Regime(None, "largest sink share of one (query, head)"),
    "topk_selecting_rows_frac": Regime(0.05, "rows with context <= index_topk keep every key, so a "
                                       "top-k selection bug (order, off-by-one, wrong keys) only shows on "
                                       "the others; >= 5 % of the indexer rows"),
    "topk_selecting_rows": Regime(None, "count of those rows"),
    "routing_near_tie_rows": Regime(1, "at least one row where a small routing error (bias in bf16, "
                                    "sigmoid vs softmax) flips an expert, exercising the tie masking"),
    "routing_near_tie_frac": Regime(None, "share of routed rows that are near-ties (masked when swapped)"),
    "indexer_ue8m0_rounded_frac": Regime(0.5, "a kernel that used amax/448 instead of the UE8M0 scale on "
                                         "one side (q folded into the weights, k in the cache) only "
                                         "differs where the power-of-two rounding moved the scale"),
    "indexer_ue8m0_scale_ratio_mean": Regime(None, "mean UE8M0 / fp32 scale (1 = no rounding, < 2)"),
    "weight_ue8m0_rounded_frac": Regime(0.5, "FP8 checkpoints only: a loader or GEMM that kept the "
                                        "fp32 block scale where vLLM re-quantizes to UE8M0 (or the "
                                        "reverse) only differs in blocks whose scale is not a power "
                                        "of two; >= half of the FP8 weight blocks"),
    "index_share_steps": Regime(1, "index_share_for_mtp_iteration: compaction + skip_topk only run "
                                "at steps >= 1 of a sharing case"),
    "draft_steps": Regime(2, "multi-step: steps >= 1 feed the previous step's token and hidden state"),
    "headwise_gate_rows": Regime(1, "the headwise gate broadcasts one value per head (repeat_interleave)"),
    "elementwise_gate_rows": Regime(1, "the elementwise gate multiplies each core element"),
    "kv_fp8_scale_spread_frac": Regime(None, "an FP8 KV cache's tile-scale bugs (kv-fp8-scale-wrong-tile, "
                                       "kv-fp8-scale-per-row) are visible only in rows whose tiles have different "
                                       "scales; reported for every case, it matters for those served with fp8"),
}


def _frac(mask: torch.Tensor) -> float:
    return float(mask.double().mean()) if mask.numel() else 0.0


def _ue8m0_rounded(x: torch.Tensor, group: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token group of x [..., D]: (UE8M0 scale != amax/448, UE8M0 / fp32 scale)."""
    g = x.double().reshape(-1, x.shape[-1] // group, group)
    fp32 = g.abs().amax(-1).clamp_min(eps) / E4M3_MAX
    ue = ue8m0_round_up(fp32)
    return ue != fp32, ue / fp32


def _weight_ue8m0_rounded(cfg: R.MTPConfig, weights: dict, hf: dict) -> float | None:
    """Share of the FP8 weights' 128x128 blocks whose fp32 scale amax/448 is not a power of two."""
    from harness.checkpoint.quant import mtp_fp8_plan

    plan = mtp_fp8_plan(hf, cfg)
    if plan is None:
        return None
    changed = total = 0
    for name, w in weights.items():
        parts = name.split(".", 2)
        if parts[0] != "layers" or not plan.is_quantized(int(parts[1]), parts[2]):
            continue
        *lead, n, k = w.shape
        nb, kb = -(-n // 128), -(-k // 128)
        pad = torch.zeros(*lead, nb * 128, kb * 128, dtype=torch.float64)
        pad[..., :n, :k] = w.double()
        amax = pad.reshape(*lead, nb, 128, kb, 128).abs().amax(dim=(-3, -1))
        fp32 = amax[amax > 0] / E4M3_MAX
        changed += int((ue8m0_round_up(fp32) != fp32).sum())
        total += fp32.numel()
    return changed / total if total else None


def from_run(cfg: R.MTPConfig, weights: dict, flat: dict, rec: dict, steps: int,
             hf: dict | None = None) -> dict:
    """Regime values of one reference run: ``flat`` = ``R.flatten(draft(...))`` (the steps that ran),
    ``rec`` = its ``probes.recording()``."""
    out: dict = {k: None for k in REGIMES}
    ran = sorted({int(k.split(".", 1)[0][4:]) for k in flat if k.startswith("step") and k.endswith(".final_norm")})
    out["draft_steps"] = steps
    out["steps_measured"] = len(ran)
    # routed-expert clamp
    limit = clamp_limit(cfg)
    if cfg.mlp_moe:
        gu = rec.get("moe.routed.gate_up", [])
        if gu and limit is not None:
            g = torch.cat([t[0].reshape(-1) for t in gu])
            u = torch.cat([t[1].reshape(-1) for t in gu])
            out["routed_clamp_gate_frac"] = _frac(g > limit)
            out["routed_clamp_up_frac"] = _frac(u.abs() > limit)
            out["routed_clamp_frac"] = _frac((g > limit) | (u.abs() > limit))
        else:
            out["routed_clamp_frac"] = out["routed_clamp_gate_frac"] = out["routed_clamp_up_frac"] = 0.0
    # sink
    shares = rec.get("attn.sink_share", [])
    if cfg.learnable_sink and shares:
        s = torch.cat([t.reshape(-1) for t in shares])
        out["sink_mass_mean"], out["sink_mass_max"] = float(s.mean()), float(s.max())
    # sparse top-k
    if cfg.attention_sparse:
        rows = sel = 0
        for k in ran:
            if f"step{k}.indexer.topk" in flat:
                pos = flat[f"step{k}.positions"].long()
                rows += pos.numel()
                sel += int((pos + 1 > cfg.index_topk).sum())
        out["topk_selecting_rows"] = sel
        out["topk_selecting_rows_frac"] = sel / rows if rows else 0.0
        out["index_share_steps"] = sum(1 for k in ran if k >= 1 and cfg.index_share_for_mtp_iteration)
        qs, ks = rec.get("indexer.q_prequant", []), rec.get("indexer.k_prequant", [])
        if qs:
            rq, ratio_q = _ue8m0_rounded(torch.cat([q.reshape(-1, q.shape[-1]) for q in qs]), QUANT_GROUP, 1e-10)
            rk, ratio_k = _ue8m0_rounded(torch.cat(ks), QUANT_GROUP, 1e-4)  # the k cache clamps amax at 1e-4
            out["indexer_ue8m0_rounded_frac"] = _frac(torch.cat([rq.flatten(), rk.flatten()]))
            out["indexer_ue8m0_scale_ratio_mean"] = float(torch.cat([ratio_q.flatten(), ratio_k.flatten()]).mean())
    else:
        out["index_share_steps"] = 0
    # routing near-ties
    bias = weights.get("layers.0.mlp.expert_bias")
    if cfg.mlp_moe and bias is not None:
        ties = total = 0
        kk = cfg.num_experts_per_tok
        for k in ran:
            logits = flat.get(f"step{k}.moe.router_logits")
            if logits is None or kk >= logits.shape[-1]:
                continue
            choice = torch.sigmoid(logits.double()) + bias.double()
            top = torch.topk(choice, kk + 1, dim=-1).values
            ties += int((top[:, kk - 1] - top[:, kk] <= ROUTING_TIE_MARGIN).sum())
            total += top.shape[0]
        out["routing_near_tie_rows"] = ties
        out["routing_near_tie_frac"] = ties / total if total else 0.0
    # output gate
    gated = sum(flat[f"step{k}.positions"].numel() for k in ran) if cfg.gated_mla else 0
    out["headwise_gate_rows"] = gated if cfg.gating_type == "headwise" else 0
    out["elementwise_gate_rows"] = gated if cfg.gating_type == "elementwise" else 0
    if hf is not None:
        out["weight_ue8m0_rounded_frac"] = _weight_ue8m0_rounded(cfg, weights, hf)
    # FP8 KV cache tile scales (the fp8_ds_mla layout holds a 512-value latent only)
    latents = [flat[f"step{k}.attn.kv_c"] for k in ran if f"step{k}.attn.kv_c" in flat]
    if latents and cfg.kv_lora_rank == kv_cache.NOPE:
        sc = kv_cache.tile_scales(torch.cat(latents).to(torch.bfloat16))
        out["kv_fp8_scale_spread_frac"] = _frac((sc != sc[:, :1]).any(-1))
    return out


def measure_draft(cfg: R.MTPConfig, weights: dict, first: R.StepInput, steps: int, hf: dict | None = None,
                  kv_cache_dtype: str = "auto"):
    """(``reference.draft`` result or the exception it raised, regime values). ``kv_cache_dtype``:
    the draft KV's storage (``reference.kv_cache``), as the case serves it.

    A draft that raises (``UnwrittenKVError``: the reference cycles MTP layers) is measured
    over the steps that completed (``steps_measured``).
    """
    res = None
    with probes.recording() as rec:
        try:
            res = outcome = R.draft(cfg, weights, first, steps, num=R.EXACT, kv_cache_dtype=kv_cache_dtype)
        except R.UnwrittenKVError as exc:
            outcome = exc
    if res is None:
        with probes.recording() as rec:
            res = _partial(cfg, weights, first, steps, kv_cache_dtype)
    flat = R.flatten(res) if res is not None else {}
    try:
        values = from_run(cfg, weights, flat, rec, steps, hf)
    except Exception as exc:  # noqa: BLE001 - the regime numbers inform a report, they must not cost its verdict
        values = {"error": f"{exc.__class__.__name__}: {exc}"}
    return outcome, values


def _partial(cfg, weights, first, steps, kv_cache_dtype: str = "auto"):
    """The longest draft shorter than ``steps`` that runs (None when not even one step does)."""
    for n in range(steps - 1, 0, -1):
        try:
            return R.draft(cfg, weights, first, n, num=R.EXACT, kv_cache_dtype=kv_cache_dtype)
        except R.UnwrittenKVError:
            continue
    return None


def measure(case) -> dict:
    """Regime values of a ``side_by_side.GpuCase`` (CPU, float64 reference)."""
    from harness.production.case_inputs import case_inputs

    hf, _, weights = case_inputs(case)
    cfg = R.MTPConfig.from_hf_dict(hf)
    first = R.make_case(cfg, case.seed, case.requests, case.tokens)
    return measure_draft(cfg, weights, first, case.steps, hf, kv_cache_dtype=getattr(case, "kv_cache_dtype", "auto"))[1]


def coverage(measured: dict[str, dict]) -> dict[str, dict]:
    """Per thresholded regime: the case that exercises it most, its value, and whether it reaches the threshold."""
    out = {}
    for name, regime in REGIMES.items():
        if regime.threshold is None:
            continue
        vals = [(v.get(name), cid) for cid, v in measured.items() if v.get(name) is not None]
        best = max(vals, default=(None, None))
        out[name] = {"case": best[1], "value": best[0], "threshold": regime.threshold,
                     "ok": best[0] is not None and best[0] >= regime.threshold}
    return out


def uncovered(measured: dict[str, dict]) -> list[str]:
    """The thresholded regimes that no case of ``measured`` exercises enough."""
    return [name for name, c in coverage(measured).items() if not c["ok"]]


def format_table(measured: dict[str, dict]) -> str:
    """Regime x case table (thresholded regimes marked with their threshold)."""
    ids = list(measured)
    width = max([len(c) for c in ids] + [10])
    lines = [f"{'regime':32s} {'min':>6s} " + " ".join(f"{c:>{width}s}" for c in ids)]
    for name, regime in REGIMES.items():
        cells = []
        for cid in ids:
            v = measured[cid].get(name)
            cells.append(f"{'-' if v is None else (f'{v:.3g}' if isinstance(v, float) else str(v)):>{width}s}")
        thr = "" if regime.threshold is None else f"{regime.threshold:g}"
        lines.append(f"{name:32s} {thr:>6s} " + " ".join(cells))
    return "\n".join(lines)
