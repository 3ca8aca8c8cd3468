"""The MTP head's configuration, read from a HY V4 ``config.json`` dict.

Defaults are HYV4Config's (vLLM 0.33.0 ``transformers_utils/configs/hy_v4.py``);
the per-layer kind of the MTP layer follows vLLM's rule: the MTP layer
``num_hidden_layers + i`` takes ``layer_types[idx]`` / ``mlp_layer_types[idx]``
when the list is long enough, else the list's last entry; with no
``layer_types`` at all the layer is dense ("full") attention.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

SPARSE_LAYER_TYPES = (
    "sparse_attention",
    "sparse",
    "indexed_attention",
    "deepseek_sparse_attention",
)


class ConfigError(ValueError):
    """A config that the reference (or vLLM's kernels) cannot run."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Interleaved RoPE over the ``qk_rope_head_dim`` slice.

    rope_type "default" or "yarn"/"deepseek_yarn" (YaRN frequency blend; the
    cos/sin are multiplied by ``mscale``, see ``reference.rope``).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attn_factor: float = 1.0

    @classmethod
    def from_hf(cls, params: dict | None, rope_theta: float | None) -> "RopeConfig":
        params = dict(params or {})
        theta = params.get("rope_theta", rope_theta if rope_theta is not None else 10000.0)
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", "yarn", "deepseek_yarn"):
            raise ConfigError(f"rope_type {rope_type!r} is not modelled by the reference")
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            original_max_position=int(params.get("original_max_position_embeddings", 4096)),
            beta_fast=float(params.get("beta_fast", 32.0)),
            beta_slow=float(params.get("beta_slow", 1.0)),
            mscale=float(params.get("mscale", 1.0)),
            mscale_all_dim=float(params.get("mscale_all_dim", 0.0)),
            attn_factor=float(params.get("attn_factor", 1.0)),
        )


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """Everything the reference needs to run HY V4's MTP draft head."""

    vocab_size: int = 120832
    hidden_size: int = 2816
    intermediate_size: int = 6912
    moe_intermediate_size: int = 768
    num_hidden_layers: int = 34
    num_attention_heads: int = 32
    rms_norm_eps: float = 1e-5
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    routed_scaling_factor: float = 2.827
    norm_topk_prob: bool = True
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 16
    gated_mla: bool = True
    gating_type: str = "elementwise"
    learnable_sink: bool = True
    swiglu_limit: float = 10.0
    num_nextn_predict_layers: int = 1
    index_share_for_mtp_iteration: bool = False
    lm_head_fp32: bool = True
    attention_sparse: bool = True  # the MTP layer's attention kind
    mlp_moe: bool = True  # the MTP layer's MLP kind
    rope: RopeConfig = RopeConfig()
    # Softmax scale convention: vLLM 0.33's HYV4MLAAttention uses
    # qk_head_dim**-0.5 with no YaRN correction; HF transformers' DeepSeek-style
    # attention multiplies it by yarn_get_mscale(factor, mscale_all_dim)**2.
    softmax_scale_convention: str = "vllm"

    # ---- derived ----------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_mtp_layers(self) -> int:
        """Draft blocks vLLM builds: max(num_nextn_predict_layers, 1)."""
        return max(self.num_nextn_predict_layers, 1)

    @property
    def gate_size_per_head(self) -> int:
        return self.v_head_dim if self.gating_type == "elementwise" else 1

    @property
    def softmax_scale(self) -> float:
        base = self.qk_head_dim ** -0.5
        if self.softmax_scale_convention == "vllm":
            return base
        if self.softmax_scale_convention == "hf":
            if self.rope.rope_type in ("yarn", "deepseek_yarn") and self.rope.mscale_all_dim:
                m = yarn_get_mscale(self.rope.factor, self.rope.mscale_all_dim)
                return base * m * m
            return base
        raise ConfigError(f"unknown softmax_scale_convention {self.softmax_scale_convention!r}")

    def replace(self, **changes: Any) -> "MTPConfig":
        return dataclasses.replace(self, **changes)

    # ---- construction ------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: dict, **overrides: Any) -> "MTPConfig":
        """Build from a HY V4 ``config.json`` dict (HYV4Config defaults apply)."""
        from .config_checks import validate_hf_config

        validate_hf_config(hf)  # types, ranges, NaN: what vLLM would refuse or misread, by key
        d = {f.name: f.default for f in dataclasses.fields(cls)}
        for key in d:
            if key in hf and key not in ("rope",):
                d[key] = hf[key]
        if "num_local_experts" in hf and "n_routed_experts" not in hf:
            d["n_routed_experts"] = hf["num_local_experts"]
        d["lm_head_fp32"] = bool(hf.get("enable_lm_head_fp32", True))
        d["rope"] = RopeConfig.from_hf(hf.get("rope_parameters") or hf.get("rope_scaling"),
                                       hf.get("rope_theta"))
        n = d["num_hidden_layers"]
        d["attention_sparse"] = _mtp_layer_kind(hf.get("layer_types"), n, "full_attention") in SPARSE_LAYER_TYPES
        mlp_types = hf.get("mlp_layer_types")
        if mlp_types is None:  # HYV4Config.__post_init__ default
            mlp_types = ["dense"] * min(1, n) + ["sparse"] * max(n - 1, 0)
        d["mlp_moe"] = _mtp_layer_kind(mlp_types, n, "sparse") == "sparse"
        d.update(overrides)
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(self.gating_type in ("elementwise", "headwise"), f"gating_type {self.gating_type!r}")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even (RoPE pairs)")
        need(self.index_head_dim > self.qk_rope_head_dim, "index_head_dim must exceed qk_rope_head_dim")
        need(self.index_head_dim % 128 == 0,
             "index_head_dim must be a multiple of 128 (per-token-group FP8 groups of 128)")
        need(1 <= self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok out of range")
        need(self.num_nextn_predict_layers >= 1,
             f"num_nextn_predict_layers must be >= 1 (got {self.num_nextn_predict_layers}): "
             "with 0 vLLM builds a draft layer but loads none of its weights")
        need(self.vocab_size >= 1 and self.hidden_size >= 1, "vocab_size and hidden_size must be >= 1")


def _mtp_layer_kind(types: list[str] | None, num_hidden_layers: int, fallback: str) -> str:
    """vLLM's ``_extend_layer_types`` for the first MTP layer's index."""
    if types is None:
        return fallback
    if len(types) > num_hidden_layers:
        kind = types[num_hidden_layers]
    else:
        kind = types[-1] if types else fallback
    return kind


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN attention-magnitude correction: 0.1*mscale*ln(scale) + 1 (1 for scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0
