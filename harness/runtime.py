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
