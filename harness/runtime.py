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
