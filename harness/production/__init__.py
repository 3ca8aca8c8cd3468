"""vLLM's real ``HYV4MTP`` on CUDA, side by side with the reference (map: README.md here).

    case_inputs.py  a side-by-side case's inputs (CPU; the cases are harness.case_registry's)
    module/       the module-level path: build, load, hook and run ``HYV4MTP`` as the proposer does
    judging/      CPU: the reference replayed on production's inputs, tolerances, the judge, FP8 emulation
    engine/       the engine path: ``vllm.LLM`` with vLLM's own MTP speculator, recorded and replayed
    tp/           tensor parallelism: one process per rank, rank traces merged by the registry's rules
    can_run.py    can the production path run here (one reason or None); where the reference replays
    process_temp.py  this process's temp folder for vLLM's model directories
    run_hooks.py  where a command's start-up machinery (``harness.ci_speed``) may act in a run

API:
    out = run_production(hf_config, weights_ckpt, first, steps)   # {"step0.attn.core": ...}
    session = ProductionSession(hf_config)                         # reuse one built model
    session.load(weights_ckpt); session.run(first, steps)

Everything here imports vLLM lazily, so ``import harness.production`` works on
machines without vLLM or CUDA (the GPU tests skip there).
"""

__all__ = ["ProductionSession", "cast_for_vllm", "run_production"]


def __getattr__(name):
    """The API, imported on first use: importing the package (as ``python -m
    harness.production.*`` does before its module runs) imports no torch, so those entry points
    can apply ``$HYV4_JIT_CACHE`` first (``harness.ci_speed.jit_cache.apply_jit_cache``)."""
    if name == "cast_for_vllm":
        from .module.checkpoint_cast import cast_for_vllm
        return cast_for_vllm
    if name in ("ProductionSession", "run_production"):
        from .module import runner
        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
