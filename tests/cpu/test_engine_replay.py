"""CPU: the bookkeeping of the engine-level test (harness.production.engine / engine_replay).

Request mapping from query_start_loc + block tables, row matching of the sampled
rows, the replay's KV semantics (rejected positions overwritten, unwritten ones
reported), index sharing, the token verdict and the run facts. No vLLM needed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import reference as R
from harness import case_registry
from harness.trace_compare import logit_margin_decisive
from harness.production.engine.generation_judge import verdict_problems, worst_exit_code
from harness.production.engine.taps import match_rows
from harness.production.engine.draft_replay import (CallReplay, DraftCall, RequestRegistry, judge_tokens, replay,
                                                    run_facts, token_requests)
from harness.production.judging.tolerances import tolerances_for

LOGITS_TOL = tolerances_for("bf16")["logits"]


def _qsl(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())


def _call(step, k, inp: R.StepInput, keys, sample_rows=None, **kw) -> DraftCall:
    lengths = torch.bincount(inp.request).tolist()
    return DraftCall(step, k, inp.input_ids, inp.positions, inp.hidden.to(torch.bfloat16), _qsl(lengths),
                     torch.tensor(keys), sample_rows=sample_rows, **kw)


def test_token_requests_from_query_start_loc():
    assert token_requests(torch.tensor([0, 3, 4, 7]), 7).tolist() == [0, 0, 0, 1, 2, 2, 2]
    assert token_requests(torch.tensor([0, 0, 2]), 2).tolist() == [1, 1]  # an empty request
    with pytest.raises(ValueError):
        token_requests(torch.tensor([0, 3, 2]), 2)
    with pytest.raises(ValueError):
        token_requests(torch.tensor([0, 3]), 4)


def test_registry_follows_block_keys_and_restarts_at_position_zero():
    reg = RequestRegistry()
    hid = torch.zeros(5, 2)
    c0 = DraftCall(0, 0, torch.zeros(5, dtype=torch.long), torch.tensor([0, 1, 2, 0, 1]), hid,
                   torch.tensor([0, 3, 5]), torch.tensor([40, 7]))
    assert reg.assign(c0).tolist() == [0, 0, 0, 1, 1]
    # next step, batch reordered: ids follow the block keys, not the batch order
    c1 = DraftCall(0, 1, torch.zeros(2, dtype=torch.long), torch.tensor([2, 3]), hid[:2],
                   torch.tensor([0, 1, 2]), torch.tensor([7, 40]))
    assert reg.assign(c1).tolist() == [1, 0]
    # a recycled block at position 0 of a step 0 is a new request
    c2 = DraftCall(1, 0, torch.zeros(2, dtype=torch.long), torch.tensor([0, 1]), hid[:2],
                   torch.tensor([0, 2]), torch.tensor([40]))
    assert reg.assign(c2).tolist() == [2, 2]


def test_match_rows_finds_gathered_copies():
    out = torch.randn(6, 4).to(torch.bfloat16)
    rows, amb = match_rows(out[[5, 1, 3]].clone(), out)
    assert rows.tolist() == [5, 1, 3] and amb == 0
    out[2] = out[1]
    rows, amb = match_rows(torch.stack([out[1], torch.ones(4, dtype=torch.bfloat16)]), out)
    assert rows.tolist() == [1, -1] and amb == 2


@pytest.mark.parametrize("case_id", ["tiny-moe-sink-elementwise", "tiny-share-indexer"])
def test_replay_of_one_proposal_is_the_reference_draft(case_id):
    """Calls laid out as the engine records one propose(): the replay reproduces reference.draft
    (step 0 exactly; steps >= 1 are fed bf16 hidden states, so within the token verdict)."""
    case = case_registry.spec(case_id, kind="reference")
    cfg, w, first = case.config(), case.weights(), case.first_step()
    res = R.draft(cfg, w, first, case.steps)
    last = first.last_rows()
    calls = []
    for k, inp in enumerate(res.inputs):
        calls.append(_call(0, k, inp, [9, 3], sample_rows=last if k == 0 else torch.arange(len(last))))
    reps = replay(cfg, w, calls)
    assert not [r.error for r in reps if r.error]
    assert torch.equal(reps[0].tokens, res.tokens[:, 0])
    assert torch.equal(reps[0].logits, res.traces[0]["logits"])
    for c, r in zip(calls, res.traces):
        c.tokens, c.logits = r["draft_token"], r["logits"].float()
    verdict = judge_tokens(calls, reps, LOGITS_TOL)
    assert verdict["mismatches"] == 0 and verdict["drafted"] == len(last) * case.steps
    assert verdict["compared"] + verdict["ties"] == verdict["drafted"]
    # production's top-k rows forced: the same rows give the same tokens
    for c, r in zip(calls, res.traces):
        c.topk_rows = r["attn.topk"].to(torch.int32)
    forced = replay(cfg, w, calls)
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(forced, reps))
    assert sum(r.topk_rows_differing for r in forced) == 0


def _engine_calls(cfg, gen, rejected_step: bool):
    """Prefill of 2 requests (K=2), then the next engine step's step 0 over positions L..L+2.
    With ``rejected_step`` a draft step 1 writes garbage at position L first (a rejected draft)."""
    first = R.make_case(cfg, 5, 2, 6)
    last = first.last_rows()
    calls = [_call(0, 0, first, [11, 4], sample_rows=last)]
    lens = torch.bincount(first.request)
    if rejected_step:
        junk = R.StepInput(torch.randint(0, cfg.vocab_size, (2,), generator=gen), lens.clone(),
                           torch.randn(2, cfg.hidden_size, generator=gen).to(torch.bfloat16).double(),
                           torch.arange(2))
        calls.append(_call(0, 1, junk, [11, 4], sample_rows=torch.arange(2)))
    gen.manual_seed(1)  # the engine step's inputs are the same in both runs
    pos = torch.cat([torch.arange(int(n), int(n) + 3) for n in lens])
    step = R.StepInput(torch.randint(0, cfg.vocab_size, (6,), generator=gen), pos,
                       torch.randn(6, cfg.hidden_size, generator=gen).to(torch.bfloat16).double(),
                       torch.arange(2).repeat_interleave(3))
    calls.append(_call(1, 0, step, [11, 4], sample_rows=torch.tensor([0, 4])))  # accepted 0 and 1
    return calls


def test_rejected_positions_are_overwritten_by_the_next_step():
    case = case_registry.spec("tiny-moe-sink-elementwise", kind="reference")
    cfg, w = case.config(), case.weights()
    clean = replay(cfg, w, _engine_calls(cfg, torch.Generator().manual_seed(0), False))
    dirty = replay(cfg, w, _engine_calls(cfg, torch.Generator().manual_seed(0), True))
    assert not [r.error for r in clean + dirty if r.error]
    assert torch.equal(clean[-1].logits, dirty[-1].logits)
    assert torch.equal(clean[-1].trace["final_norm"], dirty[-1].trace["final_norm"])


def test_a_position_nothing_wrote_is_reported_not_read():
    case = case_registry.spec("tiny-moe-sink-elementwise", kind="reference")
    cfg, w = case.config(), case.weights()
    calls = _engine_calls(cfg, torch.Generator().manual_seed(0), False)
    calls[-1].positions = calls[-1].positions + 2  # skips two positions of each request
    reps = replay(cfg, w, calls)
    assert reps[0].error is None and "UnwrittenKVError" in reps[-1].error
    assert judge_tokens(calls[-1:], reps[-1:], LOGITS_TOL)["drafted"] == 0  # no production tokens set


def test_index_sharing_without_step0_is_an_error_not_a_crash():
    case = case_registry.spec("tiny-share-indexer", kind="reference")
    cfg, w, first = case.config(), case.weights(), case.first_step()
    res = R.draft(cfg, w, first, 2)
    call = _call(0, 1, res.inputs[1], [1, 2], sample_rows=torch.arange(2))
    (rep,) = replay(cfg, w, [call])
    assert rep.error and "index sharing" in rep.error


def test_judge_counts_ties_and_decisive_mismatches():
    logits = torch.zeros(3, 8)
    logits[0, 2] = 5.0                     # decisive: token 2
    logits[1, 3], logits[1, 4] = 1.0, 0.99  # near-tie
    logits[2, 6] = 4.0                     # decisive: token 6
    assert logit_margin_decisive(logits[0], LOGITS_TOL) and not logit_margin_decisive(logits[1], LOGITS_TOL)
    call = DraftCall(0, 0, torch.zeros(3, dtype=torch.long), torch.arange(3), torch.zeros(3, 2),
                     torch.tensor([0, 1, 2, 3]), torch.tensor([1, 2, 3]), sample_rows=torch.arange(3),
                     tokens=torch.tensor([2, 4, 5]), logits=logits)
    v = judge_tokens([call], [CallReplay(torch.tensor([2, 3, 6]), logits.double(), {})], LOGITS_TOL)
    assert (v["drafted"], v["compared"], v["ties"], v["ties_differing"], v["mismatches"]) == (3, 2, 1, 1, 1)
    assert v["mismatch_examples"][0]["production"] == 5 and v["mismatch_examples"][0]["reference"] == 6


def test_run_facts_steps_acceptance_and_proposals():
    def c(step, k, pos, qsl, keys, toks):
        return DraftCall(step, k, torch.zeros(len(pos), dtype=torch.long), torch.tensor(pos), torch.zeros(len(pos), 2),
                         torch.tensor(qsl), torch.tensor(keys), sample_rows=torch.arange(len(toks)),
                         tokens=torch.tensor(toks))
    calls = [c(0, 0, [0, 1, 2], [0, 3], [7], [5]), c(0, 1, [3], [0, 1], [7], [6]),
             c(1, 0, [3, 4], [0, 2], [7], [1]), c(1, 1, [4], [0, 1], [7], [2]),
             c(2, 0, [5, 6], [0, 2], [7], [3]), c(2, 1, [6], [0, 1], [7], [4])]
    props = [{"engine_step": 0, "draft_tokens": torch.tensor([[5, 6]])},
             {"engine_step": 1, "draft_tokens": torch.tensor([[1, 9]])}]
    f = run_facts(calls, props)
    assert f["engine_steps"] == 3 and f["max_draft_steps"] == 2 and f["max_context"] == 7
    assert f["accepted_drafts_per_step"] == {"0": 2}  # step 0 sampled its first row: none accepted
    assert f["proposal_token_disagreements"] == 1
    assert f["step0_rejected_rows"] == 4  # step 0 samples row 0 of 2-3 rows: the rows after it are rejected
    assert f["sampled_row_not_last_token_index"] == 0
    # a propose(num_speculative_tokens=0) returns -1s and samples nothing: not a disagreement
    props.append({"engine_step": 2, "num_speculative_tokens": 0, "draft_tokens": torch.tensor([[-1, -1]])})
    assert run_facts(calls, props)["proposal_token_disagreements"] == 1


def test_verdict_and_exit_codes():
    counts = {"mismatches": 0, "compared": 5, "replay_errors": 0, "not_replayed": 0, "calls_without_logits": 0,
              "unmatched_sample_rows": 0, "tap_errors": 0, "proposal_token_disagreements": 0,
              "max_context": 200, "index_topk": 128, "num_speculative_tokens": 3, "max_draft_steps": 3}
    rep = {"counts": counts, "load": {"audit": [], "landed": {"enorm": True}}}
    assert verdict_problems(rep) == []
    rep["counts"] = dict(counts, max_draft_steps=1, mismatches=2, max_context=100)
    assert len(verdict_problems(rep)) == 3
    assert worst_exit_code([0, 125]) == 125 and worst_exit_code([125, 1, 0]) == 1 and worst_exit_code([0]) == 0


def _simulated_engine(cfg, k_steps=2, engine_steps=3, stale=True):
    """Calls shaped like a V2 MTP proposer's: a prefill, then per engine step a step 0 over K+1 rows
    per request (sampled row = last accepted = ``last_token_indices``; with ``stale`` the rejected rows
    after it hold stale ids / positions, as prepare_prefill_inputs leaves them) and K-1 one-token
    steps; metadata seq_lens as vLLM builds them."""
    gen, junk = torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)
    first = R.make_case(cfg, 7, 2, 6)
    lens = torch.bincount(first.request).tolist()
    keys = [21, 6]

    def rnd(n):
        return (torch.randint(0, cfg.vocab_size, (n,), generator=gen),
                torch.randn(n, cfg.hidden_size, generator=gen).to(torch.bfloat16))

    calls, start = [], list(lens)
    calls.append(DraftCall(0, 0, first.input_ids, first.positions, first.hidden.to(torch.bfloat16), _qsl(lens),
                           torch.tensor(keys), sample_rows=first.last_rows(), last_token_indices=first.last_rows(),
                           seq_lens=torch.tensor(lens)))
    for e in range(engine_steps):
        for k in range(1, k_steps):
            ids, hid = rnd(2)
            pos = torch.tensor([s + k - 1 for s in start])
            calls.append(DraftCall(e, k, ids, pos, hid, _qsl([1, 1]), torch.tensor(keys),
                                   sample_rows=torch.arange(2), seq_lens=pos + 1))
        acc = [e % k_steps, 0]
        ids, hid = rnd(2 * (k_steps + 1))
        pos = torch.cat([torch.arange(s, s + k_steps + 1) for s in start])
        last = torch.tensor([acc[0], k_steps + 1 + acc[1]])
        if stale:  # (own generator: the other inputs stay the same with and without)
            for r, a in enumerate(acc):
                bad = slice(r * (k_steps + 1) + a + 1, (r + 1) * (k_steps + 1))
                pos[bad] = torch.randint(0, 3 * k_steps, (bad.stop - bad.start,), generator=junk)
                ids[bad] = torch.randint(0, cfg.vocab_size, (bad.stop - bad.start,), generator=junk)
        calls.append(DraftCall(e + 1, 0, ids, pos, hid, _qsl([k_steps + 1] * 2), torch.tensor(keys),
                               sample_rows=last, last_token_indices=last,
                               seq_lens=torch.tensor([s + k_steps + 1 for s in start])))
        start = [s + a + 1 for s, a in zip(start, acc)]
    return calls


def test_judge_run_report_of_a_faithful_engine_passes():
    import json

    from harness.case_specs import EngineCase
    from harness.production.engine.generation_judge import judge_run

    case = case_registry.spec("tiny-share-indexer", kind="reference")
    cfg, w = case.config(), case.weights()
    calls = _simulated_engine(cfg)
    for c, r in zip(calls, replay(cfg, w, calls)):
        c.tokens, c.logits = r.tokens.clone(), r.logits.float()
    props = [{"engine_step": e, "draft_tokens": torch.stack([c.tokens for c in calls if c.engine_step == e], 1)}
             for e in range(4)]
    rep = judge_run(cfg, w, calls, props, [], EngineCase("sim", num_speculative_tokens=2), log=lambda *a: None)
    json.dumps(rep)
    c = rep["counts"]
    assert verdict_problems(rep) == [], verdict_problems(rep)
    assert c["drafted"] == c["compared"] + c["ties"] == 2 * len(calls) and c["max_draft_steps"] == 2
    assert rep["facts"]["accepted_drafts_per_step"] == {"0": 5, "1": 1}
    assert rep["facts"]["seq_len_disagreements"] == 0
    assert rep["facts"]["step0_rejected_rows"] == 11  # (2+2) + (1+2) + (2+2)
    # a production token flipped on a decisive row is a mismatch
    calls[-1].tokens = calls[-1].tokens.clone()
    row = next(s for s in range(2) if logit_margin_decisive(calls[-1].logits[s], LOGITS_TOL))
    calls[-1].tokens[row] = (calls[-1].tokens[row] + 1) % cfg.vocab_size
    bad = judge_run(cfg, w, calls, props, [], EngineCase("sim", num_speculative_tokens=2), log=lambda *a: None)
    assert bad["counts"]["mismatches"] == 1 and bad["counts"]["proposal_token_disagreements"] == 1


def test_step0_rejected_rows_are_dropped_and_their_slots_never_read():
    """Stale ids / positions in step 0's rejected rows change nothing (they are not replayed); the
    slots they wrote are unwritten for the reference: a read of one is reported."""
    case = case_registry.spec("tiny-share-indexer", kind="reference")
    cfg, w = case.config(), case.weights()
    clean = replay(cfg, w, _simulated_engine(cfg, stale=False))
    calls = _simulated_engine(cfg, stale=True)
    dirty = replay(cfg, w, calls)
    assert not [r.error for r in clean + dirty if r.error]
    for a, b in zip(clean, dirty):
        assert torch.equal(a.logits, b.logits) and torch.equal(a.tokens, b.tokens)
    assert dirty[4].rows.tolist() == [0, 1, 3]  # engine step 2: request 0 accepted 1 draft, request 1 none
    # a step 1 that skipped position sample + 1 would read a rejected row's slot (a case where
    # steps >= 1 attend to their whole context: with index sharing they read step 0's top-k only)
    case = case_registry.spec("tiny-moe-sink-elementwise", kind="reference")
    cfg, w = case.config(), case.weights()
    calls = _simulated_engine(cfg, stale=True)
    assert not [r.error for r in replay(cfg, w, calls) if r.error]
    skip = dataclasses.replace(calls[5], positions=calls[5].positions + 1, seq_lens=calls[5].seq_lens + 1)
    reps = replay(cfg, w, calls[:5] + [skip])
    assert reps[-1].error and "UnwrittenKVError" in reps[-1].error


def test_recording_round_trip_and_rejudge(tmp_path):
    from harness.case_specs import EngineCase
    from harness.commands.engine import main
    from harness.production.engine.generation_judge import judge_run, rejudge
    from harness.production.engine.recording import load_recording, save_recording
    from harness.production.case_inputs import case_inputs
    from harness.case_specs import GpuCase

    case = EngineCase("sim-rejudge", overrides=(("index_share_for_mtp_iteration", True),), seed=5,
                      num_speculative_tokens=2)
    hf, _ckpt, w = case_inputs(GpuCase(case.id, preset=case.preset, overrides=case.overrides, seed=case.seed))
    cfg = R.MTPConfig.from_hf_dict(hf)
    calls = _simulated_engine(cfg)
    for c, r in zip(calls, replay(cfg, w, calls)):
        c.tokens, c.logits = r.tokens.clone(), r.logits.float()
        c.trace = {k: r.trace[k].to(torch.bfloat16) for k in ("enorm", "attn.core", "final_norm")}
        c.topk_rows = r.trace["attn.topk"].to(torch.int32)
        c.notes = {"metadata": {"x": {"num_reqs": 2}}, "t": torch.tensor([1, 2])}
    props = [{"engine_step": e, "num_speculative_tokens": 2,
              "draft_tokens": torch.stack([c.tokens for c in calls if c.engine_step == e], 1)} for e in range(4)]
    stem = str(tmp_path / "rec" / f"engine_calls_{case.id}")
    (tmp_path / "rec").mkdir()
    meta = {"case": dataclasses.asdict(case), "load": {"audit": [], "landed": {"enorm": True}}, "tap_errors": []}
    summary = save_recording(stem, calls, props, meta)
    assert summary["trace_components"] == ["enorm", "attn.core", "final_norm"] and summary["tensor_bytes"] < 10 * 2**20
    back, props2, doc = load_recording(stem)
    assert len(back) == len(calls) and doc["meta"]["case"]["id"] == case.id
    for a, b in zip(calls, back):
        for f in ("input_ids", "positions", "hidden", "query_start_loc", "request_keys", "seq_lens", "sample_rows",
                  "tokens", "logits", "topk_rows", "last_token_indices"):
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None and y is None) or (torch.equal(x, y) and x.dtype == y.dtype), f
        assert (a.engine_step, a.draft_step, a.spec_step_idx) == (b.engine_step, b.draft_step, b.spec_step_idx)
        assert set(b.trace) == set(a.trace) and all(torch.equal(a.trace[k], b.trace[k]) for k in a.trace)
    assert all(torch.equal(p["draft_tokens"], q["draft_tokens"]) and q["num_speculative_tokens"] == 2
               for p, q in zip(props, props2))
    quiet = dict(log=lambda *a: None)
    direct = judge_run(cfg, w, calls, props, [], case, **quiet)
    verdict = rejudge(stem, **quiet)
    again = verdict.to_report()
    assert verdict.kind == "engine" and verdict.passed == again["passed"] and verdict.details == again
    assert verdict.first_divergent == (again["problems"][0] if again["problems"] else None)
    assert again["counts"] == direct["counts"] and again["counts"]["mismatches"] == 0
    assert again["counts"]["compared"] > 0 and again["components"].keys() == direct["components"].keys()
    # a size cap drops diagnostics, never the replay's inputs
    small = save_recording(str(tmp_path / "small"), calls, props, meta, max_bytes=summary["tensor_bytes"] - 1)
    assert small["trace_components_dropped"] and load_recording(str(tmp_path / "small"))[0][3].logits is not None
    # the CLI: the sim's context is shorter than index_topk, so it fails that check (exit 1) but judges
    out = tmp_path / "out"
    assert main(["--rejudge", str(tmp_path / "rec"), "--out", str(out)]) == 1
    assert (out / f"engine_mtp_{case.id}.rejudge.json").exists()
    assert main(["--rejudge", str(tmp_path / "nothing")]) == 2  # no such directory: bad input
    (tmp_path / "empty").mkdir()
    assert main(["--rejudge", str(tmp_path / "empty")]) == 125  # no recording in it: nothing to judge


def test_derived_weights_are_exempt_only_when_verified():
    from harness.production.engine.session import exempt_derived

    a, b, c = "m.l.mla_attn.W_UK_T", "m.l.mla_attn.W_UV", "m.l.enorm.weight"
    problems = [f"{a}: received no checkpoint value", f"{c}: received no checkpoint value",
                f"loader warning: HYV4 MTP draft model: 2 parameters received no checkpoint value: {a}, {b}",
                f"loader warning: HYV4 MTP draft model: 2 parameters received no checkpoint value: {a}, {c}",
                "x.scale: contains NaN"]
    assert exempt_derived(problems, {a, b}) == [
        f"{c}: received no checkpoint value",
        f"loader warning: HYV4 MTP draft model: 2 parameters received no checkpoint value: {c}",
        "x.scale: contains NaN"]
    assert exempt_derived(problems, set()) == problems
