"""``Verdict``: what a judge decides about one run, as one typed record.

The module judge (``harness.production.judging.trace_judge.judge``) and the TP judge
(``harness.production.tp.multigpu.run_case_tp``) return one, so do the engine judge
(``harness.production.engine.generation_judge.run_case`` / ``rejudge``) and a golden check
(``harness.goldens.store.Checked.verdict``); callers read its fields, never keys of
a dict. Its report, the JSON written to disk and compared across runs, is ``to_report()``: the same
keys in the same order as the judge's dict before this record existed.

No torch, no vLLM: the tensors it holds are whatever the judge put there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

# the fields that are report keys too: to_report() writes their current value under their name
_REPORTED = ("passed", "first_divergent", "rows", "regimes")


@dataclasses.dataclass
class Verdict:
    """One judged run. ``details`` holds the report's other keys in report order (the typed
    fields' keys sit there too, as placeholders, so the order survives)."""

    # what was judged: "module" (one process, TP = 1), "tp" (TP = N against the reference and TP = 1),
    # "golden" (a trace against its stored golden), "engine" (vllm.LLM's speculator, recorded and replayed)
    kind: str
    # every compared component within its tolerance (TP: also TP = N against TP = 1)
    passed: bool
    # the first component (dataflow order) outside its tolerance, or None; engine: the first problem
    # line (engine step, draft step, quantity)
    first_divergent: str | None
    # one JSON-able row per compared component: key, passed, max_abs, atol, rtol, ...
    rows: list[dict]
    # the regimes the run exercised (``harness.regimes``), or None where the judge names none
    regimes: Any = None
    # lines said beside the verdict (attach and step notes of the run)
    notes: list[str] = dataclasses.field(default_factory=list)
    # production's trace as recorded ({"step0.attn.core": tensor, ...}): goldens and saved traces read it
    trace: dict | None = None
    # the reference replayed on production's inputs, normalised as compared
    reference: dict | None = None
    # production's trace normalised as compared (indexer scale recovered, routing sorted, ties masked)
    trace_compared: dict | None = None
    # the component-by-component comparison (``harness.trace_compare.Report``): the saved report's table
    comparison: Any = None
    # TP: the two judged runs {"tp1": Verdict, "tpn": Verdict} and TP = N vs TP = 1 (a Report)
    parts: dict = dataclasses.field(default_factory=dict)
    # the report's other keys, in report order
    details: dict = dataclasses.field(default_factory=dict)

    def to_report(self) -> dict:
        """The JSON-able report: exactly the judge's report keys, in their order."""
        return {k: (getattr(self, k) if k in _REPORTED else v) for k, v in self.details.items()}
