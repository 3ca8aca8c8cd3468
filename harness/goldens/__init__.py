"""Goldens: stored traces a run is judged against, one package for every kind.

    store.py         the files and ``goldens/manifest.json``, and ``check``, the one entry every
                     golden goes through (``GoldenKind``: how a kind encodes and judges its trace)
    reference.py     reference goldens: the exact reference's trace of the named CPU cases (they
                     catch drift of the harness itself); ``check_reference_goldens``, the no-GPU job
    production.py    production goldens: vLLM's own trace of a GPU case, recorded on a known-good
                     vLLM and platform, judged with tolerances far tighter than the reference's
    platform_key.py  which platform a production golden belongs to (GPU, compute capability,
                     torch, CUDA; the vLLM version is stamped, never compared)
    baseline.py      the production goldens of the bisect set, recorded by the user on this host at
                     the good commit of a bisect (``bisect-check --record-baseline DIR``)

Layers (``tests/cpu/test_import_graph.py``): the reference side (``store``, ``reference``) may import
``reference`` and the shared plumbing of ``harness`` (``atomic``, ``exitcodes``, ``input_checks``,
``trace_compare``, ``verdict``, ``report``, the CPU cases), never ``harness.production`` or vLLM: it
runs on any machine. The production side (``production``, ``platform_key``, ``baseline``) may also
import ``harness.production.case_inputs``, ``harness.production.judging``, ``harness.production.can_run``
and (to run cases) ``harness.production.module``. Nothing here imports the command layer.
"""
