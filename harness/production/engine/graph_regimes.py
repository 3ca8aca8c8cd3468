"""Which draft-decode paths a CUDA-graph engine case actually ran, proven from vLLM per run.

A graph-mode engine case (``EngineCase.graphs``) is chosen to exercise some of vLLM's draft
paths under CUDA graphs; whether it did depends on vLLM (its capture sizes, the attention
backend's metadata support, the scheduler), not on the case's parameters alone. As
``harness.regimes`` proves the numeric regimes of the module cases, this module proves the
graph regimes of the engine cases: ``GraphTap`` records, at the speculator's Python seams, what
vLLM did on every ``propose`` (``GraphStep.modes`` / ``GraphStep.facts``) and what the proposer
was built with (``GraphTap.facts``); ``measure`` turns that into one count per regime; a case
declares the regimes it is for (``EngineCase.graph_regimes``) and ``problems`` fails it, naming
the regime and what ran, when one of them did not run (never a silent pass).

  decode_full_graph         proposes whose draft decode (steps >= 1) replayed a FULL graph
  decode_eager              proposes whose draft decode ran eagerly in the graph engine (a batch
                            no graph was captured for, or vLLM's eager fallback)
  draft_steps_ge2           proposes that ran draft step 2 or later (K >= 3)
  indexer_at_step_ge2       of those, the proposes whose steps >= 2 ran the indexer (index sharing
                            off in vLLM's speculator: the graph reads per-step indexer metadata)
  index_sharing             proposes whose steps >= 1 reused step 0's compacted top-k rows
  metadata_host_rebuild     proposes whose decode metadata was rebuilt on the host at a step >= 2
                            and then replayed by a FULL graph (vLLM's fallback for backends that
                            cannot update draft decode metadata in place: the graph must read
                            what the host rebuilt, not what it captured)
  metadata_in_graph_update  proposes whose FULL decode graph updates its metadata in place between
                            steps (one fused replay for steps 1..K-1)
  decode_metadata_per_step  either of the two: steps >= 2 under a graph saw fresh metadata
  padded_rows               FULL decode replays run for more rows than live requests (the
                            captured size above the batch: padded rows computed and dropped)
  batch_shrink              proposes with fewer requests than the one before (requests finished
                            mid-generation: the next replay runs a smaller or more padded batch)
  prefill_full_graph / prefill_piecewise / prefill_eager
                            how the draft prefill (step 0) ran, per propose
  prefill_breakable         1 when vLLM built the prefill graphs breakable (reported only)

Torch-free: the registry's tests check the declared names without torch.
May import: nothing of the harness.
"""

from __future__ import annotations

GRAPH_REGIMES: dict[str, str] = {
    "decode_full_graph": "the draft decode (steps >= 1) replayed a FULL CUDA graph",
    "decode_eager": "the draft decode ran eagerly inside the graph engine",
    "draft_steps_ge2": "a draft step >= 2 ran (K >= 3)",
    "indexer_at_step_ge2": "a draft step >= 2 ran the indexer (no index sharing)",
    "index_sharing": "draft steps >= 1 reused step 0's compacted top-k rows",
    "metadata_host_rebuild": "decode metadata rebuilt on the host at a step >= 2, then a FULL graph replayed",
    "metadata_in_graph_update": "a FULL decode graph updated its metadata in place between steps",
    "decode_metadata_per_step": "steps >= 2 under a graph ran on per-step metadata (rebuilt or updated)",
    "padded_rows": "a FULL decode graph ran padded rows (captured size above the live batch)",
    "batch_shrink": "the batch shrank as requests finished",
    "prefill_full_graph": "the draft prefill replayed a FULL graph",
    "prefill_piecewise": "the draft prefill ran piecewise graphs",
    "prefill_eager": "the draft prefill ran eagerly",
    "prefill_breakable": "vLLM built breakable prefill graphs",
}

# What the graph-bisect set must cover together (tests/cpu/test_graph_regimes.py): the decode
# paths where a graph replays state frozen at capture (stale metadata, stale buffers, padded rows).
REQUIRED: tuple[str, ...] = ("decode_full_graph", "draft_steps_ge2", "indexer_at_step_ge2", "index_sharing",
                             "decode_metadata_per_step", "padded_rows", "batch_shrink", "prefill_full_graph")
if not set(REQUIRED) <= set(GRAPH_REGIMES):  # a required regime is a declared one (checked at import)
    raise ValueError(f"graph_regimes.REQUIRED names {sorted(set(REQUIRED) - set(GRAPH_REGIMES))}, not in "
                     "GRAPH_REGIMES; declare them there (with what they mean) or drop them")


def _has(mode, what: str) -> bool:
    return isinstance(mode, str) and what in mode.split("+")


def decode_steps(step) -> int:
    """Draft steps >= 1 one ``propose`` ran: K_run - 1 (K_run the drafts it returned per request)."""
    d = getattr(step, "draft_tokens", None)
    if d is None or getattr(d, "dim", lambda: 0)() != 2:
        return 0
    k = int(d.shape[1])
    n = getattr(step, "num_speculative_tokens", None)
    return max(0, (k if n is None else min(k, int(n))) - 1)


def measure(steps, tap_facts: dict | None = None) -> dict:
    """{regime: count of proposes (or replays) that ran it} over a graph-mode run's ``GraphStep``s;
    ``tap_facts``: what the proposer was built with (``GraphTap.facts``)."""
    tap_facts = tap_facts or {}
    sharing = tap_facts.get("index_sharing")
    in_place = bool(tap_facts.get("supports_decode_metadata_update"))
    out = {k: 0 for k in GRAPH_REGIMES}
    prev = None
    for s in steps:
        modes, facts = s.modes or {}, getattr(s, "facts", None) or {}
        full = _has(modes.get("decode"), "FULL")
        n_dec = decode_steps(s)
        out["decode_full_graph"] += full
        out["decode_eager"] += facts.get("decode_eager_steps", 0) > 0
        out["draft_steps_ge2"] += n_dec >= 2
        if n_dec >= 1 and sharing is not None:
            out["index_sharing" if sharing else "indexer_at_step_ge2"] += bool(sharing) or n_dec >= 2
        rebuilt = full and n_dec >= 2 and any(k >= 2 for k in facts.get("metadata_rebuild_steps", ()))
        updated = full and n_dec >= 2 and in_place
        out["metadata_host_rebuild"] += rebuilt
        out["metadata_in_graph_update"] += updated
        out["decode_metadata_per_step"] += rebuilt or updated
        out["padded_rows"] += full and facts.get("decode_graph_tokens", 0) > s.num_reqs
        out["batch_shrink"] += prev is not None and s.num_reqs < prev.num_reqs
        pm = modes.get("prefill")
        out["prefill_full_graph"] += _has(pm, "FULL")
        out["prefill_piecewise"] += _has(pm, "PIECEWISE")
        out["prefill_eager"] += pm == "NONE"
        prev = s
    out["prefill_breakable"] = int(bool(tap_facts.get("prefill_breakable")))
    return out


MARK = "graph regime"  # every line ``problems`` returns starts with it


def problems(declared, measured: dict | None) -> list[str]:
    """One line per declared regime that did not run (the case's verdict fails with it)."""
    if not declared:
        return []
    if not measured:
        return [f"graph regimes not recorded (declared: {', '.join(declared)})"]
    ran = {k: v for k, v in measured.items() if v}
    return [f"graph regime not exercised: {name} ({GRAPH_REGIMES.get(name, '?')}); ran: {ran}"
            for name in declared if not measured.get(name)]


def table(measured: dict | None, declared=()) -> list[str]:
    """The regime table as report lines: each regime, its count, declared or not."""
    if not measured:
        return []
    return [f"{name:26s} {measured.get(name, 0):4d}  {'declared' if name in declared else ''}".rstrip()
            for name in GRAPH_REGIMES]
