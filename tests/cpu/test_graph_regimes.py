"""CPU: the graph regimes of the CUDA-graph engine cases (harness.production.engine.graph_regimes).

What vLLM did on each ``propose`` (recorded by ``GraphTap`` at the speculator's seams) becomes one
count per regime; a graph case declares the regimes it is for and fails, naming the regime, when
one did not run; the graph-bisect set covers every required regime; the tap records the seams of
a stand-in proposer shaped like both releases' (0.33's ``_generate_draft``, 0.34's ``_decode``).
"""

from __future__ import annotations

import types

import pytest
import torch

from harness import case_registry as reg
from harness.production.engine import graph_regimes as gr
from harness.production.engine.graph_tap import GraphStep, GraphTap
from harness.production.engine.generation_judge import verdict_problems


def _step(i, r, k, *, decode="FULL", prefill="FULL", facts=None):
    return GraphStep(engine_step=i, num_reqs=r, num_tokens=r * (k + 1), query_start_loc=torch.arange(r + 1),
                     request_keys=torch.arange(r), seq_lens=None, draft_tokens=torch.zeros(r, k, dtype=torch.long),
                     num_speculative_tokens=k, modes={"prefill": prefill, "decode": decode}, facts=facts or {})


def test_a_k3_non_sharing_host_rebuild_run_is_measured_as_such():
    rebuilt = {"metadata_rebuild_steps": [1, 2], "decode_graph_tokens": 4}
    steps = [_step(0, 3, 3, prefill="NONE", facts=rebuilt), _step(1, 3, 3, facts=rebuilt),
             _step(2, 2, 3, facts={"metadata_rebuild_steps": [1, 2], "decode_graph_tokens": 2})]
    m = gr.measure(steps, {"index_sharing": False, "supports_decode_metadata_update": False})
    assert m["decode_full_graph"] == 3 and m["draft_steps_ge2"] == 3 and m["indexer_at_step_ge2"] == 3
    assert m["metadata_host_rebuild"] == 3 and m["metadata_in_graph_update"] == 0
    assert m["decode_metadata_per_step"] == 3 and m["index_sharing"] == 0
    assert m["padded_rows"] == 2 and m["batch_shrink"] == 1  # 3 rows in a graph of 4, then 2 in 2
    assert m["prefill_eager"] == 1 and m["prefill_full_graph"] == 2
    declared = reg.BY_ID["engine-graphs-accept-k3-noshare"].spec.graph_regimes
    assert gr.problems(declared, m) == []


def test_a_declared_regime_that_did_not_run_fails_naming_it():
    # index sharing on: steps >= 2 reuse step 0's rows, the indexer never runs there
    steps = [_step(0, 4, 3, facts={"metadata_rebuild_steps": [1, 2], "decode_graph_tokens": 4})]
    m = gr.measure(steps, {"index_sharing": True})
    assert m["index_sharing"] == 1 and m["indexer_at_step_ge2"] == 0 and m["padded_rows"] == 0
    lines = gr.problems(("indexer_at_step_ge2", "padded_rows", "draft_steps_ge2"), m)
    assert [line.split(":")[1].split("(")[0].strip() for line in lines] == ["indexer_at_step_ge2", "padded_rows"]
    assert gr.problems(("x",), None) == ["graph regimes not recorded (declared: x)"]
    # K = 2: one decode step, no step >= 2 whatever else ran; an eager decode is not a graph's
    m2 = gr.measure([_step(0, 3, 2, decode="NONE", facts={"decode_eager_steps": 1})], {"index_sharing": False})
    assert m2["draft_steps_ge2"] == m2["decode_full_graph"] == m2["indexer_at_step_ge2"] == 0
    assert m2["decode_eager"] == 1


def test_in_place_metadata_update_counts_as_per_step_metadata():
    steps = [_step(0, 4, 4, facts={"decode_graph_tokens": 4})]  # fused: one replay, no host rebuild
    m = gr.measure(steps, {"index_sharing": False, "supports_decode_metadata_update": True})
    assert m["metadata_in_graph_update"] == 1 and m["metadata_host_rebuild"] == 0
    assert m["decode_metadata_per_step"] == 1


def test_the_verdict_fails_a_graph_case_whose_regime_did_not_run():
    case = {"graph_regimes": ["indexer_at_step_ge2"]}
    rep = {"drafter_mode": "CUDA graphs", "graph_replays": {"prefill": {"FULL": 3}, "decode": {"FULL": 3}},
           "graph_regimes": {**{k: 1 for k in gr.GRAPH_REGIMES}, "indexer_at_step_ge2": 0}, "case": case,
           "counts": {"compared": 5, "max_context": 300, "index_topk": 128, "num_speculative_tokens": 3,
                      "max_draft_steps": 3}, "load": {"landed": {}}}
    assert any(p.startswith("graph regime not exercised: indexer_at_step_ge2") for p in verdict_problems(rep))
    rep["graph_regimes"]["indexer_at_step_ge2"] = 2
    assert not any("graph regime" in p for p in verdict_problems(rep))
    rep["drafter_mode"] = "eager (forced) in a CUDA-graph engine"  # the eager re-run judges numbers only
    rep["graph_regimes"]["indexer_at_step_ge2"] = 0
    assert not any("graph regime" in p for p in verdict_problems(rep))


def test_every_graph_case_declares_known_regimes_and_the_graph_bisect_set_covers_the_required():
    graph_cases = [r for r in reg.records(kind="engine") if r.spec.graphs]
    for r in reg.records(kind="engine"):
        assert bool(r.spec.graph_regimes) == r.spec.graphs, r.id  # declared exactly on graph cases
        assert set(r.spec.graph_regimes) <= set(gr.GRAPH_REGIMES), r.id
    assert set(gr.REQUIRED) <= set(gr.GRAPH_REGIMES)
    bisect = reg.records(role="graph-bisect", kind="engine")
    covered = {x for r in bisect for x in r.spec.graph_regimes}
    assert set(gr.REQUIRED) <= covered, set(gr.REQUIRED) - covered
    # and the set is the smallest: no graph-bisect case can be dropped
    for r in bisect:
        rest = {x for o in bisect if o is not r for x in o.spec.graph_regimes}
        assert not set(gr.REQUIRED) <= rest, f"{r.id} is not needed for the coverage"
    assert len(graph_cases) >= 3


@pytest.mark.parametrize("eager_step", ["_generate_draft", "_decode"])
def test_the_tap_records_the_decode_seams_of_either_release(eager_step):
    """A stand-in proposer with both releases' seams: per-step host rebuild + FULL replay (the
    FLASHMLA_SPARSE fallback), then the same with the decode eager (no graph for the batch)."""
    class Mgr:
        def run_fullgraph(self, desc): return None

    class Spec:
        supports_decode_metadata_update = False
        share_mtp_topk_indices = False

        def __init__(self):
            self.prefill_cudagraph_manager, self.decode_cudagraph_manager = Mgr(), Mgr()
            self.prefill_cudagraph_manager.use_breakable_cg = False

        def _build_uniform_attn_metadata(self, **kw): return {}

        def on_prefill_begin(self, num_reqs): return None
        on_prefill_end = on_multi_step_decode_begin = on_prefill_begin

        def eager(self, *a): return None

        def propose(self, input_batch, *rest, graph=True, **kw):
            r = input_batch.num_reqs
            self.prefill_cudagraph_manager.run_fullgraph(types.SimpleNamespace(num_tokens=16))
            for step in (1, 2):
                self._build_uniform_attn_metadata(num_reqs=r, step=step)
                if graph:
                    self.decode_cudagraph_manager.run_fullgraph(types.SimpleNamespace(num_tokens=4))
                else:
                    getattr(self, eager_step)(r)
            return torch.zeros(r, 3, dtype=torch.long)

    setattr(Spec, eager_step, Spec.eager)
    spec = Spec()
    draft = types.SimpleNamespace(model=types.SimpleNamespace(layers={"0": types.SimpleNamespace(
        mtp_block=types.SimpleNamespace(self_attn=types.SimpleNamespace(is_sparse=False, mla_attn=None)))}))
    tap = GraphTap(spec, draft)
    ib = types.SimpleNamespace(num_reqs=3, num_tokens=12, query_start_loc=torch.tensor([0, 4, 8, 12]),
                               idx_mapping=torch.arange(3), input_ids=torch.arange(12), positions=torch.arange(12))
    tap.armed = True
    spec.propose(ib)
    spec.propose(ib, graph=False)
    tap.armed = False
    tap.remove()
    assert tap.errors == [], tap.errors
    assert tap.facts["index_sharing"] is False and tap.facts["supports_decode_metadata_update"] is False
    assert eager_step in tap.facts["seams"] and "_build_uniform_attn_metadata" in tap.facts["seams"]
    a, b = tap.steps
    assert a.facts == {"prefill_graph_tokens": 16, "metadata_rebuild_steps": [1, 2], "decode_graph_tokens": 4}
    assert b.facts["decode_eager_steps"] == 2 and "decode_graph_tokens" not in b.facts
    m = gr.measure(tap.steps, tap.facts)
    assert m["metadata_host_rebuild"] == 1 and m["padded_rows"] == 1 and m["decode_eager"] == 1
    assert m["indexer_at_step_ge2"] == 2 and m["decode_full_graph"] == 1
    for attr in ("_build_uniform_attn_metadata", eager_step, "propose"):
        assert attr not in vars(spec), attr


def test_a_regime_not_run_is_not_attributed_to_capture():
    """A graph case whose only problem is a declared regime that did not run keeps that line first
    (no eager re-run, no "graph replay differs from eager"): coverage, not a capture bug; numeric
    problems are attributed and the regime lines follow them."""
    from harness.production.engine.generation_judge import _graph_attribution, split_regime_problems

    reg_line = gr.problems(("padded_rows",), {"padded_rows": 0})[0]
    assert split_regime_problems([reg_line]) == ([], [reg_line])
    numeric, regime = split_regime_problems(["engine step 2, draft step 2: draft_token 5 != 7", reg_line])
    lines = _graph_attribution(numeric, {"passed": True, "problems": []}) + regime
    assert lines[0].startswith("graph replay differs from eager") and "draft step 2" in lines[0]
    assert lines[-1] == reg_line and not lines[-1].startswith("graph replay")
