"""Checkpoint tensors in the dtypes a real bf16 HY V4 checkpoint stores them."""

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


def is_fp32_checkpoint_tensor(name: str) -> bool:
    return name.endswith(_FP32_SUFFIXES)


def cast_for_vllm(ckpt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """bf16 for every tensor except the fp32 ones above (values are already representable)."""
    out = {}
    for name, t in ckpt.items():
        dtype = torch.float32 if is_fp32_checkpoint_tensor(name) else torch.bfloat16
        out[name] = t.detach().to(dtype).contiguous()
    return out
