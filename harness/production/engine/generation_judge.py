"""Engine level, judging: one greedy generation recorded and replayed by the float64 reference
(``generate_and_judge``), the verdict's problems (``verdict_problems``), the mutant sweep on one
engine (``run_mutant_sweep``) and the CPU re-judge of a saved recording (``rejudge``).

Steps 4-5 of ``session.py``'s module doc; the command printing these reports is
``harness.commands.engine``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import traceback

from harness.atomic import atomic_write_json
from harness.exitcodes import first_line
from harness.case_specs import EngineCase
from harness.production.engine.graph_regimes import measure as measure_graph_regimes
from harness.production.engine.graph_regimes import MARK as GRAPH_REGIME_MARK
from harness.production.engine.graph_regimes import problems as graph_regime_problems
from harness.production.engine.graph_regimes import table as graph_regime_table
from harness.production.engine.draft_replay import (DraftCall, component_errors, expects_logits, judge_tokens,
                                                    replay, run_facts)
from harness.production.engine.recording import load_recording, save_recording
from harness.production.engine.session import build_session, engine_inputs, prompts_for
from harness.production.engine.taps import DrafterTap, TargetTap, graph_replay_counts
from harness.verdict import Verdict


def judge_run(cfg, weights, recorded: list[DraftCall], proposals: list[dict], tap_errors: list[str],
              case: EngineCase, *, targets: list | None = None, multi_module: bool = False,
              max_model_len: int = 1024, prompts: list | None = None, generated: list | None = None,
              log=print) -> dict:
    """Check the speculator's bookkeeping against the target (``bookkeeping``), replay the
    recorded draft forwards with the float64 reference and judge them (CPU): ``counts``,
    ``facts``, ``findings`` (localised lines), ``acceptance`` (per request, as vLLM counts it:
    ``generated``, the output tokens per prompt, says when each request finished),
    ``mismatch_examples``, ``replay_errors``, ``components``, ``tap_errors``."""
    import reference as R
    from harness.production.judging.tolerances import tolerances_for

    from harness.production.engine import bookkeeping

    calls = [c for c in recorded if c.engine_step >= 0]
    facts = run_facts(recorded, proposals, multi_module=multi_module)
    log(f"recorded {len(recorded)} draft forwards in {facts['engine_steps']} engine steps; facts:", json.dumps(facts))
    for i, c in enumerate(calls[: 2 * case.num_speculative_tokens + 2]):
        span = f"{int(c.positions.min())}..{int(c.positions.max())}" if c.num_tokens else "-"
        lti = None if c.last_token_indices is None else c.last_token_indices.tolist()
        log(f"  call {i}: engine_step {c.engine_step} draft_step {c.draft_step} layer {c.layer_ran} T={c.num_tokens} "
            f"qsl={c.query_start_loc.tolist()[:9]} keys={c.request_keys.tolist()} pos[{span}] "
            f"seq_lens={None if c.seq_lens is None else c.seq_lens.tolist()} last_token_indices={lti} "
            f"sample_rows={None if c.sample_rows is None else c.sample_rows.tolist()} "
            f"tokens={None if c.tokens is None else c.tokens.tolist()} "
            f"topk={'yes' if c.topk_rows is not None else 'no'}")
    book = (bookkeeping.check(calls, targets, multi_module=multi_module, num_layers=cfg.num_mtp_layers,
                              max_model_len=max_model_len, prompts=prompts,
                              output_lens=[len(g) for g in generated] if generated is not None else None)
            if targets else None)
    # (engine step, draft step, dataflow rank, line): inputs, then top-k, then KV reads, then tokens
    items = [(f.engine_step, f.draft_step, 0, f.line()) for f in book["findings"]] if book else []
    t = time.perf_counter()
    replays = replay(cfg, weights, calls, R.EXACT, multi_module=multi_module, kv_cache_dtype=case.kv_cache_dtype)
    t_ref = time.perf_counter() - t
    tols = tolerances_for("bf16", case.kv_cache_dtype)
    tokens = judge_tokens(calls, replays, tols["logits"])
    errors = [(i, r.error) for i, r in enumerate(replays) if r.error]
    for i, e in errors:
        c = calls[i]
        what = ("production's top-k rows / KV reads reach draft KV that no draft step wrote for this request "
                "(stale or rejected slots)" if "UnwrittenKVError" in e else "the call could not be replayed")
        items.append((c.engine_step, c.draft_step, 2, f"engine step {c.engine_step}, draft step {c.draft_step}: "
                                                     f"{what}: {e}"))
    for i, r in enumerate(replays):
        if r.topk_beyond_ties:
            c = calls[i]
            shared = " (shared step 0 rows, compacted to the sampled rows)" if (
                c.draft_step and cfg.index_share_for_mtp_iteration) else ""
            items.append((c.engine_step, c.draft_step, 1, f"engine step {c.engine_step}, draft step {c.draft_step}: "
                                                         f"attn.topk rows are not the reference's{shared}: "
                                                         f"{r.topk_beyond_ties}"))
    for ex in tokens["mismatch_examples"]:
        items.append((ex["engine_step"], ex["draft_step"], 3,
                      f"engine step {ex['engine_step']}, draft step {ex['draft_step']}, sample row {ex['sample_row']} "
                      f"(position {ex['position']}): draft_token {ex['production']} != reference {ex['reference']} "
                      f"(decisive margin)"))
    findings = [line for *_, line in sorted(items, key=lambda x: x[:3])]
    counts = {
        "calls": len(calls), "engine_steps": facts["engine_steps"], "target_forwards": len(targets or []),
        "drafted": tokens["drafted"], "compared": tokens["compared"], "ties": tokens["ties"],
        "ties_differing": tokens["ties_differing"], "mismatches": tokens["mismatches"],
        "not_replayed": tokens["not_replayed"], "replay_errors": len(errors),
        "bookkeeping_findings": len(book["findings"]) if book else None,
        "bookkeeping_checked": book["checked"] if book else None,
        "calls_without_logits": sum(c.tokens is None and expects_logits(c, proposals) for c in calls),
        "sampled_row_not_last_token_index": facts["sampled_row_not_last_token_index"],
        "seq_len_disagreements": facts["seq_len_disagreements"],
        "step0_without_last_token_indices": sum(c.draft_step == 0 and c.last_token_indices is None for c in calls),
        "unmatched_sample_rows": sum(int((c.sample_rows < 0).sum()) for c in calls if c.sample_rows is not None),
        "ambiguous_sample_rows": sum(c.notes.get("ambiguous_sample_rows", 0) for c in calls),
        "calls_without_topk_rows": sum(c.topk_rows is None for c in calls) if cfg.attention_sparse else 0,
        "topk_rows_differing": sum(r.topk_rows_differing for r in replays),
        "topk_calls_beyond_ties": sum(r.topk_beyond_ties is not None for r in replays),
        "max_context": facts["max_context"], "index_topk": cfg.index_topk,
        "max_draft_steps": facts["max_draft_steps"], "num_speculative_tokens": case.num_speculative_tokens,
        "proposal_token_disagreements": facts.get("proposal_token_disagreements"),
        "tap_errors": len(tap_errors),
    }
    return {"counts": counts, "facts": facts, "findings": findings,
            "acceptance": book["acceptance"] if book else None,
            "mismatch_examples": tokens["mismatch_examples"],
            "replay_errors": [f"call {i}: {e}" for i, e in errors[:10]],
            "components": component_errors(calls, replays, tols), "tap_errors": list(tap_errors),
            "reference_s": t_ref}


def _pattern_rates(rep: dict) -> dict:
    """{pattern: acceptance rate} of the acceptance case's requests (request i = prompt i)."""
    acc = rep.get("acceptance") or {}
    pats = (rep.get("case") or {}).get("patterns") or ()
    out = {}
    for i, name in enumerate(pats):
        a = acc.get(f"request {i}")
        if a and a.get("rate") is not None:
            out[name] = a["rate"]
    return out


def acceptance_disagreements(rep: dict) -> list[str]:
    """vLLM's own spec-decode counters against the harness's figure in vLLM's definition
    (``spec_counts``): reported beside the verdict and in the report, not part of the exit code.
    The harness's figure is derived from the recording alone; vLLM's counters come from its stat
    logging, whose reading in this in-process engine is what this comparison establishes."""
    from harness.production.engine.spec_counts import disagreements
    return disagreements(rep.get("acceptance"), rep.get("vllm_spec_decode"))


def verdict_problems(rep: dict) -> list[str]:
    """Why ``rep`` fails the engine-level check (empty: it passes); localised findings first."""
    c = rep["counts"]
    p = list(rep.get("findings") or [])
    if rep.get("load", {}).get("audit"):
        p.insert(0, f"load: vLLM left parameters unloaded or wrong: {rep['load']['audit'][:3]}")
    if c.get("mismatches") and not any("draft_token" in x for x in p):
        p.append(f"{c['mismatches']} draft token(s) differ from the reference with a decisive margin")
    if c.get("replay_errors") and not any("replay" in x or "reference never wrote" in x for x in p):
        p.append(f"replay_errors: {c['replay_errors']}")
    if c["compared"] < 1:
        p.append("no draft token was compared")
    for key in ("not_replayed", "calls_without_logits", "unmatched_sample_rows",
                "tap_errors", "proposal_token_disagreements",
                # the replay's model of the proposer (draft_replay's module doc) does not hold
                "sampled_row_not_last_token_index", "seq_len_disagreements", "step0_without_last_token_indices"):
        if c.get(key):
            p.append(f"{key}: {c[key]}")
    if not all(rep.get("load", {}).get("landed", {}).values()):
        p.append(f"synthetic weights did not land in the live draft: {rep['load'].get('landed')}")
    if c["max_context"] <= c["index_topk"]:
        p.append(f"no call had a context longer than index_topk ({c['max_context']} <= {c['index_topk']})")
    if rep.get("drafter_mode") == "CUDA graphs":
        g = rep.get("graph_replays") or {}
        if not any(m != "NONE" for phase in g.values() for m in phase):
            p.append(f"CUDA-graph mode not exercised: no draft step ran under a graph ({g}; "
                     f"compilation {rep.get('compilation')})")
        # the decode paths the case is for, as vLLM ran them (graph_regimes): a case whose
        # declared regime did not run fails naming it
        declared = ((rep.get("case") or {}) if isinstance(rep.get("case"), dict) else {}).get("graph_regimes") or ()
        p.extend(graph_regime_problems(declared, rep.get("graph_regimes")))
    if c["num_speculative_tokens"] >= 2 and c["max_draft_steps"] < 2:
        p.append(f"the drafter ran {c['max_draft_steps']} step(s) per engine step (K={c['num_speculative_tokens']})")
    case = rep.get("case") if isinstance(rep.get("case"), dict) else {}
    if case.get("kv_cache_dtype", "auto") != "auto":  # the cache the case names is the one the draft ran
        stored = rep.get("kv_cache") or {}
        if not stored or any(v != "fp8_ds_mla" for v in stored.values()):
            p.append(f"kv_cache_dtype {case['kv_cache_dtype']!r} not exercised: the draft's MLA caches are "
                     f"{stored or 'unknown'}, not fp8_ds_mla")
    if case.get("target") == "acceptance":
        if rep.get("target_follows_f") is not None and not all(rep["target_follows_f"]):
            p.append(f"the edited target did not follow its permutation: {rep['target_follows_f']} "
                     "(acceptance regime not reached)")
        rates = _pattern_rates(rep)
        for name, lo, hi in case.get("expect_rates") or ():
            r = rates.get(name)
            if r is None or not lo <= r <= hi:
                p.append(f"acceptance regime not exercised: pattern {name!r} accepted {r} of its drafts, "
                         f"expected [{lo}, {hi}]")
    return p


def split_regime_problems(problems: list[str]) -> tuple[list[str], list[str]]:
    """(the other problems, the declared graph regimes that did not run): only the first are a
    reason to re-run the drafter eagerly and to attribute graph replay against eager."""
    regime = [p for p in problems if p.startswith(GRAPH_REGIME_MARK)]
    return [p for p in problems if p not in regime], regime


def _graph_attribution(graph_problems: list[str], eager: dict) -> list[str]:
    """The problems of a failed graph-mode run, first line saying whether graph replay or the
    drafter itself (eager too) differs from the reference."""
    first = graph_problems[0] if graph_problems else "failed"
    if eager["passed"]:
        return [f"graph replay differs from eager (capture bug: the same generation with the drafter eager "
                f"passes): {first}", *graph_problems[1:]]
    return [f"graph replay and eager both differ from the reference (a numeric bug, not capture): "
            f"eager: {eager['problems'][0]}", f"graph replay: {first}", *graph_problems[1:]]


def generate_and_judge(sess: dict, *, out: str | None = None, log=print, mutant: dict | None = None,
                       t0: float | None = None, stem: str | None = None, eager_drafter: bool = False) -> dict:
    """One greedy generation on ``sess``'s engine with fresh taps, recorded (under ``out``, as
    ``stem``: default ``engine_calls_<case>``), replayed by the reference and judged: the report.

    A graph-mode case (``case.graphs``) is recorded at the speculator's Python seams
    (``graph_tap``); when it fails, the generation runs again with the drafter forced eager
    (``eager_drafter``: every draft forward tapped, the target still in graphs) and the verdict's
    first line says which of the two differs from the reference (``_graph_attribution``)."""
    from harness.production.engine.graph_tap import GraphTap, drafter_forced_eager, graph_calls, target_calls

    t0 = time.perf_counter() if t0 is None else t0
    case, cfg, weights, plan = sess["case"], sess["cfg"], sess["weights"], sess["plan"]
    rep: dict = {**sess["base"], "timing_s": {"build": sess["build_s"]}}
    if mutant is not None:
        rep["mutant"] = mutant
    graphs = case.graphs
    rep["drafter_mode"] = ("eager (forced) in a CUDA-graph engine" if graphs and eager_drafter
                           else "CUDA graphs" if graphs else "eager")
    # graph mode: the seams always (they give the target side); the per-forward taps only when
    # the drafter runs eager (attached after, so its propose wrapper calls the seams')
    gtap = GraphTap(sess["proposer"], sess["draft"]) if graphs else None
    tap = DrafterTap(sess["proposer"], sess["draft"]) if not graphs or eager_drafter else None
    ttap = None if graphs else TargetTap(sess["target"])
    taps = [t for t in (tap, gtap, ttap) if t is not None]
    rep["attach_notes"] = tap.attach_notes if tap is not None else []
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=case.max_tokens, ignore_eos=True, detokenize=False)
    prompts = prompts_for(case, cfg.vocab_size, plan)
    from harness.production.engine import spec_counts
    before = spec_counts.read_metric_totals(sess["llm"])  # cumulative over the process: a difference
    t1 = time.perf_counter()
    for t in taps:
        t.armed = True
    try:
        with drafter_forced_eager() if eager_drafter else contextlib.nullcontext():
            outs = sess["llm"].generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        for t in taps:
            t.armed = False
            t.remove()
    rep["timing_s"]["generate"] = time.perf_counter() - t1
    rep["generated"] = [list(o.outputs[0].token_ids) for o in outs]
    rep["vllm_spec_decode"] = spec_counts.vllm_counters(outs, before, spec_counts.read_metric_totals(sess["llm"]))
    log("vLLM's spec-decode counters:", json.dumps(rep["vllm_spec_decode"]))
    errors = [e for t in taps for e in t.errors]
    if gtap is not None:
        rep["graph_replays"] = graph_replay_counts(gtap.steps)
        log("draft steps by CUDA-graph mode:", json.dumps(rep["graph_replays"]))
        rep["graph_facts"] = gtap.facts
        rep["graph_regimes"] = measure_graph_regimes(gtap.steps, gtap.facts)
        log("graph regimes (proposes that ran each; vLLM:", json.dumps(gtap.facts) + "):")
        for line in graph_regime_table(rep["graph_regimes"], case.graph_regimes):
            log("  " + line)
        if tap is not None:  # the eager re-run: the target side keyed as the per-forward tap keys requests
            calls, proposals = tap.calls, tap.proposals
            targets = target_calls(gtap.steps, keys={c.engine_step: c.request_keys for c in calls
                                                     if c.draft_step == 0 and c.engine_step >= 0})
        else:
            targets = target_calls(gtap.steps)
            calls = graph_calls(gtap.steps, rep["runner"]["max_model_len"])
            proposals = gtap.proposals()
    else:
        calls, proposals, targets = tap.calls, tap.proposals, ttap.calls
    for e in errors[:3]:
        log("tap error:", e)
    if plan is not None:  # the edited target must continue every prompt with f
        from harness.production.engine.acceptance import target_tokens
        rep["target_follows_f"] = [g == target_tokens(plan, p[-1], len(g)) for p, g in zip(prompts, rep["generated"])]
    if out:  # before judging: a crash in the replay still leaves the recording for --rejudge
        try:
            stem = os.path.join(out, stem or f"engine_calls_{case.id}")
            os.makedirs(out, exist_ok=True)
            meta = {"case": dataclasses.asdict(case), "versions": rep["versions"], "runner": rep["runner"],
                    "sharing": rep["sharing"], "load": rep["load"], "tap_errors": errors,
                    "generated": rep["generated"], "prompts": prompts, "mutant": rep.get("mutant"),
                    "target_follows_f": rep.get("target_follows_f"), "vllm_spec_decode": rep["vllm_spec_decode"],
                    "drafter_mode": rep["drafter_mode"], "graph_replays": rep.get("graph_replays"),
                    "graph_facts": rep.get("graph_facts"), "graph_regimes": rep.get("graph_regimes")}
            rep["recording"] = save_recording(stem, calls, proposals, meta, targets=targets)
            log("recording:", stem + ".safetensors", json.dumps(rep["recording"]))
        except Exception:  # noqa: BLE001 - the verdict does not depend on it
            rep["recording"] = {"error": traceback.format_exc()}
            log("recording failed:", rep["recording"]["error"])
    rep.update(judge_run(cfg, weights, calls, proposals, errors, case, targets=targets,
                         multi_module="MultiModule" in rep["runner"]["proposer"],
                         max_model_len=rep["runner"]["max_model_len"], prompts=prompts,
                         generated=rep["generated"], log=log))
    rep["timing_s"]["reference"] = rep.pop("reference_s")
    rep["timing_s"]["total"] = time.perf_counter() - t0
    rep["problems"] = verdict_problems(rep)
    rep["acceptance_disagreements"] = acceptance_disagreements(rep)
    rep["passed"] = rep["problems"] == []
    # a declared graph regime that did not run is a coverage finding, not a numeric one: the eager
    # re-run attributes the numeric problems only, and the regime lines follow them unchanged
    numeric, regime = split_regime_problems(rep["problems"])
    if graphs and not eager_drafter and numeric:
        rep["problems"] = numeric
        log("graph-mode run failed: the same generation again with the drafter eager")
        t2 = time.perf_counter()
        eager = generate_and_judge(sess, log=lambda *a, **k: None, mutant=mutant, eager_drafter=True)
        rep["eager_rerun"] = {"passed": eager["passed"], "problems": eager["problems"][:8],
                              "counts": eager.get("counts"), "acceptance": eager.get("acceptance"),
                              "components": eager.get("components"), "wall_s": time.perf_counter() - t2}
        rep["problems"] = _graph_attribution(rep["problems"], eager) + regime
        rep["timing_s"]["eager_rerun"] = rep["eager_rerun"]["wall_s"]
    return rep


def engine_verdict(rep: dict) -> Verdict:
    """An engine judge's report as the shared verdict record (kind "engine"). Its first divergent is
    the first problem line (it names the engine step, draft step and quantity); its rows are the
    per-component errors of the replay (``components``); its notes the acceptance figures that
    disagree with vLLM's own counters. ``to_report()`` is the report itself."""
    problems = rep["problems"] if rep.get("problems") is not None else verdict_problems(rep)
    rows = [{"key": k, **v} for k, v in (rep.get("components") or {}).items() if isinstance(v, dict)]
    return Verdict(kind="engine", passed=not problems, first_divergent=problems[0] if problems else None,
                   rows=rows, notes=list(rep.get("acceptance_disagreements") or []), details=rep)


def run_case(case: EngineCase, *, log=print, out: str | None = None, mutant: str | None = None) -> Verdict:
    """Build, load, hook, generate, replay, judge: the verdict (its ``to_report()`` the JSON-able
    report). ``mutant`` is planted before the engine is built (as ``bisect-check`` passes it on).
    Its ``timing_s.start_up``: this process's seconds before the case began (the interpreter,
    the imports and the host checks: in a process of its own, the cost of one more engine)."""
    from harness.process_clock import process_age_s

    start_up = process_age_s()
    if case.reload_seed is not None:  # two generations around a reload: engine/reload.py
        raise ValueError(f"{case.id}: a reload case runs through harness.production.engine.reload")
    t0 = time.perf_counter()
    planted = None
    if mutant:
        from harness.production.engine.speculator_mutants import apply_mutant
        planted = apply_mutant(mutant)
        log("planted speculator bug:", json.dumps(planted))
    sess = build_session(case, log=log)
    return engine_verdict(_case_run(sess, start_up, t0, out=out, log=log, mutant=planted))


def _case_run(sess: dict, start_up: float | None, t0: float, *, out, log, mutant: dict | None = None) -> dict:
    """The case's own generation on ``sess`` (recorded under ``out``), its report carrying the
    process's start-up seconds (``run_case``; a sweep's first pristine run)."""
    rep = generate_and_judge(sess, out=out, log=log, mutant=mutant, t0=t0)
    if start_up is not None:
        rep["timing_s"]["start_up"] = start_up
    return rep


def run_mutant_sweep(case: EngineCase, mutants: list[str], *, log=print, out: str | None = None) -> dict:
    """One engine of ``case`` for a pristine run, then per mutant a planted run and a pristine
    run again (the restore checked by the engine's own verdict): measured ~4 s per run
    instead of ~40 s per engine process. A mutant is caught when its run fails with the
    mutant's quantity named first; a capture-only mutant swept on its eager twin
    (``speculator_mutants.harmless_on``) must pass there instead. The first pristine run is the
    case's own engine run, in full: recorded under ``out`` and reported as ``engine_mtp_<case>.json``,
    as ``run_case`` does (the GPU tier judges a swept case from it instead of building its engine
    twice); the later runs' recordings are not kept (a failing run keeps its problems)."""
    from harness.process_clock import process_age_s
    from harness.production.engine.speculator_mutants import MUTANTS, harmless_on, planted

    start_up = process_age_s()
    t0 = time.perf_counter()
    sess = build_session(case, log=log)
    runs = []

    def one(label: str, mutant: str | None) -> dict:
        if not runs:  # the case's own run
            rep = _case_run(sess, start_up, t0, out=out, log=log)
            if out:
                atomic_write_json(os.path.join(out, f"engine_mtp_{case.id}.json"),
                                  engine_verdict(rep).to_report(), default=str)
        elif mutant is None:
            rep = generate_and_judge(sess, log=lambda *a, **k: None)
        else:
            with planted(mutant) as desc:
                rep = generate_and_judge(sess, log=lambda *a, **k: None, mutant=desc)
        first = (rep["problems"] or [""])[0]
        row = {"label": label, "mutant": mutant, "passed": rep["passed"], "problems": rep["problems"][:5],
               "counts": rep.get("counts"), "timing_s": rep["timing_s"]}
        if mutant is None:
            row["ok"] = rep["passed"]
        elif harmless_on(mutant, case.id):  # capture-only: no graph here, so nothing to catch
            row["harmless_here"] = True
            row["ok"] = rep["passed"]
        else:
            row["caught"], row["named_first"] = not rep["passed"], MUTANTS[mutant].expect in first
            row["ok"] = row["caught"] and row["named_first"]
        log(f"{'ok  ' if row['ok'] else 'BAD '} {label}: {'pass' if rep['passed'] else 'FAIL'} {first[:200]}")
        runs.append(row)
        return rep

    one("control-0", None)
    for i, m in enumerate(mutants, 1):
        one(m, m)
        one(f"control-{i}", None)
    doc = {"case": case.id, "mutants": list(mutants), "runs": runs, "build_s": sess["build_s"],
           "wall_s": time.perf_counter() - t0, "ok": all(r["ok"] for r in runs)}
    if out:
        os.makedirs(out, exist_ok=True)
        atomic_write_json(os.path.join(out, f"engine_mtp_{case.id}.sweep.json"), doc, default=str)
    return doc


def case_from_dict(d: dict) -> EngineCase:
    """Inverse of ``dataclasses.asdict`` for an ``EngineCase`` (JSON lists back to tuples)."""
    d = dict(d)
    d["overrides"] = tuple(tuple(x) for x in d.get("overrides", ()))
    for k in ("prompt_lens", "patterns", "known_audit", "graph_regimes"):
        d[k] = tuple(d.get(k, ()))
    d["expect_rates"] = tuple(tuple(x) for x in d.get("expect_rates", ()))
    d["upstream_gaps"] = tuple(tuple(x) for x in d.get("upstream_gaps", ()))
    return EngineCase(**d)


def _read_recording(stem: str):
    """(calls, proposals, doc, meta, case) of a saved recording; one that cannot be read
    (truncated, edited, another format) is bad input: ``CLIError`` naming it (exit 2)."""
    from harness.exitcodes import CLIError

    try:
        calls, proposals, doc = load_recording(stem)
        meta = doc["meta"]
        return calls, proposals, doc, meta, case_from_dict(meta["case"])
    except CLIError:
        raise
    except Exception as exc:  # json, safetensors (SafetensorError is no OSError), keys
        raise CLIError(f"{stem}.json / .safetensors: not a readable engine recording: "
                       f"{exc.__class__.__name__}: {first_line(exc)}") from exc


def rejudge(stem: str, *, log=print) -> Verdict:
    """Replay and judge one saved recording (``<stem>.safetensors`` + ``.json``) on CPU: the verdict."""
    import reference as R
    calls, proposals, doc, meta, case = _read_recording(stem)
    targets = doc.get("targets")
    _hf, _ckpt, weights, _plan = engine_inputs(case)
    cfg = R.MTPConfig.from_hf_dict(_hf)
    rep = {"case": meta["case"], "rejudged_from": stem, "versions": meta.get("versions"),
           "runner": meta.get("runner"), "sharing": meta.get("sharing"), "load": meta.get("load", {}),
           "recording": {k: v for k, v in doc.items() if k not in ("meta", "call_meta", "proposal_meta")}}
    runner = meta.get("runner") or {}
    rep["target_follows_f"] = meta.get("target_follows_f")
    for key in ("drafter_mode", "graph_replays", "graph_facts", "graph_regimes"):  # a graph run's regimes
        if meta.get(key) is not None:
            rep[key] = meta[key]
    rep["vllm_spec_decode"] = meta.get("vllm_spec_decode") or {
        "per_request": "unavailable: not in the recording", "totals": "unavailable: not in the recording"}
    rep.update(judge_run(cfg, weights, calls, proposals, list(meta.get("tap_errors", [])), case, targets=targets,
                         multi_module="MultiModule" in str(runner.get("proposer", "")),
                         max_model_len=int(runner.get("max_model_len", 1024)), prompts=meta.get("prompts"),
                         generated=meta.get("generated"), log=log))
    rep["timing_s"] = {"reference": rep.pop("reference_s")}
    rep["problems"] = verdict_problems(rep)
    rep["acceptance_disagreements"] = acceptance_disagreements(rep)
    rep["passed"] = rep["problems"] == []
    return engine_verdict(rep)


def upstream_gap(rep: dict):
    """The case's ``upstream_gaps`` entry whose speculator vLLM picked for this run, or None."""
    case = rep.get("case") if isinstance(rep.get("case"), dict) else {}
    proposer = str((rep.get("runner") or {}).get("proposer", ""))
    return next((tuple(g) for g in case.get("upstream_gaps") or () if g[0] in proposer), None)


def worst_exit_code(codes) -> int:
    """2 if any input was bad, else 1 if any case mismatched, else 125 if any could not be judged, else 0."""
    from harness.exitcodes import worst

    return worst(codes)
