"""Planted bugs in vLLM's MTP speculator (Python-level patches, as an upstream commit would make).

Each mutant patches a class or module attribute of vLLM's V2 speculators
(``vllm/v1/worker/gpu/spec_decode/``, reached through ``harness.production.vllm_compat``) in this process, before
the engine is built, and names the engine case that must catch it and the quantity the first failing
line must name. Nothing on disk changes. Used by ``python -m harness engine
--mutant NAME`` (or ``HYV4_SPECULATOR_MUTANT=NAME``, which ``bisect-check`` passes on
to its engine runs) and by ``python -m harness mutants --speculator``.
"""

from __future__ import annotations

import contextlib
import dataclasses

from harness.record_checks import RecordError, one_of
from harness.undo import UndoStack


@dataclasses.dataclass(frozen=True)
class SpeculatorMutant:
    name: str
    case: str  # the engine case that exercises the patched code
    expect: str  # what the first failing line must name
    what: str
    # capture-only bugs: also judged on this eager case, where they must pass (the bug lives in
    # graph capture / replay alone)
    passes_eager: str | None = None
    # patches graph capture, which runs while the engine is built: planted before the build only
    # (bisect-check / --mutant), never in a --sweep of a live engine
    at_build: bool = False

    def __post_init__(self):
        """The engine cases it names are the registry's; a capture-only bug is judged on a CUDA-graph
        case and passes on that case's eager twin."""
        from harness.case_registry import specs

        where, engines = f"speculator mutant {self.name!r}", specs(kind="engine")
        fix = "declare the case in harness/case_registry.py (the one list of cases) or pick one there"
        one_of(where, "case", self.case, engines, fix)
        if self.passes_eager is not None:
            one_of(where, "passes_eager", self.passes_eager, engines, fix)
            if not engines[self.case].graphs or engines[self.passes_eager].graphs:
                raise RecordError(f"{where}: a capture-only bug (passes_eager) runs on a CUDA-graph case and passes "
                                  "on an eager one; pick case=graphs, passes_eager=eager")
        if self.at_build and self.passes_eager is None:
            raise RecordError(f"{where}: at_build is for capture-only bugs (graph capture runs at build); "
                              "give passes_eager too")


MUTANTS: dict[str, SpeculatorMutant] = {m.name: m for m in (
    SpeculatorMutant("compaction-dropped", "engine-accept-k3-share", "attn.topk",
                     "MTPSpeculator.on_prefill_end no longer compacts the top-k rows to the sampled rows"),
    SpeculatorMutant("skip-topk-never", "engine-accept-k3-share", "attn.topk",
                     "MTPSpeculator.on_multi_step_decode_begin no longer sets skip_topk: steps >= 1 rerun the "
                     "indexer instead of reusing step 0's rows"),
    SpeculatorMutant("last-token-index-off-by-one", "engine-accept-k3-share", "last_token_indices",
                     "prepare_prefill_inputs leaves last_token_indices one row early (where a request has "
                     "two or more valid rows)"),
    SpeculatorMutant("accepted-hidden-wrong-row", "engine-accept-k3-share", "hidden",
                     "propose() feeds the target's hidden states shifted by one row"),
    SpeculatorMutant("spec-step-idx-ignored", "engine-accept-k2-two-layers", "MTP layer",
                     "MultiModuleMTPSpeculator._run_model runs MTP module 0 at every step"),
    # capture-only bugs (CUDA graphs): each breaks graph replay alone
    SpeculatorMutant("graph-hidden-buffer-stale", "engine-graphs-accept-k3-share", "graph replay differs from eager",
                     "propose() writes the target's hidden states into a buffer re-allocated after capture: "
                     "eager code reads it, captured graphs read the old address (stale rows)",
                     passes_eager="engine-accept-k3-share"),
    SpeculatorMutant("graph-skip-topk-not-captured", "engine-graphs-accept-k3-share", "graph replay differs from eager",
                     "the draft-decode graphs are captured without on_multi_step_decode_begin: skip_topk is "
                     "baked in off, so replayed steps >= 1 rerun the indexer instead of reusing step 0's rows",
                     passes_eager="engine-accept-k3-share", at_build=True),
    # capture-only bugs of the draft decode without index sharing (K >= 3): steps >= 2 run the
    # indexer over per-step metadata that a FULL graph reads from buffers the host refreshes
    SpeculatorMutant("graph-step-metadata-frozen", "engine-graphs-accept-k3-noshare",
                     "graph replay differs from eager",
                     "the draft decode skips the host's attention-metadata rebuild at steps >= 2 when a FULL "
                     "graph will replay (the graph replays the buffers of step 1: seq_lens and the indexer's "
                     "lengths one short, the key written at step 1 never read)",
                     passes_eager="engine-accept-k3-noshare"),
    SpeculatorMutant("graph-padded-rows-live-slot", "engine-graphs-accept-k3-noshare",
                     "graph replay differs from eager",
                     "the draft decode's slot mapping gives a padded row of a FULL graph a live slot of "
                     "request 0 (the one before its current slot) instead of the pad slot: the padded row's "
                     "KV write overwrites draft KV that request reads at later steps",
                     passes_eager="engine-accept-k3-noshare"),
)}

# the mutants a sweep of one live engine can plant and undo
SWEEPABLE = tuple(n for n, m in MUTANTS.items() if not m.at_build)


def sweep_mutants(case: str) -> list[str]:
    """What a sweep of ``case`` plants by default: the mutants it must catch (``case``), then the
    capture-only ones whose eager twin it is (``passes_eager``), which must pass there. A
    sweepable mutant patches code that runs while generating, so planting it on the live eager
    engine runs the same code as planting it before that engine is built."""
    return ([n for n in SWEEPABLE if MUTANTS[n].case == case]
            + [n for n in SWEEPABLE if MUTANTS[n].passes_eager == case])


def harmless_on(name: str, case: str) -> bool:
    """Whether mutant ``name`` must pass on ``case`` (its eager twin) rather than be caught there."""
    return MUTANTS[name].passes_eager == case


def swept_cases() -> list[str]:
    """The engine cases a sweep runs on (sorted): each sweep's first pristine run is that case's run."""
    return sorted({c for n in SWEEPABLE for c in (MUTANTS[n].case, MUTANTS[n].passes_eager) if c})


def _vllm(name: str):
    """A speculator internal, wherever the installed release keeps it (``vllm_compat``)."""
    from harness.production import vllm_compat

    return vllm_compat.internal(name)


def apply_mutant(name: str, undo: UndoStack | None = None) -> dict:
    """Patch vLLM for mutant ``name`` (recorded on ``undo`` when given: ``planted``; else for
    the rest of the process, as ``bisect-check`` plants it before the engine is built);
    returns its description (for the report)."""
    m = MUTANTS[name]
    getattr(_Patches, name.replace("-", "_"))(undo or UndoStack())
    return dataclasses.asdict(m)


@contextlib.contextmanager
def planted(name: str):
    """Mutant ``name`` planted for the ``with`` block, then undone (``harness.undo``). A live
    engine looks its speculator's methods and module functions up at call time, so one
    engine serves a pristine run, a planted one and a pristine one again. Yields the
    mutant's description."""
    undo = UndoStack()
    try:
        yield apply_mutant(name, undo)
    finally:
        undo.restore()


def _around_multi_step_decode(undo, patch) -> None:
    """Wrap the per-step (host rebuild) draft decode of both releases,
    ``TargetDependentARSpeculator._multi_step_decode``: for its call, ``patch(self, batch_desc)``
    gives (object, attribute, stand-in) to shadow on that object as an instance attribute (None:
    run it unpatched)."""
    cls = _vllm("speculator.TargetDependentARSpeculator")
    orig = cls._multi_step_decode

    def _multi_step_decode(self, num_reqs, skip_attn, batch_desc, *a, **k):
        shadow = patch(self, batch_desc)
        if shadow is None:
            return orig(self, num_reqs, skip_attn, batch_desc, *a, **k)
        obj, attr, value = shadow
        setattr(obj, attr, value)
        try:
            return orig(self, num_reqs, skip_attn, batch_desc, *a, **k)
        finally:
            delattr(obj, attr)

    undo.setattr(cls, "_multi_step_decode", _multi_step_decode)


class _Patches:
    @staticmethod
    def compaction_dropped(undo):
        cls = _vllm("speculator.MTPSpeculator")
        undo.setattr(cls, "on_prefill_end", lambda self, num_reqs: None)

    @staticmethod
    def skip_topk_never(undo):
        cls = _vllm("speculator.MTPSpeculator")
        undo.setattr(cls, "on_multi_step_decode_begin", lambda self, num_reqs: None)

    @staticmethod
    def last_token_index_off_by_one(undo):
        mod = _vllm("speculator.target_dependent_ar_module")
        orig = mod.prepare_prefill_inputs

        def prepare_prefill_inputs(last_token_indices, current_draft_step, input_buffers, input_batch, *a, **k):
            out = orig(last_token_indices, current_draft_step, input_buffers, input_batch, *a, **k)
            n = input_batch.num_reqs
            starts = input_batch.query_start_loc[:n].to(last_token_indices.dtype)
            last_token_indices[:n] = last_token_indices[:n] - (last_token_indices[:n] > starts).to(
                last_token_indices.dtype)
            return out

        undo.setattr(mod, "prepare_prefill_inputs", prepare_prefill_inputs)

    @staticmethod
    def accepted_hidden_wrong_row(undo):
        import torch

        cls = _vllm("speculator.TargetDependentARSpeculator")
        orig = cls.propose

        def propose(self, *args, **kwargs):
            if "last_hidden_states" in kwargs:
                kwargs["last_hidden_states"] = torch.roll(kwargs["last_hidden_states"], 1, dims=0)
            elif len(args) > 3:
                args = (*args[:3], torch.roll(args[3], 1, dims=0), *args[4:])
            return orig(self, *args, **kwargs)

        undo.setattr(cls, "propose", propose)

    @staticmethod
    def graph_hidden_buffer_stale(undo):
        cls = _vllm("speculator.TargetDependentARSpeculator")
        orig = cls.propose

        def propose(self, *args, **kwargs):
            kept = self.hidden_states
            stale = self.__dict__.setdefault("_hyv4_mutant_hidden", kept.clone())
            self.hidden_states = stale  # Python writes and eager forwards read this one
            try:
                return orig(self, *args, **kwargs)
            finally:
                self.hidden_states = kept

        undo.setattr(cls, "propose", propose)

    @staticmethod
    def graph_skip_topk_not_captured(undo):
        cls = _vllm("speculator.MTPSpeculator")
        orig = cls.capture

        def capture(self, *args, **kwargs):
            self.on_multi_step_decode_begin = lambda num_reqs: None  # (instance attribute: capture only)
            try:
                return orig(self, *args, **kwargs)
            finally:
                del self.on_multi_step_decode_begin

        undo.setattr(cls, "capture", capture)

    @staticmethod
    def graph_step_metadata_frozen(undo):
        def patch(self, batch_desc):
            if getattr(getattr(batch_desc, "cg_mode", None), "name", None) != "FULL":
                return None
            build, kept = self._build_uniform_attn_metadata, {}

            def frozen(*b, **kw):  # steps >= 2: the step-1 metadata object, buffers not refreshed
                if (kw.get("step") or 1) >= 2 and "m" in kept:
                    return kept["m"]
                kept["m"] = build(*b, **kw)
                return kept["m"]
            return self, "_build_uniform_attn_metadata", frozen

        _around_multi_step_decode(undo, patch)

    @staticmethod
    def graph_padded_rows_live_slot(undo):
        def patch(self, batch_desc):
            tables = getattr(self, "block_tables", None)  # absent in the engine's profile run
            if tables is None:
                return None
            compute = tables.compute_slot_mappings

            def slots(idx_mapping, query_start_loc, positions, num_tokens_padded, *b, **kw):
                out = compute(idx_mapping, query_start_loc, positions, num_tokens_padded, *b, **kw)
                n = int(idx_mapping.shape[0])
                if num_tokens_padded > n > 0:  # only a padded (graph) batch has such rows
                    # the slot before request 0's current one: KV it wrote at an earlier position and
                    # reads at every later step (its current slot would race with its own write)
                    out[:, n:num_tokens_padded] = (out[:, :1] - 1).clamp(min=0)
                return out
            return tables, "compute_slot_mappings", slots

        _around_multi_step_decode(undo, patch)

    @staticmethod
    def spec_step_idx_ignored(undo):
        cls = _vllm("speculator.MultiModuleMTPSpeculator")
        orig = cls._run_model

        def _run_model(self, num_tokens, attn_metadata, slot_mappings, num_tokens_across_dp, spec_module_idx,
                       *a, **k):
            return orig(self, num_tokens, attn_metadata, slot_mappings, num_tokens_across_dp, 0, *a, **k)

        undo.setattr(cls, "_run_model", _run_model)


# ---- the catalogue, end to end (GPU host) -------------------------------------------------------

def run_catalogue(names=None, *, report: str | None = None, log=print) -> dict:
    """Each mutant through ``bisect-check --case <its engine case>`` in a subprocess with
    ``HYV4_SPECULATOR_MUTANT`` set, plus each case pristine (the control). A mutant is
    caught when bisect-check exits 1 and the engine's first problem names ``expect``."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    import time

    names = list(names or MUTANTS)
    cases = sorted({MUTANTS[n].case for n in names})
    rows = {}

    def bisect(case: str, mutant: str | None) -> dict:
        env = dict(os.environ)
        env.pop("HYV4_SPECULATOR_MUTANT", None)
        if mutant:
            env["HYV4_SPECULATOR_MUTANT"] = mutant
        with tempfile.TemporaryDirectory(prefix="hyv4-specmut-") as tmp:
            rpath = os.path.join(tmp, "bisect.json")
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "harness", "bisect-check", "--case", case, "--report", rpath],
                                  capture_output=True, text=True, env=env)
            wall = time.perf_counter() - t
            doc = {}
            if os.path.isfile(rpath):
                with open(rpath) as f:
                    doc = json.load(f)
        eng = ((doc.get("meta") or {}).get("engine") or {}).get(case) or {}
        first = (eng.get("problems") or [""])[0]
        return {"exit": proc.returncode, "first_problem": first, "wall_s": round(wall, 1),
                "stdout_tail": proc.stdout.strip().splitlines()[-3:]}

    for case in cases:
        rows[f"control:{case}"] = r = bisect(case, None)
        r["ok"] = r["exit"] == 0
        log(f"{'ok  ' if r['ok'] else 'BAD '} control {case}: exit {r['exit']} ({r['wall_s']} s) "
            f"{r['first_problem'][:200]}")
    for n in names:
        m = MUTANTS[n]
        rows[n] = r = bisect(m.case, n)
        r["caught"] = r["exit"] == 1
        r["named_first"] = m.expect in r["first_problem"]
        r["ok"] = r["caught"] and r["named_first"]
        log(f"{'ok  ' if r['ok'] else 'MISS'} {n} ({m.case}): exit {r['exit']} ({r['wall_s']} s) "
            f"first: {r['first_problem'][:240]}")
    summary = {"mutants": len(names), "caught": sum(rows[n]["caught"] for n in names),
               "named_first": sum(rows[n]["named_first"] for n in names),
               "controls_ok": all(rows[f"control:{c}"]["ok"] for c in cases)}
    doc = {"summary": summary, "rows": rows}
    if report:
        from harness.atomic import atomic_write_json
        atomic_write_json(report, doc)
    return doc
