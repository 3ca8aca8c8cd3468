"""The side-by-side cases: ``GpuCase`` (a preset or checkpoint directory, inputs, steps,
quantization), the named ``GPU_CASES`` / ``PROBE_CASES``, and ``case_inputs`` (the HF config,
the checkpoint tensors for vLLM and the reference's weights of a case). CPU only, no vLLM.

May import: ``reference``, ``harness.presets``, ``harness.checkpoint``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import tempfile

from harness.presets import preset


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
    # checkpoint quantization (harness.checkpoint.options.QUANTS): "bf16", "fp8"
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
    # how the seeded weights are drawn (``reference.weights.random_weights``): "stream" (the
    # goldens' one generator) or "per-tensor" (threads; for real dims, where the one serial
    # stream of 1.8 G float64 draws was the GPU tier's critical path)
    weights_draw: str = "stream"
    # modelopt-fp8-pb: MTP layers the checkpoint excludes whole (exclude_modules "<layer>.*")
    bf16_layers: tuple = ()
    # module names (``named_modules``) vLLM must build unquantized: the proof that the case
    # went through the config's exclusion path (checked after loading, see side_by_side)
    expect_unquantized: tuple = ()

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
    import reference as R  # torch: only when inputs are made (case ids are checked without it)
    from harness.checkpoint.names import to_checkpoint

    hf = case.hf_config()
    cfg = R.MTPConfig.from_hf_dict(hf)
    weights = R.random_weights(cfg, case.seed, draw=case.weights_draw)
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
                               expert_scale_suffix=case.expert_scale_suffix, bf16_layers=case.bf16_layers)
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
    for key in ("known_audit", "bf16_layers", "expect_unquantized"):
        d[key] = tuple(d.get(key, ()))
    return GpuCase(**d)


_MTP0_GATE = ("model.layers.2.mtp_block.self_attn.linear_gate",)

# Kept small enough for one GPU call of a few minutes; R <= 3 so no length-1 request lands
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
    GpuCase("real-dims-k2", preset="real-dims", requests=2, tokens=24, steps=2, seed=21, weights_draw="per-tensor"),
    # FP8 checkpoints (mtp_quant_algo FP8, 128x128 blocks): production loads the
    # stored e4m3 weights + scales through vLLM's FP8 paths (Fp8LinearMethod,
    # Fp8MoEMethod, FP8 indexer wk dequant); the reference runs on the exact
    # dequantized weights. Contexts (160, 157) longer than index_topk 128.
    GpuCase("tiny-k2-fp8-split-long", requests=2, tokens=160, steps=2, seed=18, quant="fp8"),
    GpuCase("tiny-k2-fp8-ue8m0-fused-scale-long", requests=2, tokens=160, steps=2, seed=19,
            quant="fp8-ue8m0", experts="fused", expert_scale_suffix="scale"),
    # ModelOpt FP8_PB_WO (quant_method modelopt, no mtp_quant_algo: the MTP layers inherit it):
    # the checkpoint-named exclude_modules reach the draft only through HYV4MTP's remap. The gate
    # by its exact name, the routed experts by the wildcard model.mtp_layers.0.mlp.experts*
    # (ModelOpt FP8 experts are per-tensor static W8A8, not modelled), lm_head by name.
    GpuCase("tiny-k2-modelopt-pb-long", requests=2, tokens=160, steps=2, seed=23, quant="modelopt-fp8-pb",
            expect_unquantized=_MTP0_GATE + ("model.layers.2.mtp_block.mlp.experts.routed_experts",
                                             "model.layers.2.shared_head.head")),
    # dense MLP: every linear but the gate FP8; the exclusion bug (exclusions not remapped)
    # quantizes only linears here, so it surfaces as a load failure, not a crash
    GpuCase("tiny-k2-modelopt-pb-dense", overrides=(("mlp_layer_types", ["dense", "dense"]),), steps=2, seed=24,
            quant="modelopt-fp8-pb", expect_unquantized=_MTP0_GATE + ("model.layers.2.shared_head.head",)),
    # the whole MTP layer excluded by the wildcard model.mtp_layers.0.* (a bf16 MTP head under an
    # FP8 backbone's ModelOpt config); dense MLP for the same reason as above
    GpuCase("tiny-k2-modelopt-layer-bf16-dense", overrides=(("mlp_layer_types", ["dense", "dense"]),), steps=2,
            seed=25, quant="modelopt-fp8-pb", bf16_layers=(0,),
            expect_unquantized=_MTP0_GATE + tuple(f"model.layers.2.mtp_block.{m}" for m in (
                "self_attn.fused_qkv_a_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj", "self_attn.o_proj",
                "self_attn.indexer.wq_b", "mlp.gate_up_proj", "mlp.down_proj"))),
)}

MODELOPT_CASE_IDS = tuple(c.id for c in GPU_CASES.values() if c.quant == "modelopt-fp8-pb")

FP8_CASE_IDS = tuple(c.id for c in GPU_CASES.values() if c.quant in ("fp8", "fp8-ue8m0"))

# The one list of the side-by-side cases a bisect judges: bisect-check's default set, and the
# production goldens' and host baselines' case set (a case of the one without the other would be
# judged against the reference only). Together these exercise every regime of harness/regimes.py
# above its threshold (tests/cpu/test_regimes.py): tiny-k3-share index sharing, K = 3 and a heavy
# sink; tiny-k2-long contexts beyond index_topk and routing near-ties; tiny-k2-clamp-headwise the
# routed SwiGLU clamp, the headwise gate, fused experts and layers naming;
# tiny-k2-fp8-ue8m0-fused-scale-long a block-FP8 checkpoint as stored (e4m3 weights, UE8M0
# scales, fused experts with `.scale` names): vLLM's FP8 loading, FP8 GEMMs and UE8M0 paths,
# a regression class the bf16 cases cannot see.
BISECT_CASES = ("tiny-k3-share", "tiny-k2-long", "tiny-k2-clamp-headwise", "tiny-k2-fp8-ue8m0-fused-scale-long")

# Configs the SM90 kernels refuse (kept to document the constraint; expected to raise).
PROBE_CASES: dict[str, GpuCase] = {c.id: c for c in (
    GpuCase("probe-topk4", overrides=(("index_topk", 4),), requests=2, tokens=8, steps=2, seed=10),
    # "layers" naming with two MTP layers: the loader recognises only
    # model.layers.<n + i> for i < max(num_nextn_predict_layers - 1, 1)
    GpuCase("probe-two-mtp-layers-naming", overrides=(("num_nextn_predict_layers", 2),), steps=2,
            seed=16, naming="layers"),
)}
