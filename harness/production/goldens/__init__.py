"""Production goldens: vLLM's own trace of a GPU case (the registry's ``PRODUCTION_COMPONENTS``),
recorded on a known-good vLLM and platform and checked with tolerances far tighter than the
reference's. ``goldens_gpu`` records and checks them (``python -m harness.production.goldens_gpu
record|check|list``), ``platform_key`` says which platform a golden belongs to (GPU, compute
capability, torch, CUDA; the vLLM version is stamped, never compared), ``baseline`` keeps the
same goldens in a directory the user records on the host at the good commit of a bisect.

May import: ``reference``, ``harness``, ``harness.production.case_inputs``, ``harness.production.verdict``,
and (to run cases) ``harness.production.module``.
"""
