"""Outside cross-check: HF transformers 5.23's ``hy_v4`` components against
the float64 reference, on identical weights, every convention difference aligned in
``hf_adapter`` (one named alignment each), everything else to float64 rounding.

Runs in its own environment (transformers 5.23, no vLLM):
    tox -e hf      or      HYV4_REQUIREMENTS=requirements/hf.txt ./with-env python -m pytest -m hf tests/hf
In the default environment (vLLM 0.33 pins transformers 5.20.2) every test here is skipped
before transformers is imported (HYV4_HF_ANY_VERSION=1 runs them there too: 5.20.2 ships a
``hy_v4`` with the same math, see tests/hf/README.md).
"""

from __future__ import annotations

import importlib.metadata
import math
import os

import pytest
from packaging.version import Version

HOW = "run `tox -e hf` or `HYV4_REQUIREMENTS=requirements/hf.txt ./with-env python -m pytest -m hf tests/hf`"
try:
    _TRANSFORMERS = importlib.metadata.version("transformers")
except importlib.metadata.PackageNotFoundError:
    pytest.skip(f"HF cross-check: transformers is not installed; {HOW}", allow_module_level=True)
# The cross-check's target is the pin of requirements/hf.txt. The default env's transformers
# (5.20.2, pinned by vLLM 0.33) has hy_v4 too, with the same math (see tests/hf/README.md), but is
# skipped here (without importing it) so the default CPU tier stays as fast as it was;
# HYV4_HF_ANY_VERSION=1 runs these tests on whatever transformers has hy_v4.
if Version(_TRANSFORMERS) < Version("5.23") and os.environ.get("HYV4_HF_ANY_VERSION", "") in ("", "0"):
    pytest.skip(f"HF cross-check targets transformers 5.23 (requirements/hf.txt), this env has "
                f"{_TRANSFORMERS}; {HOW}", allow_module_level=True)
pytest.importorskip("transformers.models.hy_v4.modeling_hy_v4",
                    reason=f"HF cross-check: transformers {_TRANSFORMERS} has no hy_v4; {HOW}")

import torch  # noqa: E402
from hypothesis import given, strategies as st  # noqa: E402

import hf_adapter as A  # noqa: E402
from reference import MTPConfig, RopeConfig, layer_weights, make_case, probes, random_weights  # noqa: E402

pytestmark = pytest.mark.hf

# Tolerance, relative to max(1, max|reference|) of the compared tensor: float64 rounding only.
# Each compared value is a chain of at most ~12 float64 ops whose reductions run over at most
# 2*hidden = 128 (indexer: index_head_dim = 128) terms, summed in another order or grouping than
# the reference's (HF expands kv_b_proj into per-head keys/values where the reference absorbs it
# into the query; HF adds experts in hit order; rotate-half vs interleaved RoPE pairs). With
# u = 2**-53 ~ 1.1e-16 the usual bound n*u*sum|terms| over such a chain stays below ~3e-13 for
# O(1) activations; 1e-12 absorbs that and is 10**6 below the smallest misalignment effect
# measured here (an eps of 1e-5 vs 1e-6 moves the indexer scores by ~1e-6..1e-5).
REL_TOL = 1e-12

# Compared per token row (rows whose indexer top-k has an exact tie at the boundary are left
# out downstream of the indexer: HF's torch.topk and the reference's stable sort may keep
# different, equally valid keys there).
ROW_COMPONENTS = ("enorm", "hnorm", "eh_proj", "attn.out", "attn.residual", "moe.router_logits",
                  "moe.routed", "moe.shared", "mlp.out", "final_norm")
UPSTREAM_OF_TOPK = ("enorm", "hnorm", "eh_proj")


def tiny(**kw) -> MTPConfig:
    """A small MTP config: hidden 64, 2 heads, 8 experts (top 2), index_topk 4, yarn RoPE
    with mscale_all_dim (so the softmax scale differs between conventions), clamp binding."""
    base = dict(
        vocab_size=64, hidden_size=64, intermediate_size=48, moe_intermediate_size=16,
        num_attention_heads=2, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        index_topk=4, index_head_dim=128, index_n_heads=4, swiglu_limit=1.0,
        rope=RopeConfig(rope_type="yarn", factor=4.0, original_max_position=32, mscale=1.0,
                        mscale_all_dim=0.707))
    base.update(kw)
    cfg = MTPConfig(**base)
    cfg.validate()
    return cfg


def _tied_rows(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Rows whose k-th and (k+1)-th highest finite scores are equal (an ambiguous top-k)."""
    tied = torch.zeros(scores.shape[0], dtype=torch.bool)
    for i, row in enumerate(scores):
        s = torch.sort(row[torch.isfinite(row)], descending=True).values
        if s.numel() > k and s[k - 1] - s[k] <= 1e-12 * max(1.0, float(s.abs().max())):
            tied[i] = True
    return tied


def compare(cfg: MTPConfig, seed: int = 0, requests: int = 2, tokens: int = 8, skip=frozenset(),
            lengths=None) -> tuple[dict, list, int]:
    """Run the reference and HF on the same weights and inputs; returns
    ({component: max abs diff}, [failures], rows left out for top-k ties)."""
    weights = random_weights(cfg, seed)
    first = make_case(cfg, seed, requests=requests, tokens=tokens, lengths=lengths)
    context = int(first.positions.max()) + 1
    with probes.recording() as rec:  # only reads values (tests/cpu/test_regimes.py)
        ref = A.reference_step(cfg, weights, first, skip)
    limit = cfg.swiglu_limit if cfg.swiglu_limit and cfg.swiglu_limit > 0 else math.inf
    compare.clamped = sum(int((g[0] > limit).sum() + (g[1].abs() > limit).sum())
                          for g in rec.get("moe.routed.gate_up", []))  # entries the clamp changed
    block = A.build(cfg, layer_weights(weights, 0), context=context, skip=skip)
    got = A.mtp_step(block, first.input_ids, first.positions, first.hidden, first.request)

    diffs, failures = {}, []

    def check(name, a, b, rows=None):
        if rows is not None:
            a, b = a[rows], b[rows]
        if a.numel() == 0:
            return
        fin = torch.isfinite(b)
        if not torch.equal(torch.isfinite(a), fin):
            failures.append(f"{name}: -inf pattern differs")
            return
        d = float((a[fin] - b[fin]).abs().max()) if fin.any() else 0.0
        scale = max(1.0, float(b[fin].abs().max())) if fin.any() else 1.0
        diffs[name] = max(diffs.get(name, 0.0), d)
        if not d <= REL_TOL * scale:
            failures.append(f"{name}: max abs diff {d:.3e} > {REL_TOL * scale:.1e}")

    t = first.input_ids.numel()
    keep = torch.ones(t, dtype=torch.bool)
    if cfg.attention_sparse:
        check("indexer.scores", got["indexer.scores"], ref["indexer.scores"])
        tied = _tied_rows(ref["indexer.scores"], cfg.index_topk)
        keep &= ~tied
        ref_sets = [sorted(x for x in row.tolist() if x >= 0) for row in ref["indexer.topk"]]
        bad = [i for i in range(t) if keep[i] and ref_sets[i] != got["indexer.topk_sets"][i]]
        if bad:
            failures.append(f"indexer.topk: {len(bad)} rows select other keys (first row {bad[0]}: "
                            f"reference {ref_sets[bad[0]]}, HF {got['indexer.topk_sets'][bad[0]]})")
    if cfg.mlp_moe:
        ref_ids = [set(r.tolist()) for r in ref["moe.topk_ids"]]
        got_ids = [set(r.tolist()) for r in got["moe.topk_ids"]]
        bad = [i for i in range(t) if keep[i] and ref_ids[i] != got_ids[i]]
        if bad:
            failures.append(f"moe.topk_ids: {len(bad)} rows route to other experts")
        # weights per expert id (HF's topk is unsorted)
        gw = torch.stack([w[torch.argsort(i)] for w, i in zip(got["moe.topk_weights"], got["moe.topk_ids"])])
        rw = torch.stack([w[torch.argsort(i)] for w, i in zip(ref["moe.topk_weights"], ref["moe.topk_ids"])])
        check("moe.topk_weights", gw, rw, keep)
    for name in ROW_COMPONENTS:
        if name in got and name in ref:
            check(name, got[name], ref[name], None if name in UPSTREAM_OF_TOPK else keep)
    last = first.last_rows()
    check("logits", got["logits"], ref["logits"], keep[last])
    if not torch.equal(got["draft_token"][keep[last]], ref["draft_token"][keep[last]]):
        failures.append("draft_token differs")
    return diffs, failures, int((~keep).sum())


# ---- fixed variants ------------------------------------------------------------------------

VARIANTS = {
    "yarn-sink-elementwise-topk-below-context": {},
    "default-rope": dict(rope=RopeConfig(rope_type="default", theta=10000.0)),
    "yarn-attention-factor-untruncated": dict(rope=RopeConfig(
        rope_type="yarn", factor=8.0, original_max_position=16, attention_factor=0.9, truncate=False,
        beta_fast=16.0, beta_slow=2.0)),
    "yarn-mscale-only": dict(rope=RopeConfig(rope_type="yarn", factor=40.0, original_max_position=8,
                                             mscale=0.707)),
    "no-sink": dict(learnable_sink=False),
    "headwise-gate": dict(gating_type="headwise"),
    "no-gate": dict(gated_mla=False),
    "topk-above-context": dict(index_topk=64),
    "swiglu-limit-0": dict(swiglu_limit=0.0),
    "clamp-not-binding": dict(swiglu_limit=1e3),
    "no-shared-expert": dict(n_shared_experts=0),
    "dense-mlp": dict(mlp_moe=False),
    "dense-attention": dict(attention_sparse=False),  # sink loaded but not applied (vLLM)
    "dense-attention-dense-mlp-no-sink": dict(attention_sparse=False, mlp_moe=False, learnable_sink=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mtp_components_match_reference(variant):
    cfg = tiny(**VARIANTS[variant])
    diffs, failures, left_out = compare(cfg, seed=3, requests=2, tokens=9)
    print(variant, {k: f"{v:.2e}" for k, v in diffs.items()}, f"tied rows left out: {left_out}",
          f"clamped entries: {compare.clamped}")
    assert not failures, failures
    if cfg.mlp_moe:  # the clamp binds where the variant says so (limit 1.0 on O(1) activations)
        assert (compare.clamped > 0) == (0 < cfg.swiglu_limit < 100), compare.clamped
    assert left_out <= 4, f"{left_out} of the rows were tied at the top-k boundary"


@st.composite
def configs(draw):
    rope_kind = draw(st.sampled_from(["default", "yarn"]))
    if rope_kind == "default":
        rope = RopeConfig(rope_type="default", theta=draw(st.sampled_from([100.0, 10000.0])))
    else:
        opt = lambda *v: draw(st.sampled_from([None, *v]))  # noqa: E731
        rope = RopeConfig(rope_type="yarn", theta=draw(st.sampled_from([100.0, 10000.0])),
                          factor=draw(st.sampled_from([2.0, 4.0, 40.0])),
                          original_max_position=draw(st.sampled_from([8, 16, 64])),
                          mscale=opt(0.707, 1.0), mscale_all_dim=opt(0.707, 1.0),
                          attention_factor=opt(0.8, 1.3), truncate=draw(st.booleans()))
    gate = draw(st.sampled_from(["elementwise", "headwise", "none"]))
    return tiny(
        rope=rope, learnable_sink=draw(st.booleans()), gated_mla=gate != "none",
        gating_type="headwise" if gate == "headwise" else "elementwise",
        attention_sparse=draw(st.booleans()), mlp_moe=draw(st.booleans()),
        index_topk=draw(st.sampled_from([1, 3, 6, 64])),
        swiglu_limit=draw(st.sampled_from([0.0, 0.3, 1.0, 1e3])),
        n_shared_experts=draw(st.sampled_from([0, 1])))


@given(cfg=configs(), seed=st.integers(0, 2**16), requests=st.integers(1, 3), tokens=st.integers(2, 10))
def test_mtp_components_match_reference_over_configs(cfg, seed, requests, tokens):
    _, failures, _ = compare(cfg, seed=seed, requests=requests, tokens=tokens)
    assert not failures, failures


# ---- each alignment is needed: leaving one out makes the comparison fail -------------------

# alignment -> a config where it matters
NEEDED_IN = {
    "float64": {},
    "rope_layout": {},
    "qkv_a_norm_eps": {},
    "index_k_norm_eps": {},
    "softmax_scale": {},
    "indexer_fp8": {},
    "swiglu_limit": dict(swiglu_limit=0.0),
    "sink": dict(learnable_sink=False),
    "gate": dict(gated_mla=False),  # (headwise without it does not even load: build raises)
    "dense_attention": dict(attention_sparse=False),
}


def test_needed_in_covers_every_alignment():
    assert set(NEEDED_IN) == set(A.ALIGNMENTS)


@pytest.mark.parametrize("alignment", list(NEEDED_IN))
def test_each_alignment_is_needed(alignment):
    cfg = tiny(**NEEDED_IN[alignment])
    _, ok, _ = compare(cfg, seed=3, requests=2, tokens=9)
    assert not ok, ok
    _, failures, _ = compare(cfg, seed=3, requests=2, tokens=9, skip={alignment})
    assert failures, f"leaving out {alignment!r} still agreed to float64 rounding"
    print(alignment, failures[:3])


def test_float64_alignment_removes_only_float32_rounding():
    """HF as it is (its float32 casts kept): agrees to float32 rounding, not float64's."""
    cfg = tiny(index_topk=64)  # no top-k selection, so float32 noise cannot flip a key
    diffs, failures, _ = compare(cfg, seed=3, requests=2, tokens=9, skip={"float64"})
    assert failures
    for name, d in diffs.items():
        assert d < 2e-5, (name, d)  # float32: u = 6e-8, times the reduction lengths above
    assert max(diffs.values()) > 1e-9


# ---- the HF-vs-vLLM differences of tests/hf/README.md, as asserted facts ---------------

def _hf_attention(cfg: MTPConfig, layer_type: str, sink: float):
    config = A.hf_config(cfg, context=8)
    config.layer_types = [layer_type]
    with A.hf_float64():
        attn = A.hf.HYV4Attention(config, 0)
        rotary = A.hf.HYV4RotaryEmbedding(config)
    attn.to(torch.float64)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.2)
        attn.sinks.fill_(sink)
    x = torch.randn(1, 6, cfg.hidden_size, generator=gen, dtype=torch.float64)
    pos = torch.arange(6)[None]
    with A.hf_float64(), torch.no_grad():
        out = attn(x, rotary(x, pos), A.causal_mask(6), position_ids=pos)[0]
    return attn, out


def test_hf_applies_the_sink_on_dense_attention_layers_vllm_does_not():
    """Open question 1: HF 5.23 has no dense-attention layer kind. With layer_types
    'full_attention' it builds the same HYV4Attention (indexer and sinks), and its eager
    attention adds the sinks on every layer; vLLM 0.33 (and the reference) apply none on a
    dense-attention layer (MTPConfig.sink_applied)."""
    cfg = tiny(attention_sparse=False, learnable_sink=True, index_topk=64)
    assert not cfg.sink_applied
    attn, out0 = _hf_attention(cfg, "full_attention", 0.0)
    assert attn.indexer is not None and attn.sinks.shape == (cfg.num_attention_heads,)
    _, out_big = _hf_attention(cfg, "full_attention", 3.0)
    _, out_none = _hf_attention(cfg, "full_attention", float("-inf"))
    assert (out0 - out_big).abs().max() > 1e-3  # the sink value changes HF's output
    assert (out0 - out_none).abs().max() > 1e-3  # even its default logit 0.0 is a sink


@given(factor=st.sampled_from([1.0, 2.0, 4.0, 40.0]), omax=st.sampled_from([8, 64, 4096]),
       mscale=st.sampled_from([None, 0.0, 0.707, 1.0]), mscale_all_dim=st.sampled_from([None, 0.0, 0.707, 1.0]),
       attention_factor=st.sampled_from([None, 0.8, 1.3]), truncate=st.booleans(),
       beta=st.sampled_from([(32.0, 1.0), (16.0, 2.0)]), theta=st.sampled_from([100.0, 1e4, 1e6]))
def test_hf_reads_the_yarn_keys_as_vllm(factor, omax, mscale, mscale_all_dim, attention_factor, truncate,
                                        beta, theta):
    """Open question 2: HF 5.23's yarn reads attention_factor, mscale, mscale_all_dim and truncate
    as vLLM 0.33's YaRNScalingRotaryEmbedding (the reference's RopeConfig): the cos/sin
    magnitude and the inverse frequencies agree (float64, HF's float32 lifted)."""
    from reference import rope as ref_rope

    r = RopeConfig(rope_type="yarn", theta=theta, factor=factor, original_max_position=omax,
                   mscale=mscale, mscale_all_dim=mscale_all_dim, attention_factor=attention_factor,
                   truncate=truncate, beta_fast=beta[0], beta_slow=beta[1])
    cfg = tiny(rope=r)
    with A.hf_float64():
        rotary = A.hf.HYV4RotaryEmbedding(A.hf_config(cfg, context=8))
    assert rotary.attention_scaling == pytest.approx(ref_rope.mscale(r), rel=1e-15, abs=0)
    want = ref_rope.inv_freq(r, cfg.qk_rope_head_dim)
    assert rotary.inv_freq.dtype == torch.float64
    torch.testing.assert_close(rotary.inv_freq, want, rtol=1e-14, atol=0)
    # the softmax scale: HF's yarn_apply_mscale == the reference's 'hf' convention
    with A.hf_float64():
        attn = A.hf.HYV4Attention(A.hf_config(cfg, context=8), 0)
    assert attn.scaling == pytest.approx(cfg.replace(softmax_scale_convention="hf").softmax_scale, rel=1e-15)
    if factor > 1 and mscale_all_dim:
        assert attn.scaling != pytest.approx(cfg.softmax_scale, rel=1e-6)  # vLLM: no mscale**2


def test_hf_has_no_deepseek_yarn():
    """vLLM 0.33 builds DeepseekScalingRotaryEmbedding for rope_type deepseek_yarn; HF 5.23's
    ROPE_INIT_FUNCTIONS has no such type (HYV4RotaryEmbedding raises KeyError)."""
    config = A.HYV4Config(num_hidden_layers=1, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                          rope_parameters={"rope_type": "deepseek_yarn", "rope_theta": 1e4, "factor": 4.0,
                                           "original_max_position_embeddings": 64})
    with pytest.raises(KeyError, match="deepseek_yarn"):
        A.hf.HYV4RotaryEmbedding(config)


def test_hf_swiglu_limit_zero_zeroes_the_routed_experts():
    """HF 5.23's HYV4Experts clamps whatever swiglu_limit is (its config docstring says values
    at or below zero disable the clamp): with 0, clamp(up, -0, 0) = 0 and every routed expert
    outputs 0. vLLM 0.33 clamps only when swiglu_limit > 0."""
    cfg = tiny(swiglu_limit=0.0)
    w = layer_weights(random_weights(cfg, 1), 0)
    block = A.build(cfg, w, context=8, skip={"swiglu_limit"})
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with A.hf_float64(), torch.no_grad():
        _, weights, idx = block.mlp.gate(x)
        routed = block.mlp.experts(x, idx, weights)
    assert block.mlp.experts.swiglu_limit == 0.0
    assert torch.count_nonzero(routed) == 0
    aligned = A.build(cfg, w, context=8)
    with A.hf_float64(), torch.no_grad():
        assert torch.count_nonzero(aligned.mlp.experts(x, idx, weights)) > 0


def test_hf_defaults_that_differ_from_vllm():
    """The eps and scale defaults the alignments undo, read off HF's modules."""
    cfg = tiny()
    with A.hf_float64():
        attn = A.hf.HYV4Attention(A.hf_config(cfg, context=8), 0)
    assert attn.q_a_layernorm.variance_epsilon == 1e-6 != cfg.rms_norm_eps
    assert attn.kv_a_layernorm.variance_epsilon == 1e-6
    assert attn.indexer.k_norm.eps == cfg.rms_norm_eps == 1e-5  # vLLM: 1e-6
    assert attn.gate_proj.weight.shape == (cfg.num_attention_heads * cfg.v_head_dim, cfg.hidden_size)
    assert float(attn.sinks.detach().abs().max()) == 0.0  # learnable_sink_init: a sink logit of 0


def test_hf_has_no_mtp_module():
    """HF 5.23 ignores the checkpoint's MTP layers and has no eh_proj / enorm / hnorm; its decoder
    layer wraps attention and MLP in iHC hyper-connections (vLLM's MTP block has none)."""
    hf = A.hf
    assert r"model\.mtp_layers\..*" in hf.HYV4PreTrainedModel._keys_to_ignore_on_load_unexpected
    assert not [n for n in dir(hf) if "mtp" in n.lower() or "nextn" in n.lower()]
    config = A.hf_config(tiny(), context=8)
    with A.hf_float64():
        layer = hf.HYV4DecoderLayer(config, 0)
    assert hasattr(layer, "attn_hc") and hasattr(layer, "ffn_hc")
    assert math.isfinite(config.hc_eps)


def test_hf_loads_the_rope_rows_as_stored():
    """HF 5.23's checkpoint conversion for hy_v4 only renames tensors (sinks, gate_proj, iHC):
    no permutation of the rope rows. HF rotates rotate-half pairs, vLLM interleaved pairs, so
    on one checkpoint the two compute different RoPE unless one of them permutes; the
    cross-check permutes ("rope_layout") to compare the rest."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    ops = get_checkpoint_conversion_mapping("hy_v4")
    assert ops and {type(op).__name__ for op in ops} == {"WeightRenaming"}
