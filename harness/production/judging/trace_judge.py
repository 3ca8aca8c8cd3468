"""The side-by-side verdict: a production trace of a case against the reference replayed on its
inputs, in named steps (``judge``). CPU, no vLLM.

May import: ``reference``, ``harness`` (``components``, ``compare``, ``regimes``, ``verdict``),
``harness.production.case_inputs``, ``harness.production.can_run`` and the rest of ``harness.production.judging``.
"""

from __future__ import annotations

import dataclasses
import time

import torch

import reference as R
from harness.trace_compare import finite_everywhere
from harness.components import PRODUCTION_COMPONENTS
from harness.production.case_inputs import case_inputs, CaseInputs
from harness.case_specs import GpuCase
from harness.verdict import Verdict


def _sort_routing(trace: dict) -> dict:
    """Expert ids ascending per row (weights permuted alike): routing compares as a set."""
    out = dict(trace)
    for key in [k for k in trace if k.endswith("moe.topk_ids")]:
        wkey = key.replace("topk_ids", "topk_weights")
        ids = trace[key].long()
        order = torch.argsort(ids, dim=-1)
        out[key] = torch.gather(ids, -1, order)
        if wkey in trace:
            out[wkey] = torch.gather(trace[wkey].double(), -1, order)
    return out


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float | None:
    if a.shape != b.shape:
        return None
    a, b = a.double(), b.double()
    if a.numel() and finite_everywhere(a) and finite_everywhere(b):  # the usual case: no mask to build
        return float((a - b).abs().max())
    fin = torch.isfinite(a) & torch.isfinite(b)
    if not fin.any():
        return 0.0
    return float((a - b).abs()[fin].max())


def derive_indexer(trace: dict, cfg: R.MTPConfig, production: bool) -> None:
    """Add ``indexer.q_scale`` (production: recovered from the folded weights) and
    ``indexer.q_deq`` = q_fp8 * q_scale, which is invariant to a UE8M0 scale flip."""
    c = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
    for key in [k for k in trace if k.endswith(".indexer.q_fp8")]:
        step = key.split(".", 1)[0]
        q8 = trace[key].float().double()
        if production:
            kw = trace.get(f"{step}.indexer.kw")
            folded = trace.get(f"{step}.indexer.weights")
            if kw is None or folded is None:
                continue
            raw = kw[:, cfg.index_head_dim:].double()
            ratio = folded.double() / (raw * c)
            scale = torch.where(raw != 0, torch.exp2(torch.round(torch.log2(ratio.abs()))), torch.nan)
            trace[f"{step}.indexer.q_scale"] = scale
        scale = trace.get(f"{step}.indexer.q_scale")
        if scale is not None:
            trace[f"{step}.indexer.q_deq"] = q8 * scale.double()[..., None]
            folded = trace.get(f"{step}.indexer.weights")
            if folded is not None:
                trace[f"{step}.indexer.head_weights"] = folded.double() / scale.double()


def _normalise_scores(ref: dict) -> None:
    """Indexer scores / the row's largest |score|: tie bounds become relative."""
    for key in [k for k in ref if k.endswith(".indexer.scores")]:
        s = ref[key].double()
        fin = torch.where(torch.isfinite(s), s.abs(), torch.zeros_like(s))
        ref[key] = s / fin.amax(dim=-1, keepdim=True).clamp_min(1e-30)


def _routing_ties(prod: dict, ref: dict, weights: dict, steps: int, sampled_rows: list) -> dict:
    """Rows whose expert set differs only at a near-tie of the reference's choice scores.

    A swap (expert a chosen by production, e by the reference) is a tie when
    choice_ref[e] - choice_ref[a] <= 2 * 0.25 * max|dlogit| (sigmoid' <= 1/4):
    the router-logit noise alone can reorder them. Those rows' routed outputs
    are not judgeable against the spec, so they are masked (NaN on both sides)
    in moe.topk_weights, mlp.out, final_norm and, when sampled, logits.
    Returns {step: [(row, margin, allowed)]} for ties, and raises nothing.
    """
    ties: dict = {}
    bias = weights.get("layers.0.mlp.expert_bias")
    for k in range(steps):
        ik, lk = f"step{k}.moe.topk_ids", f"step{k}.moe.router_logits"
        if ik not in prod or ik not in ref or lk not in prod or lk not in ref or bias is None:
            continue
        ip, ir = prod[ik].long(), ref[ik].long()
        lp, lr = prod[lk].double(), ref[lk].double()
        choice = torch.sigmoid(lr) + bias.double()
        rows = []
        for r in range(ir.shape[0]):
            a_only = set(ip[r].tolist()) - set(ir[r].tolist())
            e_only = set(ir[r].tolist()) - set(ip[r].tolist())
            if not a_only:
                continue
            margin = max(float(choice[r, e] - choice[r, a]) for e in e_only for a in a_only)
            allowed = 0.5 * float((lp[r] - lr[r]).abs().max()) + 1e-7
            if margin <= allowed:
                rows.append((r, margin, allowed))
        if not rows:
            continue
        ties[k] = rows
        idx = torch.tensor([r for r, _, _ in rows])
        prod[ik] = prod[ik].clone()
        prod[ik][idx] = ref[ik][idx].to(prod[ik].dtype)
        for comp in ("moe.topk_weights", "mlp.out", "final_norm"):
            key = f"step{k}.{comp}"
            for side in (prod, ref):
                if key in side:
                    side[key] = side[key].double().clone()
                    side[key][idx] = torch.nan
        srows = sampled_rows[k]
        hit = [i for i, r in enumerate(srows) if r in set(idx.tolist())]
        if hit:
            h = torch.tensor(hit)
            for side in (prod, ref):
                key = f"step{k}.logits"
                if key in side:
                    side[key] = side[key].double().clone()
                    side[key][h] = torch.nan
            prod[f"step{k}.draft_token"] = prod[f"step{k}.draft_token"].clone()
            prod[f"step{k}.draft_token"][h] = ref[f"step{k}.draft_token"][h]
    return ties


def _router_self_check(prod: dict, weights: dict, cfg: R.MTPConfig, steps: int) -> list:
    """Production's expert ids vs top-k of its own sigmoid(logits) + bias: [(step, bad rows)]."""
    bias = weights.get("layers.0.mlp.expert_bias")
    out = []
    for k in range(steps):
        ik, lk = f"step{k}.moe.topk_ids", f"step{k}.moe.router_logits"
        if ik not in prod or lk not in prod or bias is None:
            continue
        choice = torch.sigmoid(prod[lk].double()) + bias.double()
        own = torch.topk(choice, cfg.num_experts_per_tok, dim=-1).indices
        bad = sum(set(own[r].tolist()) != set(prod[ik][r].long().tolist()) for r in range(own.shape[0]))
        out.append((k, int(bad), int(own.shape[0])))
    return out


@dataclasses.dataclass
class ReferenceRuns:
    """The reference's runs for one production trace (``replay_reference``)."""

    ref: dict  # EXACT, replayed on production's per-step inputs (teacher forcing, forced top-k)
    ref_p: dict  # PRODUCTION numerics (bf16 storage; FP8: activation quantization), replayed alike
    free_tokens: list | str  # the free-running reference's draft tokens (or why it cannot run)
    regimes: dict  # harness.regimes values of the free-running run
    device: str  # where the replays ran
    weights_on_device: dict
    seconds: float


def replay_reference(case: GpuCase, hf: dict, cfg: R.MTPConfig, weights: dict, prod: dict, first) -> ReferenceRuns:
    """Step 1: the reference replayed on production's inputs (EXACT and PRODUCTION numerics) and
    run free (CPU, instrumented: how strongly this case exercises each regime)."""
    from harness import regimes
    from harness.production.judging.fp8_numerics import production_numerics
    from harness.production.judging.teacher_forcing import replay
    from harness.production.can_run import reference_device

    t1 = time.perf_counter()
    dev = reference_device()
    # weights moved once for the replays (.to on a moved tensor is a no-op)
    wdev = weights if dev == "cpu" else {k: v.to(dev) for k, v in weights.items()}
    kv = case.kv_cache_dtype
    ref = replay(cfg, wdev, prod, first, case.steps, R.EXACT, device=dev, kv_cache_dtype=kv)
    # production numerics: bf16 storage, twice-rounded RMSNorm, bf16 RoPE tables and, for FP8
    # cases, the activation quantization of the FP8 GEMMs (fp8_numerics.production_numerics)
    # (the FP8 emulation's numerics are CPU-tested only: FP8 cases replay them on the CPU, from
    # weights re-quantized from the CPU ones; bf16 cases replay the weights already moved)
    on_dev = case.quant == "bf16"
    prod_weights, prod_num = production_numerics(case, wdev if on_dev else weights)
    ref_p = replay(cfg, prod_weights, prod, first, case.steps, prod_num, device=dev if on_dev else "cpu",
                   kv_cache_dtype=kv)
    free, regime_values = regimes.measure_draft(cfg, weights, first, case.steps, hf, kv_cache_dtype=kv)
    if isinstance(free, R.UnwrittenKVError):  # reference cycles MTP layers: layer k>0 has no KV context
        free_tokens = f"reference.draft cannot run: {free}"
    else:
        free_tokens = free.tokens.tolist()
    return ReferenceRuns(ref, ref_p, free_tokens, regime_values, dev, wdev, time.perf_counter() - t1)


def skip_unused_topk(info: dict, sides: tuple[dict, ...]) -> list[str]:
    """Step 2: a dense MLA prefill (no sink, short context) leaves the top-k buffer unused: drop
    those steps' top-k rows from every side; returns the keys dropped."""
    skipped = []
    for n in info.get("step_notes", []):
        if any(d.get("prefill.use_dense_mha") and d.get("num_decode_tokens", 1) == 0
               for d in n["metadata"].values()):
            for key in (f"step{n['step']}.indexer.topk", f"step{n['step']}.attn.topk"):
                for side in sides:
                    side.pop(key, None)
                skipped.append(key)
    return skipped


def comparable(prod: dict, ref: dict, ref_p: dict, cfg: R.MTPConfig) -> tuple[dict, dict, dict]:
    """Step 3: the three traces in the form they are compared in: the derived indexer components
    (q_scale, q_deq, head_weights), index scores relative to the row maximum (tie bounds), expert
    ids sorted per row. Returns (production, reference, production-numerics reference)."""
    prod_cmp = dict(prod)
    for side, is_prod in ((prod_cmp, True), (ref, False), (ref_p, False)):
        derive_indexer(side, cfg, is_prod)
    for key in [k for k in prod_cmp if k.endswith((".indexer.q_scale", ".indexer.q_deq", ".indexer.head_weights"))]:
        if key in ref and prod_cmp[key].shape == ref[key].shape:  # raw weight exactly 0: scale unknown
            nan = torch.isnan(prod_cmp[key])
            prod_cmp[key] = torch.where(nan, ref[key].double(), prod_cmp[key].double())
    _normalise_scores(ref)
    return _sort_routing(prod_cmp), _sort_routing(ref), _sort_routing(ref_p)


def derive_kv_cache(case: GpuCase, prod_cmp: dict, ref: dict, ref_p: dict) -> list[str]:
    """Step 3b (FP8 KV cache): ``attn.kv_cache`` on every side, from the rows production's cache
    holds after each step (``attn.kv_cache_rows``, captured by the runner): production's side is
    those rows read back as the kernels read them (``reference.kv_cache.read_rows``), the
    reference's is its own writer applied to production's captured ``attn.kv_c`` / ``attn.k_pe``
    (the cache writer replayed on production's inputs, so the comparison is exact). A case with
    an FP8 cache whose rows were not captured is judged as missing them. Returns the keys made."""
    from reference import kv_cache

    if kv_cache.canonical(case.kv_cache_dtype) != "fp8_ds_mla":
        return []
    made = []
    for k in range(case.steps):
        rows = prod_cmp.pop(f"step{k}.attn.kv_cache_rows", None)
        kv_c, k_pe = prod_cmp.get(f"step{k}.attn.kv_c"), prod_cmp.get(f"step{k}.attn.k_pe")
        key = f"step{k}.attn.kv_cache"
        if kv_c is not None and k_pe is not None:
            expected = kv_cache.read_rows(kv_cache.pack_rows(kv_c.to(torch.bfloat16), k_pe.reshape(k_pe.shape[0], -1)))
        else:  # nothing to write the reference's rows from: an empty expectation, never a skipped check
            expected = torch.empty(0, kv_cache.NOPE + kv_cache.ROPE, dtype=torch.float64)
        ref[key] = ref_p[key] = expected
        if rows is not None:
            prod_cmp[key] = kv_cache.read_rows(rows)
        made.append(key)
    return made


def mask_routing_ties(prod_cmp: dict, ref: dict, weights: dict, case: GpuCase, first) -> dict:
    """Step 4: rows whose expert set differs only at a routing near-tie, masked on both sides
    (``_routing_ties``); the logits rows sampled at each step are the requests' last rows at
    step 0, one per request after."""
    last = first.last_rows().tolist()
    sampled = [last] + [list(range(len(last)))] * (case.steps - 1)
    return _routing_ties(prod_cmp, ref, weights, case.steps, sampled)


def report_rows(report, prod_cmp: dict, ref_p: dict) -> list[dict]:
    """Step 5: one row per compared key, with the max |d| against the production-numerics replay."""
    rows = []
    for r in report.results:
        key = r.name
        rows.append({
            "key": key, "passed": r.passed, "note": r.note,
            "max_abs_vs_exact": r.max_abs,
            "max_abs_vs_prodnum": (_max_abs(prod_cmp[key], ref_p[key])
                                   if key in prod_cmp and key in ref_p else None),
            "max_rel": r.max_rel, "sim_gap": r.similarity_gap, "mismatch_pct": r.mismatch_pct,
            "atol": r.tolerance.atol if r.tolerance else None,
            "rtol": r.tolerance.rtol if r.tolerance else None,
        })
    return rows


def layer_policy(cfg: R.MTPConfig, case: GpuCase, prod: dict, ref: dict, runs: ReferenceRuns, first) -> dict | None:
    """Step 6 (several MTP layers): which layer served steps >= 1? Both policies replayed,
    final_norm compared."""
    from harness.production.judging.teacher_forcing import replay

    if not (cfg.num_mtp_layers > 1 and case.steps > 1):
        return None
    policy: dict = {}
    try:
        cyc = replay(cfg, runs.weights_on_device, prod, first, case.steps, R.EXACT, layer_policy="cycle",
                     device=runs.device, kv_cache_dtype=case.kv_cache_dtype)
    except R.UnwrittenKVError as exc:
        cyc = None
        policy["cycle(k mod n)"] = f"reference cannot replay: {exc}"
    for k in range(1, case.steps):
        key = f"step{k}.final_norm"
        policy[key] = {"proposer(layer 0)": _max_abs(prod[key], ref[key]),
                       "cycle(k mod n)": None if cyc is None else _max_abs(prod[key], cyc[key])}
    return policy


def judge(case: GpuCase, prod: dict, info: dict, *, tolerances: dict | None = None,
          inputs: CaseInputs | None = None) -> Verdict:
    """Compare a production trace of ``case`` with the reference replayed on its inputs.

    ``inputs``: the ``CaseInputs`` production ran on (the side-by-side run passes them down);
    without them (a re-judge of saved traces, a TP run's merged trace) they are made from the
    case (``case_inputs``, cached per case). The reference weights are ``inputs.weights`` (FP8:
    the exact dequantized checkpoint); tolerances default to ``tolerances_for(case.quant,
    case.kv_cache_dtype)``, and the reference stores its draft KV as ``case.kv_cache_dtype`` does.
    """
    from harness import trace_compare
    from harness.production.judging.tolerances import tolerances_for

    if inputs is not None:
        hf, weights, cfg, first = inputs.hf_config, inputs.weights, inputs.config, inputs.first
    else:
        hf, _, weights = case_inputs(case)
        cfg = R.MTPConfig.from_hf_dict(hf)
        first = R.make_case(cfg, case.seed, case.requests, case.tokens)
    tols = tolerances if tolerances is not None else tolerances_for(case.quant, case.kv_cache_dtype)
    prod = dict(prod)
    runs = replay_reference(case, hf, cfg, weights, prod, first)
    ref, ref_p = runs.ref, runs.ref_p
    skipped = skip_unused_topk(info, (prod, ref, ref_p))
    prod_cmp, ref, ref_p = comparable(prod, ref, ref_p, cfg)
    derive_kv_cache(case, prod_cmp, ref, ref_p)
    ties = mask_routing_ties(prod_cmp, ref, weights, case, first)
    report = trace_compare.compare_traces(prod_cmp, ref, tols, components=PRODUCTION_COMPONENTS)
    prod_tokens = torch.stack([prod[f"step{k}.draft_token"] for k in range(case.steps)], 1).tolist()
    timing = dict(info.get("timing_s", {}))
    timing["reference"] = runs.seconds
    rows = report_rows(report, prod_cmp, ref_p)
    details = {
        "case": dataclasses.asdict(case), "quant": case.quant, "passed": None, "first_divergent": None,
        "table": report.table(), "rows": None,
        "audit": info.get("audit", []), "attach_notes": info.get("attach_notes", []),
        "step_notes": info.get("step_notes", []),
        "routing_ties": {str(k): v for k, v in ties.items()},
        "router_self_check": _router_self_check(prod, weights, cfg, case.steps),
        "skipped": skipped,
        "layer_policy": layer_policy(cfg, case, prod, ref, runs, first),
        "tokens": {"production": prod_tokens, "reference_free_running": runs.free_tokens,
                   "agree": prod_tokens == runs.free_tokens},
        "timing_s": timing, "reference_device": runs.device, "fp8_kernels": info.get("fp8_kernels"),
        "unquantized_modules": info.get("unquantized_modules"),
        "model_kernel_paths": info.get("model_kernel_paths"), "regimes": None,
        "prod_keys": sorted(prod),
    }
    return Verdict(kind="module", passed=report.passed,
                   first_divergent=report.first_divergent.name if report.first_divergent else None,
                   rows=rows, regimes=runs.regimes,
                   notes=[*info.get("attach_notes", []), *map(str, info.get("step_notes", []))],
                   trace=prod, reference=ref, trace_compared=prod_cmp, comparison=report, details=details)
