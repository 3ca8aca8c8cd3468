"""The module-level path: vLLM's ``HYV4MTP`` built, loaded, hooked
and run the way the MTP proposer runs it, one case at a time (GPU).

    vllm_config.py      ``VllmConfig`` via ``EngineArgs`` from a synthetic HF dict
    build.py            process group, workspace manager, build + load like ``BaseModelLoader``
    checkpoint_cast.py  checkpoint tensors cast as vLLM reads them from disk
    audit.py            post-load audit (unloaded parameters, loader warnings, -inf sinks, NaN)
    kv.py               paged caches, ``CommonAttentionMetadata``, per-step metadata
    capture.py          the registry's hooks (``harness.components.HOOKS``) -> canonical names
    runner.py           ``ProductionSession``: the proposer loop
    side_by_side.py     run a case, judge it (``verdict``), the side-by-side command

May import: vLLM (lazily, inside functions: ``import harness.production`` works without it),
``reference``, ``harness`` (not ``harness.mutants`` / ``harness.cli``),
``harness.production.case_inputs`` and ``harness.production.judging``.
"""
