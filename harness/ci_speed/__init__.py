"""How fast the harness and its test tiers run; never what they decide (map: README.md here).

    jit_cache.py            one cache root for every JIT layer ($HYV4_JIT_CACHE), bytecode included
    warmup.py               ``python -m harness warmup``: compile the GPU stack's kernels once per host
    kernel_prefetch.py      the kernels a library builds alone, started beside warmup's lead lane
    startup_gc.py           the cyclic GC paused while a command imports torch and vLLM
    model_info_prefetch.py  vLLM's model-class inspection in the background (cold hosts)
    pytest_plugin.py        xdist workers, GC/malloc tuning, a worker's share of the host (conftest.py)
    xdist_schedule.py       the GPU tier's order under xdist worksteal; ``harness ci schedule`` records durations
    pytest_timeline.py      where a pytest run's wall time goes, per process; ``harness ci timeline`` summarises

The numeric harness (``reference``, the rest of ``harness``) reads and runs without this package
but for the command entry points that apply the JIT cache root before vLLM is imported;
``tests/cpu/test_import_graph.py`` holds both sides to that.
"""
