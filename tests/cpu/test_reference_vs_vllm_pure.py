"""The reference against vLLM's own pure-PyTorch functions, run on CPU.

These pin the reference to what vLLM 0.33 computes for RoPE (every rope type
and parameter HY V4's get_rope call reads, from config.json through vLLM's
own config loader) and MoE routing, without any GPU kernel. The comparisons
live in ``harness.mutants`` (the CPU mutants reuse them); each says which
rounding its tolerance absorbs.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.mutants import ROPE_PARAMS, rope_cross_check, routing_cross_check

# vLLM is imported when this module's first test runs, not at collection (every xdist worker collects
# the whole suite; `import vllm` costs ~5 s of CPU); where it is missing every test here skips, as the
# module-level importorskip did. VLLM_IN_PROCESS: tests/cpu/conftest.py runs these tests in one worker.
VLLM_IN_PROCESS = True


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    pytest.importorskip("vllm", reason="vLLM is not installed")


@pytest.mark.parametrize("kind", sorted(ROPE_PARAMS))
def test_rope_matches_vllm(kind):
    assert rope_cross_check(kind) == []


_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}
_DSY = dict(_YARN, rope_type="deepseek_yarn")

# The readings that once differed between the reference and vLLM, pinned: each moves q / k_pe by
# 8-100 % when read another way.
READINGS = {
    "yarn-attention_factor": {"rope_parameters": dict(_YARN, attention_factor=1.3)},
    "yarn-mscale-pair": {"rope_parameters": dict(_YARN, mscale=1.0, mscale_all_dim=0.707)},
    "yarn-mscale-alone": {"rope_parameters": dict(_YARN, mscale=0.707)},  # YaRN ignores a lone mscale
    "yarn-truncate-false": {"rope_parameters": dict(_YARN, truncate=False, beta_fast=24, beta_slow=2)},
    "yarn-original-max-from-max_position": {"rope_parameters": {"rope_type": "yarn", "factor": 2.0},
                                            "max_position_embeddings": 2048},
    "yarn-top-level-original-max": {"rope_parameters": dict(_YARN), "original_max_position_embeddings": 256},
    "deepseek_yarn-attn_factor-unread": {"rope_parameters": dict(_DSY, attn_factor=1.5, attention_factor=2.0,
                                                                 truncate=False)},
    "deepseek_yarn-no-original-max": {"rope_parameters": {"rope_type": "deepseek_yarn", "factor": 4.0}},
    "yarn-no-factor": {"rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 64}},
    "legacy-rope_scaling-type": {"rope_parameters": None, "rope_theta": 30000.0,
                                 "rope_scaling": {"type": "yarn", "factor": 2.0,
                                                  "original_max_position_embeddings": 512}},
    "top-level-rope_theta": {"rope_parameters": {"rope_type": "default"}, "rope_theta": 50000.0},
    "partial_rotary_factor": {"rope_parameters": dict(_YARN, partial_rotary_factor=0.5)},
    "top-level-partial_rotary_factor": {"rope_parameters": {"rope_type": "default"}, "partial_rotary_factor": 0.25},
    "rope_dim": {"rope_parameters": dict(_DSY, rope_dim=32)},
    "rope_dim-wins-over-partial_rotary_factor": {"rope_parameters": {"rope_type": "default", "rope_dim": 32,
                                                                     "partial_rotary_factor": 2.0}},
    "rotary_pct": {"rope_parameters": {"rope_type": "default"}, "rotary_pct": 0.5},
    "rotary_emb_base-unread": {"rope_parameters": {"rope_type": "default"}, "rotary_emb_base": 50000.0},
    "deepseek_llama_scaling": {"rope_parameters": dict(_DSY, rope_type="deepseek_llama_scaling")},
    "linear-refused": {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
}


@pytest.mark.parametrize("reading", sorted(READINGS))
def test_rope_reading_matches_vllm(reading):
    assert rope_cross_check(READINGS[reading]) == []


_opt = lambda *values: st.sampled_from((None,) + values)  # noqa: E731 (None: key absent)


@st.composite
def rope_configs(draw) -> dict:
    """config.json rope keys over every parameter vLLM's yarn / deepseek_yarn / default RoPE reads."""
    rope_type = draw(st.sampled_from(["default", "yarn", "deepseek_yarn"]))
    params = {"type" if draw(st.booleans()) else "rope_type": rope_type}
    values = {
        "rope_theta": _opt(10000.0, 50000.0),
        "factor": st.one_of(st.sampled_from([1.0, 4.0, 40.0]), st.floats(1.0, 64.0)),
        "original_max_position_embeddings": _opt(64, 1024, 4096),
        "beta_fast": _opt(32, 8.0, 64),
        "beta_slow": _opt(1, 0.5, 2.0),
        "mscale": _opt(0.0, 0.707, 1.0),
        "mscale_all_dim": _opt(0.0, 0.707, 1.0),
        "attention_factor": _opt(0.5, 1.3),
        "truncate": _opt(True, False),
        "partial_rotary_factor": _opt(0.5, 1.0),
        "attn_factor": _opt(1.5),  # read by no vLLM code
    }
    for key, strategy in values.items():
        if rope_type == "default" and key not in ("rope_theta", "partial_rotary_factor", "attn_factor"):
            continue
        value = draw(strategy)
        if value is not None:
            params[key] = value
    top = {"rope_parameters": params}
    if draw(st.booleans()) and "rope_theta" not in params:
        top["rope_theta"] = 20000.0
    return top


@given(rope_configs())
def test_rope_parameters_read_as_vllm_reads_them(hf_keys):
    assert rope_cross_check(hf_keys) == []


@given(st.integers(0, 2**16), st.sampled_from([(8, 2), (16, 4), (256, 8)]), st.booleans())
def test_routing_matches_vllm_grouped_topk(seed, shape, renorm):
    experts, topk = shape
    assert routing_cross_check(seed, experts, topk, renorm, tokens=5) == []


# ---- production numerics (bf16) against vLLM's own pure functions: bitwise ------------------------

def test_production_rms_norm_rounds_as_vllm():
    """Two roundings (normalized x to bf16, then x * weight in bf16), as vLLM's rms_norm /
    fused_add_rms_norm; bitwise equal, no tolerance."""
    import torch
    from vllm.ir.ops.layernorm import fused_add_rms_norm, rms_norm

    from reference import PRODUCTION
    from reference.norms import rms_norm as ref_rms_norm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g).to(torch.bfloat16)
    res = torch.randn(64, 256, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(256, generator=g)).to(torch.bfloat16)
    got = rms_norm.impls["native"].impl_fn(x, w, 1e-5)
    assert torch.equal(got, ref_rms_norm(x.double(), w.double(), 1e-5, PRODUCTION))
    got_fused, _ = fused_add_rms_norm.impls["native"].impl_fn(x, res, w, 1e-5)
    # the reference's final_norm: the fp32 sum, unrounded, is normalized (as the fused kernel does)
    assert torch.equal(got_fused, ref_rms_norm(x.float() + res.float(), w.double(), 1e-5, PRODUCTION))


@pytest.mark.parametrize("kind", sorted(ROPE_PARAMS))
def test_production_rope_table_is_vllms_bf16_table(kind):
    """bf16 cos/sin built from float32 frequencies and angles: vLLM's cos_sin_cache, bitwise."""
    import torch
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding as re_mod

    from reference import PRODUCTION, RopeConfig, rope

    params = dict(ROPE_PARAMS[kind], attention_factor=1.3) if kind == "yarn" else ROPE_PARAMS[kind]
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        vr = re_mod.get_rope(64, max_position=8192, rope_parameters=dict(params), is_neox_style=False,
                             dtype=torch.bfloat16)
    pos = torch.arange(0, 4096, 7)
    c, s = rope.cos_sin(RopeConfig.from_hf(params, None), 64, pos, PRODUCTION)
    assert vr.cos_sin_cache.dtype == c.dtype == torch.bfloat16
    assert torch.equal(vr.cos_sin_cache[pos], torch.cat([c, s], dim=-1))
