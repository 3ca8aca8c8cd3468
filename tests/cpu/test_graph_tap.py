"""CPU: the graph-mode engine path (harness.production.engine.graph_tap) without vLLM.

What a CUDA-graph engine's speculator hands its graphs (recorded at the Python seams) becomes
the ``DraftCall`` list the engine replay judges; draft steps >= 2 are chained through the
reference's own hidden state. A faithful drafter passes, a stale hidden state or a wrong token
fails, the bookkeeping's target side comes from ``propose``'s arguments, and the tap restores
what it wrapped. The GPU tier runs the same code on vLLM's real speculator.
"""

from __future__ import annotations

import types

import pytest
import torch

import reference as R
from harness import case_registry
from harness.case_specs import EngineCase
from harness.production.engine.graph_tap import GraphStep, GraphTap, graph_calls, target_calls
from harness.production.engine.draft_replay import DraftCall, replay
from harness.production.engine.generation_judge import _graph_attribution, judge_run, verdict_problems
from harness.production.engine.taps import graph_replay_counts
from harness.production.engine.speculator_mutants import MUTANTS, SWEEPABLE

K = 3


def _faithful(cfg, w, requests=4, seed=7):
    """One engine step (a prefill of ``requests`` prompts) as a faithful graph-mode drafter
    records it: step 0's inputs, step 1's inputs (the hidden state kept from step 0, in bf16)
    and the K draft tokens, all from the reference's own draft."""
    first = R.make_case(cfg, seed, requests, 6 * requests)
    res = R.draft(cfg, w, first, K)
    lens = torch.bincount(first.request).tolist()
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    lti = first.last_rows()
    step = GraphStep(engine_step=0, num_reqs=requests, num_tokens=first.input_ids.numel(), query_start_loc=qsl,
                     request_keys=torch.arange(10, 10 + requests), seq_lens=torch.tensor(lens),
                     ids0=first.input_ids, positions0=first.positions, hidden0=first.hidden.to(torch.bfloat16),
                     last_token_indices=lti, ids1=res.inputs[1].input_ids, positions1=res.inputs[1].positions,
                     hidden1=res.inputs[1].hidden.to(torch.bfloat16), draft_tokens=res.tokens,
                     num_speculative_tokens=K, modes={"prefill": "FULL", "decode": "FULL"})
    return step, res


def _judge(cfg, w, steps):
    calls = graph_calls(steps, max_model_len=1024)
    props = [{"engine_step": s.engine_step, "num_speculative_tokens": K, "draft_tokens": s.draft_tokens}
             for s in steps]
    return calls, judge_run(cfg, w, calls, props, [], EngineCase("sim", num_speculative_tokens=K),
                            log=lambda *a: None)


@pytest.fixture(scope="module", params=["tiny-moe-sink-elementwise", "tiny-share-indexer"])
def sparse_case(request):
    # sparse attention; the second shares step 0's top-k rows
    case = case_registry.spec(request.param, kind="reference")
    return case.config(), case.weights()


def test_graph_calls_shape_the_steps_as_the_speculator_runs_them(sparse_case):
    cfg, w = sparse_case
    step, res = _faithful(cfg, w)
    calls = graph_calls([step], max_model_len=1024)
    assert [c.draft_step for c in calls] == [0, 1, 2]
    c0, c1, c2 = calls
    assert torch.equal(c0.sample_rows, step.last_token_indices) and torch.equal(c0.tokens, res.tokens[:, 0])
    assert c1.hidden is not None and torch.equal(c1.input_ids, step.ids1)
    # step 2: fed step 1's draft token at the next position, its hidden state chained by the replay
    assert c2.hidden is None and torch.equal(c2.input_ids, res.tokens[:, 1])
    assert torch.equal(c2.positions, step.positions1 + 1) and torch.equal(c2.seq_lens, c2.positions + 1)
    assert c2.query_start_loc.tolist() == list(range(step.num_reqs + 1))


def test_a_faithful_graph_mode_drafter_passes(sparse_case):
    cfg, w = sparse_case
    step, _ = _faithful(cfg, w)
    calls, rep = _judge(cfg, w, [step])
    c = rep["counts"]
    assert c["mismatches"] == 0 and c["replay_errors"] == 0, (c, rep["mismatch_examples"], rep["replay_errors"])
    assert c["compared"] > 0 and c["drafted"] == K * step.num_reqs and c["max_draft_steps"] == K
    assert any(x.hidden is None for x in calls)  # the chain was exercised


def test_a_stale_hidden_state_in_the_decode_graph_is_a_mismatch(sparse_case):
    """The decode graph read another buffer than the one Python wrote (zeros here): its drafts
    are wrong where the reference is decisive."""
    cfg, w = sparse_case
    step, _ = _faithful(cfg, w, requests=8, seed=3)
    import dataclasses

    stale = dataclasses.replace(step, hidden1=torch.zeros_like(step.hidden1))
    bad = replay(cfg, w, graph_calls([stale], max_model_len=1024))[1]  # draft step 1 on the stale buffer
    step.draft_tokens = step.draft_tokens.clone()
    step.draft_tokens[:, 1] = bad.tokens
    _, rep = _judge(cfg, w, [step])
    assert rep["counts"]["mismatches"] >= 1, rep["counts"]
    assert any("draft step 1" in f for f in rep["findings"]), rep["findings"]


def test_a_chained_step_without_a_previous_one_is_a_replay_error(sparse_case):
    cfg, w = sparse_case
    step, _ = _faithful(cfg, w)
    calls = graph_calls([step], max_model_len=1024)
    out = replay(cfg, w, [calls[2]])
    assert out[0].error and "never seen at a step 0" in out[0].error


def test_target_calls_take_the_rejection_samplers_counts():
    """A decode request with 3 rows whose sampler kept 2 tokens (1 draft accepted), and a prefill."""
    step = GraphStep(engine_step=0, num_reqs=2, num_tokens=5, query_start_loc=torch.tensor([0, 3, 5]),
                     request_keys=torch.tensor([4, 1]), seq_lens=None,
                     target_ids=torch.tensor([50, 51, 52, 60, 61]), target_positions=torch.tensor([9, 10, 11, 0, 1]),
                     target_hidden=torch.zeros(5, 2), num_sampled=torch.tensor([2, 1]),
                     last_sampled=torch.tensor([77, 88]))
    (tc,) = target_calls([step])
    assert tc.sample_rows.tolist() == [0, 1, 4] and tc.greedy.tolist() == [51, 77, 88]
    assert tc.request_keys.tolist() == [4, 1]
    # paired with draft calls that key requests another way (first KV block): their keys, same order
    (tc,) = target_calls([step], keys={0: torch.tensor([130, 70])})
    assert tc.request_keys.tolist() == [130, 70]


def test_graph_tap_records_at_the_seams_and_restores_them():
    """The tap on a stand-in speculator (the seams' names and order as in vLLM's propose)."""
    t, r, h = 5, 2, 4

    class Mgr:
        def run_fullgraph(self, desc):
            return "replayed"

    class Spec:
        num_speculative_steps = 2

        def __init__(self):
            self.input_buffers = types.SimpleNamespace(input_ids=torch.arange(8), positions=torch.arange(8) + 100)
            self.hidden_states = torch.ones(8, h)
            self.last_token_indices = torch.tensor([2, 4, 0])
            self.prefill_cudagraph_manager, self.decode_cudagraph_manager = Mgr(), Mgr()
            self.order = []

        def on_prefill_begin(self, num_reqs): self.order.append("begin")
        def on_prefill_end(self, num_reqs): self.order.append("end")
        def on_multi_step_decode_begin(self, num_reqs): self.order.append("decode")

        def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux, num_sampled,
                    num_rejected, last_sampled, *rest, dummy_run=False, **kw):
            self.on_prefill_begin(r)
            self.prefill_cudagraph_manager.run_fullgraph(None)
            self.on_prefill_end(r)
            self.on_multi_step_decode_begin(r)
            self.decode_cudagraph_manager.run_fullgraph(None)
            return torch.tensor([[7, 8], [9, 10]])

    attn = types.SimpleNamespace(is_sparse=False, mla_attn=None)
    layer = types.SimpleNamespace(mtp_block=types.SimpleNamespace(self_attn=attn))
    draft = types.SimpleNamespace(model=types.SimpleNamespace(layers={"0": layer}))
    spec = Spec()
    tap = GraphTap(spec, draft)
    ib = types.SimpleNamespace(num_reqs=r, num_tokens=t, query_start_loc=torch.tensor([0, 3, 5, 5]),
                               idx_mapping=torch.tensor([1, 0, 2]), seq_lens=torch.tensor([9, 2, 0]),
                               input_ids=torch.arange(t), positions=torch.arange(t))
    args = (ib, None, None, torch.zeros(t, h), None, torch.tensor([1, 1]), torch.zeros(2), torch.tensor([5, 6, 0]))
    spec.propose(*args)  # not armed: nothing recorded
    assert tap.steps == []
    tap.armed = True
    spec.propose(*args)
    spec.propose(*args, dummy_run=True)  # a dummy run is not an engine step
    tap.armed = False
    tap.remove()
    assert tap.errors == [], tap.errors
    (s,) = tap.steps
    assert s.ids0.tolist() == list(range(t)) and s.positions1.tolist() == [100, 101]
    assert s.last_token_indices.tolist() == [2, 4] and s.last_sampled.tolist() == [6, 5]
    assert s.draft_tokens.tolist() == [[7, 8], [9, 10]] and s.modes["decode"] == "FULL"
    assert graph_replay_counts(tap.steps) == {"prefill": {"FULL": 1}, "decode": {"FULL": 1}}
    for attr in ("propose", "on_prefill_begin", "on_prefill_end", "on_multi_step_decode_begin"):
        assert attr not in vars(spec), attr
    assert "run_fullgraph" not in vars(spec.decode_cudagraph_manager)


def test_graph_attribution_first_line():
    assert _graph_attribution(["engine step 3 ... draft_token"], {"passed": True, "problems": []})[0].startswith(
        "graph replay differs from eager (capture bug")
    lines = _graph_attribution(["x"], {"passed": False, "problems": ["engine step 1: attn.topk rows ..."]})
    assert lines[0].startswith("graph replay and eager both differ") and "attn.topk" in lines[0]


def test_graph_mode_not_exercised_is_a_problem():
    rep = {"drafter_mode": "CUDA graphs", "graph_replays": {"prefill": {"NONE": 3}, "decode": {"NONE": 3}},
           "counts": {"compared": 5, "max_context": 300, "index_topk": 128, "num_speculative_tokens": 3,
                      "max_draft_steps": 3}, "load": {"landed": {}}}
    assert any("CUDA-graph mode not exercised" in p for p in verdict_problems(rep))
    rep["graph_replays"]["decode"] = {"FULL": 3}
    assert not any("CUDA-graph" in p for p in verdict_problems(rep))


def test_capture_only_mutants_are_judged_in_both_modes():
    for name, m in MUTANTS.items():
        if m.passes_eager is None:  # an eager-path bug: planted on an eager case
            assert not case_registry.spec(m.case, kind="engine").graphs, name
            continue
        assert case_registry.spec(m.case, kind="engine").graphs, name
        assert not case_registry.spec(m.passes_eager, kind="engine").graphs, name
        assert m.expect == "graph replay differs from eager"
    assert any(MUTANTS[n].passes_eager for n in SWEEPABLE)  # the graph case's sweep has a capture-only bug to catch
    assert any(m.at_build for m in MUTANTS.values())


def test_every_capture_only_mutant_is_judged_on_its_eager_twin_once():
    """The eager half of a capture-only bug: its own engine when it patches capture (``at_build``,
    tests/gpu/test_speculator_mutants.py), else a row of the eager twin's sweep that must pass;
    every other swept mutant must be caught where it is swept."""
    from harness.production.engine.speculator_mutants import harmless_on, sweep_mutants, swept_cases

    swept = {c: sweep_mutants(c) for c in swept_cases()}
    for name, m in MUTANTS.items():
        rows = [c for c, names in swept.items() if name in names]
        if m.at_build:
            assert rows == [], name  # a live engine's capture has already run
        elif m.passes_eager:
            assert sorted(rows) == sorted([m.case, m.passes_eager]), name
            assert harmless_on(name, m.passes_eager) and not harmless_on(name, m.case), name
        else:
            assert rows == [m.case] and not harmless_on(name, m.case), name
    assert all(swept.values())  # a swept case's first pristine run is its engine case's judged run


def test_a_known_vllm_gap_is_matched_by_the_speculator_vllm_picked():
    import dataclasses as dc

    from harness.production.engine.generation_judge import case_from_dict, upstream_gap

    case = case_registry.spec("engine-accept-k2-two-layers-share", kind="engine")
    assert case_from_dict(dc.asdict(case)) == case
    rep = {"case": dc.asdict(case), "runner": {"proposer": "MultiModuleMTPSpeculator"}}
    assert upstream_gap(rep)[0] == "MultiModule"
    rep["runner"]["proposer"] = "MTPSpeculator"
    assert upstream_gap(rep) is None


def test_the_bookkeeping_pairs_the_seams_target_side_with_either_tap():
    """The target side from ``propose``'s arguments, checked against draft calls keyed like the
    seams (state rows) or like the eager re-run's per-forward tap (first KV block): no finding
    when ``target_calls`` is given the calls' keys, a 'batch' finding when it is not (the pairing
    earlier GPU runs got wrong)."""
    from harness.production.engine import bookkeeping

    gen = torch.Generator().manual_seed(2)
    lens, r = [5, 3], 2
    qsl = torch.tensor([0, 5, 8])
    tids = torch.randint(0, 500, (8,), generator=gen)
    last = torch.tensor([401, 402])
    ids0 = torch.cat([torch.cat([tids[a + 1:b], last[i:i + 1]]) for i, (a, b) in enumerate([(0, 5), (5, 8)])])
    pos = torch.cat([torch.arange(n) for n in lens])
    hid = torch.randn(8, 4, generator=gen).to(torch.bfloat16)
    step = GraphStep(engine_step=0, num_reqs=r, num_tokens=8, query_start_loc=qsl, request_keys=torch.tensor([3, 1]),
                     seq_lens=torch.tensor(lens), target_ids=tids, target_positions=pos, target_hidden=hid,
                     num_sampled=torch.tensor([1, 1]), last_sampled=last, ids0=ids0, positions0=pos, hidden0=hid,
                     last_token_indices=torch.tensor([4, 7]), draft_tokens=torch.tensor([[7], [9]]),
                     num_speculative_tokens=1)
    calls = graph_calls([step], max_model_len=1024)
    kw = dict(multi_module=False, num_layers=1, max_model_len=1024, prompts=[tids[:5].tolist(), tids[5:].tolist()])
    ok = bookkeeping.check(calls, target_calls([step]), **kw)
    assert ok["findings"] == [] and ok["checked"]["requests_steps"] == r, ok["findings"]
    eager = [DraftCall(c.engine_step, c.draft_step, c.input_ids, c.positions, c.hidden, c.query_start_loc,
                       torch.tensor([64, 128]), last_token_indices=c.last_token_indices, sample_rows=c.sample_rows,
                       tokens=c.tokens) for c in calls]  # keyed by first KV block
    bad = bookkeeping.check(eager, target_calls([step]), **kw)
    assert any(f.what == "batch" for f in bad["findings"]), bad["findings"]
    keys = {c.engine_step: c.request_keys for c in eager if c.draft_step == 0}
    good = bookkeeping.check(eager, target_calls([step], keys=keys), **kw)
    assert good["findings"] == [], good["findings"]
