"""CPU: the speculator bookkeeping checks and the acceptance weights, on a simulated engine.

``_simulate`` lays out recordings the way vLLM 0.33's V2 runner with ``MTPSpeculator``
produces them (target forward with the acceptance target of
``harness.production.engine.acceptance``, greedy verification, draft step 0 over the target's
batch including rejected rows, steps >= 1 one row per request, index sharing with
compaction), with the draft's outputs computed by the reference. A faithful run must
pass the whole engine verdict with drafts accepted at the planned rates; each planted
speculator bug (the CPU twins of ``speculator_mutants``) must fail with its quantity
named first.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import reference as R
from harness import case_registry
from harness.production.engine import acceptance as A
from harness.production.engine.bookkeeping import TargetCall, check
from harness.case_specs import EngineCase
from harness.production.engine.generation_judge import judge_run, verdict_problems
from harness.production.engine.draft_replay import DraftCall
from reference.mtp import compact_topk, forward_step, layer_weights
from reference.tp import shard_all

K = 3


def _setup(share: bool):
    case = case_registry.spec("tiny-share-indexer" if share else "tiny-moe-sink-elementwise", kind="reference")
    cfg = case.config()
    plan = A.plan_for(cfg.hidden_size, cfg.vocab_size, 7)
    w = A.acceptance_weights(cfg, case.weights(), plan, 7)
    return cfg, w, plan


def _rms(x):
    return x / (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()


def _simulate(cfg, w, plan, patterns, lengths, engine_steps=5, bug=None):
    """(draft calls, target calls, proposals): a V2 run of ``engine_steps`` engine steps.

    ``bug``: "lti" (sample one row early), "hidden" (target hidden shifted one row),
    "layer" (layer_ran 1 at steps >= 1), "compaction" (steps >= 1 read step 0's first rows).
    """
    prompts = A.prompts(plan, patterns, lengths, 7)
    shards = shard_all(cfg, layer_weights(w, 0), 1, "tp")
    cache = R.DraftCache()
    emb = w["embed_tokens"]
    seqs = [list(p) for p in prompts]
    drafts: list[list[int]] = [[] for _ in prompts]
    calls, targets, proposals = [], [], []
    keys = [10 + 7 * r for r in range(len(prompts))]
    for s in range(engine_steps):
        ids, pos, req = [], [], []
        for r, seq in enumerate(seqs):
            rows = seq if s == 0 else [seq[-1]] + drafts[r]
            start = 0 if s == 0 else len(seq) - 1
            ids += rows
            pos += list(range(start, start + len(rows)))
            req += [r] * len(rows)
        ids_t, pos_t, req_t = torch.tensor(ids), torch.tensor(pos), torch.tensor(req)
        qsl = torch.cat([torch.zeros(1, dtype=torch.long), torch.bincount(req_t).cumsum(0)])
        hid = _rms(emb[ids_t]).to(torch.bfloat16)
        greedy = torch.tensor([plan.f[i] for i in ids])
        targets.append(TargetCall(s, ids_t, pos_t, hid, qsl, torch.tensor(keys), torch.arange(len(ids)), greedy))
        # greedy verification -> accepted prefix, emitted tokens, step 0 rows
        d_ids, lti = ids_t.clone(), []
        for r in range(len(seqs)):
            a, b = int(qsl[r]), int(qsl[r + 1])
            n = 0
            if s > 0:
                while n < len(drafts[r]) and drafts[r][n] == int(greedy[a + n]):
                    n += 1
                seqs[r] += drafts[r][:n]
            last = a + n if s > 0 else b - 1
            seqs[r].append(int(greedy[last]))
            d_ids[a:last] = ids_t[a + 1: last + 1]
            d_ids[last] = greedy[last]
            d_ids[last + 1: b] = 0  # stale buffer contents in rejected rows
            lti.append(last)
        lti_t = torch.tensor(lti)
        d_hid = torch.roll(hid, 1, 0) if bug == "hidden" else hid
        sample = lti_t - (lti_t > qsl[:-1]).long() if bug == "lti" else lti_t
        keep = torch.cat([torch.arange(int(qsl[r]), int(sample[r]) + 1) for r in range(len(seqs))])
        inp = R.StepInput(d_ids[keep], pos_t[keep], d_hid[keep].double(), req_t[keep])
        rows = torch.tensor([int((keep <= int(x)).sum()) - 1 for x in sample])
        tr = forward_step(cfg, shards, inp, cache, 0, logit_rows=rows)
        topk = torch.full((len(ids), cfg.index_topk), -1, dtype=torch.long)
        topk[keep] = tr["indexer.topk"]
        c0 = DraftCall(s, 0, d_ids, pos_t, d_hid, qsl, torch.tensor(keys), sample_rows=sample,
                       tokens=tr["draft_token"].clone(), logits=tr["logits"].float(), topk_rows=topk,
                       last_token_indices=sample.clone(), layer_ran=0,
                       sample_hidden=tr["final_norm"][rows].to(torch.bfloat16))
        calls.append(c0)
        shared = compact_topk(tr["indexer.topk"], rows)
        if bug == "compaction":  # buffer rows 0..R-1 (request 0's first rows), keys past a request masked
            shared = tr["indexer.topk"].clone()
            for r in range(len(seqs)):
                shared[r][shared[r] > int(pos_t[sample][r])] = -1
        prev, p_pos, out = c0, pos_t[sample], [tr["draft_token"]]
        for k in range(1, K):
            p_pos = p_pos + 1
            inp = R.StepInput(prev.tokens.clone(), p_pos, prev.sample_hidden.double(), torch.arange(len(seqs)))
            tk = forward_step(cfg, shards, inp, cache, 0, run_indexer=False, topk_rows=shared[: len(seqs)])
            c = DraftCall(s, k, inp.input_ids, p_pos, prev.sample_hidden, torch.arange(len(seqs) + 1),
                          torch.tensor(keys), sample_rows=torch.arange(len(seqs)), tokens=tk["draft_token"].clone(),
                          logits=tk["logits"].float(), topk_rows=shared[: len(seqs)].clone(),
                          layer_ran=1 if bug == "layer" else 0,
                          sample_hidden=tk["final_norm"].to(torch.bfloat16))
            calls.append(c)
            prev = c
            out.append(tk["draft_token"])
        toks = torch.stack(out, 1)
        proposals.append({"engine_step": s, "num_speculative_tokens": K, "draft_tokens": toks})
        drafts = [toks[r].tolist() for r in range(len(seqs))]
    return calls, targets, proposals


PATTERNS, LENGTHS = ("accept", "reject", "alternate", "agree2"), (9, 6, 7, 8)


def _judge(cfg, w, calls, targets, proposals):
    case = EngineCase("sim", num_speculative_tokens=K, target="acceptance", patterns=PATTERNS)
    rep = judge_run(cfg, w, calls, proposals, [], case, targets=targets, log=lambda *a: None)
    rep["case"] = dataclasses.asdict(case)
    return rep


@pytest.fixture(scope="module")
def faithful():
    cfg, w, plan = _setup(share=True)
    return cfg, w, plan, _simulate(cfg, w, plan, PATTERNS, LENGTHS)


def test_acceptance_weights_make_the_planned_rates(faithful):
    cfg, w, plan, (calls, targets, proposals) = faithful
    book = check(calls, targets, multi_module=False, num_layers=1, max_model_len=1024)
    assert [f.line() for f in book["findings"]] == []
    rates = {PATTERNS[int(k.split()[-1])]: v["rate"] for k, v in book["acceptance"].items()}
    # K = 3: every draft of an all-agree cycle, none of an all-disagree one, 1 of 3 when the
    # cycle alternates, 2 of 3 for agree-agree-disagree (acceptance's module doc)
    # (the first engine step can start the cycle on a disagree token: one step short of the rate)
    assert rates["accept"] == 1.0 and rates["reject"] == 0.0
    assert 0.2 <= rates["alternate"] <= 1 / 3 and 0.5 <= rates["agree2"] <= 2 / 3
    # the CPU model of the engine says the same
    for name in PATTERNS:
        last = plan.cycles[name][0]
        sim = A.simulate_acceptance(plan, lambda t: plan.f[plan.draft_map[t]], plan.f[last], K, 12)
        assert sum(sim) / (len(sim) * K) == pytest.approx(rates[name], abs=0.2)


def test_faithful_run_passes_the_engine_verdict(faithful):
    cfg, w, _plan, (calls, targets, proposals) = faithful
    rep = _judge(cfg, w, calls, targets, proposals)
    problems = [p for p in verdict_problems(rep) if "index_topk" not in p]  # tiny contexts here
    assert problems == []
    assert rep["counts"]["compared"] > 0 and rep["counts"]["mismatches"] == 0


@pytest.mark.parametrize("bug, names", [
    ("lti", "last_token_indices"),
    ("hidden", "hidden"),
    ("layer", "MTP layer"),
    ("compaction", "attn.topk"),
])
def test_each_planted_speculator_bug_fails_first_on_its_quantity(bug, names):
    cfg, w, plan = _setup(share=True)
    calls, targets, proposals = _simulate(cfg, w, plan, PATTERNS, LENGTHS, engine_steps=3, bug=bug)
    rep = _judge(cfg, w, calls, targets, proposals)
    problems = verdict_problems(rep)
    assert problems, bug
    first = problems[0]
    assert first.startswith("engine step ") and names in first, first
    assert "draft step" in first


def test_target_tokens_and_plan_are_consistent():
    plan = A.plan_for(64, 300, 3)
    for name, cyc in plan.cycles.items():
        assert A.target_tokens(plan, cyc[-1], len(cyc)) == list(cyc)
        assert [plan.agrees(t) for t in cyc] == list(A.PATTERNS[name])
    assert sorted(t for t in plan.active if plan.f[t] >= 0) == list(plan.active)
    assert all(plan.draft_map[t] != t for t in plan.active if not plan.agrees(t))
    with pytest.raises(ValueError):
        A.plan_for(64, 64, 0)


def test_a_planted_speculator_bug_is_undone():
    """``harness.undo.UndoStack``, what ``speculator_mutants.planted`` restores with (so one engine
    serves pristine and planted runs): on the shapes of vLLM's speculator classes -- a method
    the class defines, one a subclass inherits, a staticmethod, a module function -- a live
    instance sees the planted bug, and after ``restore`` the originals again (the inherited
    method inherited, the staticmethod still a staticmethod)."""
    import types

    from harness.undo import UndoStack

    mod = types.ModuleType("hyv4_standin_speculator")

    class Base:
        def propose(self, x):
            return ("proposed", x)

        @staticmethod
        def helper():
            return "static"

    class Speculator(Base):
        def on_prefill_end(self, n):
            return ("compacted", n)

    mod.prepare_prefill_inputs = lambda x: x + 1
    live = Speculator()  # built before the bug is planted, like the engine's speculator
    undo = UndoStack()
    undo.setattr(Speculator, "on_prefill_end", lambda self, n: None)
    undo.setattr(Speculator, "propose", lambda self, x: "shifted")  # Base's, inherited
    undo.setattr(Base, "helper", staticmethod(lambda: "planted"))
    undo.setattr(mod, "prepare_prefill_inputs", lambda x: x - 1)
    assert (live.on_prefill_end(4), live.propose(1), live.helper(), mod.prepare_prefill_inputs(1)) == (
        None, "shifted", "planted", 0)
    undo.restore()
    assert (live.on_prefill_end(4), live.propose(1), live.helper(), mod.prepare_prefill_inputs(1)) == (
        ("compacted", 4), ("proposed", 1), "static", 2)
    assert "propose" not in vars(Speculator) and isinstance(vars(Base)["helper"], staticmethod)


@pytest.mark.parametrize("argv, culprit", [
    (["--sweep"], "--sweep needs exactly one --case"),
    (["--sweep", "--case", "engine-tiny-k2"], "no speculator mutant targets this case"),
    (["--case", "engine-accept-k3-share", "--mutant", "compaction-dropped", "--mutant", "skip-topk-never"],
     "--mutant given more than once"),
    (["--sweep", "--case", "engine-accept-k3-share", "--mutant", "nope"], "--mutant nope: unknown"),
    (["--sweep", "--case", "engine-accept-k3-share", "--rejudge", "."], "--rejudge and --sweep"),
])
def test_sweep_flags_are_checked_first(argv, culprit, capsys):
    """``engine --sweep`` (one engine, every mutant of the case): bad flags exit 2 in one line,
    before any GPU question."""
    from harness.commands.engine import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and culprit in err[0], err


def test_a_padded_draft_batch_is_trimmed_to_the_batch_requests(faithful):
    """A drafter forced eager inside a CUDA-graph engine (the graph verdict's eager re-run) gets
    the attention metadata of the batch padded to a capture size: one more request, no query
    tokens at step 0. Recorded as is, the bookkeeping reads it as a different batch from the
    target's (the finding a GPU run of the re-run gave); the tap records the input batch's
    requests only (``taps.real_requests``), and the same run passes."""
    from harness.production.engine.taps import real_requests

    calls, targets, _ = faithful[3]
    d0 = next(c for c in calls if c.draft_step == 0 and c.engine_step == 1)
    n = d0.query_start_loc.numel() - 1
    padded = dataclasses.replace(d0, query_start_loc=torch.cat([d0.query_start_loc, d0.query_start_loc[-1:]]),
                                 request_keys=torch.cat([d0.request_keys, torch.zeros(1, dtype=torch.long)]))
    book = check([padded if c is d0 else c for c in calls], targets, multi_module=False, num_layers=1,
                 max_model_len=1024)
    assert [f.what for f in book["findings"]] == ["batch"], [f.line() for f in book["findings"]]
    keep = real_requests(n + 1, n)
    trimmed = dataclasses.replace(padded, query_start_loc=padded.query_start_loc[: keep + 1],
                                  request_keys=padded.request_keys[:keep])
    book = check([trimmed if c is d0 else c for c in calls], targets, multi_module=False, num_layers=1,
                 max_model_len=1024)
    assert [f.line() for f in book["findings"]] == []
    # no input batch known (a forward outside propose), or one no smaller: the metadata stands
    assert real_requests(4, None) == 4 and real_requests(4, 4) == 4 and real_requests(4, 0) == 4
