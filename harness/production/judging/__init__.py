"""The judges (CPU, no vLLM): the reference replayed on production's per-step inputs, the
tolerances (from the registry), the side-by-side judge in named steps, and the CPU emulation of
the FP8 production path the FP8 tolerances come from.

    teacher_forcing.py  the reference teacher-forced on production's inputs (forced top-k)
    tolerances.py     ``tolerances_for(quant)``: the registry's tables
    trace_judge.py    ``judge``: replay -> skip unused top-k -> derive -> mask routing ties -> compare -> report
    fp8_numerics.py   the FP8 production numerics the judge replays FP8 cases with
    fp8_emulation.py  the FP8 production numerics on CPU; ``python -m harness fp8-emulation``

May import: ``reference``, ``harness`` (``components``, ``trace_compare``, ``regimes``, ``checkpoint``,
``presets``, ``case_registry``), ``harness.production.case_inputs`` and ``harness.production.can_run``
(where the reference replays); never vLLM, never another ``harness.production`` sub-package.
"""
