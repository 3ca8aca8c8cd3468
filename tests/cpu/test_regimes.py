"""Regime coverage: the default bisect cases exercise every regime of
harness/regimes.py above its threshold, the probes leave the reference's outputs unchanged, and a
planted clamp-off bug fails the side by side of the clamp case at mlp.out."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import reference as R
from harness import case_registry as reg
from harness import regimes
from harness.production.case_inputs import case_inputs
from harness.production.module import side_by_side as sbs
from harness.production.judging.fp8_emulation import as_production_trace
from reference import probes

CLAMP_CASE = "tiny-k2-clamp-headwise"


@pytest.fixture(scope="module")
def measured() -> dict:
    return {cid: regimes.measure(reg.spec(cid, kind="module")) for cid in reg.ids(role="bisect", kind="module")}


def test_default_bisect_cases_cover_every_regime(measured):
    print("\n" + regimes.format_table(measured))
    assert regimes.uncovered(measured) == [], regimes.coverage(measured)
    assert measured[CLAMP_CASE]["routed_clamp_frac"] >= 0.05  # the bar, on one named case


def test_a_case_set_missing_a_regime_fails(measured):
    """The check can fail: without the clamp case, the clamp and the headwise gate go unexercised;
    the same case with the preset's swiglu_limit 10 clamps nothing."""
    without = {cid: v for cid, v in measured.items() if cid != CLAMP_CASE}
    assert {"routed_clamp_frac", "headwise_gate_rows"} <= set(regimes.uncovered(without))
    bf16_only = {cid: v for cid, v in measured.items() if reg.spec(cid, kind="module").quant == "bf16"}
    assert regimes.uncovered(bf16_only) == ["weight_ue8m0_rounded_frac"]  # the FP8 case brings it alone
    loose = dataclasses.replace(reg.spec(CLAMP_CASE, kind="module"), id="clamp-at-10",
                                overrides=(("swiglu_limit", 10.0), ("gating_type", "headwise")))
    values = regimes.measure(loose)
    assert values["routed_clamp_frac"] < 0.05
    assert "routed_clamp_frac" in regimes.uncovered({**without, loose.id: values})


def test_probes_leave_the_reference_bitwise_unchanged():
    case = reg.spec("tiny-k3-share", kind="module")
    hf, _, w = case_inputs(case)
    cfg = R.MTPConfig.from_hf_dict(hf)
    first = R.make_case(cfg, case.seed, case.requests, case.tokens)
    plain = R.flatten(R.draft(cfg, w, first, case.steps))
    with probes.recording() as rec:
        probed = R.flatten(R.draft(cfg, w, first, case.steps))
    assert not probes.active()
    assert set(rec) == {"moe.routed.gate_up", "attn.sink_share", "indexer.q_prequant", "indexer.k_prequant"}
    assert plain.keys() == probed.keys()
    for k in plain:
        assert torch.equal(plain[k], probed[k]), k


def test_clamp_fraction_is_the_share_of_clamped_elements():
    """Hand-checked values: gate clamps above L only, up on both sides."""
    cfg = R.MTPConfig(swiglu_limit=1.0, attention_sparse=False, learnable_sink=False, gated_mla=False)
    gu = torch.tensor([[[2.0, -3.0, 0.5, 0.5]], [[0.1, 0.2, -1.5, 0.3]]])  # [2, T=1, I=4]
    v = regimes.from_run(cfg, {}, {}, {"moe.routed.gate_up": [gu]}, steps=1)
    assert v["routed_clamp_gate_frac"] == 0.25  # 2.0 only (-3.0 is below the upper bound)
    assert v["routed_clamp_up_frac"] == 0.25  # -1.5
    assert v["routed_clamp_frac"] == 0.5
    off = regimes.from_run(cfg.replace(swiglu_limit=0.0), {}, {}, {"moe.routed.gate_up": [gu]}, steps=1)
    assert off["routed_clamp_frac"] == 0.0


def test_clamp_off_fails_the_clamp_case_at_mlp_out():
    """A production stand-in without the routed clamp (the reference with swiglu_limit off, bf16
    numerics) fails the side by side of the clamp case, first at mlp.out; with the clamp it passes."""
    case = reg.spec(CLAMP_CASE, kind="module")
    hf, _, w = case_inputs(case)
    cfg = R.MTPConfig.from_hf_dict(hf)
    first = R.make_case(cfg, case.seed, case.requests, case.tokens)

    def production(c):
        return as_production_trace(cfg, R.flatten(R.draft(c, w, first, case.steps, num=R.PRODUCTION)), case.steps)

    good = sbs.judge(case, production(cfg), {})
    assert good.passed, good.details["table"]
    assert good.regimes["routed_clamp_frac"] >= 0.05
    bad = sbs.judge(case, production(cfg.replace(swiglu_limit=0.0)), {})
    assert not bad.passed
    assert bad.first_divergent == "step0.mlp.out", bad.details["table"]


def test_each_bisect_case_reaches_the_regimes_it_is_chosen_for(measured):
    """The registry's ``regimes`` field: every bisect case reaches its declared regimes' thresholds,
    and together the declared regimes are every regime with a threshold."""
    from harness import case_registry as reg

    declared = set()
    for rec in reg.records(role="bisect", kind="module"):
        for name in rec.regimes:
            threshold = regimes.REGIMES[name].threshold
            assert threshold is not None and measured[rec.id][name] >= threshold, (rec.id, name)
        declared |= set(rec.regimes)
    assert declared == {n for n, r in regimes.REGIMES.items() if r.threshold is not None}
    assert all(not r.regimes for r in reg.REGISTRY if "bisect" not in r.roles)
