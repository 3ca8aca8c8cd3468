"""What an engine case's pristine run must show, judged from its report (``engine_mtp_<case>.json``)
and recording (``engine_calls_<case>``): shared by ``test_engine_mtp.py`` (a case's own engine
process) and ``test_speculator_mutants.py`` (a swept case: its sweep's first pristine run is the
case's run, so its engine is built once for both)."""

from __future__ import annotations

import json
import os

from harness.production.engine.generation_judge import rejudge, upstream_gap, verdict_problems

# ~2/3 of the synthetic draft tokens are near-ties under the logits tolerance (top-2 gap
# vs 2*(0.1 + 0.02*|top1|), CPU-simulated); a K=2..3, 3-request, 32-token run drafts > 140.
MIN_COMPARED = 20


def check_engine_report(case_id: str, out: str, returncode: int, stderr: str = "") -> None:
    """Assert the pristine run of ``case_id`` reported under ``out`` passed, in full (its process
    exited ``returncode``)."""
    path = os.path.join(out, f"engine_mtp_{case_id}.json")
    assert os.path.exists(path), f"no report (exit {returncode}); stderr tail:\n{stderr[-4000:]}"
    with open(path) as f:
        rep = json.load(f)
    assert "error" not in rep, f"the engine run crashed:\n{rep['error']}"
    c = rep["counts"]
    print("counts:", json.dumps(c))
    gap = upstream_gap(rep)
    if gap is not None:  # a speculator that ignores part of the checkpoint: the harness must say so
        print("known vLLM gap:", gap[2])
        assert returncode == 1 and gap[1] in rep["problems"][0], rep["problems"][:3]
        assert c["mismatches"] == 0 and c["compared"] >= MIN_COMPARED, c  # the drafts themselves agree
        return
    if rep["case"].get("reload_seed") is not None:  # the drafter reloaded in place between two generations
        r = rep["reload"]
        print("reload:", json.dumps({k: r[k] for k in ("reload_s", "compared", "findings", "moved", "run_a")}))
        assert r["findings"] == [] and r["run_a"]["passed"], (r["findings"][:6], r["run_a"])
        assert r["compared"] > 20, r
    assert c["mismatches"] == 0, json.dumps(rep["mismatch_examples"], indent=1)
    assert c["compared"] >= MIN_COMPARED, c
    assert c["max_context"] > c["index_topk"], c
    if c["num_speculative_tokens"] >= 2:  # the proposer's multi-step loop ran
        assert c["max_draft_steps"] >= 2, rep["facts"]
    # the saved recording re-judged offline (CPU) gives the same counts
    rec = rep.get("recording", {})
    assert "error" not in rec and rec.get("tensor_bytes", 0) < 10 * 2**20, rec
    again = rejudge(os.path.join(out, f"engine_calls_{case_id}"), log=lambda *a: None).to_report()
    assert again["counts"] == c, (again["counts"], c)
    assert verdict_problems(rep) == [], verdict_problems(rep)
    assert returncode == 0, returncode
    if rep["case"].get("graphs"):  # the draft decodes replayed a captured graph
        print("compilation:", json.dumps(rep["compilation"]), "graph replays:", json.dumps(rep["graph_replays"]))
        assert rep["compilation"]["enforce_eager"] is False and rep["drafter_mode"] == "CUDA graphs", rep["compilation"]
        assert rep["graph_replays"]["decode"].get("FULL", 0) > 0, rep["graph_replays"]
    if rep["case"]["target"] == "acceptance":  # drafts accepted: the accepted path ran on the GPU
        acc = rep["acceptance"]
        print("acceptance:", json.dumps({k: (v["accepted"], v["drafted"]) for k, v in acc.items()}))
        assert sum(v["accepted"] for v in acc.values()) > 0, acc
        assert c["bookkeeping_findings"] == 0 and c["bookkeeping_checked"]["requests_steps"] > 0, c
