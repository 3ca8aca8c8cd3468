"""Can the production path run here? One reason string, or None."""

from __future__ import annotations


def cannot_run_production_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (9, 0):
        return f"GPU capability {major}.{minor}: FlashMLA sparse and DeepGEMM need SM90+"
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"vLLM does not import: {exc.__class__.__name__}: {exc}"
    return None


def reference_device() -> str:
    """Where the float64 reference replays production: the GPU when one is present (the
    side by side's replay at real dims takes tens of seconds on a host CPU, well under a
    second on an H200), unless ``HYV4_REFERENCE_DEVICE`` says otherwise (``cpu``/``cuda``)."""
    import os

    want = os.environ.get("HYV4_REFERENCE_DEVICE", "").strip().lower()
    if want in ("cpu", "cuda"):
        return want
    try:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


JIT_CACHE_ENV = "HYV4_JIT_CACHE"

# Where each JIT layer of the GPU stack keeps what it compiled, relative to one cache root.
# Each variable is read by its library at import time, so they must be set before vLLM,
# FlashInfer, Triton, DeepGEMM or torch's inductor are imported.
JIT_CACHE_LAYOUT = {
    "VLLM_CACHE_ROOT": "vllm",                 # vLLM: torch.compile artefacts, its own kernel caches
    "TRITON_CACHE_DIR": "triton",              # Triton kernels (fused MoE, vLLM's Triton ops)
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",  # FlashInfer JIT (FP8 block GEMM); it appends .cache/flashinfer
    "DG_JIT_CACHE_DIR": "deep_gemm",           # DeepGEMM JIT (indexer logits, FP8 GEMMs)
    "TORCHINDUCTOR_CACHE_DIR": "inductor",     # torch inductor
    "CUDA_CACHE_PATH": "cuda",                 # the driver's PTX -> SASS cache
}


def jit_cache_env(root: str) -> dict[str, str]:
    """The environment that points every JIT layer at ``root``."""
    import os

    root = os.path.abspath(os.path.expanduser(root))
    return {var: os.path.join(root, sub) for var, sub in JIT_CACHE_LAYOUT.items()}


def apply_jit_cache(root: str | None = None) -> dict[str, str]:
    """Point the JIT layers at one cache root: ``root``, else ``$HYV4_JIT_CACHE``; without
    either, nothing changes (each library keeps its own default under ``~``). A variable the
    user already set wins. Returns the variables this call set. Cheap: imports nothing."""
    import os

    root = root or os.environ.get(JIT_CACHE_ENV) or None
    if not root:
        return {}
    os.environ[JIT_CACHE_ENV] = os.path.abspath(os.path.expanduser(root))
    os.environ.setdefault("CUDA_CACHE_MAXSIZE", str(4 << 30))  # the driver's default (256 MiB) evicts
    done = {}
    for var, path in jit_cache_env(root).items():
        if var not in os.environ:
            os.environ[var] = done[var] = path
    return done
