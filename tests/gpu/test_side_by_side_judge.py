"""CPU check of the side-by-side judge (runs without a GPU).

Feeds ``judge`` a stand-in "production" trace: the reference itself with
PRODUCTION numerics (bf16 storage, fp32 accumulation), reshaped to what the
hooks capture (``attn.topk`` every sparse step, q scale folded into the
indexer weights, ``indexer.kw`` raw). The judge must pass it under
``GPU_VS_REFERENCE`` (the tolerances are not tighter than bf16 itself), and
must fail a trace with one semantic change (the attention sink ignored).
"""

from __future__ import annotations

import pytest

import reference as R
from harness.production.judging.fp8_emulation import as_production_trace as _as_production
from harness import case_registry
from harness.production.judging.trace_judge import judge


@pytest.mark.parametrize("case_id", ["tiny-k3-ragged", "tiny-k3-share", "tiny-k2-nosink"])
def test_judge_accepts_bf16_reference(case_id):
    case = case_registry.spec(case_id, kind="module")
    cfg = R.MTPConfig.from_hf_dict(case.hf_config())
    w = R.random_weights(cfg, case.seed)
    first = R.make_case(cfg, case.seed, case.requests, case.tokens)
    fake = _as_production(cfg, R.flatten(R.draft(cfg, w, first, case.steps, num=R.PRODUCTION)), case.steps)
    res = judge(case, fake, {})
    assert res.passed, res.details["table"]


def test_judge_rejects_a_dropped_sink():
    case = case_registry.spec("tiny-k1", kind="module")
    cfg = R.MTPConfig.from_hf_dict(case.hf_config())
    w = R.random_weights(cfg, case.seed)
    first = R.make_case(cfg, case.seed, case.requests, case.tokens)
    no_sink = cfg.replace(learnable_sink=False)
    wrong = R.flatten(R.draft(no_sink, {k: v for k, v in w.items() if not k.endswith("attn.sink")},
                              first, 1, num=R.PRODUCTION))
    res = judge(case, _as_production(cfg, wrong, 1), {})
    assert not res.passed
    assert res.first_divergent == "step0.attn.core", res.details["table"]
