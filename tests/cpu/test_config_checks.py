"""Config validation (``reference.config_checks``): what vLLM 0.33 refuses or misreads is refused, by key.

The oracle is vLLM's own ``HYV4Config`` (a strict dataclass; pure Python, no
GPU): every config it refuses, the harness refuses too, and the configs the
harness ships (the presets) pass both. Values vLLM's types let through but
that make no sense (NaN eps, ``index_topk: 0``, ...) are refused by the harness
alone; the table says so.
"""

from __future__ import annotations

import pytest

from harness.presets import PRESETS, preset
from reference.config import ConfigError, MTPConfig
from reference.config_checks import validate_hf_config

NAN, INF = float("nan"), float("inf")

# (key, value, vLLM's HYV4Config refuses it too)
BAD = [
    ("hidden_size", 256.0, True), ("hidden_size", "256", True), ("hidden_size", None, True),
    ("hidden_size", True, True), ("num_attention_heads", None, True), ("vocab_size", 1024.5, True),
    ("num_nextn_predict_layers", 1.0, True), ("q_lora_rank", None, True), ("index_topk", "128", True),
    ("rms_norm_eps", 1, True), ("routed_scaling_factor", 2, True), ("swiglu_limit", "10", True),
    ("gated_mla", "false", True), ("learnable_sink", 0, True), ("norm_topk_prob", "true", True),
    ("enable_lm_head_fp32", "false", True), ("gating_type", 1, True), ("hidden_act", 3, True),
    ("eos_token_id", 1.0, True), ("pad_token_id", "0", True), ("layer_types", "sparse", True),
    ("rope_parameters", [1], True),
    # accepted by the strict types, nonsense (or misread) all the same
    ("rms_norm_eps", -1.0, False), ("rms_norm_eps", NAN, False), ("rms_norm_eps", 0.0, False),
    ("routed_scaling_factor", NAN, False), ("routed_scaling_factor", -1.0, False),
    ("routed_scaling_factor", INF, False), ("swiglu_limit", NAN, False), ("index_topk", 0, False),
    ("index_topk", -1, False), ("num_attention_heads", 0, False), ("n_routed_experts", 0, False),
    ("n_shared_experts", -1, False), ("hidden_size", -256, False),
    ("quantization_config", ["fp8"], False), ("index_share_for_mtp_iteration", "false", False),
    ("torch_dtype", "float64", False), ("attention_dropout", -0.5, False),
]


@pytest.mark.parametrize("key,value,vllm_refuses", BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_bad_value_is_refused_naming_the_key(key, value, vllm_refuses):
    hf = preset("tiny", **{key: value})
    with pytest.raises(ConfigError, match=key):
        MTPConfig.from_hf_dict(hf)


def test_config_must_be_an_object():
    for doc in ([], [preset("tiny")], "hy_v4", 3, None):
        with pytest.raises(ConfigError, match="JSON object"):
            validate_hf_config(doc)


def test_unknown_dtype_and_disagreements():
    with pytest.raises(ConfigError, match="torch_dtype.*bfloat17"):
        validate_hf_config(preset("tiny", torch_dtype="bfloat17"))
    with pytest.raises(ConfigError, match="'torch_dtype'.*'dtype'.*disagree"):
        validate_hf_config(preset("tiny", dtype="float32"))
    with pytest.raises(ConfigError, match="'n_routed_experts'.*'num_local_experts'.*disagree"):
        validate_hf_config(preset("tiny", num_local_experts=4))
    validate_hf_config(preset("tiny", dtype="bfloat16", num_local_experts=8))


@pytest.mark.parametrize("change", [{"eos_token_id": [1, 2]}, {"eos_token_id": None}, {"rope_theta": 10000},
                                    {"swiglu_limit": -1.0}, {"n_shared_experts": 0}, {"quantization_config": None},
                                    {"layer_types": None}, {"mtp_quant_algo": None}])
def test_meaningful_values_pass(change):
    validate_hf_config(preset("tiny", **change))


# tests/cpu/conftest.py runs these in the xdist worker that imports vLLM anyway
VLLM_IN_PROCESS = {"test_presets_pass_vllm_and_the_harness", "test_what_vllm_refuses_the_harness_refuses"}


@pytest.fixture(scope="module")
def hyv4config():
    mod = pytest.importorskip("vllm.transformers_utils.configs.hy_v4")
    return mod.HYV4Config


def _vllm_refuses(cls, hf: dict) -> bool:
    try:
        cls(**hf)
    except Exception:  # noqa: BLE001 - strict validation raises several types
        return True
    return False


def test_presets_pass_vllm_and_the_harness(hyv4config):
    for name in PRESETS:
        hf = preset(name)
        validate_hf_config(hf)
        assert not _vllm_refuses(hyv4config, hf), name


@pytest.mark.parametrize("key,value,vllm_refuses", BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_what_vllm_refuses_the_harness_refuses(hyv4config, key, value, vllm_refuses):
    hf = preset("tiny", **{key: value})
    assert _vllm_refuses(hyv4config, hf) == vllm_refuses, "the table's vLLM column is out of date"
    with pytest.raises(ConfigError, match=key):
        validate_hf_config(hf)
