"""RMSNorm and LayerNorm, as the MTP head uses them."""

from __future__ import annotations

import torch

from .numerics import Numerics


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, num: Numerics) -> torch.Tensor:
    """y = x / sqrt(mean(x^2, -1) + eps) * weight, computed in ``num.acc``.

    x: [..., d], weight: [d]. One rounding to ``num.act`` at the end, as a
    fused norm kernel does.
    """
    xf = num.up(x)
    var = xf.pow(2).mean(-1, keepdim=True)
    y = xf * torch.rsqrt(var + eps) * num.up(weight)
    return num.store(y)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               dtype: torch.dtype) -> torch.Tensor:
    """y = (x - mean) / sqrt(var + eps) * weight + bias, all in ``dtype`` (biased var)."""
    xf = x.to(dtype)
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    return (xf - mean) * torch.rsqrt(var + eps) * weight.to(dtype) + bias.to(dtype)
