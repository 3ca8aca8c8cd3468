"""Rotary position embedding, interleaved ("GPT-J", non-NeoX) layout.

For a vector x of even size d at position p, pairs (x[2i], x[2i+1]) rotate
by the angle p * f_i:
    x'[2i]   = x[2i] cos(p f_i) - x[2i+1] sin(p f_i)
    x'[2i+1] = x[2i+1] cos(p f_i) + x[2i] sin(p f_i)
with f_i = theta^(-2i/d) (default) or the YaRN blend of interpolated and
extrapolated frequencies. YaRN variants scale cos and sin by an attention
magnitude ``mscale`` (so |x'| = mscale |x|).

HF transformers' hy_v4 applies the same rotation to de-interleaved halves
(rotate_half on a permuted copy); vLLM 0.33 rotates the interleaved pairs
in place (``is_neox_style=False``), which is what this module models.
"""

from __future__ import annotations

import math

import torch

from .config import RopeConfig, yarn_get_mscale


def inv_freq(cfg: RopeConfig, dim: int) -> torch.Tensor:
    """f_i for i in [0, dim/2), float64."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    pos_freqs = cfg.theta ** exponents
    if cfg.rope_type == "default":
        return 1.0 / pos_freqs
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (cfg.factor * pos_freqs)
    low, high = _yarn_correction_range(cfg.beta_fast, cfg.beta_slow, dim, cfg.theta,
                                       cfg.original_max_position)
    ramp = _linear_ramp(low, high, dim // 2)
    extrapolation_factor = 1.0
    mask = (1 - ramp) * extrapolation_factor
    return interpolation * (1 - mask) + extrapolation * mask


def mscale(cfg: RopeConfig) -> float:
    """Magnitude applied to cos/sin."""
    if cfg.rope_type == "default":
        return 1.0
    if cfg.rope_type == "yarn":
        return yarn_get_mscale(cfg.factor) * cfg.attn_factor
    # deepseek_yarn
    return (yarn_get_mscale(cfg.factor, cfg.mscale)
            / yarn_get_mscale(cfg.factor, cfg.mscale_all_dim) * cfg.attn_factor)


def cos_sin(cfg: RopeConfig, dim: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [T, dim/2] (float64), magnitude-scaled."""
    angles = positions.to(torch.float64)[:, None] * inv_freq(cfg, dim).to(positions.device)[None, :]
    m = mscale(cfg)
    return torch.cos(angles) * m, torch.sin(angles) * m


def apply_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of x's last dim. x: [T, ..., d]; cos/sin: [T, d/2]."""
    shape = x.shape
    xf = x.reshape(shape[0], -1, shape[-1])
    c = cos[:, None, :].to(xf.dtype)
    s = sin[:, None, :].to(xf.dtype)
    x1 = xf[..., 0::2]
    x2 = xf[..., 1::2]
    out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return out.reshape(shape)


def _yarn_find_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def _yarn_correction_range(low_rot: float, high_rot: float, dim: int, base: float,
                           max_pos: int) -> tuple[int, int]:
    low = math.floor(_yarn_find_correction_dim(low_rot, dim, base, max_pos))
    high = math.ceil(_yarn_find_correction_dim(high_rot, dim, base, max_pos))
    return max(low, 0), min(high, dim - 1)


def _linear_ramp(low: float, high: float, dim: int) -> torch.Tensor:
    if low == high:
        high += 0.001
    ramp = (torch.arange(dim, dtype=torch.float64) - low) / (high - low)
    return ramp.clamp(0, 1)
