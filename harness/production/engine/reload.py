"""Engine level, weights updated in place (an ``EngineCase`` with ``reload_seed``).

    build the engine, load the drafter with set A (``case.seed``), generate, judge against set A
    -> reload the drafter in place with set B (``case.reload_seed``) inside the worker
       (``LLM.collective_rpc`` with a callable): vLLM's layerwise
       ``model_loader.reload.inplace.reload_weights`` on the draft model
    -> every draft parameter, and every tensor an attention impl bound from one at build time (the
       sink), must have left its set A value (set B differs in every stored tensor); the post-load
       audit's sentinel / NaN checks run again; in CUDA-graph mode no tensor may have moved (the
       captured graphs read the old addresses)
    -> generate again and judge that generation against the reference built from set B.

Which reload path: in vLLM 0.33.0 and 0.34.0 the public ``reload_weights`` (``LLM.collective_rpc
("reload_weights", ...)`` -> ``GPUModelRunner.reload_weights``) reloads the target model only
(``self.get_model()``); the drafter's weights are not reachable through it. 0.34.0 adds draft
updates to its weight-transfer engines (``Worker.start_draft_weight_update``), which need a
``weight_transfer_config`` backend (NCCL / IPC with a trainer). The closest vLLM-own path that
both releases provide is the one ``reload_weights`` runs, ``model_loader.reload.inplace.reload_weights``
(layerwise: meta restore, buffered weight loaders, ``process_weights_after_loading``, copy back
into the original storage), applied here to the drafter.

May import: vLLM (lazily), ``reference``, ``harness``, ``harness.production``.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from harness.exitcodes import CannotJudge, first_line

PUBLIC_PATH_NOTE = ("LLM.collective_rpc('reload_weights') reloads the target model only "
                    "(GPUModelRunner.reload_weights: self.get_model()) in vLLM 0.33.0 and 0.34.0; 0.34.0's "
                    "draft weight updates need a weight_transfer_config backend. The drafter is reloaded "
                    "with model_loader.reload.inplace.reload_weights, the layerwise path reload_weights runs.")


def _reload_draft_in_worker(worker, ckpt: dict) -> dict:
    """Runs inside the worker (``collective_rpc``): vLLM's layerwise reload of the drafter with ``ckpt``."""
    from vllm.config import set_current_vllm_config

    from harness.production import vllm_compat
    from harness.production.engine.session import drafter_of

    reload_weights = vllm_compat.internal("reload.reload_weights")
    runner = worker.model_runner
    _, draft, _, _ = drafter_of(runner)
    inference = any(p.is_inference() for p in draft.parameters())
    t0 = time.perf_counter()
    with set_current_vllm_config(runner.vllm_config), (torch.inference_mode() if inference
                                                        else torch.no_grad()):
        reload_weights(runner.vllm_config, draft, iter(sorted(ckpt.items())), None, True)
    torch.cuda.synchronize()
    return {"reload_s": time.perf_counter() - t0, "inference_mode": inference}


def reload_drafter(llm, ckpt: dict) -> dict:
    """Reload the live drafter with ``ckpt`` (checkpoint tensors, cast as for a load) in the worker."""
    from harness.production.engine.session import model_runner
    from harness.production.module.checkpoint_cast import cast_for_vllm

    ckpt = cast_for_vllm(ckpt)
    started: list = []

    def in_worker(worker, ckpt):
        started.append(True)
        return _reload_draft_in_worker(worker, ckpt)

    try:
        out = llm.collective_rpc(in_worker, args=(ckpt,))[0]
        out["via"] = "LLM.collective_rpc (a callable in the worker)"
        return out
    except Exception:
        if started:  # the reload itself failed: that is the finding
            raise
    # the RPC never reached the worker (a release whose collective_rpc takes no callable with
    # arguments): the in-process worker's model runner directly, as ``session.model_runner`` does
    runner = model_runner(llm)

    class _W:
        model_runner = runner
    out = _reload_draft_in_worker(_W, ckpt)
    out["via"] = "the in-process worker's model runner (collective_rpc refused the callable)"
    return out


def unchanged_since_set_a(after: dict, set_a: dict) -> list[str]:
    """Names of ``after`` (a snapshot after the reload) bitwise equal to their set A value: with a set B
    that differs in every stored tensor, each one is a part the reload left stale."""
    from harness.production.module.reload import _same

    return [f"{n}: stale: still holds set A's value after the reload" for n in sorted(after)
            if n in set_a and _same(after[n], set_a[n])]


def _param_snapshot(draft, impl_names=None) -> dict:
    from harness.production.module.reload import _key, bound_impl_tensors, snapshot

    out = {n: _key(p) for n, p in draft.named_parameters()}
    if impl_names is None:
        out.update({n: _key(t) for n, t in bound_impl_tensors(draft).items()})
        return out
    full = snapshot(draft, impl_names=impl_names)
    out.update({n: full[n] for n in impl_names if n in full})
    return out


def run_reload_engine_case(case, *, log=print, out: str | None = None):
    """The reload engine case (module doc): the verdict of the second generation, with the reload's
    findings and the first generation's verdict in front of its problems."""
    import reference as R
    from harness.production.engine.generation_judge import engine_verdict, generate_and_judge
    from harness.production.engine.session import _param_addresses, build_session, engine_inputs
    from harness.production.module import audit
    from harness.production.module.reload import bound_impl_tensors

    t0 = time.perf_counter()
    case_b = dataclasses.replace(case, seed=case.reload_seed, reload_seed=None)
    sess = build_session(dataclasses.replace(case, reload_seed=None), log=log)
    sess["base"]["case"] = dataclasses.asdict(case)
    rep_a = generate_and_judge(sess, out=out, log=log, stem=f"engine_calls_{case.id}.set_a")
    log(f"run 1 (set A): {'PASS' if rep_a['passed'] else 'FAIL: ' + rep_a['problems'][0]}")
    draft = sess["draft"]
    impl_names = sorted(bound_impl_tensors(draft))
    set_a = _param_snapshot(draft)
    ptrs = _param_addresses(draft, sess["target"])
    hf_b, ckpt_b, weights_b, _ = engine_inputs(case_b)
    try:
        info = reload_drafter(sess["llm"], ckpt_b)
    except CannotJudge:
        raise
    except Exception as exc:  # vLLM failed to reload what set B holds: a load failure (exit 1), named
        raise audit.LoadAuditError([f"reload: vLLM's reload_weights raised {exc.__class__.__name__}: "
                                    f"{first_line(exc)}"]) from exc
    after = _param_snapshot(draft, impl_names)
    stale = unchanged_since_set_a(after, set_a)
    stale += [f"{n}: still on the meta device after the reload (never re-materialized)"
              for n, t in sorted(after.items()) if t.is_meta]
    names = {n for n, p in draft.named_parameters() if not p.is_meta}
    try:  # the post-load audit's value checks (sentinel scales, -inf sink, NaN) on the reloaded drafter
        sentinels = ([p for p in audit.audit_loaded_model(draft, names, {}, [])]
                     if len(names) == len(list(draft.parameters())) else [])
    except Exception as exc:  # noqa: BLE001 - e.g. a buffer left on meta: said, not fatal
        sentinels = [f"the post-load audit could not read the reloaded drafter: {exc.__class__.__name__}: "
                     f"{first_line(exc)}"]
    moved = sorted(k for k, v in _param_addresses(draft, sess["target"]).items() if ptrs.get(k) != v)
    findings = stale + sentinels
    if case.graphs and moved:
        findings += [f"{k}: re-allocated by the reload: the captured CUDA graphs still read the old tensor"
                     for k in moved]
    log("reload:", f"{info}; {len(set_a)} tensors, {len(stale)} stale, moved {len(moved)}", findings[:4])
    sess["case"], sess["weights"], sess["cfg"] = case_b, weights_b, R.MTPConfig.from_hf_dict(hf_b)
    try:
        rep = generate_and_judge(sess, out=out, log=log, t0=t0)
    except Exception as exc:  # the reloaded drafter cannot run: the reload's findings, then why
        raise audit.LoadAuditError([f"reload: {f}" for f in findings] + [
            f"run 2 (after the reload) raised {exc.__class__.__name__}: {first_line(exc)}"]) from exc
    rep["reload"] = {"path": PUBLIC_PATH_NOTE, **info, "findings": findings, "moved": moved,
                     "bound_impl_tensors": impl_names, "compared": len(set_a),
                     "run_a": {"passed": rep_a["passed"], "problems": rep_a["problems"][:8],
                               "counts": rep_a.get("counts")}}
    lead = [] if rep_a["passed"] else [f"run 1 (set A): {rep_a['problems'][0]}"]
    lead += [f"reload: {f}" for f in findings]
    if lead:
        rep["problems"] = lead + [f"run 2 (set B, after the reload): {p}" for p in rep["problems"]]
        rep["passed"] = False
    return engine_verdict(rep)
