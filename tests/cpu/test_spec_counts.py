"""CPU: acceptance as vLLM counts it, vLLM's own counters beside it, and their disagreement.

vLLM counts a verify step only while its request still runs (``spec_counts``' module doc);
async scheduling runs one more step of a request the in-flight step finishes, which the
target computes and vLLM leaves out. The harness's figure must leave it out too, keep the
figure over every verify step under ``all_verify_steps``, and report any other difference
from vLLM's per-request counters as a problem.
"""

from __future__ import annotations

import json
import os
import types

import pytest
import torch

from harness.production.engine import spec_counts as SC
from harness.production.engine.bookkeeping import TargetCall, check
from harness.production.engine.draft_replay import DraftCall

# vllm_compat.missing() resolves every required internal in the installed vLLM, in process (~6 s of CPU
# to import): tests/cpu/conftest.py runs this test in the worker that imports vLLM anyway, and in every
# supported release's environment (-m vllm_facing).
VLLM_IN_PROCESS = {"test_an_optional_internal_never_makes_a_run_cannot_judge"}

DATA = os.path.join(os.path.dirname(__file__), "data", "engine_accept_k3_share_verify_steps.json")
V = 50


def _greedy(t: int) -> int:  # the target's next token after t
    return (t + 1) % V


def _engine(prompts, plans, steps):
    """(draft step 0 calls, target calls) of ``steps`` engine steps: step 0 prefills every prompt,
    then each request's rows are [its last token, 3 drafts] where ``plans[r][s-1]`` of the drafts
    agree with the target; ``steps[r]`` says in which engine steps request r is scheduled."""
    seqs = [list(p) for p in prompts]
    drafts = [[] for _ in prompts]
    calls, targets = [], []
    for s in range(max(max(v) for v in steps) + 1):
        live = [r for r in range(len(prompts)) if s in steps[r]]
        ids, pos, qsl, lasts = [], [], [0], []
        for r in live:
            rows = seqs[r] if s == 0 else [seqs[r][-1]] + drafts[r]
            start = 0 if s == 0 else len(seqs[r]) - 1
            ids += rows
            pos += list(range(start, start + len(rows)))
            qsl.append(len(ids))
        greedy = [_greedy(t) for t in ids]
        d_ids = list(ids)
        for j, r in enumerate(live):
            a, b = qsl[j], qsl[j + 1]
            n = 0
            if s > 0:
                while n < len(drafts[r]) and drafts[r][n] == greedy[a + n]:
                    n += 1
                seqs[r] += drafts[r][:n]
            last = a + n if s > 0 else b - 1
            seqs[r].append(greedy[last])
            d_ids[a:last] = ids[a + 1: last + 1]
            d_ids[last] = greedy[last]
            lasts.append(last)
            agree = plans[r][s] if s < len(plans[r]) else 0
            t, nxt = seqs[r][-1], []
            for i in range(3):
                nxt.append(_greedy(t) if i < agree else (_greedy(t) + 7) % V)
                t = nxt[-1]
            drafts[r] = nxt
        keys = torch.tensor([10 + r for r in live])
        hid = torch.zeros(len(ids), 4, dtype=torch.bfloat16)
        t_ids, t_pos, t_qsl = torch.tensor(ids), torch.tensor(pos), torch.tensor(qsl)
        targets.append(TargetCall(s, t_ids, t_pos, hid, t_qsl, keys, torch.arange(len(ids)), torch.tensor(greedy)))
        calls.append(DraftCall(s, 0, torch.tensor(d_ids), t_pos, hid, t_qsl, keys,
                               sample_rows=torch.tensor(lasts), last_token_indices=torch.tensor(lasts), layer_ran=0))
    return calls, targets, seqs


def test_a_verify_step_after_the_request_finished_is_left_out_as_vllm_does():
    """Request 0 accepts every draft: 1 token from the prefill, 4 per step; with 8 output tokens
    it finishes in step 2 (which computes 9, the last one cut); step 3 (scheduled while step 2
    was in flight) verifies 3 more drafts the target runs and vLLM never counts. Request 1 rejects
    every draft and finishes with its own last step: all of its steps count."""
    prompts = [[1, 2, 3, 4, 5], [20, 21, 22, 23]]
    plans = [[3, 3, 3, 3], [0, 0, 0, 0]]
    calls, targets, _ = _engine(prompts, plans, steps=[{0, 1, 2, 3}, {0, 1, 2, 3}])
    book = check(calls, targets, multi_module=False, num_layers=1, max_model_len=1024, prompts=prompts,
                 output_lens=[8, 4])
    assert [f.line() for f in book["findings"]] == []
    a0, a1 = book["acceptance"]["request 0"], book["acceptance"]["request 1"]
    assert (a0["accepted"], a0["drafted"], a0["drafts"], a0["per_step"]) == (6, 6, 2, [3, 3])
    assert a0["rate"] == 1.0 and a0["output_tokens"] == 8
    assert a0["verified_after_finish"] == {"steps": 1, "accepted": 3, "drafted": 3, "engine_steps": [3]}
    assert a0["all_verify_steps"] == {"accepted": 9, "drafted": 9, "rate": 1.0, "steps": 3}
    assert (a1["accepted"], a1["drafted"], a1["drafts"]) == (0, 9, 3)
    assert a1["verified_after_finish"]["steps"] == 0
    # without the output lengths nothing says when a request finished: every verify step counts
    book = check(calls, targets, multi_module=False, num_layers=1, max_model_len=1024, prompts=prompts)
    a0 = book["acceptance"]["request 0"]
    assert (a0["accepted"], a0["drafted"], a0["output_tokens"]) == (9, 9, None)
    assert a0["definition"].startswith("every verify step")


def test_the_h200_recording_gives_vllms_own_counts():
    """The verify steps of engine-accept-k3-share's GPU recording (K = 3, max_tokens 32): over
    every verify step the harness had 27/27, 0/93, 16/51, 23/36; vLLM's per-request counters
    said 24/24, 0/93, 15/48, 21/33 -- one step fewer for every request that finished with drafts
    accepted. vLLM's definition applied to the recording gives vLLM's numbers."""
    d = json.load(open(DATA))
    by_req: dict[int, list] = {}
    for r, step, pos, n, m in d["steps"]:
        by_req.setdefault(r, []).append(SC.VerifyStep(step, n, m, pos + 1 - d["prompt_lens"][r]))
    got = {r: SC.summarize(v, d["output_lens"][r]) for r, v in by_req.items()}
    assert {r: (g["accepted"], g["drafted"]) for r, g in got.items()} == {0: (24, 24), 1: (0, 93), 2: (15, 48),
                                                                         3: (21, 33)}
    assert {r: (g["all_verify_steps"]["accepted"], g["all_verify_steps"]["drafted"]) for r, g in got.items()} == {
        0: (27, 27), 1: (0, 93), 2: (16, 51), 3: (23, 36)}
    assert [got[r]["verified_after_finish"]["steps"] for r in range(4)] == [1, 0, 1, 1]


def _metrics(hist, drafted, per_step=None):
    m = types.SimpleNamespace(histogram=hist, num_draft_tokens=drafted, per_step_accepted=per_step or [],
                              per_step_drafted=[3] * len(per_step or []))
    return types.SimpleNamespace(outputs=[types.SimpleNamespace(spec_decode_metrics=m)])


def _harness(accepted, drafted, drafts, per_step, after=(0, 0, 0)):
    return {"accepted": accepted, "drafted": drafted, "drafts": drafts, "per_step": per_step,
            "verified_after_finish": {"steps": after[0], "accepted": after[1], "drafted": after[2]},
            "all_verify_steps": {"accepted": accepted + after[1], "drafted": drafted + after[2]}}


def test_vllms_per_request_counters_are_read_and_compared():
    outs = [_metrics([0, 0, 0, 8], 24, [3] * 8), _metrics([31, 0, 0, 0], 93)]
    per = SC.request_counters(outs)
    assert per["request 0"] == {"accepted": 24, "drafted": 24, "drafts": 8, "histogram": [0, 0, 0, 8],
                                "per_step": [3] * 8, "per_step_drafted": [3] * 8}
    assert per["request 1"]["accepted"] == 0 and per["request 1"]["drafted"] == 93 and "per_step" not in per[
        "request 1"]
    acc = {"request 0": _harness(24, 24, 8, [3] * 8, after=(1, 3, 3)), "request 1": _harness(0, 93, 31, [0] * 31)}
    totals = {"num_drafts": 39, "num_draft_tokens": 117, "num_accepted_tokens": 24}
    assert SC.disagreements(acc, {"per_request": per, "totals": totals}) == []
    # the harness's previous figure (every verify step) is what vLLM does not count: a finding,
    # saying that vLLM counted the step the harness takes as run after the request finished
    old = dict(acc, **{"request 0": _harness(27, 27, 9, [3] * 9)})
    lines = SC.disagreements(old, {"per_request": per, "totals": totals})
    assert len(lines) == 2 and lines[0].startswith("acceptance: request 0: the harness counts 27/27")
    assert "vLLM's per-request counters 24/24 over 8" in lines[0] and "first differing verify step 8" in lines[0]
    assert "spec-decode counters over the run" in lines[1]
    # vLLM counting the after-finish step itself: named as such
    per9 = SC.request_counters([_metrics([0, 0, 0, 9], 27, [3] * 9), outs[1]])
    lines = SC.disagreements(acc, {"per_request": per9, "totals": "unavailable: x"})
    assert len(lines) == 1 and "run after the request finished" in lines[0]
    # a request only one side counted
    lines = SC.disagreements({"request 1": acc["request 1"]}, {"per_request": per, "totals": "unavailable: x"})
    assert lines == ["acceptance: request 0: counted only by vLLM (24/24 accepted/drafted)"]


def test_unavailable_counters_are_recorded_not_failed():
    no_attr = types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[1])])
    assert SC.request_counters([no_attr]).startswith("unavailable: this vLLM's CompletionOutput has no")
    off = types.SimpleNamespace(outputs=[types.SimpleNamespace(spec_decode_metrics=None)])
    assert SC.request_counters([off]).startswith("unavailable: request 0: no spec_decode_metrics")
    assert SC.read_metric_totals(object()).startswith("unavailable: this vLLM's LLM has no get_metrics")

    class StatsOff:
        def get_metrics(self):
            raise AssertionError("Stat logging disabled")

    assert SC.read_metric_totals(StatsOff()) == ("unavailable: LLM.get_metrics() raised AssertionError: "
                                                 "Stat logging disabled")
    empty = types.SimpleNamespace(get_metrics=lambda: [])
    assert SC.read_metric_totals(empty).startswith("unavailable: LLM.get_metrics() has no vllm:spec_decode_num_drafts")
    rep = SC.vllm_counters([off], SC.read_metric_totals(empty), SC.read_metric_totals(empty))
    assert all(isinstance(v, str) and v.startswith("unavailable") for v in rep.values())
    assert SC.disagreements({"request 0": _harness(1, 3, 1, [1])}, rep) == []
    assert SC.disagreements({"request 0": _harness(1, 3, 1, [1])}, None) == []


def test_metric_totals_are_a_difference_over_generate_summed_over_engines():
    def snap(d, a, t):
        c = types.SimpleNamespace
        return [c(name="vllm:spec_decode_num_drafts", value=d, labels={"engine": "0"}),
                c(name="vllm:spec_decode_num_draft_tokens", value=t, labels={"engine": "0"}),
                c(name="vllm:spec_decode_num_accepted_tokens", value=a, labels={"engine": "0"}),
                c(name="vllm:spec_decode_num_accepted_tokens", value=1, labels={"engine": "1"}),
                c(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[1, 2], labels={}),
                c(name="vllm:num_requests_running", value=4.0, labels={})]

    llm = types.SimpleNamespace(get_metrics=lambda: snap(10, 5, 30))
    before = SC.read_metric_totals(llm)
    assert before == {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 6}
    llm.get_metrics = lambda: snap(12, 9, 36)
    assert SC.totals_over(before, SC.read_metric_totals(llm)) == {"num_drafts": 2, "num_draft_tokens": 6,
                                                                   "num_accepted_tokens": 4}
    assert SC.totals_over("unavailable: off", before) == "unavailable: off"


def test_a_disagreement_is_reported_beside_the_engine_verdict():
    from harness.production.engine.generation_judge import acceptance_disagreements, verdict_problems

    rep = {"counts": {"compared": 1, "max_context": 200, "index_topk": 128, "num_speculative_tokens": 3,
                      "max_draft_steps": 3}, "load": {"landed": {"x": True}},
           "acceptance": {"request 0": _harness(24, 24, 8, [3] * 8, after=(1, 3, 3))},
           "vllm_spec_decode": {"per_request": SC.request_counters([_metrics([0, 0, 0, 8], 24)]),
                                "totals": {"num_drafts": 8, "num_draft_tokens": 24, "num_accepted_tokens": 24}}}
    assert verdict_problems(rep) == [] and acceptance_disagreements(rep) == []
    rep["vllm_spec_decode"]["per_request"]["request 0"]["accepted"] = 23
    notes = acceptance_disagreements(rep)
    assert len(notes) == 1 and notes[0].startswith("acceptance: request 0: the harness counts 24/24")
    assert verdict_problems(rep) == []  # beside the verdict, not in its exit code
    rep["vllm_spec_decode"] = {"per_request": "unavailable: off", "totals": "unavailable: off"}
    assert acceptance_disagreements(rep) == []


@pytest.mark.parametrize("has_it", [True, False])
def test_the_per_request_counters_are_asked_for_only_where_the_release_has_them(has_it, monkeypatch, tmp_path):
    from harness.production import vllm_compat
    from harness import case_registry
    engine_cases = case_registry.specs(kind="engine")
    from harness.production.engine.session import engine_kwargs

    real = vllm_compat.available
    monkeypatch.setattr(vllm_compat, "available",
                        lambda name: has_it if name == "metrics.per_request_spec_decode" else real(name))
    kw = engine_kwargs(str(tmp_path), engine_cases["engine-accept-k3-share"])
    assert kw["disable_log_stats"] is False
    assert kw.get("per_request_spec_decode_metrics") == ("detailed" if has_it else None)


@pytest.mark.parametrize("value, has_it, warmup", [
    (None, True, True), ("1", True, True), ("0", True, False), ("0", False, None)])
def test_the_jit_warmup_switch_reaches_vllms_kernel_config(value, has_it, warmup, monkeypatch, tmp_path):
    """``HYV4_ENGINE_JIT_WARMUP=0`` builds the engine with vLLM's own switch off, as vLLM's
    EngineArgs turns the argument into its KernelConfig; unset or 1, and on a release without
    the switch, the argument is not given (vLLM's default)."""
    from vllm.engine.arg_utils import EngineArgs

    from harness import case_registry
    from harness.production import vllm_compat
    from harness.production.engine.session import JIT_WARMUP_ENV, engine_kwargs

    if value is None:
        monkeypatch.delenv(JIT_WARMUP_ENV, raising=False)
    else:
        monkeypatch.setenv(JIT_WARMUP_ENV, value)
    real = vllm_compat.available
    monkeypatch.setattr(vllm_compat, "available",
                        lambda name: has_it if name == "kernel_config.enable_jit_warmup" else real(name))
    kw = engine_kwargs(str(tmp_path), case_registry.specs(kind="engine")["engine-graphs-accept-k3-share"])
    assert ("kernel_config" in kw) == (warmup is False)
    if warmup is not None:
        assert EngineArgs(**kw).kernel_config.enable_jit_warmup is warmup


def test_an_optional_internal_never_makes_a_run_cannot_judge(monkeypatch):
    from harness.production import vllm_compat

    gone = vllm_compat.Internal("metrics.gone", ("harness_no_such_module:x",), "optional counters", optional=True)
    monkeypatch.setitem(vllm_compat.INTERNALS, "metrics.gone", gone)
    assert vllm_compat.available("metrics.gone") is False
    assert not any(m.startswith("metrics.gone") for m in vllm_compat.missing())
    required = vllm_compat.Internal("metrics.needed", ("harness_no_such_module:x",), "required counters")
    monkeypatch.setitem(vllm_compat.INTERNALS, "metrics.needed", required)
    assert any(m.startswith("metrics.needed") for m in vllm_compat.missing())  # the same entry, not optional
    assert "metrics.per_request_spec_decode" not in vllm_compat.REQUIRED
