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
import torch

import reference as R
from harness.production.side_by_side import GPU_CASES, judge


def _as_production(cfg, trace: dict, steps: int) -> dict:
    fake = dict(trace)
    c0 = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
    for k in range(steps):
        if f"step{k}.indexer.topk" in fake:
            fake[f"step{k}.attn.topk"] = fake[f"step{k}.indexer.topk"]
        qs = fake.pop(f"step{k}.indexer.q_scale", None)
        if qs is not None:
            raw = (fake[f"step{k}.indexer.weights"] / (qs * c0)).to(torch.bfloat16)
            fake[f"step{k}.indexer.kw"] = torch.cat([fake[f"step{k}.indexer.k"].to(torch.bfloat16), raw], -1)
        for drop in ("indexer.scores", "moe.routed"):
            fake.pop(f"step{k}.{drop}", None)
    return fake


@pytest.mark.parametrize("case_id", ["tiny-k3-ragged", "tiny-k3-share", "tiny-k2-nosink"])
def test_judge_accepts_bf16_reference(case_id):
    case = GPU_CASES[case_id]
    cfg = R.MTPConfig.from_hf_dict(case.hf_config())
    w = R.random_weights(cfg, case.seed)
    first = R.make_case(cfg, case.seed, case.requests, case.tokens)
    fake = _as_production(cfg, R.flatten(R.draft(cfg, w, first, case.steps, num=R.PRODUCTION)), case.steps)
    res = judge(case, fake, {})
    assert res["passed"], res["table"]


def test_judge_rejects_a_dropped_sink():
    case = GPU_CASES["tiny-k1"]
    cfg = R.MTPConfig.from_hf_dict(case.hf_config())
    w = R.random_weights(cfg, case.seed)
    first = R.make_case(cfg, case.seed, case.requests, case.tokens)
    no_sink = cfg.replace(learnable_sink=False)
    wrong = R.flatten(R.draft(no_sink, {k: v for k, v in w.items() if not k.endswith("attn.sink")},
                              first, 1, num=R.PRODUCTION))
    res = judge(case, _as_production(cfg, wrong, 1), {})
    assert not res["passed"]
    assert res["first_divergent"] == "step0.attn.core", res["table"]
