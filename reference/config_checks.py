"""Refuse a HY V4 ``config.json`` dict that vLLM 0.33 would refuse or misread, naming the key.

vLLM reads the config through ``HYV4Config`` (``transformers_utils/configs/hy_v4.py``),
a ``huggingface_hub`` *strict* dataclass: a declared ``int`` field refuses a
float (``256.0``), a string, ``null`` and a bool; a ``float`` field refuses an
int (``1`` for ``rms_norm_eps``); a ``bool`` field refuses ``"false"``. Those
become ``ConfigError`` here too, so the harness never judges a config vLLM
cannot build. Some values the strict types let through are nonsense that
vLLM would run silently (NaN or negative ``rms_norm_eps``, NaN
``routed_scaling_factor``, ``index_topk: 0``, an unknown ``torch_dtype`` that
the loader would read as bf16, ``quantization_config`` that is not an
object, ``index_share_for_mtp_iteration: "false"`` which vLLM's
``bool(getattr(...))`` reads as true): refused too, with the reason.

RoPE keys (``rope_parameters`` / ``rope_scaling``'s contents), the per-layer
kind lists and ``partial_rotary_factor`` are only type-checked here: how they
are read is ``reference.config`` / ``reference.rope``'s job.
"""

from __future__ import annotations

import math

from .config_error import ConfigError

# HYV4Config's declared scalar fields (strict types) that the harness or vLLM's
# MTP path reads, with the smallest value that makes sense for each.
INT_FIELDS: dict[str, int] = {
    "vocab_size": 1, "hidden_size": 1, "intermediate_size": 1, "moe_intermediate_size": 1,
    "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
    "max_position_embeddings": 1, "n_routed_experts": 1, "n_shared_experts": 0, "num_experts_per_tok": 1,
    "q_lora_rank": 1, "kv_lora_rank": 1, "qk_nope_head_dim": 1, "qk_rope_head_dim": 2, "v_head_dim": 1,
    "index_topk": 1, "index_head_dim": 1, "index_n_heads": 1, "hc_mult": 1, "num_nextn_predict_layers": 1,
    "head_dim": 1,
    "num_local_experts": 1,  # HYV4Config.attribute_map alias of n_routed_experts
}
INT_MAX = 2 ** 31 - 1  # every int field's upper bound: shapes and indices are int32 in vLLM's kernels
OPTIONAL_INT_FIELDS = ("pad_token_id", "bos_token_id")
BOOL_FIELDS = ("use_cache", "tie_word_embeddings", "attention_bias", "norm_topk_prob", "enable_lm_head_fp32",
               "enable_ihc", "gated_mla", "learnable_sink",
               # not a HYV4Config field: vLLM reads it with bool(getattr(config, ...)), so a
               # string "false" would switch index sharing on
               "index_share_for_mtp_iteration")
STR_FIELDS = ("hidden_act", "gating_type", "model_type")
STR_LIST_FIELDS = ("layer_types", "mlp_layer_types", "indexer_types")
# float fields: (lower bound, whether the bound itself is allowed); None = any finite value
FLOAT_FIELDS: dict[str, tuple[float, bool] | None] = {
    "rms_norm_eps": (0.0, False),  # added under a square root: must be > 0
    "routed_scaling_factor": (0.0, False),  # scales the routed experts' sum: 0 or less drops / flips them
    "swiglu_limit": None,  # <= 0 disables the clamp (HYV4Config's doc), so any finite value is meaningful
    "attention_dropout": (0.0, True),
    "initializer_range": (0.0, True),
    "hc_magnitude": None, "hc_eps": (0.0, True), "learnable_sink_init": None, "mtp_loss_factor": None,
}
MODEL_DTYPES = ("bfloat16", "float16", "float32")  # the model dtypes vLLM (and the loader) run HY V4 in


def _kind(v) -> str:
    return "null" if v is None else type(v).__name__


def _is_a(v) -> str:
    """``is null`` / ``is an int`` / ``is a str``: what the value is, for a message."""
    k = _kind(v)
    return "is null" if v is None else f"is {'an' if k[0] in 'aeiou' else 'a'} {k}"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_hf_config(hf) -> None:
    """Raise ``ConfigError`` naming the key when ``hf`` is not a config vLLM 0.33 reads as written."""
    if not isinstance(hf, dict):
        raise ConfigError(f"config.json must be a JSON object, got a JSON {_kind(hf)}")

    def bad(key: str, why: str) -> ConfigError:
        shown = repr(hf[key])
        return ConfigError(f"config key {key!r}: {shown if len(shown) <= 60 else shown[:57] + '...'} {why}")

    for key, low in INT_FIELDS.items():
        if key in hf:
            v = hf[key]
            if not _is_int(v):
                raise bad(key, f"{_is_a(v)}; vLLM's HYV4Config (strict) needs an int")
            if v < low:
                raise bad(key, f"must be >= {low}")
            if v > INT_MAX:
                raise ConfigError(f"config key {key!r}: {v if len(str(v)) <= 30 else str(v)[:20] + '...'} "
                                  f"must be <= {INT_MAX} (vLLM's kernels index with int32)")
    for key in OPTIONAL_INT_FIELDS:
        if key in hf and hf[key] is not None and not _is_int(hf[key]):
            raise bad(key, f"{_is_a(hf[key])}; vLLM's HYV4Config (strict) needs an int or null")
    if "eos_token_id" in hf:
        v = hf["eos_token_id"]
        if not (v is None or _is_int(v) or (isinstance(v, list) and all(_is_int(x) for x in v))):
            raise bad("eos_token_id", "must be an int, a list of ints or null (HYV4Config, strict)")
    for key in BOOL_FIELDS:
        if key in hf and not isinstance(hf[key], bool):
            raise bad(key, f"{_is_a(hf[key])}; must be true or false (a string like \"false\" "
                      "would be read as true, or refused by vLLM's strict HYV4Config)")
    for key in STR_FIELDS:
        if key in hf and not isinstance(hf[key], str):
            raise bad(key, f"{_is_a(hf[key])}; must be a string")
    for key in STR_LIST_FIELDS:
        if key in hf and hf[key] is not None and not (
                isinstance(hf[key], list) and all(isinstance(x, str) for x in hf[key])):
            raise bad(key, "must be a list of strings or null")
    for key, bound in FLOAT_FIELDS.items():
        if key not in hf:
            continue
        v = hf[key]
        if not isinstance(v, float):
            raise bad(key, f"{_is_a(v)}; vLLM's HYV4Config (strict) needs a float "
                      f"(write {v}.0)" if _is_int(v) and abs(v) < 10 ** 20 else
                      f"{_is_a(v)}; vLLM's HYV4Config (strict) needs a float")
        if not math.isfinite(v):
            raise bad(key, "must be finite")
        if bound is not None:
            low, inclusive = bound
            if v < low or (v == low and not inclusive):
                raise bad(key, f"must be {'>=' if inclusive else '>'} {low}")

    if "n_routed_experts" in hf and "num_local_experts" in hf and hf["n_routed_experts"] != hf["num_local_experts"]:
        raise ConfigError(f"config keys 'n_routed_experts' ({hf['n_routed_experts']}) and 'num_local_experts' "
                          f"({hf['num_local_experts']}) disagree; HYV4Config maps one onto the other")

    dtypes = {k: hf[k] for k in ("torch_dtype", "dtype") if hf.get(k) is not None}
    for key, v in dtypes.items():
        if not isinstance(v, str) or v not in MODEL_DTYPES:
            raise bad(key, f"is not a model dtype vLLM runs HY V4 in ({', '.join(MODEL_DTYPES)})")
    if len(set(dtypes.values())) > 1:
        raise ConfigError(f"config keys 'torch_dtype' ({dtypes['torch_dtype']!r}) and 'dtype' "
                          f"({dtypes['dtype']!r}) disagree")

    for key in ("quantization_config", "rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise bad(key, f"{_is_a(hf[key])}; must be a JSON object or null")
    if isinstance(hf.get("quantization_config"), dict):
        _check_quantization_config(hf["quantization_config"])
    if "mtp_quant_algo" in hf and hf["mtp_quant_algo"] is not None and not isinstance(hf["mtp_quant_algo"], str):
        raise bad("mtp_quant_algo", "must be a string or null")
    if "rope_theta" in hf:  # not a HYV4Config field (read from kwargs): a finite number > 1
        v = hf["rope_theta"]
        if not ((_is_int(v) and 1 < v < 2 ** 1000) or (isinstance(v, float) and math.isfinite(v) and v > 1)):
            raise bad("rope_theta", "must be a finite number > 1 (the base of RoPE's theta**(-2i/r) ladder; "
                      "YaRN divides by log(theta))")


# quantization_config's keys as vLLM's Fp8Config / ModelOptFp8Config read them: module lists are
# matched as strings (a number in one is an AttributeError deep in vLLM), the block size divides
# every quantized dim, the names are compared as strings
QUANT_STR_LIST_KEYS = ("modules_to_not_convert", "ignored_layers", "exclude_modules", "ignore")
QUANT_STR_KEYS = ("quant_method", "quant_algo", "scale_fmt", "activation_scheme", "kv_cache_quant_algo")


def _check_quantization_config(qc: dict) -> None:
    def shown(v) -> str:
        r = repr(v)
        return r if len(r) <= 60 else r[:57] + "..."

    for key in QUANT_STR_LIST_KEYS:
        v = qc.get(key)
        if v is None:
            continue
        if not isinstance(v, list):
            raise ConfigError(f"quantization_config.{key} {shown(v)}: must be a list of strings (module names)")
        bad = [x for x in v if not isinstance(x, str)]
        if bad:
            raise ConfigError(f"quantization_config.{key}: entry {shown(bad[0])} {_is_a(bad[0])}; every entry "
                              "must be a string (a module name or pattern)")
    for key in QUANT_STR_KEYS:
        if qc.get(key) is not None and not isinstance(qc[key], str):
            raise ConfigError(f"quantization_config.{key} {shown(qc[key])}: must be a string or null")
    block = qc.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2
                                  and all(_is_int(b) and 1 <= b <= INT_MAX for b in block)):
        raise ConfigError(f"quantization_config.weight_block_size {shown(block)}: must be two ints within "
                          f"1..{INT_MAX} (the FP8 block's rows and columns)")
