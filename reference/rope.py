"""Rotary position embedding, interleaved ("GPT-J", non-NeoX) layout.

For a vector x of even size d at position p, pairs (x[2i], x[2i+1]) rotate
by the angle p * f_i:
    x'[2i]   = x[2i] cos(p f_i) - x[2i+1] sin(p f_i)
    x'[2i+1] = x[2i+1] cos(p f_i) + x[2i] sin(p f_i)
with f_i = theta^(-2i/r) (default) or the YaRN blend of interpolated and
extrapolated frequencies, for the first r = ``RopeConfig.rotary_dim(d)``
entries (vLLM's ``rope_dim`` / ``partial_rotary_factor``); entries r.. pass
through unrotated. YaRN variants scale cos and sin by an attention magnitude
``mscale`` (so |x'| = mscale |x| on the rotated entries), read per rope type
as vLLM 0.33's RoPE classes read it (see ``mscale``).

HF transformers' hy_v4 (5.20 to 5.23) rotates rotate-half pairs (j, j + r/2)
of the slice as loaded (its checkpoint conversion permutes nothing); vLLM 0.33
rotates the interleaved pairs (2i, 2i+1) in place (``is_neox_style=False``),
which is what this module models. The two agree only up to a permutation of
the rope rows of the projections (tests/hf/hf_adapter.py, "rope_layout").
"""

from __future__ import annotations

import math

import torch

from .config import RopeConfig, yarn_get_mscale
from .numerics import EXACT, Numerics


def inv_freq(cfg: RopeConfig, dim: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """f_i for i in [0, dim/2) computed in ``dtype`` (float64; float32 as vLLM builds its
    table); ``dim`` is the rotary width."""
    exponents = torch.arange(0, dim, 2, dtype=dtype) / dim
    pos_freqs = cfg.theta ** exponents
    if cfg.rope_type == "default":
        return 1.0 / pos_freqs
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (cfg.factor * pos_freqs)
    low, high = _yarn_correction_range(cfg.beta_fast, cfg.beta_slow, dim, cfg.theta,
                                       cfg.original_max_position,
                                       truncate=cfg.truncate or cfg.rope_type != "yarn")
    ramp = _linear_ramp(low, high, dim // 2, dtype)
    extrapolation_factor = 1.0
    mask = (1 - ramp) * extrapolation_factor
    return interpolation * (1 - mask) + extrapolation * mask


def mscale(cfg: RopeConfig) -> float:
    """Magnitude applied to cos/sin.

    yarn (YaRNScalingRotaryEmbedding): ``attention_factor`` when given, else
    m(factor, mscale) / m(factor, mscale_all_dim) when both are given and
    non-zero, else m(factor); deepseek_yarn (DeepseekScalingRotaryEmbedding):
    m(factor, mscale) / m(factor, mscale_all_dim), defaults 1 and 0; with
    m = ``yarn_get_mscale``. No other key (``attn_factor``) is read.
    """
    if cfg.rope_type == "default":
        return 1.0
    if cfg.rope_type == "yarn":
        if cfg.attention_factor is not None:
            return float(cfg.attention_factor)
        if cfg.mscale and cfg.mscale_all_dim:
            return yarn_get_mscale(cfg.factor, cfg.mscale) / yarn_get_mscale(cfg.factor, cfg.mscale_all_dim)
        return yarn_get_mscale(cfg.factor)
    return (yarn_get_mscale(cfg.factor, 1.0 if cfg.mscale is None else cfg.mscale)
            / yarn_get_mscale(cfg.factor, cfg.mscale_all_dim or 0.0))


def cos_sin(cfg: RopeConfig, dim: int, positions: torch.Tensor,
            num: Numerics = EXACT) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, r/2], magnitude-scaled; ``dim`` is the rope slice width,
    r = ``cfg.rotary_dim(dim)`` the rotated part of it.

    EXACT: float64. Otherwise vLLM's table: f_i and the angles p f_i in float32,
    cos / sin times the magnitude in float32, rounded to ``num.act`` (bf16).
    """
    r = cfg.rotary_dim(dim)
    dt = torch.float64 if num.act == torch.float64 else torch.float32
    angles = positions.to(dt)[:, None] * inv_freq(cfg, r, dt).to(positions.device)[None, :]
    m = mscale(cfg)
    c, s = torch.cos(angles) * m, torch.sin(angles) * m
    return (c, s) if num.act == torch.float64 else (num.store(c), num.store(s))


def apply_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of x's first r = 2 cos.shape[-1] entries; the rest pass through.

    x: [T, ..., d]; cos/sin: [T, r/2] with r <= d.
    """
    shape = x.shape
    r = 2 * cos.shape[-1]
    xf = x.reshape(shape[0], -1, shape[-1])
    c = cos[:, None, :].to(xf.dtype)
    s = sin[:, None, :].to(xf.dtype)
    x1 = xf[..., 0:r:2]
    x2 = xf[..., 1:r:2]
    rot = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).reshape(xf.shape[0], xf.shape[1], r)
    return torch.cat((rot, xf[..., r:]), dim=-1).reshape(shape)


def _yarn_find_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def _yarn_correction_range(low_rot: float, high_rot: float, dim: int, base: float,
                           max_pos: int, truncate: bool = True) -> tuple[float, float]:
    low = _yarn_find_correction_dim(low_rot, dim, base, max_pos)
    high = _yarn_find_correction_dim(high_rot, dim, base, max_pos)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _linear_ramp(low: float, high: float, dim: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    if low == high:
        high += 0.001
    ramp = (torch.arange(dim, dtype=dtype) - low) / (high - low)
    return ramp.clamp(0, 1)
