"""Tensor parallelism on two GPUs: vLLM's HYV4MTP at TP = 2 (one spawned process per
rank, NCCL, vLLM's own per-rank sharding in ``load_weights``) against TP = 1 and the
float64 reference, component by component (``harness.production.tp.multigpu``).

    python -m pytest -m multigpu tests/gpu/test_multigpu.py

Checked per case: every component's ranks follow their TP rule (replicated ones
bitwise equal across ranks, head-sharded ones tile the TP = 1 shape), the
attention heads really are split, each rank holds its own slice of the learnable
sink, TP = 2 is within the reference tolerances of the spec and of TP = 1, and
the draft tokens agree wherever the logit margin decides them.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

# TP = 2 on this host's two GPUs: the registry's cases of role "tp" that run on one GPU or are
# written for TP = 2 (``gpus`` 2), in the role's order
TP = 2


def _tp_cases() -> dict:
    from harness import case_registry

    return {r.id: r.spec for r in case_registry.records(role="tp", max_gpus=TP) if r.gpus in (1, TP)}


_OUT = os.environ.get("HYV4_GPU_OUT") or os.environ.get("OUT")


@pytest.fixture(scope="module")
def tp2():
    from harness.production.tp.multigpu import TPWorkers
    with TPWorkers(TP) as w:
        yield w


def _record(res: dict) -> None:
    from harness.production.tp.multigpu import summary
    if not _OUT:
        return
    os.makedirs(_OUT, exist_ok=True)
    with open(os.path.join(_OUT, "gpu_multigpu.jsonl"), "a") as f:
        f.write(json.dumps(summary(res), default=str) + "\n")


def _check(res: dict, case) -> None:
    import reference as R
    from harness.production.case_inputs import case_inputs
    from harness.production.module.side_by_side import format_rows

    _record(res)
    problems = {k: v for k, v in res.details["rules"].items() if v.startswith("problem")}
    assert not problems, problems
    sharded = [k for k, v in res.details["rules"].items() if v.startswith("head-sharded")]
    assert any(k.endswith(".attn.q") for k in sharded), f"TP=2 did not split the heads: {res.details['rules']}"
    hf, _, weights = case_inputs(case)
    cfg = R.MTPConfig.from_hf_dict(hf)
    if cfg.learnable_sink:  # rank r holds heads [r H/2, (r+1) H/2) of the sink, as stored
        h = cfg.num_attention_heads // 2
        sink = weights["layers.0.attn.sink"].float()
        for r, sinks in res.details["sinks"].items():
            vals = list(sinks.values())
            assert vals, sinks
            got = torch.tensor(vals[0])
            assert torch.equal(got[:h], sink[r * h:(r + 1) * h]), (r, got[:h], sink[r * h:(r + 1) * h])
    bad = [r.note for r in res.details["rank_variant_vs_reference"] if not r.passed]
    assert not bad, f"a rank's own top-k rows differ from the reference beyond score ties: {bad}"
    assert res.parts["tp1"].passed, format_rows(res.parts["tp1"])
    assert res.parts["tpn"].passed, format_rows(res.parts["tpn"])
    vs = res.parts["tp_vs_tp1"]
    assert vs.passed, f"TP=2 vs TP=1: first divergent {vs.first_divergent.name}\n{vs.table()}"


@pytest.mark.parametrize("case_id", list(_tp_cases()))
def test_tp2_matches_tp1_and_reference(tp2, case_id):
    from harness.production.tp.multigpu import run_case_tp

    case = _tp_cases()[case_id]
    _check(run_case_tp(tp2, case), case)


@settings(deadline=None, suppress_health_check=list(HealthCheck))  # examples: the `gpu` profile (conftest.py)
@given(seed=st.integers(0, 2**16), requests=st.integers(1, 3), tokens=st.sampled_from([8, 40, 160, 300]),
       steps=st.integers(1, 3), share=st.booleans(), experts=st.sampled_from(["split", "fused"]))
def test_property_tp2_equals_tp1(tp2, seed, requests, tokens, steps, share, experts):
    """Random ragged batches, contexts below and above index_topk, sharing on/off."""
    from harness.production.tp.multigpu import run_case_tp
    from harness.case_specs import GpuCase

    case = GpuCase(f"prop-tp2-s{seed}-r{requests}-t{tokens}-k{steps}-{'share' if share else 'own'}-{experts}",
                   overrides=(("index_share_for_mtp_iteration", share),), seed=seed, requests=requests,
                   tokens=tokens, steps=steps, experts=experts)
    note(f"case id: {case.id} (GpuCase(...) fields are in the id)")
    _check(run_case_tp(tp2, case), case)
