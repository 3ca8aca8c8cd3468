"""vLLM's real ``HYV4MTP`` on CUDA, driven module-level as the MTP proposer drives it.

API:
    out = run_production(hf_config, weights_ckpt, first, steps)   # {"step0.attn.core": ...}
    session = ProductionSession(hf_config)                         # reuse one built model
    session.load(weights_ckpt); session.run(first, steps)

Everything here imports vLLM lazily, so ``import harness.production`` works on
machines without vLLM or CUDA (the GPU tests skip there).
"""

from .checkpoint_cast import cast_for_vllm
from .runner import ProductionSession, run_production

__all__ = ["ProductionSession", "cast_for_vllm", "run_production"]
