"""FP8 e4m3 and UE8M0 arithmetic, exactly.

e4m3 ("fn" variant): 1 sign, 4 exponent, 3 mantissa bits, max finite 448,
no infinities. Casting to it rounds to nearest, ties to even; values beyond
+-448 are clamped first (the cast alone would give NaN).

UE8M0: an unsigned 8-bit exponent, value 2^(e - 127); byte 255 is NaN, so
valid scales are the bytes 0..254.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
UE8M0_BIAS = 127
UE8M0_MAX_BYTE = 254


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round x (any float dtype) to the nearest e4m3 value, saturating at +-448."""
    return x.to(torch.float64).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def ue8m0_round_up(scale: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= scale (scale > 0): 2^ceil(log2 scale)."""
    return torch.exp2(torch.ceil(torch.log2(scale.to(torch.float64))))


def ue8m0_encode(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales -> exponent bytes (uint8). Raises on non powers of two."""
    s = scale.to(torch.float64)
    e = torch.log2(s)
    if not torch.all(e == torch.round(e)):
        raise ValueError("UE8M0 scales must be exact powers of two")
    b = e.round().to(torch.int64) + UE8M0_BIAS
    if b.min() < 0 or b.max() > UE8M0_MAX_BYTE:
        raise ValueError("UE8M0 exponent out of range")
    return b.to(torch.uint8)


def ue8m0_decode(b: torch.Tensor) -> torch.Tensor:
    """Exponent bytes (uint8) -> 2^(b - 127) in float64; byte 255 is invalid."""
    if b.dtype != torch.uint8:
        raise ValueError(f"UE8M0 scales are uint8 bytes, got {b.dtype}")
    if b.numel() and int(b.max()) > UE8M0_MAX_BYTE:
        raise ValueError("UE8M0 byte 255 is NaN, not a scale")
    return torch.exp2(b.to(torch.float64) - UE8M0_BIAS)


def quantize_token_groups(x: torch.Tensor, group: int, ue8m0: bool,
                          eps: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group FP8 quantization (DeepSeek-V3.2 indexer q and k).

    x: [T, D] with D % group == 0. For each group g of a row:
    s = max(|x_g|, eps) / 448, rounded up to a power of two if ``ue8m0``;
    q_g = e4m3(x_g / s). Returns (q [T, D] e4m3, s [T, D/group] float64), so
    that x ~= q * s.
    """
    t, d = x.shape
    if d % group:
        raise ValueError(f"last dim {d} is not a multiple of the group size {group}")
    g = x.to(torch.float64).reshape(t, d // group, group)
    amax = g.abs().amax(-1).clamp_min(eps)
    scale = amax / E4M3_MAX
    if ue8m0:
        scale = ue8m0_round_up(scale)
    q = to_e4m3(g / scale[..., None]).reshape(t, d)
    return q, scale


def dequantize_token_groups(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_token_groups``: q * s per group, float64."""
    t, d = q.shape
    groups = scale.shape[-1]
    return (q.to(torch.float64).reshape(t, groups, d // groups) * scale[..., None]).reshape(t, d)


def quantize_block(w: torch.Tensor, block: tuple[int, int] = (128, 128),
                   ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 weight quantization (DeepSeek-V3 checkpoints).

    w: [..., N, K]. Each (bn x bk) tile gets s = max|tile| / 448 (a power of two
    rounded up when ``ue8m0``; 1 for an all-zero tile); q = e4m3(w / s).
    Returns q [..., N, K] e4m3 and s [..., ceil(N/bn), ceil(K/bk)] float64
    (the checkpoint's ``weight_scale_inv``: w ~= q * s).
    """
    bn, bk = block
    *lead, n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    wp = torch.zeros(*lead, nb * bn, kb * bk, dtype=torch.float64, device=w.device)
    wp[..., :n, :k] = w.to(torch.float64)
    tiles = wp.reshape(*lead, nb, bn, kb, bk)
    amax = tiles.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if ue8m0:
        scale = ue8m0_round_up(scale)
    q = to_e4m3(tiles / scale[..., :, None, :, None]).reshape(*lead, nb * bn, kb * bk)
    return q[..., :n, :k].contiguous(), scale


def dequantize_block(q: torch.Tensor, scale: torch.Tensor,
                     block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """w = q * s, each scale broadcast over its (bn x bk) tile. Exact in float64."""
    bn, bk = block
    *lead, n, k = q.shape
    s = scale.to(torch.float64).repeat_interleave(bn, -2).repeat_interleave(bk, -1)
    return q.to(torch.float64) * s[..., :n, :k]
