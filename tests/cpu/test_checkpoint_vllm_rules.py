"""The checkpoint code's restated vLLM 0.33 rules, checked against vLLM's own (CPU-importable) helpers.

* which MTP modules are FP8 (``_create_mtp_quant_config`` ->
  ``_remap_mtp_quant_exclusions`` -> ``is_layer_skipped``) vs
  ``harness.checkpoint.quant.mtp_fp8_plan``, for the synthetic configs and for
  arbitrary exclusion lists (hypothesis);
* synthetic scale names and dtypes through ``_prepare_mtp_fp8_expert_scale`` /
  ``_resolve_fused_expert_param``: no uint8 bytes reach a numeric copy;
* the FP8 indexer wk through ``_try_load_fp8_indexer_wk`` equals
  ``LoadedCheckpoint.vllm_weights()``.
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.checkpoint.loader import load_checkpoint
from harness.checkpoint.quant import _QUANT_MODULES, mtp_fp8_plan
from harness.checkpoint.synth import checkpoint_tensors, synth_config, write_synthetic
from reference.config import MTPConfig
from reference.weights import random_weights

# vLLM's modules, imported when this module's first test runs (not at collection: importing the MTP
# model pulls in most of vLLM, ~15 s of CPU, which every xdist worker would pay while collecting)
mtp = quant_utils = deepseek_v2 = None
VLLM_IN_PROCESS = True  # tests/cpu/conftest.py runs this module in the worker that imports vLLM


@pytest.fixture(scope="module", autouse=True)
def _vllm_modules(gc_paused):
    global mtp, quant_utils, deepseek_v2
    with gc_paused():
        mtp = pytest.importorskip("vllm.models.hy_v4.nvidia.mtp", reason="vLLM's HY V4 MTP module does not import here")
        quant_utils = pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils")
        deepseek_v2 = pytest.importorskip("vllm.model_executor.models.deepseek_v2")

VOCAB = 128

_WEIGHTS: dict = {}


def _random_weights(cfg: MTPConfig, seed: int) -> dict:
    """``random_weights(cfg, seed)``, computed once per (config, seed) in this module (38 calls, 5
    distinct inputs; it is a pure function of them) and handed out as fresh clones, so no test sees
    what another did to its tensors."""
    key = (repr(cfg), seed)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = random_weights(cfg, seed)
    return {k: v.clone() for k, v in _WEIGHTS[key].items()}


def _vllm_quant_config(hf: dict, cfg: MTPConfig):
    qc = mtp._create_mtp_quant_config(types.SimpleNamespace(**hf))
    return mtp._remap_mtp_quant_exclusions(qc, cfg.num_hidden_layers, cfg.num_mtp_layers)


def _vllm_quantized(hf: dict, cfg: MTPConfig) -> dict[int, frozenset[str]] | None:
    qc = _vllm_quant_config(hf, cfg)
    if qc is None:
        return None
    out = {}
    for i in range(cfg.num_mtp_layers):
        prefix = f"model.layers.{cfg.num_hidden_layers + i}."
        leaves = set()
        from reference.weights import layer_shapes
        for leaf in layer_shapes(cfg):
            if leaf not in _QUANT_MODULES:
                continue
            skipped = quant_utils.is_layer_skipped(
                prefix + _QUANT_MODULES[leaf][0], qc.ignored_layers, mtp.HYV4MTP.packed_modules_mapping,
                match_mode=qc.ignored_layers_match_mode)
            if not skipped:
                leaves.add(leaf)
        out[i] = frozenset(leaves)
    return out


@pytest.mark.parametrize("quant", ["bf16", "fp8", "fp8-ue8m0"])
@pytest.mark.parametrize("naming", ["mtp_layers", "layers"])
@pytest.mark.parametrize("switches", [{}, dict(dense_mlp=True, headwise_gate=True, no_sink=True),
                                      dict(mtp_layers=2)])
def test_synthetic_configs_quantize_what_vllm_quantizes(naming, quant, switches):
    hf0 = synth_config("tiny", vocab_size=VOCAB, **switches)
    cfg = MTPConfig.from_hf_dict(hf0)
    w = _random_weights(cfg, 0)
    hf, tensors = checkpoint_tensors(hf0, w, naming=naming, quant=quant)
    plan = mtp_fp8_plan(hf, cfg)
    want = _vllm_quantized(hf, cfg)
    if quant == "bf16":
        assert plan is None and want is None
        assert not any(t.dtype == torch.float8_e4m3fn for t in tensors.values())
        return
    assert plan.quantized == want
    qc = _vllm_quant_config(hf, cfg)
    assert list(qc.weight_block_size) == list(plan.block) == [128, 128]
    assert bool(getattr(qc, "is_scale_e8m0", False)) == plan.ue8m0 == (quant == "fp8-ue8m0")
    # the stored tensors follow the plan: FP8 exactly where vLLM has FP8 (wk: our choice, dequantized by vLLM)
    from harness.checkpoint.names import canonical_leaf, parse_layer_name
    for name, t in tensors.items():
        p = parse_layer_name(name, cfg.num_hidden_layers)
        if p is None or not name.endswith(".weight") or ".experts." in name:
            continue
        leaf = canonical_leaf(p[2])
        if leaf == "indexer.wk":
            continue
        assert (t.dtype == torch.float8_e4m3fn) == plan.is_quantized(p[0], leaf), name


_CANDIDATES = ["self_attn.linear_gate", "self_attn.q_b_proj", "self_attn.kv_b_proj", "self_attn.o_proj",
               "self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.fused_qkv_a_proj",
               "self_attn.indexer.wq_b", "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
               "mlp.shared_experts.down_proj", "mlp.shared_experts.gate_up_proj", "mlp.experts", "mlp.gate",
               "eh_proj"]


@given(picks=st.lists(st.tuples(st.sampled_from(["model.mtp_layers.0.", "model.layers.2.", "model.layers.1."]),
                                st.sampled_from(_CANDIDATES)), max_size=6),
       key=st.sampled_from(["modules_to_not_convert", "ignored_layers"]),
       algo=st.sampled_from(["FP8", "fp8", None, "NONE"]))
def test_any_exclusion_list_agrees_with_vllm(picks, key, algo):
    hf = synth_config("tiny", vocab_size=VOCAB)
    cfg = MTPConfig.from_hf_dict(hf)
    hf["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                 "weight_block_size": [128, 128], key: [a + b for a, b in picks]}
    if algo is not None:
        hf["mtp_quant_algo"] = algo
    hf_v = hf
    if algo in (None, "NONE"):  # vLLM then uses the backbone's config, built from the same quantization_config
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config
        hf_v = dict(hf, mtp_quant_algo="FP8")
        backbone = mtp._create_mtp_quant_config(types.SimpleNamespace(**hf),
                                                Fp8Config.from_config(hf["quantization_config"]))
        assert backbone.ignored_layers == mtp._create_mtp_quant_config(types.SimpleNamespace(**hf_v)).ignored_layers
    try:
        want = _vllm_quantized(hf_v, cfg)
    except ValueError as exc:
        assert "shards" in str(exc)
        with pytest.raises(ValueError, match="some but not all shards"):
            mtp_fp8_plan(hf, cfg)
        return
    assert mtp_fp8_plan(hf, cfg).quantized == want


@pytest.mark.parametrize("experts", ["split", "fused"])
@pytest.mark.parametrize("suffix", ["weight_scale_inv", "scale"])
@pytest.mark.parametrize("quant,scale_dtype", [("fp8", "auto"), ("fp8-ue8m0", "auto"), ("fp8-ue8m0", "e8m0"),
                                               ("fp8-ue8m0", "float32")])
def test_scale_names_and_dtypes_reach_vllm_parameters_intact(experts, suffix, quant, scale_dtype):
    hf0 = synth_config("tiny", vocab_size=VOCAB)
    cfg = MTPConfig.from_hf_dict(hf0)
    hf, tensors = checkpoint_tensors(hf0, _random_weights(cfg, 0), experts=experts, quant=quant,
                                     expert_scale_suffix=suffix, scale_dtype=scale_dtype)
    qc = _vllm_quant_config(hf, cfg)
    n = cfg.num_hidden_layers
    base = f"model.layers.{n}.mtp_block.mlp.experts.routed_experts."
    params = {base + p: None for p in ("w13_weight", "w13_weight_scale_inv", "w2_weight", "w2_weight_scale_inv")}
    scales = {k: v for k, v in tensors.items() if "scale" in k.rsplit(".", 1)[-1] or k.endswith("_scale_inv")}
    assert scales
    for name, t in scales.items():
        draft = name.replace("model.mtp_layers.0.", f"model.layers.{n}.mtp_block.")
        new_name, t2 = mtp._prepare_mtp_fp8_expert_scale(qc, draft, t)
        if ".indexer.wk." in name:
            continue  # checked against _try_load_fp8_indexer_wk below
        # what reaches a parameter by a numeric copy must not be raw exponent bytes
        assert t2.dtype != torch.uint8, name
        if ".mlp.experts." in draft:
            if experts == "split":
                assert new_name.endswith(".weight_scale_inv"), new_name
            else:
                proj = "gate_up_proj" if "gate_up_proj" in draft else "down_proj"
                tag = "w13_weight" if proj == "gate_up_proj" else "w2_weight"
                target = mtp._resolve_fused_expert_param(base + tag, new_name.split(f".experts.{proj}", 1)[1],
                                                         params)
                assert target == base + tag + "_scale_inv", (name, target)
        else:
            assert new_name.endswith(".weight_scale_inv")
        if t2.dtype == torch.float8_e8m0fnu:  # the exact value the float32/e8m0 parameter receives
            assert torch.equal(t2.to(torch.float32), torch.exp2(t.view(torch.uint8).double() - 127).float())


@pytest.mark.parametrize("quant,scale_dtype", [("fp8", "auto"), ("fp8-ue8m0", "auto"), ("fp8-ue8m0", "e8m0"),
                                               ("fp8-ue8m0", "float32")])
def test_fp8_wk_matches_vllms_dequantization(tmp_path, quant, scale_dtype):
    hf0 = synth_config("tiny", vocab_size=VOCAB)
    cfg = MTPConfig.from_hf_dict(hf0)
    d = write_synthetic(tmp_path / "c", hf0, _random_weights(cfg, 5), quant=quant, scale_dtype=scale_dtype)
    loaded = load_checkpoint(d)
    from safetensors.torch import load_file
    raw = load_file(str(d / "model-00001-of-00001.safetensors"))
    n = cfg.num_hidden_layers
    got = []
    fused = f"model.layers.{n}.mtp_block.self_attn.indexer.wk_weights_proj.weight"
    params = {fused: types.SimpleNamespace(weight_loader=lambda p, w, shard: got.append((w, shard)))}
    buf, loaded_params = {}, set()
    for suffix in ("weight", "weight_scale_inv"):
        name = f"model.layers.{n}.mtp_block.self_attn.indexer.wk.{suffix}"
        assert deepseek_v2._try_load_fp8_indexer_wk(name, raw[f"model.mtp_layers.0.self_attn.indexer.wk.{suffix}"],
                                                     buf, params, loaded_params, [])
    (w, shard), = got
    assert shard == 0 and w.dtype == torch.bfloat16
    assert torch.equal(w.double(), loaded.vllm_weights()["layers.0.indexer.wk"])
