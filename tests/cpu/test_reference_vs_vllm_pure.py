"""The reference against vLLM's own pure-PyTorch functions, run on CPU.

These pin the reference to what vLLM 0.33 computes for RoPE (all three
rope types HY V4 configs use) and MoE routing, without any GPU kernel.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference import EXACT, RopeConfig, moe, rope
from reference.config import MTPConfig

vllm = pytest.importorskip("vllm", reason="vLLM is not installed")

ROPE_PARAMS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0},
    "deepseek_yarn": {"rope_type": "deepseek_yarn", "rope_theta": 10000.0, "factor": 4.0,
                      "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
                      "mscale": 1.0, "mscale_all_dim": 0.7},
}


@pytest.fixture(scope="module")
def vllm_cpu_context():
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        yield


@pytest.mark.parametrize("kind", sorted(ROPE_PARAMS))
def test_rope_matches_vllm(kind, vllm_cpu_context):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = ROPE_PARAMS[kind]
    vr = get_rope(64, max_position=8192, rope_parameters=dict(params), is_neox_style=False, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    pos = torch.tensor([0, 1, 5, 777, 2048, 4000])
    q = torch.randn(6, 3, 64, generator=g, dtype=torch.float32)
    k = torch.randn(6, 1, 64, generator=g, dtype=torch.float32)
    vq, vk = vr.forward_native(pos, q.clone(), k.clone())
    cfg = RopeConfig.from_hf(params, None)
    c, s = rope.cos_sin(cfg, 64, pos)
    rq = rope.apply_interleaved(q.double(), c, s)
    rk = rope.apply_interleaved(k.double(), c, s)
    # vLLM's cos/sin cache and rotation are float32 here: one fp32 rounding of
    # angles up to ~4000 rad (absolute error ~ 4000 * 2^-24 ~ 2.4e-4) dominates.
    torch.testing.assert_close(vq.double(), rq, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(vk.double(), rk, atol=2e-3, rtol=1e-3)


@given(st.integers(0, 2**16), st.sampled_from([(8, 2), (16, 4), (256, 8)]), st.booleans())
def test_routing_matches_vllm_grouped_topk(seed, shape, renorm):
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import grouped_topk

    e, k = shape
    cfg = MTPConfig().replace(n_routed_experts=e, num_experts_per_tok=k, hidden_size=16,
                              routed_scaling_factor=2.827, norm_topk_prob=renorm)
    g = torch.Generator().manual_seed(seed)
    lw = {"mlp.gate": torch.randn(e, 16, generator=g, dtype=torch.float64),
          "mlp.expert_bias": 0.05 * torch.randn(e, generator=g, dtype=torch.float64)}
    x = torch.randn(5, 16, generator=g, dtype=torch.float64)
    ref = moe.route(cfg, lw, x, EXACT)
    logits = ref["router_logits"].float()
    w, ids = grouped_topk(x.float(), logits, k, renorm, num_expert_group=1, topk_group=1,
                          scoring_func="sigmoid", routed_scaling_factor=2.827,
                          e_score_correction_bias=lw["mlp.expert_bias"].float())
    for t in range(5):
        assert set(ids[t].tolist()) == set(ref["topk_ids"][t].tolist())
        got = dict(zip(ids[t].tolist(), w[t].double().tolist()))
        want = dict(zip(ref["topk_ids"][t].tolist(), ref["topk_weights"][t].tolist()))
        for eid in want:
            # fp32 sigmoid/normalisation in vLLM vs float64 here.
            assert got[eid] == pytest.approx(want[eid], rel=1e-5, abs=1e-6)
