"""The kernels a library builds alone, from its own JIT entry point, that ``warmup`` starts beside
its lead lane (``PREFETCH``: name -> (needed by these steps?, the child's code)) and which of
them the steps to warm need (``plan_prefetch``).
"""

from __future__ import annotations

from .. import case_registry  # torch-free: the cases' specs
from ..production.can_run import GPU_DEVICE_GLOB

# Kernels a library builds alone, from its own JIT entry point, sharing no kernel with the
# lead: started BESIDE the lead (t = 0) instead of in a lane after it. The lanes that need
# one wait on the library's own build lock and load what it built (FlashInfer's
# ``build_and_load``: a file lock, then a second look at the cache). Each entry is
# name -> (whether the steps to warm need it: a predicate on (GpuCases, engine wanted), the
# child's code). The child first asks vLLM, where vLLM has a predicate for it, whether it
# would use the kernel on this GPU, and exits 0 having built nothing when not.
# Why these: in a serial warmup on a fresh host FlashInfer's JIT modules are the long single
# compiles of the whole warmup, each inside one step.
_PREFETCH_HEAD = ("import glob, sys\n"  # no NVIDIA device node: said before importing torch (~4 s of CPU)
                  f"if not glob.glob({GPU_DEVICE_GLOB!r}):\n"
                  "    print('prefetch: no CUDA device; nothing built'); sys.exit(0)\n"
                  "import torch\n"
                  "if not torch.cuda.is_available():\n"
                  "    print('prefetch: no CUDA device; nothing built'); sys.exit(0)\n")


def _prefetch_code(check: str, why_not: str, build: str) -> str:
    return (_PREFETCH_HEAD + f"{check}\n    print({'prefetch: ' + why_not + '; nothing built'!r}); sys.exit(0)\n"
            f"{build}\nprint('prefetch: built')\n")


def _is_yarn(case) -> bool:
    cfg = case.hf_config()
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return "yarn" in str(rope.get("rope_type", rope.get("type", "")))


PREFETCH = {
    # fp8_blockscale_gemm_90: minutes of nvcc (benchmarks/NOTES.md); vLLM picks it for 128x128-block FP8 linears
    # on SM90.
    "flashinfer-fp8-blockscale-gemm-sm90": (
        lambda cases, engine: any(c.quant != "bf16" for c in cases),
        _prefetch_code(
            "from vllm.utils.flashinfer import is_flashinfer_fp8_blockscale_gemm_supported\n"
            "if torch.cuda.get_device_capability() != (9, 0) or not is_flashinfer_fp8_blockscale_gemm_supported():",
            "vLLM would not pick this kernel here",
            "from flashinfer.gemm.gemm_base import get_fp8_blockscale_gemm_runner_sm90\n"
            "get_fp8_blockscale_gemm_runner_sm90()")),
    # sampling: most of the engine's first start (benchmarks/NOTES.md); vLLM's
    # sampler uses it for top-p / top-k when flashinfer_sampler_supported().
    "flashinfer-sampling": (
        lambda cases, engine: engine,
        _prefetch_code(
            "from vllm.v1.sample.ops.topk_topp_sampler import flashinfer_sampler_supported\n"
            "if not flashinfer_sampler_supported():",
            "vLLM would not use FlashInfer's sampler here",
            "from flashinfer.sampling import get_sampling_module\nget_sampling_module()")),
    # rope: most of the yarn case's first run; vLLM's DeepSeek yarn rotary embedding applies it
    # through FlashInfer (its own per-layer condition needs a model config: checked here is
    # only that vLLM sees FlashInfer).
    "flashinfer-rope": (
        lambda cases, engine: any(_is_yarn(c) for c in cases),
        _prefetch_code(
            "from vllm.utils.flashinfer import has_flashinfer\n"
            "if not has_flashinfer():",
            "vLLM does not see FlashInfer",
            "from flashinfer.rope import get_rope_module\nget_rope_module()")),
}


def plan_prefetch(cases: list[str], engine: bool = False) -> list[str]:
    """The ``PREFETCH`` kernels the steps to warm (module-level ``cases``, an ``engine``) may need."""
    gpu_cases = [case_registry.spec(c, kind="module", without="probe") for c in cases]
    return [name for name, (needed, _) in PREFETCH.items() if needed(gpu_cases, engine)]
