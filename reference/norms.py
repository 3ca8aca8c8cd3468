"""RMSNorm and LayerNorm, as the MTP head uses them."""

from __future__ import annotations

import torch

from .numerics import Numerics


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, num: Numerics) -> torch.Tensor:
    """y = x / sqrt(mean(x^2, -1) + eps) * weight, computed in ``num.acc``.

    x: [..., d], weight: [d]. Two roundings to ``num.act``, as vLLM 0.33's
    RMSNorm (``vllm.ir.ops.rms_norm`` / ``fused_add_rms_norm``): the normalized
    x is cast to the weight's dtype (bf16) before the multiply, whose product
    is rounded again. In float64 both are no-ops: the same (x r) w as before.
    """
    xf = num.up(x)
    var = xf.pow(2).mean(-1, keepdim=True)
    xn = num.store(xf * torch.rsqrt(var + eps))
    return num.store(num.up(xn) * num.up(weight))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               dtype: torch.dtype) -> torch.Tensor:
    """y = (x - mean) / sqrt(var + eps) * weight + bias, all in ``dtype`` (biased var)."""
    xf = x.to(dtype)
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    return (xf - mean) * torch.rsqrt(var + eps) * weight.to(dtype) + bias.to(dtype)
