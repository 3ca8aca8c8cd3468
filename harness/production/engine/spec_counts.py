"""Acceptance as vLLM counts it, and vLLM's own spec-decode counters beside the harness's.

vLLM's definition (the scheduler's ``update_from_output``, both supported releases): a verify
step of a request counts when its output reaches the scheduler while the request is still
running and the step verified at least one draft. Then ``num_drafts += 1``,
``num_draft_tokens += len(scheduled drafts)``, ``num_accepted_tokens += sampled tokens - 1``
(the whole accepted prefix, also where max_tokens cuts the step's last tokens off). A step
whose output arrives for a request that has already finished is skipped before any count.
Under async scheduling that happens once per request that finishes with drafts accepted: the
scheduler runs one more step of a request while the step that will finish it is still in
flight (it skips it only when that in-flight step is sure to reach max_tokens even if every
draft is rejected).

The harness derives the same from the recording, without vLLM's code: a decode step of
request r whose first row (the last token the request sampled) sits at position p follows
``p + 1 - len(prompt)`` output tokens; when that is already the request's final output
length the request had finished and the step is not vLLM's. The figure over every verify
step the target ran is kept too (``all_verify_steps``).

vLLM's own counters, read after ``generate``: per request ``CompletionOutput.spec_decode_metrics``
(engine argument ``per_request_spec_decode_metrics="detailed"``), in total the
``vllm:spec_decode_*`` counters of ``LLM.get_metrics()`` (needs stat logging), as a difference
over the generate call (the Prometheus registry lives as long as the process). A release or a
run without one records ``"unavailable: <why>"`` instead. Where both are there, a difference
the definition does not explain is a finding of its own (``disagreements``).

May import: nothing of vLLM (the objects are read by attribute, duck-typed).
"""

from __future__ import annotations

import dataclasses

# the Counter names LLM.get_metrics() reports (Prometheus strips the "_total" suffix)
METRIC_NAMES = {"num_drafts": "vllm:spec_decode_num_drafts",
                "num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
                "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}


@dataclasses.dataclass(frozen=True)
class VerifyStep:
    """One decode step of one request as the target ran it."""

    engine_step: int
    accepted: int  # the longest accepted prefix of its drafts
    drafted: int  # drafts the target verified (rows after the first)
    outputs_before: int | None  # output tokens the request had sampled before it (None: unknown)


def _rate(a: int, d: int):
    return a / d if d else None


def summarize(steps: list[VerifyStep], output_tokens: int | None) -> dict:
    """One request's acceptance in vLLM's definition (``accepted``/``drafted``/``rate``/``drafts``/
    ``per_step``), the steps left out because the request had already finished
    (``verified_after_finish``) and the figure over every verify step (``all_verify_steps``)."""
    counted, after = [], []
    for st in steps:
        if output_tokens is not None and st.outputs_before is not None and st.outputs_before >= output_tokens:
            after.append(st)
        elif st.drafted > 0:  # a step without drafts is no draft in vLLM's count
            counted.append(st)
    a, d = sum(s.accepted for s in counted), sum(s.drafted for s in counted)
    a_all, d_all = sum(s.accepted for s in steps), sum(s.drafted for s in steps)
    return {"accepted": a, "drafted": d, "rate": _rate(a, d), "drafts": len(counted),
            "per_step": [s.accepted for s in counted], "output_tokens": output_tokens,
            "definition": ("vLLM's: verify steps whose output reached the running request"
                           if output_tokens is not None else
                           "every verify step (the request's output length is unknown)"),
            "verified_after_finish": {"steps": len(after), "accepted": sum(s.accepted for s in after),
                                      "drafted": sum(s.drafted for s in after),
                                      "engine_steps": [s.engine_step for s in after]},
            "all_verify_steps": {"accepted": a_all, "drafted": d_all, "rate": _rate(a_all, d_all),
                                 "steps": len(steps)}}


# ---- vLLM's counters ----------------------------------------------------------------------


def _unavailable(why: str) -> str:
    return f"unavailable: {why}"


def request_counters(outputs) -> dict | str:
    """``{"request i": {accepted, drafted, drafts[, per_step, per_step_drafted]}}`` from vLLM's
    per-request metrics of ``LLM.generate``'s outputs (in prompt order), or ``"unavailable: ..."``."""
    got = {}
    for i, o in enumerate(outputs):
        comps = getattr(o, "outputs", None) or []
        m = getattr(comps[0], "spec_decode_metrics", None) if comps else None
        if comps and not hasattr(comps[0], "spec_decode_metrics"):
            return _unavailable("this vLLM's CompletionOutput has no spec_decode_metrics")
        if m is None:
            return _unavailable(f"request {i}: no spec_decode_metrics (per_request_spec_decode_metrics off, "
                                "or no speculative decoding ran)")
        try:
            hist = list(m.histogram)
            row = {"accepted": sum(j * c for j, c in enumerate(hist)), "drafted": int(m.num_draft_tokens),
                   "drafts": int(sum(hist)), "histogram": hist}
            if getattr(m, "per_step_accepted", None):
                row["per_step"] = [int(x) for x in m.per_step_accepted]
                row["per_step_drafted"] = [int(x) for x in m.per_step_drafted]
        except (AttributeError, TypeError) as exc:
            return _unavailable(f"request {i}: spec_decode_metrics of another shape ({exc})")
        got[f"request {i}"] = row
    return got


def metric_totals(metrics) -> dict:
    """``{num_drafts, num_draft_tokens, num_accepted_tokens}`` summed over the Counters of an
    ``LLM.get_metrics()`` list (every engine label); a name absent is left out."""
    out = {}
    for key, name in METRIC_NAMES.items():
        vals = [getattr(m, "value", None) for m in metrics if getattr(m, "name", None) == name]
        vals = [int(v) for v in vals if v is not None]
        if vals:
            out[key] = sum(vals)
    return out


def read_metric_totals(llm) -> dict | str:
    """``metric_totals(llm.get_metrics())``, or ``"unavailable: ..."`` (no ``get_metrics``, stat
    logging off, no spec-decode counters)."""
    get = getattr(llm, "get_metrics", None)
    if get is None:
        return _unavailable("this vLLM's LLM has no get_metrics()")
    try:
        metrics = get()
    except Exception as exc:  # noqa: BLE001 - vLLM asserts when stat logging is off
        return _unavailable(f"LLM.get_metrics() raised {exc.__class__.__name__}: {str(exc)[:200]}")
    totals = metric_totals(metrics)
    if len(totals) != len(METRIC_NAMES):
        absent = ", ".join(n for k, n in METRIC_NAMES.items() if k not in totals)
        return _unavailable(f"LLM.get_metrics() has no {absent}")
    return totals


def totals_over(before, after) -> dict | str:
    """The counters' growth between two ``read_metric_totals``."""
    for x in (before, after):
        if isinstance(x, str):
            return x
    return {k: after[k] - before[k] for k in METRIC_NAMES}


def vllm_counters(outputs, before, after) -> dict:
    """What the report records as ``vllm_spec_decode``."""
    return {"per_request": request_counters(outputs), "totals": totals_over(before, after)}


# ---- the comparison -----------------------------------------------------------------------


def disagreements(acceptance: dict | None, vllm: dict | None) -> list[str]:
    """Problem lines where vLLM's counters and the harness's figure in vLLM's definition differ
    (nothing where vLLM's are unavailable)."""
    if not vllm:
        return []
    acc = acceptance or {}
    out = []
    per = vllm.get("per_request")
    if isinstance(per, dict):
        for name in sorted(set(per) | set(acc), key=lambda n: (len(n), n)):
            v, h = per.get(name), acc.get(name)
            if v is None or h is None:
                if (v or h or {}).get("drafted"):
                    out.append(f"acceptance: {name}: counted only by {'vLLM' if h is None else 'the harness'} "
                               f"({(v or h)['accepted']}/{(v or h)['drafted']} accepted/drafted)")
                continue
            if (h["accepted"], h["drafted"], h["drafts"]) == (v["accepted"], v["drafted"], v["drafts"]) and (
                    "per_step" not in v or v["per_step"] == h["per_step"]):
                continue
            line = (f"acceptance: {name}: the harness counts {h['accepted']}/{h['drafted']} accepted/drafted over "
                    f"{h['drafts']} verify step(s) in vLLM's definition, vLLM's per-request counters "
                    f"{v['accepted']}/{v['drafted']} over {v['drafts']}")
            if "per_step" in v:
                i = next((j for j, (x, y) in enumerate(zip(h["per_step"], v["per_step"])) if x != y),
                         min(len(h["per_step"]), len(v["per_step"])))
                line += f"; first differing verify step {i} (accepted per step: harness {h['per_step'][i:i + 4]}, " \
                        f"vLLM {v['per_step'][i:i + 4]})"
            allv = h.get("all_verify_steps") or {}
            if (allv.get("accepted"), allv.get("drafted")) == (v["accepted"], v["drafted"]) and \
                    h["verified_after_finish"]["steps"]:
                line += " (vLLM counted the verify step(s) the harness takes as run after the request finished)"
            out.append(line)
    tot = vllm.get("totals")
    if isinstance(tot, dict):
        mine = {"num_drafts": sum(h["drafts"] for h in acc.values()),
                "num_draft_tokens": sum(h["drafted"] for h in acc.values()),
                "num_accepted_tokens": sum(h["accepted"] for h in acc.values())}
        if mine != {k: tot.get(k) for k in mine}:
            out.append(f"acceptance: vLLM's spec-decode counters over the run {tot} are not the sum of the "
                       f"harness's per-request figures in vLLM's definition {mine}")
    return out
