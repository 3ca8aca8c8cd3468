"""Tensor parallelism: TP = N ranks as spawned processes (``multigpu.TPWorkers``), their traces
merged by the registry's per-component rule (replicated / head-sharded / partial-sum) and judged
against the reference and against TP = 1.

May import: vLLM (lazily, in the rank processes), ``reference``, ``harness``,
``harness.production.case_inputs``, ``harness.production.module`` and ``harness.production.judging``.
"""
