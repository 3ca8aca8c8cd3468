"""Production goldens: vLLM's own trace of a GPU case (the registry's ``PRODUCTION_COMPONENTS``),
recorded on a known-good vLLM and platform and checked with tolerances far tighter than the
reference's. ``python -m harness.production.goldens_gpu record|check``.

May import: ``reference``, ``harness``, ``harness.production.cases``, ``harness.production.verdict``,
and (to run cases) ``harness.production.module``.
"""
