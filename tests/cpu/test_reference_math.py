"""Reference building blocks against independent computations: closed forms,
brute force, hypothesis invariants."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference import EXACT, RopeConfig, fp8, moe, rope
from reference.attention import attend
from reference.config import MTPConfig
from reference.indexer import select_topk
from reference.norms import rms_norm

seeds = st.integers(0, 2**16)


@given(seeds, st.floats(1e-3, 1e3))
def test_rms_norm_is_scale_invariant(seed, c):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 16, generator=g, dtype=torch.float64)
    w = torch.randn(16, generator=g, dtype=torch.float64)
    # eps=0 makes the invariance exact; with eps it holds up to eps/mean(x^2).
    torch.testing.assert_close(rms_norm(c * x, w, 0.0, EXACT), rms_norm(x, w, 0.0, EXACT), rtol=1e-12, atol=1e-12)


def test_rms_norm_hand_case():
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64)  # mean square 12.5
    y = rms_norm(x, torch.tensor([1.0, 2.0], dtype=torch.float64), 0.0, EXACT)
    torch.testing.assert_close(y, torch.tensor([[3 / math.sqrt(12.5), 8 / math.sqrt(12.5)]], dtype=torch.float64))


@given(seeds, st.integers(0, 5000))
def test_rope_preserves_norm_and_is_relative(seed, shift):
    cfg = RopeConfig()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 64, generator=g, dtype=torch.float64)
    k = torch.randn(1, 64, generator=g, dtype=torch.float64)

    def rot(x, p):
        c, s = rope.cos_sin(cfg, 64, torch.tensor([p]))
        return rope.apply_interleaved(x[:, None], c, s)[:, 0]

    torch.testing.assert_close(rot(q, 7 + shift).norm(), q.norm())
    a = (rot(q, 11) * rot(k, 4)).sum()
    b = (rot(q, 11 + shift) * rot(k, 4 + shift)).sum()
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_rope_rotates_interleaved_pairs():
    # Position 1, pair 0 has frequency 1: (1, 0) -> (cos 1, sin 1); NeoX would pair (0, 32).
    x = torch.zeros(1, 1, 64, dtype=torch.float64)
    x[0, 0, 0] = 1.0
    c, s = rope.cos_sin(RopeConfig(), 64, torch.tensor([1]))
    y = rope.apply_interleaved(x, c, s)[0, 0]
    assert y[0] == pytest.approx(math.cos(1.0)) and y[1] == pytest.approx(math.sin(1.0))
    assert torch.count_nonzero(y[2:]) == 0


def _all_e4m3() -> torch.Tensor:
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    return torch.unique(v[torch.isfinite(v)])


@given(st.floats(-500, 500, allow_nan=False))
def test_e4m3_rounds_to_nearest_even_and_saturates(x):
    grid = _all_e4m3()
    got = float(fp8.to_e4m3(torch.tensor([x])).to(torch.float64))
    xc = max(-448.0, min(448.0, x))
    dist = (grid - xc).abs()
    best = dist.min()
    assert abs(got - xc) == pytest.approx(float(best), abs=0.0)


def test_e4m3_ties_round_to_even():
    # Midpoints between neighbouring e4m3 values: 1.0625 sits between 1.0 (mantissa
    # 000, even) and 1.125 (001, odd); 1.1875 between 1.125 (odd) and 1.25 (010, even).
    x = torch.tensor([1.0625, 1.1875, -1.0625, 448.0 + 16.0, 0.0], dtype=torch.float64)
    got = fp8.to_e4m3(x).to(torch.float64).tolist()
    assert got == [1.0, 1.25, -1.0, 448.0, 0.0]


@given(st.integers(0, 254))
def test_ue8m0_decode_encode_roundtrip(b):
    byte = torch.tensor([b], dtype=torch.uint8)
    s = fp8.ue8m0_decode(byte)
    assert float(s) == 2.0 ** (b - 127)
    assert torch.equal(fp8.ue8m0_encode(s), byte)


def test_ue8m0_rejects_byte_255():
    with pytest.raises(ValueError, match="255"):
        fp8.ue8m0_decode(torch.tensor([255], dtype=torch.uint8))


@given(seeds, st.sampled_from([(128, 128), (64, 32), (16, 128)]), st.booleans())
def test_block_quantization_error_is_within_e4m3_bound(seed, block, ue8m0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(2 * block[0] + 3, block[1] + 5, generator=g, dtype=torch.float64)
    q, s = fp8.quantize_block(w, block, ue8m0)
    back = fp8.dequantize_block(q, s, block)
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 for normals;
    # subnormals (below 2^-6 * s) have absolute error <= 2^-10 * s.
    smax = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: w.shape[0], : w.shape[1]]
    bound = torch.maximum(w.abs() * 2.0**-4, smax * 2.0**-10)
    assert torch.all((back - w).abs() <= bound + 1e-15)
    if ue8m0:
        assert torch.all(torch.log2(s) == torch.round(torch.log2(s)))


def test_topk_brute_force_and_short_context():
    s = torch.tensor([0.5, 3.0, -1.0, 2.0, 2.5], dtype=torch.float64)
    assert select_topk(s, 3).tolist() == [1, 4, 3]
    assert select_topk(s, 8).tolist() == [1, 4, 3, 0, 2, -1, -1, -1]


def _attn_cfg(**kw) -> MTPConfig:
    base = dict(num_attention_heads=2, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, kv_lora_rank=10)
    base.update(kw)
    return MTPConfig().replace(**base)


def _naive_attention(cfg, w_kvb, q, kv_c, k_pe, sink):
    """Non-absorbed MLA: materialise k_nope, v per head, then softmax with sink."""
    nh, dn, dv = q.shape[0], cfg.qk_nope_head_dim, cfg.v_head_dim
    w = w_kvb.reshape(nh, dn + dv, -1)
    out = []
    for h in range(nh):
        k_nope = kv_c @ w[h, :dn].T
        v = kv_c @ w[h, dn:].T
        logits = (k_nope @ q[h, :dn] + k_pe @ q[h, dn:]) * cfg.softmax_scale
        num = torch.exp(logits)
        den = num.sum() + (math.exp(float(sink[h])) if sink is not None else 0.0)
        out.append((num / den) @ v)
    return torch.cat(out)


@given(seeds, st.integers(1, 9), st.booleans())
def test_absorbed_attention_equals_naive(seed, s, with_sink):
    cfg = _attn_cfg()
    g = torch.Generator().manual_seed(seed)
    nh = cfg.num_attention_heads
    w_kvb = torch.randn(nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank,
                        generator=g, dtype=torch.float64)
    q = torch.randn(nh, cfg.qk_head_dim, generator=g, dtype=torch.float64)
    kv_c = torch.randn(s, cfg.kv_lora_rank, generator=g, dtype=torch.float64)
    k_pe = torch.randn(s, cfg.qk_rope_head_dim, generator=g, dtype=torch.float64)
    sink = torch.randn(nh, generator=g, dtype=torch.float64) if with_sink else None
    got = attend(cfg, {"attn.kv_b_proj": w_kvb}, q, kv_c, k_pe, sink, EXACT)
    torch.testing.assert_close(got, _naive_attention(cfg, w_kvb, q, kv_c, k_pe, sink), rtol=1e-10, atol=1e-12)


def test_sink_of_minus_inf_changes_nothing():
    cfg = _attn_cfg()
    g = torch.Generator().manual_seed(0)
    lw = {"attn.kv_b_proj": torch.randn(2 * 14, 10, generator=g, dtype=torch.float64)}
    q = torch.randn(2, 12, generator=g, dtype=torch.float64)
    kv_c = torch.randn(5, 10, generator=g, dtype=torch.float64)
    k_pe = torch.randn(5, 4, generator=g, dtype=torch.float64)
    ninf = torch.full((2,), float("-inf"), dtype=torch.float64)
    torch.testing.assert_close(attend(cfg, lw, q, kv_c, k_pe, ninf, EXACT), attend(cfg, lw, q, kv_c, k_pe, None, EXACT))


def test_sink_single_key_closed_form():
    # One key: out = v * e^l / (e^l + e^sink).
    cfg = _attn_cfg(num_attention_heads=1)
    g = torch.Generator().manual_seed(1)
    lw = {"attn.kv_b_proj": torch.randn(14, 10, generator=g, dtype=torch.float64)}
    q = torch.randn(1, 12, generator=g, dtype=torch.float64)
    kv_c = torch.randn(1, 10, generator=g, dtype=torch.float64)
    k_pe = torch.randn(1, 4, generator=g, dtype=torch.float64)
    sink = torch.tensor([0.7], dtype=torch.float64)
    w = lw["attn.kv_b_proj"]
    logit = float((kv_c @ w[:8].T) @ q[0, :8] + k_pe @ q[0, 8:]) * cfg.softmax_scale
    v = (kv_c @ w[8:].T)[0]
    expect = v * math.exp(logit) / (math.exp(logit) + math.exp(0.7))
    torch.testing.assert_close(attend(cfg, lw, q, kv_c, k_pe, sink, EXACT), expect)


@given(seeds)
def test_routing_brute_force(seed):
    cfg = MTPConfig().replace(n_routed_experts=6, num_experts_per_tok=2, hidden_size=4, routed_scaling_factor=1.5)
    g = torch.Generator().manual_seed(seed)
    lw = {"mlp.gate": torch.randn(6, 4, generator=g, dtype=torch.float64),
          "mlp.expert_bias": torch.randn(6, generator=g, dtype=torch.float64)}
    x = torch.randn(3, 4, generator=g, dtype=torch.float64)
    r = moe.route(cfg, lw, x, EXACT)
    for t in range(3):
        s = torch.sigmoid(x[t] @ lw["mlp.gate"].T)
        choice = (s + lw["mlp.expert_bias"]).tolist()
        best = sorted(range(6), key=lambda e: -choice[e])[:2]
        assert set(r["topk_ids"][t].tolist()) == set(best)
        ws = torch.tensor([float(s[e]) for e in r["topk_ids"][t]], dtype=torch.float64)
        torch.testing.assert_close(r["topk_weights"][t], ws / ws.sum() * 1.5)


def test_swiglu_clamp_off_equals_plain_and_clamps_only_when_set():
    g = torch.linspace(-30, 30, 61, dtype=torch.float64)
    u = torch.linspace(30, -30, 61, dtype=torch.float64)
    plain = torch.nn.functional.silu(g) * u
    torch.testing.assert_close(moe.swiglu(g, u, None), plain)
    clamped = moe.swiglu(g, u, 10.0)
    torch.testing.assert_close(clamped, torch.nn.functional.silu(g.clamp(max=10)) * u.clamp(-10, 10))
    assert not torch.equal(clamped, plain)
    assert moe.clamp_limit(MTPConfig().replace(swiglu_limit=0.0)) is None
