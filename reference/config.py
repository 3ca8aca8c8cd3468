"""The MTP head's configuration, read from a HY V4 ``config.json`` dict.

Defaults are HYV4Config's (vLLM 0.33.0 ``transformers_utils/configs/hy_v4.py``).
Every key is read the way vLLM 0.33's HY V4 MTP path reads it after
transformers 5.20's config processing (``HYV4Config``, ``standardize_rope_params``,
``validate_layer_type``), or refused with the key named where the reference
does not model what vLLM would do; keys vLLM does not read are not used
(``rope_parameters.attn_factor``, for one). ``tests/cpu/test_config_surface.py``
walks this surface against vLLM's own config loader, RoPE classes and model
constructor.

Per-layer kinds: the MTP layer ``num_hidden_layers + i`` takes
``layer_types[idx]`` / ``mlp_layer_types[idx]`` when the list is long enough,
else the list's last entry (vLLM's ``_extend_layer_types``); with no
``layer_types`` at all the layer is dense ("full") attention. Attention is
sparse for the DSA spellings, the MLP is MoE for anything but ``"dense"``.
A dense-attention layer applies no sink: vLLM loads ``learnable_sink_param``
but no dense MLA backend on NVIDIA takes sinks, so it disables the bias
(``HYV4MLAAttention._resolve_sink_backend``); ``MTPConfig.sink_applied``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .config_checks import validate_hf_config
from .config_error import ConfigError

SPARSE_LAYER_TYPES = (  # vLLM's _SPARSE_LAYER_TYPES (attention.py)
    "sparse_attention",
    "sparse",
    "indexed_attention",
    "deepseek_sparse_attention",
)


# rope_type -> the vLLM 0.33 RoPE class ``get_rope`` builds for it (the ones modelled here).
ROPE_TYPES = {"default": "RotaryEmbedding", "yarn": "YaRNScalingRotaryEmbedding",
              "deepseek_yarn": "DeepseekScalingRotaryEmbedding",
              "deepseek_llama_scaling": "DeepseekScalingRotaryEmbedding"}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Interleaved RoPE over the first ``rotary_dim`` entries of the ``qk_rope_head_dim`` slice.

    rope_type "default", "yarn" (vLLM's YaRNScalingRotaryEmbedding) or
    "deepseek_yarn" (DeepseekScalingRotaryEmbedding): YaRN frequency blend,
    cos/sin multiplied by the magnitude ``reference.rope.mscale``. ``None``
    means "key absent" where vLLM tells absent from a value (yarn's
    ``mscale`` / ``mscale_all_dim`` / ``attention_factor``).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # yarn only
    truncate: bool = True  # yarn only; deepseek_yarn always truncates
    rope_dim: int | None = None  # rope_parameters.rope_dim: the rotated width
    partial_rotary_factor: float = 1.0  # rotated width = int(head_size * factor) without rope_dim

    def rotary_dim(self, head_size: int) -> int:
        """``get_rope``'s rotary_dim for a rope slice of ``head_size`` entries."""
        return int(self.rope_dim) if self.rope_dim else int(head_size * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, params: dict | None, rope_theta: float | None, hf: dict | None = None) -> "RopeConfig":
        """``config.rope_parameters`` as vLLM's ``get_rope`` reads it.

        ``params``: ``rope_parameters`` (or legacy ``rope_scaling``); ``rope_theta``
        and ``hf`` (the whole config dict) give the top-level keys that
        transformers' ``standardize_rope_params`` / vLLM's
        ``patch_rope_parameters`` fold into it.
        """
        hf = hf or {}
        params = dict(params or {})
        if params and all(isinstance(v, dict) for v in params.values()):
            raise ConfigError("rope_parameters nested per layer type is not modelled by the reference "
                              "(HY V4's get_rope reads the top level only)")
        _check_rope_types(params, hf)
        legacy = params.get("type")
        if "rope_type" in params and legacy is not None and legacy != params["rope_type"]:
            raise ConfigError(f"rope_parameters.rope_type {params['rope_type']!r} conflicts with "
                              f"rope_parameters.type {legacy!r} (vLLM refuses this)")
        rope_type = params.get("rope_type", legacy if legacy is not None else "default")
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope_parameters.rope_type {rope_type!r} is not modelled by the reference")
        for key in ("mrope_section", "use_fope", "is_deepseek_v4"):
            if params.get(key):
                raise ConfigError(f"rope_parameters.{key} is not modelled by the reference")
        theta = params.get("rope_theta", rope_theta)  # (a top-level rotary_emb_base does not reach get_rope)
        prf = params.get("partial_rotary_factor")
        if prf is None:
            prf = next((hf[k] for k in ("partial_rotary_factor", "rotary_pct", "rotary_emb_fraction")
                        if hf.get(k) is not None), 1.0)
        if not params.get("rope_dim") and not 0.0 < float(prf) <= 1.0:  # get_rope checks it without rope_dim only
            raise ConfigError(f"rope_parameters.partial_rotary_factor {prf} must be in (0, 1] (vLLM refuses it)")
        kw: dict[str, Any] = dict(theta=float(10000.0 if theta is None else theta), rope_type=rope_type,
                                  rope_dim=params.get("rope_dim") or None, partial_rotary_factor=float(prf))
        if rope_type == "default":
            return cls(**kw)
        if params.get("factor") is None:
            raise ConfigError(f"rope_parameters.factor is required for rope_type {rope_type!r}")
        omax = params.get("original_max_position_embeddings")
        if rope_type == "yarn":
            # transformers: a top-level original_max_position_embeddings wins, else
            # max_position_embeddings fills it in (HYV4Config default 262144).
            omax = hf.get("original_max_position_embeddings",
                          omax if omax is not None else hf.get("max_position_embeddings", 262144))
        elif omax is None:
            raise ConfigError(f"rope_parameters.original_max_position_embeddings is required for "
                              f"rope_type {rope_type!r} (vLLM's get_rope reads it unconditionally)")
        kw.update(factor=float(params["factor"]), original_max_position=int(omax),
                  beta_fast=float(params.get("beta_fast", 32)), beta_slow=float(params.get("beta_slow", 1)))
        if rope_type == "yarn":
            opt = lambda k: None if params.get(k) is None else float(params[k])  # noqa: E731
            kw.update(mscale=opt("mscale"), mscale_all_dim=opt("mscale_all_dim"),
                      attention_factor=opt("attention_factor"), truncate=bool(params.get("truncate", True)))
        else:  # deepseek_yarn: DeepseekScalingRotaryEmbedding's defaults; no attention_factor / truncate
            kw.update(rope_type="deepseek_yarn", mscale=float(params.get("mscale", 1)),
                      mscale_all_dim=float(params.get("mscale_all_dim", 0)))
        return cls(**kw)


# the RoPE keys' JSON types: a list-valued rope_type or a string factor is named, not a TypeError
_ROPE_STR_KEYS = ("rope_type", "type")
_ROPE_NUMBER_KEYS = ("factor", "rope_theta", "partial_rotary_factor", "beta_fast", "beta_slow", "mscale",
                     "mscale_all_dim", "attention_factor")
_ROPE_INT_KEYS = ("original_max_position_embeddings", "rope_dim")
_TOP_NUMBER_KEYS = ("rope_theta", "partial_rotary_factor", "rotary_pct", "rotary_emb_fraction")

# The domain of every RoPE number, derived from where ``reference.rope`` (as vLLM's RoPE classes)
# uses it: (low, low allowed, high or None, why). Outside it the trace is NaN, infinite or silently
# meaningless, never a model.
_ROPE_DOMAIN: dict[str, tuple[float, bool, float | None, str]] = {
    # theta ** (2i / r) is the frequency ladder and log(theta) divides in YaRN's correction range:
    # <= 0 is NaN, 1 a division by zero / every pair rotating alike, below 1 a ladder upside down
    "rope_theta": (1.0, False, None, "the base of theta**(-2i/r); YaRN divides by log(theta)"),
    # 1 / (factor * theta**(2i/r)) and log(factor) in the magnitude
    "factor": (0.0, False, None, "YaRN interpolates 1/(factor*theta**(2i/r)) and takes log(factor)"),
    # log(original_max_position / (2 pi beta))
    "original_max_position_embeddings": (1.0, True, None, "YaRN takes log(original_max_position / (2 pi beta))"),
    "beta_fast": (0.0, False, None, "YaRN takes log(original_max_position / (2 pi beta_fast))"),
    "beta_slow": (0.0, False, None, "YaRN takes log(original_max_position / (2 pi beta_slow))"),
    # 0.1 * mscale * log(factor) + 1: a negative one can divide by zero (mscale_all_dim) or flip cos/sin
    "mscale": (0.0, True, None, "the magnitude 0.1*mscale*log(factor)+1"),
    "mscale_all_dim": (0.0, True, None, "the magnitude's divisor 0.1*mscale_all_dim*log(factor)+1"),
    "attention_factor": (0.0, False, None, "the magnitude cos and sin are multiplied by"),
    "rope_dim": (2.0, True, None, "the rotated width: RoPE pairs"),
}


def _domain(where: str, key: str, v) -> None:
    low, inclusive, high, why = _ROPE_DOMAIN[key]
    if v < low or (v == low and not inclusive) or (high is not None and v > high):
        rng = f"{'>=' if inclusive else '>'} {low:g}" + (f" and <= {high:g}" if high is not None else "")
        shown = str(v) if len(str(v)) <= 40 else str(v)[:37] + "..."
        raise ConfigError(f"{where} {shown}: must be {rng} ({why})")


def _check_rope_types(params: dict, hf: dict) -> None:
    """``ConfigError`` naming the RoPE key whose value has the wrong JSON type, is not finite, or
    lies outside the domain its use gives it (``_ROPE_DOMAIN``)."""
    import math

    def number(where: str, v, integer: bool) -> None:
        ok = isinstance(v, int) if integer else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok or (isinstance(v, float) and not math.isfinite(v)) or (
                isinstance(v, int) and abs(v) > 2 ** 53):
            raise ConfigError(f"{where} {str(v)[:40]!r}: must be a finite {'int' if integer else 'number'}"
                              + (" (true / false is not a number)" if isinstance(v, bool) else ""))

    for k in _ROPE_STR_KEYS:
        if params.get(k) is not None and not isinstance(params[k], str):
            raise ConfigError(f"rope_parameters.{k} {str(params[k])[:40]!r}: must be a string")
    for k in _ROPE_NUMBER_KEYS + _ROPE_INT_KEYS:
        if params.get(k) is not None:
            number(f"rope_parameters.{k}", params[k], k in _ROPE_INT_KEYS)
            if k in _ROPE_DOMAIN:
                _domain(f"rope_parameters.{k}", k, params[k])
    kind = params.get("rope_type", params.get("type"))
    deepseek = kind not in (None, "default", "yarn")
    read_with_a_default = ("beta_fast", "beta_slow") + (("mscale", "mscale_all_dim") if deepseek else ())
    for k in read_with_a_default:  # get(k, default) returns a null as is: float(None) in vLLM too
        if k in params and params[k] is None:
            raise ConfigError(f"rope_parameters.{k} is null; give a number or leave the key out")
    if params.get("truncate") is not None and not isinstance(params["truncate"], bool):
        raise ConfigError(f"rope_parameters.truncate {str(params['truncate'])[:40]!r}: must be true or false")
    for k in _TOP_NUMBER_KEYS:
        if hf.get(k) is not None:
            number(f"config key {k!r}", hf[k], False)
            if k in _ROPE_DOMAIN:
                _domain(f"config key {k!r}", k, hf[k])
    for k in ("original_max_position_embeddings",):
        if hf.get(k) is not None:
            number(f"config key {k!r}", hf[k], True)
            _domain(f"config key {k!r}", k, hf[k])


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
        validate_hf_config(hf)  # types, ranges, NaN: what vLLM would refuse or misread, by key
        d = {f.name: f.default for f in dataclasses.fields(cls)}
        for key in d:
            if key in hf and key not in _NOT_HF_KEYS:
                d[key] = hf[key]
        if "num_local_experts" in hf and "n_routed_experts" not in hf:
            d["n_routed_experts"] = hf["num_local_experts"]
        d["lm_head_fp32"] = _lm_head_fp32(hf)
        d["rope"] = RopeConfig.from_hf(hf.get("rope_parameters") or hf.get("rope_scaling"),
                                       hf.get("rope_theta"), hf)
        if "q_lora_rank" in hf and hf["q_lora_rank"] is None:
            raise ConfigError("q_lora_rank: null (vLLM's q_proj path without a query down-projection) "
                              "is not modelled by the reference")
        kinds = mtp_layer_kinds(hf)
        if len(set(kinds)) > 1:
            raise ConfigError(f"layer_types / mlp_layer_types give the MTP layers different kinds {kinds} "
                              "((sparse attention, MoE) per layer); the reference builds one kind for all")
        d["attention_sparse"], d["mlp_moe"] = kinds[0]
        if hf.get("hidden_act", "silu") != "silu" and (not d["mlp_moe"] or d["n_shared_experts"] > 0):
            raise ConfigError(f"hidden_act {hf['hidden_act']!r}: vLLM's HYV4FeedForward (dense MLP, "
                              "shared experts) takes only 'silu'")
        d.update(overrides)
        cfg = cls(**d)
        cfg.validate()
        return cfg

    @property
    def sink_applied(self) -> bool:
        """Whether attention adds the learnable sink: only on sparse layers (see the module doc)."""
        return self.learnable_sink and self.attention_sparse

    @property
    def rotary_dim(self) -> int:
        return self.rope.rotary_dim(self.qk_rope_head_dim)

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        # vLLM reads gating_type only when gated_mla is set
        need(not self.gated_mla or self.gating_type in ("elementwise", "headwise"),
             f"gating_type {self.gating_type!r}")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even (RoPE pairs)")
        need(0 < self.rotary_dim <= self.qk_rope_head_dim and self.rotary_dim % 2 == 0,
             f"rope_parameters.rope_dim / partial_rotary_factor give rotary_dim {self.rotary_dim}: it must "
             f"be even and in (0, qk_rope_head_dim={self.qk_rope_head_dim}]")
        need(self.index_head_dim > self.qk_rope_head_dim, "index_head_dim must exceed qk_rope_head_dim")
        need(self.index_head_dim % 128 == 0,
             "index_head_dim must be a multiple of 128 (per-token-group FP8 groups of 128)")
        need(1 <= self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok out of range")
        need(self.num_nextn_predict_layers >= 1,
             f"num_nextn_predict_layers must be >= 1 (got {self.num_nextn_predict_layers}): "
             "with 0 vLLM builds a draft layer but loads none of its weights")
        need(self.vocab_size >= 1 and self.hidden_size >= 1, "vocab_size and hidden_size must be >= 1")


# MTPConfig fields that are the reference's own settings, never read from config.json.
_NOT_HF_KEYS = ("rope", "attention_sparse", "mlp_moe", "lm_head_fp32", "softmax_scale_convention")

# transformers 5.20's PreTrainedConfig.validate_layer_type allow-lists (checked
# only when layer_types is set: mlp_layer_types goes unchecked without it).
_ALLOWED_ATTN_LAYER_TYPES = (
    "full_attention", "sliding_attention", "chunked_attention", "window_attention", "indexed_attention",
    "compressed_sparse_attention", "heavily_compressed_attention", "minimax_m3_sparse", "conv", "moe",
    "hybrid", "hybrid_sliding", "reference_sliding_attention", "linear_attention")
_ALLOWED_MLP_LAYER_TYPES = ("sparse", "dense")


def mtp_layer_kinds(hf: dict) -> list[tuple[bool, bool]]:
    """(sparse attention, MoE MLP) of each MTP layer vLLM builds, read as vLLM reads them.

    HYV4Config folds "sparse" / "sparse_attention" into the DSA spelling and
    transformers refuses unknown entries or a length other than
    num_hidden_layers (``layer_types`` set only); each MTP layer
    ``n + i`` then takes ``_extend_layer_types``'s entry.
    """
    n = int(hf.get("num_hidden_layers", MTPConfig.num_hidden_layers))
    layer_types = hf.get("layer_types")
    mlp_types = hf.get("mlp_layer_types")
    if mlp_types is None:  # HYV4Config.__post_init__ default
        mlp_types = ["dense"] * min(1, n) + ["sparse"] * max(n - 1, 0)
    if layer_types is not None:
        folded = ["indexed_attention" if t in SPARSE_LAYER_TYPES else t for t in layer_types]
        for key, types, allowed in (("layer_types", folded, _ALLOWED_ATTN_LAYER_TYPES),
                                    ("mlp_layer_types", mlp_types, _ALLOWED_MLP_LAYER_TYPES)):
            bad = sorted({str(t) for t in types if t not in allowed})
            if bad:
                raise ConfigError(f"{key} entries {bad} are refused by transformers' HYV4Config")
            if len(types) != n:
                raise ConfigError(f"{key} has {len(types)} entries but num_hidden_layers is {n} "
                                  "(refused by transformers' HYV4Config)")
    num_mtp = max(int(hf.get("num_nextn_predict_layers", MTPConfig.num_nextn_predict_layers)), 1)
    return [(_extended_kind(layer_types, n + i, "full_attention") in SPARSE_LAYER_TYPES,
             _extended_kind(mlp_types, n + i, "sparse") != "dense") for i in range(num_mtp)]


def _extended_kind(types: list[str] | None, idx: int, fallback: str) -> str:
    """Entry ``idx`` of vLLM's ``_extend_layer_types(types, idx, fallback)``."""
    if types is None:
        return fallback
    if len(types) > idx:
        return types[idx]
    return types[-1] if types else fallback


def _lm_head_fp32(hf: dict) -> bool:
    """vLLM's head dtype: ``head_dtype`` if set, else float32 when ``enable_lm_head_fp32`` (default)."""
    head = hf.get("head_dtype")
    if head is None:
        return bool(hf.get("enable_lm_head_fp32", True))
    if str(head).lower() in ("float32", "float"):
        return True
    if str(head).lower() in ("model", "bfloat16"):
        return False
    raise ConfigError(f"head_dtype {head!r} is not modelled by the reference (float32, model, bfloat16)")


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN attention-magnitude correction: 0.1*mscale*ln(scale) + 1 (1 for scale <= 1)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0
