"""Checkpoint tensors in the dtypes a real HY V4 checkpoint stores them.

bf16 checkpoints: float64 canonical values are cast to bf16, except the fp32
tensors below. FP8 checkpoints (``harness.checkpoint.synth`` /
``load_checkpoint(...).stored_tensors()``): e4m3 weights, their block scales
(float32 ``weight_scale_inv`` or ModelOpt ``weight_scale``, UE8M0 as uint8 bytes /
float8_e8m0fnu / power-of-two float32, expert ``.scale`` / fused ``_scale_inv`` names) pass
through unchanged, so
vLLM's own FP8 loader paths run on them (``.scale`` -> ``weight_scale_inv``
renaming and uint8 -> e8m0 reinterpretation, fused scale suffixes, the FP8
indexer ``wk`` dequantization).
"""

from __future__ import annotations

import torch

# vLLM keeps these in float32 (router weight, expert bias, attention sink,
# indexer k LayerNorm); everything else is bf16 on disk.
_FP32_SUFFIXES = (
    "mlp.gate.weight",
    "mlp.gate.e_score_correction_bias",
    "self_attn.learnable_sink_param",
    "self_attn.indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias",
)
# Stored FP8 payloads and scale encodings: never cast (a cast would re-quantize
# or, for uint8 UE8M0 bytes, turn exponent bytes into numbers).
PASSTHROUGH_DTYPES = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.uint8)
# Block-scale names (linear ``.weight_scale_inv``, ModelOpt linear ``.weight_scale``, fused
# experts ``_scale_inv``, split experts ``.scale``): float32 scales stay float32 (bf16 would
# round them).
SCALE_SUFFIXES = ("weight_scale_inv", "_scale_inv", ".scale", ".weight_scale")


def is_fp32_checkpoint_tensor(name: str) -> bool:
    return name.endswith(_FP32_SUFFIXES)


def is_passthrough(name: str, t: torch.Tensor) -> bool:
    """Stored FP8 data or a block scale: fed to vLLM exactly as stored."""
    return t.dtype in PASSTHROUGH_DTYPES or name.endswith(SCALE_SUFFIXES)


def cast_for_vllm(ckpt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """bf16 for every tensor except the fp32 ones above; FP8 tensors and scales unchanged."""
    out = {}
    for name, t in ckpt.items():
        if is_passthrough(name, t):
            out[name] = t.detach().contiguous()
            continue
        dtype = torch.float32 if is_fp32_checkpoint_tensor(name) else torch.bfloat16
        out[name] = t.detach().to(dtype).contiguous()
    return out
