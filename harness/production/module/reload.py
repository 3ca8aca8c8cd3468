"""Weights updated in place: a reload case (``GpuCase.reload_seed``) side by side.

    set A (``case.seed``) loaded -> K draft steps, judged against set A's reference
    -> the draft reloaded in place with set B (``case.reload_seed``) through vLLM's layerwise
       ``reload_weights`` (``ProductionSession.reload``)
    -> every parameter, and every tensor an attention impl bound from a parameter at
       build time (the learnable sink reaches the kernels that way), compared with a fresh load of
       set B: one still holding set A's value is stale, named
    -> K draft steps on set B's inputs, judged against set B's reference.

The verdict passes when all three hold; its first divergent names the first that does not
("run 1 (set A): <component>", "reload: <parameter> ...", "run 2 (set B): <component>").

May import: vLLM (lazily), ``reference``, ``harness``, ``harness.production.case_inputs``,
``harness.production.judging`` and the rest of ``harness.production.module``.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from harness.exitcodes import CannotJudge, first_line
from harness.verdict import Verdict

# A parameter recomputed from others at process time (the absorbed MLA W_UK_T / W_UV from kv_b_proj)
# may round its last bit the other way between two loads if a kernel's summation order differs:
# bf16 keeps 8 significant bits, so neighbouring values are at most 2^-7 apart relatively. Within
# that of a fresh load it is a note, not a finding (a stale value differs by set A vs set B, O(1))
RECOMPUTE_RTOL = 2.0 ** -7


def _key(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy (a tensor left on the meta device stays there: it has no values to copy)."""
    return t.detach() if t.is_meta else t.detach().to("cpu").clone()


def snapshot(model, impl_names=None) -> dict[str, torch.Tensor]:
    """{name: CPU copy} of every parameter of ``model``, plus every tensor attribute of an attention
    ``impl`` that shares storage with a parameter (``<module>.impl.<attr>``), or, with ``impl_names``,
    those impl attributes whatever they share (after a reload that re-allocated a parameter the impl
    still holds the old tensor: that is what is judged). Buffers are left out: some are scratch a
    forward writes (they would differ from a fresh load for no fault of the reload)."""
    out = {name: _key(t) for name, t in model.named_parameters()}
    if impl_names is None:
        out.update({name: _key(t) for name, t in bound_impl_tensors(model).items()})
        return out
    for name in impl_names:
        mname, _, attr = name.rpartition(".impl.")
        t = getattr(getattr(model.get_submodule(mname), "impl", None), attr, None)
        if torch.is_tensor(t):
            out[name] = _key(t)
    return out


def bound_impl_tensors(model) -> dict[str, torch.Tensor]:
    """{``<module>.impl.<attr>``: tensor} for every tensor an attention impl holds that shares storage
    with one of ``model``'s parameters now (bound at build time, e.g. the sink passed as ``sinks``)."""
    ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    out = {}
    for mname, m in model.named_modules():
        impl = getattr(m, "impl", None)
        if impl is None or isinstance(impl, torch.nn.Module):
            continue
        for attr, v in vars(impl).items():
            if torch.is_tensor(v) and v.numel() and v.untyped_storage().data_ptr() in ptrs:
                out[f"{mname}.impl.{attr}"] = v
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (NaN == NaN), any dtype; a meta tensor equals nothing."""
    if a.shape != b.shape or a.dtype != b.dtype or a.is_meta or b.is_meta:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max()) if a.numel() else 0.0


def stale_parameters(after: dict, fresh_b: dict, set_a: dict, bound: dict | None = None) -> tuple[list[str], list[str]]:
    """(problems, notes) comparing the reloaded model (``after``) with a fresh load of set B.

    Every name of ``fresh_b`` must be in ``after`` and equal to it bitwise. One that equals its set A
    value (``set_a``) where A and B differ is stale; one within ``RECOMPUTE_RTOL`` of set B is a note;
    anything else a problem. ``bound``: {impl tensor name: the parameter it was bound from} (judged
    against that parameter's set B / set A values)."""
    problems, notes = [], []
    for name in sorted(set(fresh_b) | set(bound or {})):
        src = (bound or {}).get(name, name)
        b, a, got = fresh_b.get(src), set_a.get(name, set_a.get(src)), after.get(name)
        if b is None:
            continue
        if got is None:
            problems.append(f"{name}: not in the model after the reload")
            continue
        if got.is_meta:
            problems.append(f"{name}: still on the meta device after the reload (never re-materialized)")
            continue
        if _same(got, b):
            continue
        if a is not None and _same(got, a) and not _same(a, b):
            problems.append(f"{name}: stale: still holds set A's value after the reload (a fresh load of set B "
                            f"differs by max |d| {_max_abs(a, b):.4g})")
            continue
        if got.shape == b.shape and got.is_floating_point() and torch.allclose(
                got.to(torch.float64), b.to(torch.float64), rtol=RECOMPUTE_RTOL, atol=0.0):
            notes.append(f"{name}: within {RECOMPUTE_RTOL:g} relative of a fresh load of set B "
                         f"(max |d| {_max_abs(got, b):.3g}): a recomputation's rounding")
            continue
        what = (f"shape {tuple(got.shape)} vs {tuple(b.shape)}" if got.shape != b.shape
                else f"max |d| {_max_abs(got, b):.4g}")
        problems.append(f"{name}: differs from a fresh load of set B after the reload ({what})")
    return problems, notes


def run_reload_case(case, *, session_kw: dict | None = None, plant_withheld: tuple = ()) -> Verdict:
    """A reload case side by side (module doc): the combined verdict. ``plant_withheld``: a planted
    reload bug, the set B tensors whose names contain one of these substrings are left out of the
    reload (their parameters keep set A's values): the verdict must name them."""
    from harness.production.case_inputs import build_inputs, reload_set_b
    from harness.production.module import audit
    from harness.production.module.runner import ProductionSession
    from harness.production.judging.trace_judge import judge

    t0 = time.perf_counter()
    case_b = reload_set_b(case)
    case_a = dataclasses.replace(case, reload_seed=None)
    inputs_a, inputs_b = build_inputs(case_a), build_inputs(case_b)
    # what set B implies: a fresh model loaded with it (vLLM's own processing of set B)
    fresh = ProductionSession(inputs_b.hf_config, num_speculative_tokens=case.steps, **(session_kw or {}))
    fresh.load(inputs_b.checkpoint)
    fresh_b = snapshot(fresh.model)
    del fresh
    torch.cuda.empty_cache()

    sess = ProductionSession(inputs_a.hf_config, num_speculative_tokens=case.steps, **(session_kw or {}))
    sess.load(inputs_a.checkpoint, strict=not case.known_audit)
    prod_a = sess.run(inputs_a.first, case.steps)
    torch.cuda.synchronize()
    info = {"audit": sess.audit_problems, "attach_notes": sess.attach_notes,
            "step_notes": [dataclasses.asdict(n) for n in sess.notes], "timing_s": {}}
    state = {"set_a": snapshot(sess.model)}
    state["bound"] = {n: _bound_source(sess.model, n) for n in bound_impl_tensors(sess.model)}
    t1 = time.perf_counter()
    try:
        sess.reload({k: v for k, v in inputs_b.checkpoint.items() if not any(w in k for w in plant_withheld)})
    except CannotJudge:
        raise
    except Exception as exc:  # vLLM failed to reload what set B holds: a load failure (exit 1), named
        raise audit.LoadAuditError([f"reload: vLLM's reload_weights raised {exc.__class__.__name__}: "
                                    f"{first_line(exc)}"]) from exc
    state["reload_s"] = time.perf_counter() - t1
    state["after"] = snapshot(sess.model, impl_names=state["bound"])
    problems, notes = stale_parameters(state["after"], fresh_b, state["set_a"], state["bound"])
    # the post-load audit's value checks again (sentinel scales, -inf sink, NaN) on the reloaded model
    live = {n for n, p in sess.model.named_parameters() if not p.is_meta}
    try:
        if len(live) == len(list(sess.model.parameters())):
            problems += [f"after the reload: {p}" for p in audit.audit_loaded_model(sess.model, live, {}, [])]
    except Exception as exc:  # noqa: BLE001 - e.g. a buffer left on meta: said, not fatal
        problems.append(f"the post-load audit could not read the reloaded model: {exc.__class__.__name__}: "
                        f"{first_line(exc)}")
    try:
        state["trace_b"] = sess.run(inputs_b.first, case.steps)
        torch.cuda.synchronize()
    except Exception as exc:  # the reloaded model cannot run: the reload's findings, then why
        raise audit.LoadAuditError([f"reload: {p}" for p in problems] + [
            f"run 2 (after the reload) raised {exc.__class__.__name__}: {first_line(exc)}"]) from exc
    info_b = {**info, "step_notes": [dataclasses.asdict(n) for n in sess.notes]}
    verdict_a = judge(case_a, prod_a, info, inputs=inputs_a)
    verdict_b = judge(case_b, state["trace_b"], info_b, inputs=inputs_b)
    first = (None if verdict_a.passed else f"run 1 (set A): {verdict_a.first_divergent}")
    if first is None and problems:
        first = f"reload: {problems[0]}"
    if first is None and not verdict_b.passed:
        first = f"run 2 (set B, after the reload): {verdict_b.first_divergent}"
    details = dict(verdict_b.details)
    details["case"] = dataclasses.asdict(case)
    details["reload"] = {"planted_withheld": list(plant_withheld),
                         "path": "vllm.model_executor.model_loader.reload.inplace.reload_weights (layerwise), "
                                 "applied to the draft model",
                         "stale": problems, "notes": notes, "bound_impl_tensors": state["bound"],
                         "compared": len(fresh_b), "reload_s": state["reload_s"],
                         "run_a": {"passed": verdict_a.passed, "first_divergent": verdict_a.first_divergent,
                                   "table": verdict_a.details.get("table")},
                         "wall_s": time.perf_counter() - t0}
    return Verdict(kind="module", passed=first is None, first_divergent=first, rows=verdict_b.rows,
                   regimes=verdict_b.regimes, notes=[*verdict_b.notes, *notes], trace=state["trace_b"],
                   reference=verdict_b.reference, trace_compared=verdict_b.trace_compared,
                   comparison=verdict_b.comparison, details=details)


def _bound_source(model, impl_name: str) -> str | None:
    """The parameter an impl tensor shares storage with (its name), or None."""
    t = bound_impl_tensors(model)[impl_name]
    ptr = t.untyped_storage().data_ptr()
    return next((n for n, p in model.named_parameters() if p.untyped_storage().data_ptr() == ptr), None)
