"""Triton's C launchers for the kernels this process compiled but never launched
(``build_pending_launchers``), so that a warmed cache root holds them.

Triton compiles a kernel's binary at its first call or at ``kernel.warmup()``, and builds the
kernel's C launcher (gcc, cached by Triton under a key of the kernel's signature) only when the
kernel is first launched. vLLM's start-up JIT warmup compiles its Triton kernels for ranges of
shapes with ``kernel.warmup()``: the binaries reach the cache root, their launchers do not. A
kernel the warmup compiled that way but no warmed case launched had its launcher built later, in
the tier, on a host whose root was restored: the sparse indexer's ``pack_seq`` / ``unpack_seq``,
launched in graph mode only by capture-only planted bugs. The warmup builds them at the end of
each step, through Triton's own lazy initialisation of a compiled kernel.
"""

from __future__ import annotations


def _jit_functions():
    """Every live ``triton.runtime.jit.JITFunction`` of this process (none when Triton was never
    imported: a step that ran no Triton kernel)."""
    import gc
    import sys

    if "triton.runtime.jit" not in sys.modules:
        return []
    jit_function = getattr(sys.modules["triton.runtime.jit"], "JITFunction", None)
    if jit_function is None:
        return []
    # type(), not isinstance(): isinstance reads an object's __class__, which some deprecated
    # torch objects answer with a warning
    return [obj for obj in gc.get_objects() if issubclass(type(obj), jit_function)]


def _compiled_kernels(fn):
    """The compiled kernels a JITFunction holds: its per-device caches' first member,
    {specialisation key: CompiledKernel}."""
    for caches in list(getattr(fn, "device_caches", {}).values()):
        kernels = caches[0] if isinstance(caches, tuple) and caches else None
        if isinstance(kernels, dict):
            yield from list(kernels.values())


def build_pending_launchers() -> dict:
    """Initialise every compiled, never-launched kernel of this process's JITFunctions the way its
    first launch would (``CompiledKernel.run``: its launcher built or read from Triton's cache, its
    binary loaded); {"kernels": n initialised, "refused": n that Triton refuses to load here (a
    kernel over this GPU's shared-memory or thread limits raises at any launch as well)}."""
    done = refused = 0
    for fn in _jit_functions():
        for kernel in _compiled_kernels(fn):
            if getattr(kernel, "_run", False) is not None:  # launched already, or not a CompiledKernel
                continue
            try:
                kernel.run  # Triton's lazy initialisation: the property builds the launcher
            except Exception:  # noqa: BLE001 - OutOfResources and the like: Triton raises the same at a launch
                refused += 1
                continue
            done += 1
    return {"kernels": done, "refused": refused}
