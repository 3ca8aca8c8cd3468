"""Precision policy of the reference.

``EXACT``: every tensor and every accumulation in float64: the mathematical
spec, up to float64 rounding.

``PRODUCTION``: what vLLM's CUDA path rounds: weights and activations are
bfloat16 between ops, each op accumulates in float32 and rounds its output
to bfloat16; the MoE router, the indexer k LayerNorm and the LM head logits
stay float32 (as vLLM keeps them). RMSNorm rounds twice (the normalized x,
then its product with the bf16 weight) and the RoPE cos/sin tables are bf16
built from float32 angles, as vLLM's (``norms.rms_norm``, ``rope.cos_sin``;
both pinned bitwise to vLLM's pure functions on CPU). The activation
quantization of FP8 GEMMs is ``harness.production.judging.fp8_numerics.Fp8Numerics``. FP8 quantization steps of the
model (the indexer's q and k) are part of the spec and happen in both modes.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Numerics:
    name: str
    act: torch.dtype  # storage dtype between ops
    acc: torch.dtype  # accumulation dtype inside an op

    def store(self, x: torch.Tensor) -> torch.Tensor:
        """Round to the between-ops dtype (bf16 in production), kept there."""
        return x.to(self.act)

    def up(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.acc)

    def linear(self, x: torch.Tensor, w: torch.Tensor, out: torch.dtype | None = None) -> torch.Tensor:
        """y = x @ w.T accumulated in ``acc``, rounded to ``out`` (default ``act``).

        x: [..., in], w: [out_features, in] -> [..., out_features]; w may be a stack
        [..., out_features, in] (x broadcast against it).
        """
        y = self.up(x) @ self.up(w).mT
        return y.to(out or self.act)

    @property
    def fp32(self) -> torch.dtype:
        """Where production keeps float32 (router, LM head): float64 when exact."""
        return torch.float64 if self.acc == torch.float64 else torch.float32


EXACT = Numerics("float64", torch.float64, torch.float64)
PRODUCTION = Numerics("production", torch.bfloat16, torch.float32)


def numerics_by_name(name: str) -> Numerics:
    table = {"float64": EXACT, "exact": EXACT, "production": PRODUCTION}
    if name not in table:
        raise ValueError(f"unknown dtype mode {name!r}; choose float64 or production")
    return table[name]
