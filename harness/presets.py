"""Synthetic HY V4 configs sized to run on vLLM 0.33's SM90 kernels.

Kernel constraints (checked by ``check_kernel_constraints``; found by running vLLM 0.33.0 on
an SM90 GPU):
- sparse MLA (FlashMLA sparse) needs head size 576 = kv_lora_rank 512 +
  qk_rope_head_dim 64;
- DeepGEMM's indexer logits kernel needs index_n_heads 32 or 64;
- FlashMLA sparse uses KV cache block size 64 (a runner setting, not config);
- FlashMLA sparse needs index_topk to be a multiple of 128 (top-k rows are
  converted to cache slots in blocks of 128; 128, 256 and 512 were run);
- FP8 block quantization needs every quantized dimension to be a multiple of
  the 128 block (a Fp8LinearMethod check on the partition sizes).
"""

from __future__ import annotations

import copy

from reference.config import ConfigError, MTPConfig

_COMMON = {
    "architectures": ["HYV4ForCausalLM"],
    "model_type": "hy_v4",
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "num_nextn_predict_layers": 1,
    "gated_mla": True,
    "gating_type": "elementwise",
    "learnable_sink": True,
    "swiglu_limit": 10.0,
    "enable_ihc": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "enable_lm_head_fp32": True,
    "torch_dtype": "bfloat16",
}

PRESETS: dict[str, dict] = {
    # Seconds on CPU for the reference; the smallest shape the kernels accept.
    "tiny": {
        **_COMMON,
        "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
        "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "q_lora_rank": 256, "qk_nope_head_dim": 64,
        "v_head_dim": 128, "index_topk": 128,
    },
    "small": {
        **_COMMON,
        "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1024,
        "moe_intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8,
        "num_key_value_heads": 8, "n_routed_experts": 16, "n_shared_experts": 1,
        "num_experts_per_tok": 4, "q_lora_rank": 512, "qk_nope_head_dim": 128,
        "v_head_dim": 128, "index_topk": 256,
    },
    # HYV4Config's defaults for the MTP layer, except a shrunk vocab and the
    # indexer head count the SM90 kernel needs (default 16 fails there).
    "real-dims": {
        **_COMMON,
        "vocab_size": 8192, "hidden_size": 2816, "intermediate_size": 6912,
        "moe_intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 32,
        "num_key_value_heads": 32, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "q_lora_rank": 1536, "qk_nope_head_dim": 192,
        "v_head_dim": 256, "index_topk": 2048,
    },
}


def preset(name: str, **overrides) -> dict:
    """A copy of preset ``name``'s HF config dict with ``overrides`` applied."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    cfg = copy.deepcopy(PRESETS[name])
    cfg.update(overrides)
    n = cfg["num_hidden_layers"]
    cfg.setdefault("layer_types", ["deepseek_sparse_attention"] * n)
    cfg.setdefault("mlp_layer_types", ["dense"] + ["sparse"] * (n - 1))
    return cfg


def check_kernel_constraints(cfg: MTPConfig, quantized: bool = False, tp: int = 1) -> None:
    """Raise ConfigError when vLLM 0.33's SM90 production path cannot run ``cfg``."""
    problems = []
    if cfg.attention_sparse and cfg.kv_lora_rank + cfg.qk_rope_head_dim != 576:
        problems.append(
            f"sparse MLA needs kv_lora_rank + qk_rope_head_dim == 576 "
            f"(got {cfg.kv_lora_rank} + {cfg.qk_rope_head_dim})")
    if cfg.attention_sparse and cfg.index_topk % 128:
        # FlashMLA sparse maps top-k rows to cache slots in blocks of 128
        # (sparse_utils.triton_convert_req_index_to_global_index).
        problems.append(f"FlashMLA sparse needs index_topk % 128 == 0 (got {cfg.index_topk})")
    if cfg.attention_sparse and cfg.index_n_heads not in (32, 64):
        problems.append(f"DeepGEMM's indexer logits kernel needs index_n_heads 32 or 64 (got {cfg.index_n_heads})")
    if quantized:
        dims = {"hidden_size": cfg.hidden_size, "q_lora_rank": cfg.q_lora_rank,
                "moe_intermediate_size/tp": cfg.moe_intermediate_size // tp,
                "intermediate_size/tp": cfg.intermediate_size // tp,
                # o_proj is row-parallel: its per-rank input is the rank's heads x v_head_dim
                "num_attention_heads*v_head_dim/tp": cfg.num_attention_heads * cfg.v_head_dim // tp}
        if cfg.n_shared_experts:
            dims["moe_intermediate_size*n_shared_experts/tp"] = cfg.moe_intermediate_size * cfg.n_shared_experts // tp
        for k, v in dims.items():
            if v % 128:
                problems.append(f"FP8 128x128 blocks need {k} % 128 == 0 (got {v})")
    if problems:
        raise ConfigError("config does not fit vLLM 0.33's SM90 kernels: " + "; ".join(problems))
