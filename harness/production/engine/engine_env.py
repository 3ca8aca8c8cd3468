"""The environment of an engine subprocess (``engine_env``): a fixed KV cache size beside other
GPU processes, the host's cores shared among concurrent runs. Torch-free. The engine cases
themselves are the registry's (``harness.case_registry.specs(kind="engine")``)."""

from __future__ import annotations

import os

# A fixed KV cache size for the engine (GiB): vLLM then skips its memory profiling, which fails
# when another process on the same GPU allocates or frees memory meanwhile
ENGINE_KV_GIB_ENV = "HYV4_ENGINE_KV_CACHE_GIB"
SHARED_GPU_KV_GIB = "4"

# "0": the engine is built with vLLM's start-up JIT warmup off (kernel_config.enable_jit_warmup;
# vLLM already turns it off for eager engines). That warmup compiles every key a registered
# kernel could dispatch, whichever the run will call: for HY V4 on SM90 the CuTe DSL router GEMM
# for M = 1..32, which CUTLASS DSL compiles again in every process (cute.compile bypasses its
# file cache). Measured in a GPU tier's engines: 250 CPU-s of CuTe compilation with it, 60 without.
# Off, each kernel is compiled on its first call (vLLM's capture runs each batch shape once before
# capturing it): the same kernels for the same keys, and vLLM leaves the flag out of its compile
# hash. The tier sets it for its tests; its warmup step keeps vLLM's default, so that path still
# runs on every host it warms.
JIT_WARMUP_ENV = "HYV4_ENGINE_JIT_WARMUP"


def engine_env(shared_gpu: bool, env: dict | None = None, computing: int = 1) -> dict:
    """The environment of an engine subprocess: ``env`` (default ``os.environ``), with a fixed KV
    size (``SHARED_GPU_KV_GIB`` unless one is set) when other processes use the GPU beside it,
    and, when ``computing`` processes (it included) use the host's CPU at once, its share of the
    cores as torch threads (``can_run.shared_thread_env``, unless the user set a count)."""
    from harness.production.can_run import shared_thread_env

    env = dict(os.environ if env is None else env)
    if shared_gpu and not env.get(ENGINE_KV_GIB_ENV, "").strip():
        env[ENGINE_KV_GIB_ENV] = SHARED_GPU_KV_GIB
    return shared_thread_env(env, computing) if computing > 1 else env

