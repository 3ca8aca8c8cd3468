"""Post-load audit of the production draft model: fail loudly, naming the parameter.

vLLM's MTP loader only *warns* when a draft parameter receives no checkpoint
value; the parameter then keeps its sentinel init (``-inf`` sink,
``finfo(float32).min`` FP8 scales, uninitialised memory) and the draft silently
degrades. The harness turns each of those into an error.
"""

from __future__ import annotations

import torch


class LoadAuditError(AssertionError):
    """The loaded production model has a parameter no checkpoint value reached.

    ``problems``: one ``<parameter>: <problem>`` string each (``harness.exitcodes``
    prints the first ones on the command's one line; exit 1, a bad vLLM commit).
    """

    def __init__(self, problems):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("production post-load audit failed:\n  " + "\n  ".join(self.problems))


def audit_loaded_model(model, loaded: set[str], pre_process_params: dict, warnings: list[str]) -> list[str]:
    """Problems found (empty when clean). Call after ``process_weights_after_loading``."""
    problems: list[str] = []
    try:
        from vllm.model_executor.layers.quantization.kv_cache import KVCacheScaleParameter
    except ImportError:  # pragma: no cover
        KVCacheScaleParameter = ()  # noqa: N806
    for name, p in pre_process_params.items():
        if name in loaded or isinstance(p, KVCacheScaleParameter):
            continue
        problems.append(f"{name}: received no checkpoint value")
    for msg in warnings:
        if "Skipping unknown" in msg or "received no checkpoint value" in msg:
            problems.append(f"loader warning: {msg}")
    fmin = torch.finfo(torch.float32).min
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in tensors:
        if not torch.is_tensor(t) or t.numel() == 0 or not t.is_floating_point():
            continue
        tf = t.detach()
        if tf.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            tf = tf.float()
        if bool(torch.isnan(tf).any()):
            problems.append(f"{name}: contains NaN")
        if "sink" in name and bool(torch.isinf(tf).any()):
            problems.append(f"{name}: still -inf (sink never loaded)")
        if "scale" in name and bool((tf.float() == fmin).any()):
            problems.append(f"{name}: holds finfo(float32).min (scale sentinel never loaded)")
    return problems


def check_loaded_model(model, loaded, pre_process_params, warnings) -> None:
    problems = audit_loaded_model(model, loaded, pre_process_params, warnings)
    if problems:
        raise LoadAuditError(problems)
