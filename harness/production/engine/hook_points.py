"""The points where the engine path and the planted speculator bugs touch vLLM, checked
before an engine is built.

``DrafterTap`` reads named arguments of ``HYV4MTP.forward`` and ``compute_logits`` and of
the speculator's ``propose``; the speculator mutants replace lifecycle hooks and wrap
functions by their parameter order. A release that renames one of these would make the
tap record nothing (a silent pass) or a mutant patch the wrong argument. ``problems()``
names each drifted point; the engine command answers 125 with the first of them
("cannot judge: vLLM X: ..."), and a CPU test runs it against every supported release.

May import: ``harness.production.vllm_compat`` (and vLLM lazily).
"""

from __future__ import annotations

import dataclasses
import inspect


@dataclasses.dataclass(frozen=True)
class HookPoint:
    owner: str  # a vllm_compat internal, or "HYV4MTP" (the draft class, passed in)
    attr: str
    params: tuple[str, ...] = ()  # parameter names that must exist
    positions: tuple[tuple[int, str], ...] = ()  # (index, name): parameters read by position
    who: str = ""


HOOK_POINTS = (
    HookPoint("HYV4MTP", "forward", ("input_ids", "positions", "hidden_states", "spec_step_idx"),
              ((1, "input_ids"), (2, "positions"), (3, "hidden_states")), "DrafterTap._record_inputs"),
    HookPoint("HYV4MTP", "compute_logits", ("hidden_states",), ((1, "hidden_states"),), "DrafterTap._compute_logits"),
    HookPoint("HYV4MTP", "load_weights", ("weights",), (), "build.load_checkpoint"),
    HookPoint("speculator.TargetDependentARSpeculator", "propose",
              ("last_hidden_states", "dummy_run", "num_speculative_tokens"), ((4, "last_hidden_states"),),
              "DrafterTap._propose, mutant accepted-hidden-wrong-row"),
    HookPoint("speculator.TargetDependentARSpeculator", "propose", ("input_batch", "num_sampled", "last_sampled"),
              ((1, "input_batch"), (6, "num_sampled"), (8, "last_sampled")), "GraphTap._begin"),
    HookPoint("speculator.MTPSpeculator", "on_prefill_begin", ("num_reqs",), (), "GraphTap (step 0's inputs)"),
    HookPoint("speculator.MTPSpeculator", "on_prefill_end", ("num_reqs",), (), "mutant compaction-dropped"),
    HookPoint("speculator.MTPSpeculator", "capture", (), (), "mutant graph-skip-topk-not-captured"),
    HookPoint("speculator.dp_utils_module", "dispatch_cg_and_sync_dp", ("need_eager",), (),
              "graph_tap.drafter_forced_eager"),
    HookPoint("worker.CudaGraphManager", "run_fullgraph", ("desc",), (), "GraphTap (graph replays)"),
    HookPoint("speculator.MTPSpeculator", "on_multi_step_decode_begin", ("num_reqs",), (),
              "mutant skip-topk-never"),
    HookPoint("speculator.target_dependent_ar_module", "prepare_prefill_inputs", (),
              ((0, "last_token_indices"), (1, "current_draft_step"), (2, "input_buffers"), (3, "input_batch")),
              "mutant last-token-index-off-by-one"),
    HookPoint("speculator.MultiModuleMTPSpeculator", "_run_model", (),
              ((1, "num_tokens"), (2, "attn_metadata"), (3, "slot_mappings"), (4, "num_tokens_across_dp"),
               (5, "spec_module_idx")), "mutant spec-step-idx-ignored"),
)


def _owner(point: HookPoint, draft_cls):
    if point.owner == "HYV4MTP":
        if draft_cls is None:
            from harness.production import vllm_compat
            draft_cls = vllm_compat.internal("hy_v4.HYV4MTP")
        return draft_cls
    from harness.production import vllm_compat
    return vllm_compat.internal(point.owner)


MODULE_PATH_POINTS = tuple(p for p in HOOK_POINTS if p.owner == "HYV4MTP")


def problems(draft_cls=None, points=HOOK_POINTS) -> list[str]:
    """One line per hook point of ``points`` the installed vLLM no longer offers as the harness
    reads it (``MODULE_PATH_POINTS``: those of the draft model alone)."""
    out = []
    for p in points:
        where = f"{p.owner}.{p.attr} ({p.who})"
        try:
            fn = getattr(_owner(p, draft_cls), p.attr)
        except Exception as exc:  # noqa: BLE001 - a missing owner is a drifted point
            out.append(f"{where}: {exc.__class__.__name__}: {str(exc)[:200]}")
            continue
        try:
            names = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError) as exc:
            out.append(f"{where}: no signature ({exc})")
            continue
        gone = [n for n in p.params if n not in names]
        moved = [f"{n} at {i} (found {names[i] if i < len(names) else 'nothing'})"
                 for i, n in p.positions if i >= len(names) or names[i] != n]
        if gone or moved:
            out.append(f"{where}: " + "; ".join(
                ([f"no parameter {', '.join(gone)}"] if gone else [])
                + ([f"expected {', '.join(moved)}"] if moved else [])))
    return out
