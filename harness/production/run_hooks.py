"""Two points in a production run where a command's start-up machinery may act.

    before_vllm_config  just before a ``VllmConfig`` is built (vLLM's model registry inspects
                        the model classes then)
    vllm_imported       vLLM is imported, and nothing a run frees later (a model, an engine) is
                        built yet

Nothing is registered unless a command started such machinery (``harness.ci_speed``: the
start-up GC pause, the background model-class inspection, each registered by whatever started
it); the production path only calls ``fire`` at those points and reads the same without it.
"""

from __future__ import annotations

POINTS = ("before_vllm_config", "vllm_imported")
_hooks: dict[str, list] = {point: [] for point in POINTS}


def register(point: str, fn) -> None:
    """Call ``fn()`` each time the run reaches ``point`` (registered once however often asked)."""
    if fn not in _hooks[point]:
        _hooks[point].append(fn)


def fire(point: str) -> None:
    """The run is at ``point``: call what is registered there, in the order it was registered."""
    for fn in list(_hooks[point]):
        fn()
