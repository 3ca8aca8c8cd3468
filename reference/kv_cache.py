"""The stored form of the draft's latent KV: the bf16 cache, or vLLM's packed ``fp8_ds_mla`` rows.

``--kv-cache-dtype fp8`` (or fp8_e4m3 / fp8_ds_mla) on HY V4's sparse layers: vLLM's
``_canonicalize_sparse_mla_kv_cache_dtype`` turns it into ``fp8_ds_mla`` for the
``FLASHMLA_SPARSE`` backend name that HY V4's sink-capable binding keeps
(``models/hy_v4/nvidia/flashmla_sparse.py``). One token's row is 656 bytes:

    bytes [0, 512)    the latent kv_c (kv_lora_rank 512) as e4m3, 4 tiles of 128
    bytes [512, 528)  4 float32 tile scales s_t, one per tile, in tile order
    bytes [528, 656)  the roped k_pe (64 values) as bf16, verbatim (not quantized)

The writer (vLLM 0.33.0 and 0.34.0 ``csrc/cache_kernels.cu``
``concat_and_cache_ds_mla_kernel``, the CUDA op behind ``ops.concat_and_cache_mla(...,
"fp8_ds_mla")``; the same rule in vLLM's ``tests/kernels/attention/test_cache.py``
``test_concat_and_cache_ds_mla``), per tile t of the bf16 latent x:

    a_t = max |x_i| over the tile (float32)
    s_t = 2^ceil(log2(max(a_t / 448, 1e-4)))       a power of two, stored as float32
    q_i = e4m3(x_i / s_t)    round to nearest even, saturating at +-448

so x_i / s_t is exact (a power-of-two divisor) and |x_i / s_t| <= 448. The readers
(FlashMLA's sparse FP8 decode kernel, ``cp_gather_and_upconvert_fp8_kv_cache`` for the
BF16 prefill path; FlashMLA ``tests/quant.py`` ``dequantize_k_cache``) take
``x'_i = q_i * s_t`` with s_t the float32 at byte 512 + 4 t, and the rope as stored. With a
power-of-two s_t the product is exact in bf16 ("Both SM90 and SM100 readers preserve
power-of-two fp32 scales exactly", the writer's comment): reading adds no rounding.

Error of the round trip: |x'_i - x_i| <= half an e4m3 step at |x_i / s_t|: at most 2^-4 |x_i|
for normal e4m3 values (3 mantissa bits), at most 2^-10 s_t below e4m3's smallest normal
(2^-6 s_t, subnormal steps of 2^-9 s_t).

Here: ``quantize_latent`` / ``dequantize_latent`` (the arithmetic), ``pack_rows`` /
``unpack_rows`` (the bytes), ``stored_kv`` (what the reference's draft cache holds for a
``kv_cache_dtype``), ``canonical`` (the dtype names vLLM accepts and what each becomes).
"""

from __future__ import annotations

import torch

from .config import ConfigError
from .fp8 import E4M3_MAX

NOPE = 512          # kv_lora_rank the layout is defined for
TILE = 128          # latent values per scale
TILES = NOPE // TILE
ROPE = 64           # qk_rope_head_dim
SCALE_FLOOR = 1e-4  # the writer's floor on a_t / 448 (an all-zero tile gets 2^-13)
ROW_BYTES = NOPE + 4 * TILES + 2 * ROPE  # 656
SCALE_AT = NOPE                          # byte offset of the float32 scales
ROPE_AT = NOPE + 4 * TILES               # byte offset of the bf16 rope

# kv_cache_dtype names (vLLM's CacheDType) -> what the draft's sparse MLA layer stores
_CANONICAL = {"auto": "bf16", "bfloat16": "bf16", "fp8": "fp8_ds_mla", "fp8_e4m3": "fp8_ds_mla",
              "fp8_ds_mla": "fp8_ds_mla"}


def canonical(kv_cache_dtype: str) -> str:
    """"bf16" or "fp8_ds_mla": the layout HY V4's sparse MLA cache takes for ``kv_cache_dtype``.
    Others (fp8_e5m2, nvfp4_ds_mla: SM100 only, ...) are not modelled: ConfigError."""
    if kv_cache_dtype not in _CANONICAL:
        raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r} is not modelled by the reference "
                          f"(modelled: {', '.join(_CANONICAL)})")
    return _CANONICAL[kv_cache_dtype]


def tile_scales(x: torch.Tensor) -> torch.Tensor:
    """s [..., 4] float64 (powers of two) of latents x [..., 512]: the writer's per-tile scale.

    a_t / 448 is taken in float32 when x is bf16 (as the kernel: exact amax, one float32
    division), in float64 otherwise (the spec); the power-of-two ceiling of it is exact either way.
    """
    if x.shape[-1] != NOPE:
        raise ValueError(f"fp8_ds_mla stores a latent of {NOPE} values, got {x.shape[-1]}")
    tiles = x.reshape(*x.shape[:-1], TILES, TILE)
    if x.dtype == torch.bfloat16:
        raw = (tiles.float().abs().amax(-1) / E4M3_MAX).double()
        floor = float(torch.tensor(SCALE_FLOOR, dtype=torch.float32))
    else:
        raw = tiles.double().abs().amax(-1) / E4M3_MAX
        floor = SCALE_FLOOR
    raw = raw.clamp_min(floor)
    mant, exp = torch.frexp(raw)  # raw = mant * 2^exp, mant in [0.5, 1)
    return torch.ldexp(torch.ones_like(raw), torch.where(mant == 0.5, exp - 1, exp))


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """v (float64) rounded to the nearest e4m3 value, ties to even, saturating at +-448, in float64.

    Done in float64 arithmetic (no cast through float32, so no double rounding of a float64 v):
    e4m3 has 3 mantissa bits, so the step is 2^(floor(log2|v|) - 3) for |v| >= 2^-6 (normal)
    and 2^-9 below (subnormal); v / step is exact and ``torch.round`` rounds half to even.
    """
    v = v.to(torch.float64).clamp(-E4M3_MAX, E4M3_MAX)
    _, exp = torch.frexp(v)  # |v| = m 2^exp, m in [0.5, 1): floor(log2|v|) = exp - 1
    step = torch.ldexp(torch.ones_like(v), (exp - 4).clamp_min(-9))
    return (torch.round(v / step) * step).clamp(-E4M3_MAX, E4M3_MAX)


def quantize_latent(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [..., 512] float8_e4m3fn, s [..., 4] float64): q_i = e4m3(x_i / s_t), RNE, saturating."""
    s = tile_scales(x)
    tiles = x.double().reshape(*x.shape[:-1], TILES, TILE) / s[..., None]  # exact: s is 2^k
    q = round_e4m3(tiles).to(torch.float8_e4m3fn)  # exactly representable: the cast does not round
    return q.reshape(x.shape), s


def dequantize_latent(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x' [..., 512] float64 = q_i * s_t (each scale over its tile of 128): the readers' value."""
    tiles = q.double().reshape(*q.shape[:-1], TILES, TILE) * s.double()[..., None]
    return tiles.reshape(q.shape)


def pack_rows(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """uint8 rows [..., 656] as the writer lays them out, from kv_c [..., 512] and k_pe [..., 64]
    (k_pe rounded to bf16 if it is not bf16 already)."""
    if k_pe.shape[-1] != ROPE:
        raise ValueError(f"fp8_ds_mla stores {ROPE} rope values, got {k_pe.shape[-1]}")
    q, s = quantize_latent(kv_c)
    lead = kv_c.shape[:-1]
    rows = torch.empty(*lead, ROW_BYTES, dtype=torch.uint8, device=kv_c.device)
    rows[..., :NOPE] = q.view(torch.uint8)
    rows[..., SCALE_AT:ROPE_AT] = s.float().contiguous().view(torch.uint8)
    rows[..., ROPE_AT:] = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)
    return rows


def unpack_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [..., 512] e4m3, s [..., 4] float32, rope [..., 64] bf16) of rows [..., 656] uint8."""
    if rows.dtype != torch.uint8 or rows.shape[-1] != ROW_BYTES:
        raise ValueError(f"fp8_ds_mla rows are uint8 [..., {ROW_BYTES}], got {rows.dtype} {tuple(rows.shape)}")
    rows = rows.contiguous()
    q = rows[..., :NOPE].contiguous().view(torch.float8_e4m3fn)
    s = rows[..., SCALE_AT:ROPE_AT].contiguous().view(torch.float32)
    rope = rows[..., ROPE_AT:].contiguous().view(torch.bfloat16)
    return q, s, rope


def read_rows(rows: torch.Tensor) -> torch.Tensor:
    """[..., 576] float64: the latent as the kernels read it (q * s per tile), then the rope."""
    q, s, rope = unpack_rows(rows)
    return torch.cat([dequantize_latent(q, s), rope.double()], dim=-1)


def stored_kv(kv_cache_dtype: str, kv_c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_c, k_pe) as attention reads them back from a cache of ``kv_cache_dtype``.

    "auto" / bf16: unchanged (the caller's numerics already rounded them as stored).
    fp8_ds_mla: the latent through the writer and reader above (kept in kv_c's dtype: the
    dequantized values are exact in bf16), the rope rounded to bf16 as stored (in kv_c's dtype).
    """
    if canonical(kv_cache_dtype) == "bf16":
        return kv_c, k_pe
    q, s = quantize_latent(kv_c)
    return dequantize_latent(q, s).to(kv_c.dtype), k_pe.to(torch.bfloat16).to(k_pe.dtype)
