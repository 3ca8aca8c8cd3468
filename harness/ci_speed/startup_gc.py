"""The cyclic GC paused while a command starts (its imports), resumed once they are done.

The command entry points call ``defer_gc`` first thing; the production path's ``vllm_imported``
point (``harness.production.run_hooks``) ends the pause, so the numeric harness never names it.
"""

from __future__ import annotations

# The cyclic GC while a process starts: importing torch, transformers and vLLM grows the heap by
# millions of long-lived objects, and each growth step sets off a full collection that walks all
# of them and frees next to nothing (a sixth of the imports' time on this project's CPU machine:
# benchmarks/NOTES.md). A command pauses it from its start (``defer_gc``) until the imports are done and
# nothing it builds yet exists (``end_gc_deferral``: gc.freeze() moves what exists out of the GC's
# walk for good, then the GC resumes). The pytest plugin (``pytest_plugin``) does the same for pytest
# processes.
_GC_DEFERRED = False


def defer_gc() -> None:
    """Pause the cyclic GC for this process's start-up (reference counting still frees every
    object not in a cycle); ``end_gc_deferral`` resumes it."""
    global _GC_DEFERRED
    import gc

    if gc.isenabled():
        gc.disable()
        _GC_DEFERRED = True
        from harness.production import run_hooks

        run_hooks.register("vllm_imported", end_gc_deferral)


def end_gc_deferral() -> None:
    """Start-up is over: freeze what exists (modules, classes, configs) and resume the GC. Call it
    before building what a run frees later (a model, an engine): a frozen object is never
    collected. Nothing happens unless ``defer_gc`` paused the GC."""
    global _GC_DEFERRED
    if _GC_DEFERRED:
        import gc

        _GC_DEFERRED = False
        gc.freeze()
        gc.enable()
