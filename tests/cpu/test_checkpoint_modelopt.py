"""ModelOpt FP8_PB_WO checkpoints: synth -> loader round trips, the exclusion rules (exact
names, wildcards, vLLM's MTP remap), the bad inputs (exit 2 naming tensor and config key) and
the post-load audit's decision (config, {module: quant method}) -> problems, all on CPU."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.loader import load_checkpoint
from harness.checkpoint.quant import mtp_fp8_plan, quant_of_config, remap_mtp_exclusions
from harness.checkpoint.synth import synth_config, write_synthetic
from harness.production.module.audit import quant_method_problems
from reference.config import MTPConfig
from reference.weights import random_weights

QUANT = "modelopt-fp8-pb"
GATE = "model.layers.2.mtp_block.self_attn.linear_gate"


def _write(tmp_path, name="ckpt", *, dense=False, bf16_layers=(), **kw):
    hf = synth_config("tiny", dense_mlp=dense)
    w = random_weights(MTPConfig.from_hf_dict(hf), 0)
    return write_synthetic(tmp_path / name, hf, w, quant=QUANT, bf16_layers=bf16_layers, index=False, **kw), w


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("bf16_layers", [(), (0,)])
def test_round_trip(tmp_path, dense, bf16_layers):
    path, w = _write(tmp_path, dense=dense, bf16_layers=bf16_layers)
    hf = json.loads((path / "config.json").read_text())
    qc = hf["quantization_config"]
    assert "mtp_quant_algo" not in hf and quant_of_config(hf) == QUANT
    assert (qc["quant_method"], qc["quant_algo"], qc["kv_cache_quant_algo"]) == ("modelopt", "FP8_PB_WO", None)
    assert "lm_head" in qc["exclude_modules"]
    tensors = load_file(str(path / "model.safetensors"))
    assert not any(n.endswith(("input_scale", "weight_scale_inv")) for n in tensors)  # nothing vLLM rejects
    loaded = load_checkpoint(path)
    if bf16_layers:
        assert qc["exclude_modules"] == ["lm_head", "model.mtp_layers.0.*"]
        assert loaded.fp8 == {}
        assert all(t.dtype != torch.float8_e4m3fn for t in tensors.values())
    else:
        assert "model.mtp_layers.0.self_attn.linear_gate" in qc["exclude_modules"]
        assert ("model.mtp_layers.0.mlp.experts*" in qc["exclude_modules"]) == (not dense)
        assert tensors["model.mtp_layers.0.self_attn.linear_gate.weight"].dtype == torch.bfloat16
        s = tensors["model.mtp_layers.0.self_attn.q_b_proj.weight_scale"]
        q = tensors["model.mtp_layers.0.self_attn.q_b_proj.weight"]
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert tuple(s.shape) == (-(-q.shape[0] // 128), 1, q.shape[1] // 128, 1)
        assert "layers.0.attn.q_b_proj" in loaded.fp8 and "layers.0.attn.linear_gate" not in loaded.fp8
        assert not any(k.startswith("layers.0.mlp.experts") for k in loaded.fp8)
    for k, v in loaded.weights.items():  # FP8 blocks round within e4m3's half-ulp; bf16 exactly as stored
        tol = 2 ** -4 * float(w[k].abs().max()) if k in loaded.fp8 else 2 ** -8 * float(w[k].abs().max()) + 1e-30
        assert float((v - w[k]).abs().max()) <= tol, k


def test_remap_matches_vllm_semantics():
    pats = ["lm_head", "model.mtp_layers.0.self_attn.linear_gate", "model.mtp_layers.0.mlp.experts*",
            "model.mtp_layers.1.*", "model.mtp_layers.0*"]
    out = remap_mtp_exclusions(pats, 2, 2)
    assert out[:len(pats)] == pats
    # the trailing star is kept; "model.mtp_layers.0*" does not start with "model.mtp_layers.0." (not remapped)
    assert out[len(pats):] == ["model.layers.2.self_attn.linear_gate", "model.layers.2.mlp.experts*",
                               "model.layers.3.*"]


def _plan(tmp_path, qc_edit, dense=True):
    hf = synth_config("tiny", dense_mlp=dense)
    hf["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8_PB_WO",
                                 "exclude_modules": ["lm_head"]}
    qc_edit(hf)
    return hf, mtp_fp8_plan(hf, MTPConfig.from_hf_dict(hf))


def test_plan_wildcards_and_substrings(tmp_path):
    hf, plan = _plan(tmp_path, lambda h: h["quantization_config"]["exclude_modules"].append("model.mtp_layers.0.*"))
    assert plan.quantized[0] == frozenset()
    hf, plan = _plan(tmp_path, lambda h: h["quantization_config"]["exclude_modules"].append("o_proj"))
    assert "attn.o_proj" not in plan.quantized[0] and "attn.q_b_proj" in plan.quantized[0]  # substring rule
    hf, plan = _plan(tmp_path, lambda h: h["quantization_config"]["exclude_modules"].append("model.mtp_layers.0*"))
    assert "attn.q_b_proj" in plan.quantized[0]  # vLLM never remaps that form: the layer stays FP8
    assert plan.excluded_by("model.layers.2.self_attn.fused_qkv_a_proj") is None


@pytest.mark.parametrize("edit,words", [
    (lambda h: h.__setitem__("mtp_quant_algo", "FP8"), "never reads exclude_modules"),
    (lambda h: h["quantization_config"].__setitem__("quant_algo", "FP8"), "quant_algo FP8: vLLM accepts it"),
    (lambda h: h["quantization_config"].__setitem__("quant_algo", "FP8_PER_CHANNEL_PER_TOKEN"), "does not build"),
    (lambda h: h["quantization_config"].pop("quant_algo"), "quantization_config.quant_algo: missing"),
    (lambda h: h["quantization_config"].__setitem__("exclude_modules", []), "does not exclude lm_head"),
    (lambda h: h["quantization_config"].__setitem__("exclude_modules", "lm_head"), "must be a list"),
    (lambda h: h["quantization_config"].__setitem__("kv_cache_quant_algo", "FP8"), "KV cache"),
    (lambda h: h["quantization_config"]["exclude_modules"].append("model.mtp_layers.0.self_attn.q_a_proj"),
     "some but not all shards"),
])
def test_bad_configs(tmp_path, edit, words):
    with pytest.raises(ValueError, match=words.replace("*", r"\*")):
        _plan(tmp_path, edit)


def test_moe_experts_must_be_excluded(tmp_path):
    with pytest.raises(ValueError, match=r"routed experts.*model.mtp_layers.0.mlp.experts\*"):
        _plan(tmp_path, lambda h: None, dense=False)


def _rewrite(path, tensors=None, config=None):
    if tensors is not None:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))


def _one_shard(tmp_path):
    path, _ = _write(tmp_path, dense=True)
    return path, load_file(str(path / "model.safetensors")), json.loads((path / "config.json").read_text())


def test_excluded_module_stored_fp8_names_tensor_and_key(tmp_path):
    path, t, hf = _one_shard(tmp_path)
    hf["quantization_config"]["exclude_modules"].append("model.mtp_layers.0.self_attn.o_proj")
    _rewrite(path, config=hf)
    with pytest.raises(CheckpointError, match=r"model.mtp_layers.0.self_attn.o_proj.weight: stored as "
                       r"float8_e4m3fn, but quantization_config.exclude_modules excludes it"):
        load_checkpoint(path)


def test_quantized_module_stored_bf16_names_tensor_and_key(tmp_path):
    path, t, hf = _one_shard(tmp_path)
    hf["quantization_config"]["exclude_modules"].remove("model.mtp_layers.0.self_attn.linear_gate")
    _rewrite(path, config=hf)
    with pytest.raises(CheckpointError, match=r"linear_gate.weight: dtype bfloat16, but vLLM quantizes this "
                       r"module to FP8 \(quantization_config.quant_method modelopt, not matched by "
                       r"quantization_config.exclude_modules\)"):
        load_checkpoint(path)


def test_fp8config_scale_name_under_modelopt(tmp_path):
    path, t, hf = _one_shard(tmp_path)
    name = "model.mtp_layers.0.self_attn.q_b_proj.weight_scale"
    t[name + "_inv"] = t.pop(name)
    _rewrite(path, tensors=t)
    with pytest.raises(CheckpointError, match=r"q_b_proj.weight_scale_inv: scale named .weight_scale_inv, but "
                       r"quantization_config.quant_method modelopt loads .weight_scale"):
        load_checkpoint(path)


def test_2d_scale_refused(tmp_path):
    path, t, hf = _one_shard(tmp_path)
    name = "model.mtp_layers.0.self_attn.q_b_proj.weight_scale"
    t[name] = t[name].reshape(t[name].shape[0], t[name].shape[2])
    _rewrite(path, tensors=t)
    with pytest.raises(CheckpointError, match=r"q_b_proj.weight_scale: scale shape \[\d+, \d+\], expected "
                       r"\[\d+, 1, \d+, 1\]"):
        load_checkpoint(path)


def test_synth_cli_bad_input_is_exit_2(tmp_path, capsys):
    from harness.cli import main

    assert main(["synth", str(tmp_path / "a"), "--quant", "fp8", "--bf16-mtp-layer", "0"]) == 2
    assert "need --quant modelopt-fp8-pb" in capsys.readouterr().err
    assert main(["synth", str(tmp_path / "b"), "--quant", QUANT, "--bf16-mtp-layer", "3"]) == 2
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")
    assert main(["synth", str(tmp_path / "c"), "--quant", QUANT]) == 0


# ---- the post-load audit's decision: a pure function of (config, {module: method}) ------------
def _methods(**over):
    m = {GATE: "UnquantizedLinearMethod",
         "model.layers.2.mtp_block.self_attn.q_b_proj": "ModelOptLinearMethod",
         "model.layers.2.mtp_block.self_attn.mla_attn": "ModelOptKVCacheMethod",
         "model.layers.2.mtp_block.mlp.gate_up_proj": "ModelOptLinearMethod",
         "model.layers.2.shared_head.head": "UnquantizedEmbeddingMethod"}
    m.update(over)
    return m


def _hf(tmp_path, **kw):
    path, _ = _write(tmp_path, dense=True, **kw)
    return json.loads((path / "config.json").read_text())


def test_audit_clean(tmp_path):
    assert quant_method_problems(_hf(tmp_path), _methods()) == []


def test_audit_routed_experts_by_their_moe_prefix(tmp_path):
    path, _ = _write(tmp_path)  # MoE: experts excluded by model.mtp_layers.0.mlp.experts*
    hf = json.loads((path / "config.json").read_text())
    experts = "model.layers.2.mtp_block.mlp.experts.routed_experts"
    assert quant_method_problems(hf, {experts: "UnquantizedFusedMoEMethod"}) == []
    probs = quant_method_problems(hf, {experts: "ModelOptFp8MoEMethod"})
    assert len(probs) == 1 and probs[0].startswith(f"{experts}: quantization_config.exclude_modules excludes it "
                                                   "('model.layers.2.mlp.experts*')")


def test_audit_names_excluded_module_built_quantized(tmp_path):
    probs = quant_method_problems(_hf(tmp_path), _methods(**{GATE: "ModelOptLinearMethod"}))
    assert len(probs) == 1 and probs[0].startswith(f"{GATE}: quantization_config.exclude_modules excludes it "
                                                   "('model.layers.2.self_attn.linear_gate')")
    assert "ModelOptLinearMethod (quantized)" in probs[0]


def test_audit_excluded_lm_head_and_wildcard_layer(tmp_path):
    probs = quant_method_problems(_hf(tmp_path),
                                  _methods(**{"model.layers.2.shared_head.head": "ModelOptLinearMethod"}))
    assert len(probs) == 1 and probs[0].startswith("model.layers.2.shared_head.head: ") and "'lm_head'" in probs[0]
    probs = quant_method_problems(_hf(tmp_path / "w", bf16_layers=(0,)), _methods())
    assert [p.split(":")[0] for p in probs] == ["model.layers.2.mtp_block.self_attn.q_b_proj",
                                                "model.layers.2.mtp_block.mlp.gate_up_proj"]
    assert "'model.layers.2.*'" in probs[0]


def test_audit_quantized_module_built_unquantized(tmp_path):
    probs = quant_method_problems(_hf(tmp_path), _methods(
        **{"model.layers.2.mtp_block.self_attn.q_b_proj": "UnquantizedLinearMethod"}))
    assert probs == ["model.layers.2.mtp_block.self_attn.q_b_proj: FP8 in the checkpoint (quantization_config."
                     "quant_method modelopt, not matched by quantization_config.exclude_modules), but vLLM "
                     "built it with UnquantizedLinearMethod"]


def test_audit_bf16_and_fp8config(tmp_path):
    hf = synth_config("tiny", dense_mlp=True)
    hf["mtp_quant_algo"] = "BF16"
    assert quant_method_problems(hf, {GATE: "UnquantizedLinearMethod"}) == []
    assert quant_method_problems(hf, {GATE: "Fp8LinearMethod"})[0].startswith(f"{GATE}: the MTP layers are unquantized")
    w = random_weights(MTPConfig.from_hf_dict(hf), 0)
    path = write_synthetic(tmp_path / "fp8", hf, w, quant="fp8", index=False)
    hf8 = json.loads((path / "config.json").read_text())
    assert quant_method_problems(hf8, {GATE: "UnquantizedLinearMethod",
                                       "model.layers.2.mtp_block.self_attn.q_b_proj": "Fp8LinearMethod"}) == []
    probs = quant_method_problems(hf8, {GATE: "Fp8LinearMethod"})
    assert "quantization_config.modules_to_not_convert excludes it" in probs[0]


def test_modelopt_cases_and_mutant_are_registered():
    from harness import mutants
    from harness import case_registry
    fp8_ids = case_registry.ids(role="fp8", kind="module")
    gpu_cases = case_registry.specs(kind="module", without="probe")
    modelopt_ids = case_registry.ids(role="modelopt", kind="module")

    assert set(modelopt_ids) == {"tiny-k2-modelopt-pb-long", "tiny-k2-modelopt-pb-dense",
                                      "tiny-k2-modelopt-layer-bf16-dense"}
    assert not set(modelopt_ids) & set(fp8_ids)
    assert not set(modelopt_ids) & set(case_registry.ids(role="bisect", kind="module"))
    for cid in modelopt_ids:
        assert GATE in gpu_cases[cid].expect_unquantized
    m = mutants.BY_NAME["exclusions-not-remapped"]
    assert m.case in modelopt_ids and m.build_patch is not None and m.component == "attn.gate"


# ---- the restated exclusion rules against vLLM's own (pure: no GPU, no model built) ----------
VLLM_IN_PROCESS = {"test_exclusions_match_vllm", "test_mutant_build_patch_narrows_the_remap"}

_EXTRA_PATTERNS = ([], ["o_proj"], ["model.mtp_layers.0*"], ["model.mtp_layers.0.self_attn.*"],
                   ["model.layers.2.mlp.gate_up_proj"], ["model.mtp_layers.0.mlp.gate_proj",
                                                        "model.mtp_layers.0.mlp.up_proj"])


def _vllm_excluded(hf: dict, prefixes: list[str]) -> dict[str, bool]:
    """vLLM's own answer: the MTP quant config built and remapped by HYV4MTP's functions."""
    import types

    import vllm.models.hy_v4.nvidia.mtp as mtp
    from vllm.model_executor.layers.quantization.modelopt import ModelOptFp8Config
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    cfg = MTPConfig.from_hf_dict(hf)
    qc = hf["quantization_config"]
    if qc["quant_method"] == "modelopt":
        config = ModelOptFp8Config.from_config(qc)
    else:
        config = mtp._create_mtp_quant_config(types.SimpleNamespace(**hf), None)
    config.packed_modules_mapping = mtp.HYV4MTP.packed_modules_mapping
    config = mtp._remap_mtp_quant_exclusions(config, cfg.num_hidden_layers, cfg.num_mtp_layers)
    config.packed_modules_mapping = mtp.HYV4MTP.packed_modules_mapping
    if qc["quant_method"] == "modelopt":
        return {p: bool(config.is_layer_excluded(p)) for p in prefixes}
    return {p: bool(is_layer_skipped(p, config.ignored_layers, config.packed_modules_mapping)) for p in prefixes}


def _prefixes(cfg: MTPConfig) -> list[str]:
    from harness.checkpoint.quant import _QUANT_MODULES
    from reference.weights import layer_shapes

    leaves = layer_shapes(cfg)
    mods = sorted({_QUANT_MODULES[leaf][0] for leaf in leaves if leaf in _QUANT_MODULES})
    return ["lm_head"] + [f"model.layers.{cfg.num_hidden_layers + i}.{m}"
                         for i in range(cfg.num_mtp_layers) for m in mods]


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("quant", ["fp8", QUANT])
def test_exclusions_match_vllm(tmp_path, dense, quant):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    hf = synth_config("tiny", dense_mlp=dense, mtp_layers=2)
    cfg = MTPConfig.from_hf_dict(hf)
    w = random_weights(cfg, 0)
    for j, extra in enumerate(_EXTRA_PATTERNS):
        bl = (1,) if quant == QUANT and j == 0 else ()
        path = write_synthetic(tmp_path / f"{j}", hf, w, quant=quant, index=False, bf16_layers=bl)
        h = json.loads((path / "config.json").read_text())
        key = "exclude_modules" if quant == QUANT else "modules_to_not_convert"
        h["quantization_config"][key] += extra
        try:
            plan = mtp_fp8_plan(h, cfg)
        except ValueError:  # a config the harness refuses (mixed shards, ...): vLLM must refuse it too
            with pytest.raises(ValueError):
                _vllm_excluded(h, _prefixes(cfg))
            continue
        ours = {p: plan.excluded_by(p) is not None for p in _prefixes(cfg)}
        assert ours == _vllm_excluded(h, _prefixes(cfg)), extra


def test_mutant_build_patch_narrows_the_remap(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    import vllm.models.hy_v4.nvidia.mtp as mtp

    from harness import mutants

    path, _ = _write(tmp_path, dense=True)
    hf = json.loads((path / "config.json").read_text())
    gate = "model.layers.2.self_attn.linear_gate"
    before = mtp._MTP_QUANT_EXCLUSION_ATTRS
    assert _vllm_excluded(hf, [gate]) == {gate: True}
    with mutants.BY_NAME["exclusions-not-remapped"].build_patch():
        assert _vllm_excluded(hf, [gate]) == {gate: False}  # the checkpoint-named entry never reaches the draft
    assert mtp._MTP_QUANT_EXCLUSION_ATTRS == before


def test_audit_ignores_modules_built_without_the_quant_config(tmp_path):
    # the router gate and the indexer's fused wk_weights_proj never get the quant config; an FP8 wk
    # beside a bf16 weights_proj would be "mixed shards" if the exclusion rules were asked about it
    hf = synth_config("tiny")
    w = random_weights(MTPConfig.from_hf_dict(hf), 0)
    hf8 = json.loads((write_synthetic(tmp_path / "f", hf, w, quant="fp8", index=False) / "config.json").read_text())
    assert quant_method_problems(hf8, {"model.layers.2.mtp_block.self_attn.indexer.wk_weights_proj":
                                       "UnquantizedLinearMethod",
                                       "model.layers.2.mtp_block.mlp.gate": "UnquantizedLinearMethod",
                                       "model.layers.2.mtp_block.mlp.experts.routed_experts": "Fp8MoEMethod",
                                       "model.layers.2.mtp_block.self_attn.mla_attn": "Fp8KVCacheMethod"}) == []


# ---- vLLM on a faked CUDA platform (tests/cpu/_vllm_config_probe.py, conftest's vllm_probe) ----------
MODELOPT_IDS = ("tiny-k2-modelopt-pb-long", "tiny-k2-modelopt-pb-dense", "tiny-k2-modelopt-layer-bf16-dense")
PLANTED = "tiny-k2-modelopt-pb-dense@exclusions-not-remapped"
VLLM_PROBE = {"config": list(MODELOPT_IDS), "load": [*MODELOPT_IDS, PLANTED]}
_KV_SCALES = ["model.layers.2.mtp_block.self_attn.mla_attn." + s
              for s in ("k_scale", "prob_scale", "q_scale", "v_scale")]



@pytest.mark.parametrize("case_id", MODELOPT_IDS)
def test_vllm_config_for_modelopt_cases(vllm_probe, case_id):
    d = vllm_probe.answer("config", case_id)
    assert d["quantization"] == d["draft_quantization"] == "modelopt" and d["quant_config"] == "ModelOptFp8Config"
    assert d["draft_mtp_quant_algo"] is None  # the MTP layers inherit the ModelOpt config
    assert d["draft_quantization_config"]["quant_algo"] == "FP8_PB_WO"


@pytest.mark.parametrize("case_id", MODELOPT_IDS)
def test_vllm_load_weights_takes_the_modelopt_checkpoint(vllm_probe, case_id):
    """HYV4MTP built by vLLM (CPU): every parameter but the KV-cache scale sentinels (replaced after
    loading) loaded, no warning, the dequantized FP8 parameters equal the reference exactly, every
    module's quant method agrees with the exclusion rules, and the case's expected-unquantized
    modules (its proof of the exclusion path) are built unquantized."""
    from harness import case_registry
    gpu_cases = case_registry.specs(kind="module", without="probe")

    d = vllm_probe.answer("load", case_id)
    assert d["unloaded"] == _KV_SCALES and d["warnings"] == [] and d["mismatches"] == [], d
    assert d["quant_problems"] == []
    methods = d["quant_methods"]
    for m in gpu_cases[case_id].expect_unquantized:
        assert methods[m].startswith("Unquantized"), (m, methods[m])
    qb = "model.layers.2.mtp_block.self_attn.q_b_proj"
    if case_id == "tiny-k2-modelopt-layer-bf16-dense":
        assert d["dtypes"][qb + ".weight"] == "bfloat16" and methods[qb] == "UnquantizedLinearMethod"
    else:
        assert methods[qb] == "ModelOptLinearMethod" and d["dtypes"][qb + ".weight"] == "float8_e4m3fn"
        assert d["dtypes"][qb + ".weight_scale"] == "float32"
    if case_id == "tiny-k2-modelopt-pb-long":
        assert methods["model.layers.2.mtp_block.mlp.experts.routed_experts"] == "UnquantizedFusedMoEMethod"


def test_planted_exclusion_bug_is_named_first(vllm_probe):
    """The planted bug on vLLM's own build: the gate gets a quantized method, its scale no value,
    and the audit's first problem names the gate module."""
    d = vllm_probe.answer("load", PLANTED)
    assert d["quant_problems"][0].startswith(f"{GATE}: quantization_config.exclude_modules excludes it")
    assert d["quant_methods"][GATE] == "ModelOptLinearMethod"
    assert GATE + ".weight_scale" in d["unloaded"]
