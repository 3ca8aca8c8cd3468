"""Compatibility names for ``harness/commands/*`` only (being split in issue 44 meanwhile), deleted
when the lead's merge points their imports at the registry's queries and ``case_inputs``.
Nothing else imports this module: ``tests/cpu/test_case_registry.py`` checks that.

  BISECT_CASES  = case_registry.ids(role="bisect", kind="module")
  GPU_CASES     = case_registry.specs(kind="module", without="probe")
  GpuCase       = harness.case_specs.GpuCase
  build_inputs  = harness.production.case_inputs.build_inputs
"""

from __future__ import annotations

from harness.case_registry import ids, specs
from harness.case_specs import GpuCase
from harness.production.case_inputs import build_inputs

__all__ = ["BISECT_CASES", "GPU_CASES", "GpuCase", "build_inputs"]

BISECT_CASES = ids(role="bisect", kind="module")
GPU_CASES = specs(kind="module", without="probe")
