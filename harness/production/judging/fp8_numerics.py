"""The numerics of vLLM's block-FP8 production path, for the reference to compute with: per-token-group
e4m3 activation quantization before the FP8 GEMMs (``Fp8Numerics``), the weights as production
re-quantizes them (``production_weights``), and ``production_numerics``, what the side-by-side judge
replays FP8 cases with. What vLLM does and why each step is modelled: ``fp8_emulation``'s docstring,
the tool that measures the tolerances these numerics give (it imports this module; this one imports
no judge).
"""

from __future__ import annotations

import dataclasses

import torch

import reference as R
from reference.fp8 import E4M3_MAX, quantize_block, to_e4m3, ue8m0_round_up
from reference.numerics import Numerics

GROUP = 128

# (activation scales rounded up to powers of two, fp32-scale weights re-quantized to UE8M0)
VARIANTS = {
    "deepgemm-e8m0": (True, True),   # the SM90 default (VLLM_USE_DEEP_GEMM_E8M0=1, DeepGEMM present)
    # FlashInferFp8DeepGEMMDynamicBlockScaledKernel (picked first when flashinfer has the block-scale
    # GEMM): FlashInfer quantizes the activation itself for M < 32 (steps >= 1 here) over the weight
    # DeepGEMM's post-processing already re-quantized; emulated with float32 activation scales
    "requant-fp32-act": (False, True),
    "fp32-scales": (False, False),   # VLLM_USE_DEEP_GEMM_E8M0=0 / CUTLASS or Triton block GEMM
}


def quantize_act(x: torch.Tensor, group: int = GROUP, pow2: bool = False, eps: float = 1e-10) -> torch.Tensor:
    """x [..., K] -> dequantized per-token-group e4m3 values (float64), K padded to the group."""
    k = x.shape[-1]
    pad = (-k) % group
    xf = x.to(torch.float64)
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    g = xf.reshape(*xf.shape[:-1], -1, group)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(eps).to(torch.float32).to(torch.float64) / E4M3_MAX
    scale = scale.to(torch.float32).to(torch.float64)
    if pow2:
        scale = ue8m0_round_up(scale)
    q = to_e4m3(g / scale).to(torch.float64) * scale
    return q.reshape(*xf.shape)[..., :k]


@dataclasses.dataclass(frozen=True)
class Fp8Numerics(Numerics):
    """PRODUCTION numerics plus per-token-group e4m3 activation quantization before FP8 GEMMs."""

    fp8_storages: frozenset = frozenset()
    act_pow2: bool = True

    def linear(self, x: torch.Tensor, w: torch.Tensor, out: torch.dtype | None = None) -> torch.Tensor:
        if w.untyped_storage().data_ptr() not in self.fp8_storages:
            return super().linear(x, w, out)
        xq = quantize_act(x.to(self.act), GROUP, self.act_pow2)
        y = self.up(xq) @ self.up(w).mT
        return y.to(out or self.act)


def requant_ue8m0(w: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """``requant_weight_ue8m0_inplace`` on a dequantized weight: block e4m3 with power-of-two scales."""
    q, s = quantize_block(w.to(torch.float32).to(torch.float64), block, ue8m0=True)
    bn, bk = block
    *_, n, k = w.shape
    full = s.repeat_interleave(bn, -2).repeat_interleave(bk, -1)[..., :n, :k]
    return q.to(torch.float64) * full


def production_weights(case, weights: dict, variant: str) -> tuple[dict, frozenset]:
    """(weights as production computes with them, storages of the FP8-GEMM weights)."""
    from harness.checkpoint.quant import mtp_fp8_plan
    from harness.components import QUANT_PRECISION

    _, requant = VARIANTS[variant]
    hf, _, _ = case_inputs_cached(case)
    cfg = R.MTPConfig.from_hf_dict(hf)
    plan = mtp_fp8_plan(hf, cfg)
    out = dict(weights)
    storages = set()
    if plan is None:
        return out, frozenset()
    for layer in range(cfg.num_mtp_layers):
        for leaf in sorted(plan.quantized.get(layer, ())):
            name = f"layers.{layer}.{leaf}"
            if name not in out:
                continue
            w = out[name]
            if requant and QUANT_PRECISION.get(case.quant, case.quant) == "fp8" and not leaf.startswith("mlp.experts."):
                w = requant_ue8m0(w, plan.block)  # DeepGEMM linears only; Triton MoE keeps the stored scales
            out[name] = w.clone()
            storages.add(out[name].untyped_storage().data_ptr())
    return out, frozenset(storages)


def case_inputs_cached(case):
    from harness.production.case_inputs import case_inputs
    return case_inputs(case)


def production_numerics(case, weights: dict, variant: str = "deepgemm-e8m0") -> tuple[dict, Numerics]:
    """(weights, numerics) that model what production rounds for ``case``: ``reference.PRODUCTION``
    for bf16 cases; for FP8 cases the weights production computes with (``variant``'s
    re-quantization) and ``Fp8Numerics`` (per-token-group e4m3 activation quantization before
    the FP8 GEMMs). The side-by-side's ``|d| prodnum`` column is measured against this."""
    if case.quant == "bf16":
        return weights, R.PRODUCTION
    act_pow2, _ = VARIANTS[variant]
    pw, storages = production_weights(case, weights, variant)
    return pw, Fp8Numerics("production-fp8", torch.bfloat16, torch.float32, storages, act_pow2)
