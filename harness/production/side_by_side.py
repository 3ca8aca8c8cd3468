"""Reference vs vLLM's production ``HYV4MTP``: run one case both ways and compare.

    python -m harness.production.side_by_side [--case ID ...] [--fp8] [--out DIR] [--save-traces]
    python -m harness.production.side_by_side --rejudge DIR [--out DIR2]   # CPU: re-judge saved traces

``--fp8`` selects the FP8-checkpoint cases (``FP8_CASE_IDS``); tolerances are
``tolerances.tolerances_for(case.quant)``.

The verdict is against the EXACT (float64) reference with ``tolerances_for(quant)``; the table also shows the max abs error against the reference run
with PRODUCTION numerics (bf16 storage, fp32 accumulation), which isolates
kernel/ordering noise from the spec.
Exit codes: 0 all cases pass, 1 a numeric mismatch, 125 cannot judge (no GPU/vLLM).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

import torch

from harness.atomic import atomic_write_json

import reference as R
from harness.checkpoint.names import to_checkpoint
from harness.presets import preset

# Components production exposes through hooks (see capture.py). The reference
# also has indexer.q_scale / indexer.scores / moe.routed, which vLLM never
# materialises (q scale folded into the weights, logits consumed by the top-k
# kernel, routed experts summed with the shared ones inside FusedMoE).
PRODUCTION_COMPONENTS = (
    "embed", "embed_masked", "enorm", "hnorm", "eh_proj", "attn.q_c", "attn.kv_c", "attn.q",
    "attn.k_pe", "indexer.q_scale", "indexer.q_deq", "indexer.k", "indexer.head_weights", "indexer.topk",
    "attn.topk", "attn.core", "attn.gate", "attn.out", "attn.residual", "moe.router_logits",
    "moe.topk_ids", "moe.topk_weights", "moe.shared", "mlp.out", "final_norm", "logits", "draft_token",
)


@dataclasses.dataclass(frozen=True)
class GpuCase:
    id: str
    preset: str = "tiny"
    overrides: tuple = ()
    seed: int = 0
    requests: int = 2
    tokens: int = 8
    steps: int = 2
    naming: str = "mtp_layers"
    experts: str = "split"
    # checkpoint quantization (harness.checkpoint.quant.QUANTS): "bf16", "fp8"
    # (block FP8, float32 weight_scale_inv) or "fp8-ue8m0" (power-of-two scales)
    quant: str = "bf16"
    # FP8 routed-expert scale names: "weight_scale_inv" (fused: _scale_inv) or
    # "scale" (vLLM renames .scale -> .weight_scale_inv, uint8 bytes -> e8m0)
    expert_scale_suffix: str = "weight_scale_inv"
    # substrings of post-load audit problems that are known production issues:
    # such a case loads non-strictly and the test accepts exactly those problems
    known_audit: tuple = ()
    # a checkpoint directory (``harness.checkpoint.loader``): its config and
    # weights replace preset/overrides; seed/requests/tokens still make the inputs
    ckpt_dir: str | None = None

    def hf_config(self) -> dict:
        """The preset's config with the overrides (no quantization fields: see ``case_inputs``),
        or the checkpoint's ``config.json``."""
        if self.ckpt_dir:
            with open(os.path.join(self.ckpt_dir, "config.json")) as f:
                return json.load(f)
        return preset(self.preset, **dict(self.overrides))


@functools.lru_cache(maxsize=4)
def _case_inputs(case_id: str, case_json: str):
    case = _case_from_dict(json.loads(case_json))
    if case.ckpt_dir:  # a checkpoint on disk: read like any real one (FP8 stays FP8 for vLLM)
        from harness.checkpoint.loader import load_checkpoint
        loaded = load_checkpoint(case.ckpt_dir)
        return loaded.hf_config, loaded.stored_tensors(), loaded.vllm_weights()
    hf = case.hf_config()
    cfg = R.MTPConfig.from_hf_dict(hf)
    weights = R.random_weights(cfg, case.seed)
    if case.quant == "bf16":
        return hf, to_checkpoint(cfg, weights, case.naming, case.experts), weights
    # FP8: write the synthetic checkpoint and read it back like any real one, so
    # production gets the stored tensors (e4m3 + scales) and the reference the
    # exact dequantized weights vLLM holds after loading.
    from harness.checkpoint.loader import load_checkpoint
    from harness.checkpoint.synth import write_synthetic
    tmp = tempfile.mkdtemp(prefix=f"hyv4-{case_id}-")
    try:
        path = write_synthetic(os.path.join(tmp, "ckpt"), hf, weights, naming=case.naming,
                               experts=case.experts, quant=case.quant,
                               expert_scale_suffix=case.expert_scale_suffix)
        loaded = load_checkpoint(path)
        return loaded.hf_config, loaded.stored_tensors(), loaded.vllm_weights()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def case_inputs(case: GpuCase) -> tuple[dict, dict, dict]:
    """(HF config, checkpoint tensors for vLLM's load_weights, reference weights) of ``case``.

    bf16: the preset config, unquantized checkpoint tensors (cast to bf16/fp32
    by the runner) and the seeded canonical weights. FP8: the config with
    ``mtp_quant_algo: FP8`` + ``quantization_config`` (as ``write_synthetic``
    writes it), the tensors as stored (FP8 stays FP8) and
    ``LoadedCheckpoint.vllm_weights()``.
    """
    return _case_inputs(case.id, json.dumps(dataclasses.asdict(case), sort_keys=True))


def _case_from_dict(d: dict) -> GpuCase:
    """Inverse of ``dataclasses.asdict`` (JSON lists back to the tuples the case holds)."""
    d = dict(d)
    d["overrides"] = tuple((k, v) for k, v in d.get("overrides", ()))
    d["known_audit"] = tuple(d.get("known_audit", ()))
    return GpuCase(**d)


# Kept small enough for one H200 call; R <= 3 so no length-1 request lands
# behind a longer one (vLLM's builders expect decode-like requests first).
GPU_CASES: dict[str, GpuCase] = {c.id: c for c in (
    GpuCase("tiny-k1", steps=1, seed=1),
    GpuCase("tiny-k3-ragged", requests=3, tokens=8, steps=3, seed=2),
    GpuCase("tiny-k2-fused-layers", steps=2, seed=3, naming="layers", experts="fused"),
    # The regimes the other default bisect cases leave unexercised (harness/regimes.py): swiglu_limit
    # 10 never binds on the synthetic O(1) activations, 1.5 clamps ~20 % of the routed SwiGLU
    # elements (removing the clamp moves mlp.out by ~15x its tolerance, CPU-measured); headwise gate;
    # fused experts and layers naming (what tiny-k2-fused-layers brought to the bisect set).
    GpuCase("tiny-k2-clamp-headwise", overrides=(("swiglu_limit", 1.5), ("gating_type", "headwise")), steps=2,
            seed=22, naming="layers", experts="fused"),
    GpuCase("tiny-k2-nosink", overrides=(("learnable_sink", False),), steps=2, seed=4),
    GpuCase("tiny-k3-share", overrides=(("index_share_for_mtp_iteration", True),), requests=3,
            tokens=8, steps=3, seed=5),
    # contexts longer than index_topk (128): the indexer's choice matters
    GpuCase("tiny-k2-long", requests=2, tokens=160, steps=2, seed=6),
    # a request longer than the MLA decode threshold (256): sparse prefill kernel
    GpuCase("tiny-k2-long-prefill", requests=2, tokens=300, steps=2, seed=7),
    GpuCase("tiny-k3-long-share", overrides=(("index_share_for_mtp_iteration", True),), requests=2,
            tokens=160, steps=3, seed=8),
    # index_topk probes: the decode top-k kernels take 512/1024/2048 on the fast
    # paths and fall back to per-row top-k otherwise; FlashMLA reads topk-wide rows
    GpuCase("tiny-k2-topk512", overrides=(("index_topk", 512),), requests=2, tokens=160, steps=2, seed=9),
    GpuCase("tiny-k2-small-preset", preset="small", requests=2, tokens=40, steps=2, seed=11),
    GpuCase("tiny-k2-dense-mlp", overrides=(("mlp_layer_types", ["dense", "dense"]),), steps=2, seed=12),
    GpuCase("tiny-k2-headwise", overrides=(("gating_type", "headwise"),), steps=2, seed=13),
    # positions past original_max_position_embeddings: the YaRN blend and mscale matter
    GpuCase("tiny-k2-yarn", overrides=(("rope_parameters", {
        "rope_type": "deepseek_yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0}),), requests=2, tokens=150, steps=2, seed=14),
    # two MTP layers: the proposers never pass spec_step_idx, so layer 0 serves every step
    # (vLLM requires num_speculative_tokens divisible by n_predict = 2). Known issue:
    # HYV4MTP.load_weights maps lm_head.weight onto MTP layer 0's shared_head only,
    # so layer 1's head stays uninitialised (harmless while layer 0 serves every step).
    GpuCase("tiny-k2-two-mtp-layers", overrides=(("num_nextn_predict_layers", 2),), steps=2, seed=15,
            known_audit=("model.layers.3.shared_head.head.weight",)),
    GpuCase("tiny-k3-batch8", requests=8, tokens=64, steps=3, seed=17),
    # HYV4Config's MTP dimensions (hidden 2816, 32 heads, 256 experts top-8, v 256,
    # index_topk 2048; vocab cut to 8192): ~13 GB of float64 reference weights,
    # the reference replays take tens of seconds on the host CPU
    GpuCase("real-dims-k2", preset="real-dims", requests=2, tokens=24, steps=2, seed=21),
    # FP8 checkpoints (mtp_quant_algo FP8, 128x128 blocks): production loads the
    # stored e4m3 weights + scales through vLLM's FP8 paths (Fp8LinearMethod,
    # Fp8MoEMethod, FP8 indexer wk dequant); the reference runs on the exact
    # dequantized weights. Contexts (160, 157) longer than index_topk 128.
    GpuCase("tiny-k2-fp8-split-long", requests=2, tokens=160, steps=2, seed=18, quant="fp8"),
    GpuCase("tiny-k2-fp8-ue8m0-fused-scale-long", requests=2, tokens=160, steps=2, seed=19,
            quant="fp8-ue8m0", experts="fused", expert_scale_suffix="scale"),
)}

FP8_CASE_IDS = tuple(c.id for c in GPU_CASES.values() if c.quant != "bf16")

# Configs the SM90 kernels refuse (kept to document the constraint; expected to raise).
PROBE_CASES: dict[str, GpuCase] = {c.id: c for c in (
    GpuCase("probe-topk4", overrides=(("index_topk", 4),), requests=2, tokens=8, steps=2, seed=10),
    # "layers" naming with two MTP layers: the loader recognises only
    # model.layers.<n + i> for i < max(num_nextn_predict_layers - 1, 1)
    GpuCase("probe-two-mtp-layers-naming", overrides=(("num_nextn_predict_layers", 2),), steps=2,
            seed=16, naming="layers"),
)}


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
    fin = torch.isfinite(a) & torch.isfinite(b)
    if not fin.any():
        return 0.0
    return float((a - b).abs()[fin].max())


def _derive_indexer(trace: dict, cfg: R.MTPConfig, production: bool) -> None:
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


def run_case(case: GpuCase, *, session_kw: dict | None = None) -> dict:
    """Run ``case`` on production, replay the reference on its inputs, compare; result dict (tensors included)."""
    from harness.production.runner import ProductionSession

    hf, ckpt, _ = case_inputs(case)
    cfg = R.MTPConfig.from_hf_dict(hf)
    first = R.make_case(cfg, case.seed, case.requests, case.tokens)
    t0 = time.perf_counter()
    sess = ProductionSession(hf, num_speculative_tokens=case.steps, **(session_kw or {}))
    t_build = time.perf_counter() - t0
    sess.load(ckpt, strict=not case.known_audit)
    t_load = time.perf_counter() - t0 - t_build
    prod = sess.run(first, case.steps)
    torch.cuda.synchronize()
    t_run = time.perf_counter() - t0 - t_build - t_load
    info = {"audit": sess.audit_problems, "attach_notes": sess.attach_notes,
            "step_notes": [dataclasses.asdict(n) for n in sess.notes],
            "timing_s": {"build": t_build, "load": t_load, "run": t_run}}
    if case.quant != "bf16":
        try:
            info["fp8_kernels"] = fp8_kernel_notes(sess.model)
        except Exception as exc:  # noqa: BLE001 - notes must not cost the verdict
            info["fp8_kernels"] = {"error": f"{exc.__class__.__name__}: {exc}"}
    return judge(case, prod, info)


def fp8_kernel_notes(model) -> dict:
    """Which FP8 kernels production picked (for the report): linear kernel classes,
    the MoE backend, the DeepGEMM UE8M0 switch and the weight/scale dtypes after loading."""
    notes: dict = {k: os.environ.get(k) for k in ("VLLM_USE_DEEP_GEMM_E8M0", "VLLM_USE_DEEP_GEMM",
                                                  "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER")}
    try:
        from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used, is_deep_gemm_supported
        notes["deep_gemm_supported"] = bool(is_deep_gemm_supported())
        notes["deep_gemm_e8m0_used"] = bool(is_deep_gemm_e8m0_used())
    except Exception as exc:  # noqa: BLE001 - notes only
        notes["deep_gemm"] = f"{exc.__class__.__name__}: {exc}"
    layers = {}
    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if qm is None:
            continue
        d = {"method": type(qm).__name__}
        if hasattr(qm, "fp8_linear"):
            d["kernel"] = type(qm.fp8_linear).__name__
        if hasattr(qm, "fp8_backend"):
            d["backend"] = str(getattr(qm.fp8_backend, "value", qm.fp8_backend))
        for pname, p in mod.named_parameters(recurse=False):
            if "scale" in pname or p.dtype == torch.float8_e4m3fn:
                d[pname] = str(p.dtype).removeprefix("torch.")
        layers[name] = d
    notes["layers"] = layers
    return notes


def judge(case: GpuCase, prod: dict, info: dict, *, tolerances: dict | None = None) -> dict:
    """Compare a production trace of ``case`` with the reference replayed on its inputs.

    The reference weights are ``case_inputs(case)[2]`` (FP8: the exact
    dequantized checkpoint); tolerances default to ``tolerances_for(case.quant)``.
    """
    from harness import compare, regimes
    from harness.production.replay import replay
    from harness.production.tolerances import tolerances_for

    hf, _, weights = case_inputs(case)
    cfg = R.MTPConfig.from_hf_dict(hf)
    tols = tolerances if tolerances is not None else tolerances_for(case.quant)
    first = R.make_case(cfg, case.seed, case.requests, case.tokens)
    prod = dict(prod)
    t1 = time.perf_counter()
    from harness.runtime import reference_device

    dev = reference_device()
    # weights moved once for the replays (.to on a moved tensor is a no-op)
    wdev = weights if dev == "cpu" else {k: v.to(dev) for k, v in weights.items()}
    ref = replay(cfg, wdev, prod, first, case.steps, R.EXACT, device=dev)
    # production numerics: bf16 storage, twice-rounded RMSNorm, bf16 RoPE tables and, for FP8
    # cases, the activation quantization of the FP8 GEMMs (fp8_emulation.production_numerics)
    from harness.production.fp8_emulation import production_numerics
    prod_weights, prod_num = production_numerics(case, weights)
    # (the FP8 emulation's numerics are CPU-tested only: FP8 cases replay them on the CPU)
    ref_p = replay(cfg, prod_weights, prod, first, case.steps, prod_num, device=dev if case.quant == "bf16" else "cpu")
    # the free-running reference, instrumented (CPU): how strongly this case exercises each regime
    free, regime_values = regimes.measure_draft(cfg, weights, first, case.steps, hf)
    if isinstance(free, R.UnwrittenKVError):  # reference cycles MTP layers: layer k>0 has no KV context
        free_tokens = f"reference.draft cannot run: {free}"
    else:
        free_tokens = free.tokens.tolist()
    t_ref = time.perf_counter() - t1
    # dense MLA prefill (no sink, short context) leaves the top-k buffer unused
    skipped = []
    for n in info.get("step_notes", []):
        if any(d.get("prefill.use_dense_mha") and d.get("num_decode_tokens", 1) == 0
               for d in n["metadata"].values()):
            for key in (f"step{n['step']}.indexer.topk", f"step{n['step']}.attn.topk"):
                for side in (prod, ref, ref_p):
                    side.pop(key, None)
                skipped.append(key)
    prod_cmp = dict(prod)
    for side, is_prod in ((prod_cmp, True), (ref, False), (ref_p, False)):
        _derive_indexer(side, cfg, is_prod)
    for key in [k for k in prod_cmp if k.endswith((".indexer.q_scale", ".indexer.q_deq", ".indexer.head_weights"))]:
        if key in ref and prod_cmp[key].shape == ref[key].shape:  # raw weight exactly 0: scale unknown
            nan = torch.isnan(prod_cmp[key])
            prod_cmp[key] = torch.where(nan, ref[key].double(), prod_cmp[key].double())
    _normalise_scores(ref)
    prod_cmp, ref, ref_p = _sort_routing(prod_cmp), _sort_routing(ref), _sort_routing(ref_p)
    last = first.last_rows().tolist()
    sampled = [last] + [list(range(len(last)))] * (case.steps - 1)
    ties = _routing_ties(prod_cmp, ref, weights, case.steps, sampled)
    report = compare.compare_traces(prod_cmp, ref, tols, components=PRODUCTION_COMPONENTS)
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
    prod_tokens = torch.stack([prod[f"step{k}.draft_token"] for k in range(case.steps)], 1).tolist()
    layer_policy = None
    if cfg.num_mtp_layers > 1 and case.steps > 1:
        # which MTP layer served steps >= 1? replay both policies and compare final_norm
        layer_policy = {}
        try:
            cyc = replay(cfg, wdev, prod, first, case.steps, R.EXACT, layer_policy="cycle", device=dev)
        except R.UnwrittenKVError as exc:
            cyc = None
            layer_policy["cycle(k mod n)"] = f"reference cannot replay: {exc}"
        for k in range(1, case.steps):
            key = f"step{k}.final_norm"
            layer_policy[key] = {"proposer(layer 0)": _max_abs(prod[key], ref[key]),
                                 "cycle(k mod n)": None if cyc is None else _max_abs(prod[key], cyc[key])}
    timing = dict(info.get("timing_s", {}))
    timing["reference"] = t_ref
    return {
        "case": dataclasses.asdict(case), "quant": case.quant, "passed": report.passed,
        "first_divergent": report.first_divergent.name if report.first_divergent else None,
        "table": report.table(), "rows": rows,
        "audit": info.get("audit", []), "attach_notes": info.get("attach_notes", []),
        "step_notes": info.get("step_notes", []),
        "routing_ties": {str(k): v for k, v in ties.items()},
        "router_self_check": _router_self_check(prod, weights, cfg, case.steps),
        "skipped": skipped,
        "layer_policy": layer_policy,
        "tokens": {"production": prod_tokens, "reference_free_running": free_tokens,
                   "agree": prod_tokens == free_tokens},
        "timing_s": timing, "reference_device": dev, "fp8_kernels": info.get("fp8_kernels"), "regimes": regime_values,
        "prod_keys": sorted(prod), "_prod": prod, "_ref": ref, "_prod_cmp": prod_cmp, "_report": report,
    }


def format_rows(result: dict) -> str:
    lines = [f"== {result['case']['id']}: {'PASS' if result['passed'] else 'FAIL'}"
             f" (first divergent: {result['first_divergent']})",
             f"{'component':28s} {'ok':4s} {'|d| exact':>10s} {'|d| prodnum':>11s} {'1-sim':>9s} {'mism%':>6s}  note"]
    for r in result["rows"]:
        pn = r["max_abs_vs_prodnum"]
        lines.append(f"{r['key']:28s} {'ok' if r['passed'] else 'FAIL':4s} {r['max_abs_vs_exact']:10.3e} "
                     f"{(pn if pn is not None else float('nan')):11.3e} {r['sim_gap']:9.2e} "
                     f"{r['mismatch_pct']:6.2f}  {r['note']}")
    return "\n".join(lines)


def format_regimes(values: dict) -> str:
    """One line: the thresholded regimes' values (harness/regimes.py), '!' where below the threshold."""
    from harness.regimes import REGIMES

    cells = [f"error={values['error']}"] if "error" in values else []
    for name, regime in REGIMES.items():
        v = values.get(name)
        if regime.threshold is None or v is None:
            continue
        cells.append(f"{name}={v:.3g}" + ("" if v >= regime.threshold else "!"))
    return " ".join(cells)


def versions() -> dict:
    import vllm
    v = {"torch": torch.__version__, "vllm": vllm.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name(0)
        v["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return v


def _flush(pending: dict, out: str, n: int) -> None:
    """Write collected production traces ({case}/{key}) to one safetensors file."""
    from safetensors.torch import save_file
    save_file(dict(pending), os.path.join(out, f"prod-traces-{n:02d}.safetensors"))
    pending.clear()


def _trace_tensors(cid: str, prod: dict) -> dict:
    """{case}/{key} -> an own contiguous CPU copy (safetensors refuses shared storage)."""
    return {f"{cid}/{k}": v.detach().cpu().contiguous().clone() for k, v in prod.items()
            if torch.is_tensor(v)}


def load_saved_traces(out_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    """{case id: production trace} from the prod-traces-*.safetensors files of ``out_dir``."""
    from safetensors.torch import load_file
    traces: dict[str, dict] = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "prod-traces-*.safetensors"))):
        for key, v in load_file(path).items():
            cid, k = key.split("/", 1)
            traces.setdefault(cid, {})[k] = v
    return traces


def rejudge(in_dir: str, out_dir: str | None = None, case_ids=None) -> tuple[int, list[dict]]:
    """Re-run the reference + judge on CPU for production traces saved by ``--save-traces``.

    Reads ``side_by_side.json`` (case definitions, audit and step notes) and the
    ``prod-traces-*.safetensors`` of ``in_dir``; writes ``rejudge.json`` into
    ``out_dir`` (default ``in_dir``). Returns (exit code, results).
    """
    with open(os.path.join(in_dir, "side_by_side.json")) as f:
        summary = json.load(f)
    traces = load_saved_traces(in_dir)
    results, worst = [], 0
    for entry in summary.get("cases", []):
        cid = entry["case"]["id"]
        if case_ids and cid not in case_ids:
            continue
        if "error" in entry or cid not in traces:
            print(f"== {cid}: no saved production trace ({'error in the GPU run' if 'error' in entry else 'missing'})")
            results.append({"case": entry["case"], "error": "no saved production trace"})
            worst = max(worst, 1)
            continue
        case = _case_from_dict(entry["case"])
        info = {k: entry.get(k) for k in ("audit", "attach_notes", "step_notes", "fp8_kernels")
                if entry.get(k) is not None}
        info["timing_s"] = {}
        res = judge(case, traces[cid], info)
        print(format_rows(res), flush=True)
        print("routing ties:", res["routing_ties"], "router self-check:", res["router_self_check"],
              "tokens:", res["tokens"], flush=True)
        results.append({k: v for k, v in res.items() if not k.startswith("_")})
        if not res["passed"]:
            worst = max(worst, 1)
    if not results:
        print(f"nothing to re-judge in {in_dir}")
        return 125, results
    out_dir = out_dir or in_dir
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "rejudge.json"), "w") as f:
        json.dump({"source": os.path.abspath(in_dir), "versions": summary.get("versions"),
                   "cases": results}, f, indent=1, default=str)
    return worst, results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", help=f"case id (default: all of {', '.join(GPU_CASES)})")
    ap.add_argument("--fp8", action="store_true", help=f"the FP8 cases ({', '.join(FP8_CASE_IDS)})")
    ap.add_argument("--out", default=None, help="directory for side_by_side.json (default $OUT or out)")
    ap.add_argument("--save-traces", action="store_true", help="also write production traces (safetensors)")
    ap.add_argument("--rejudge", metavar="DIR", help="CPU only: re-judge the traces a --save-traces run wrote "
                    "into DIR (writes rejudge.json into --out, default DIR)")
    args = ap.parse_args(argv)
    ids = list(args.case or [])
    if args.fp8:
        ids += [c for c in FP8_CASE_IDS if c not in ids]
    if args.rejudge:
        code, _ = rejudge(args.rejudge, args.out, ids or None)
        return code
    out = args.out or os.environ.get("OUT", "out")
    from harness.runtime import cannot_run_production_reason
    reason = cannot_run_production_reason()
    if reason:
        print(f"cannot judge: {reason}")
        return 125
    os.makedirs(out, exist_ok=True)
    ids = ids or list(GPU_CASES) + list(PROBE_CASES)
    summary = {"versions": versions(), "cases": []}
    print(json.dumps(summary["versions"]))
    worst = 0
    pending: dict = {}
    n_files = 0
    for cid in ids:
        case = GPU_CASES.get(cid) or PROBE_CASES[cid]
        try:
            res = run_case(case)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next case
            tb = traceback.format_exc()
            print(f"== {cid}: ERROR {exc.__class__.__name__}: {exc}\n{tb}", flush=True)
            summary["cases"].append({"case": dataclasses.asdict(case), "error": tb})
            worst = max(worst, 1)
            continue
        print(format_rows(res), flush=True)
        print("notes:", json.dumps(res["step_notes"]), res["attach_notes"], flush=True)
        print("routing ties:", res["routing_ties"], "router self-check (step, bad rows, rows):",
              res["router_self_check"], "skipped:", res["skipped"], flush=True)
        if res.get("fp8_kernels"):
            print("fp8 kernels:", json.dumps(res["fp8_kernels"]), flush=True)
        if res.get("layer_policy"):
            print("layer policy (max |d| of final_norm):", res["layer_policy"], flush=True)
        print("tokens:", res["tokens"], "timing", {k: round(v, 2) for k, v in res["timing_s"].items()}, flush=True)
        print("regimes:", format_regimes(res["regimes"]), flush=True)
        if args.save_traces:  # one file per case, written now: a later crash or timeout keeps it
            pending.update(_trace_tensors(cid, res["_prod"]))
            _flush(pending, out, n_files)
            n_files += 1
        summary["cases"].append({k: v for k, v in res.items() if not k.startswith("_")})
        if not res["passed"]:
            worst = max(worst, 1)
        # write as we go: a later case that kills the process leaves the earlier ones judged
        atomic_write_json(os.path.join(out, "side_by_side.json"), summary, default=str)
    if args.save_traces and pending:
        _flush(pending, out, n_files)
    atomic_write_json(os.path.join(out, "side_by_side.json"), summary, default=str)
    return worst


if __name__ == "__main__":
    sys.exit(main())
