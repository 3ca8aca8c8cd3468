"""The ``quantization_config`` a synthetic checkpoint is written with, per quantization method
(Fp8Config's ``modules_to_not_convert``, ModelOpt's ``exclude_modules``, compressed-tensors'
``config_groups`` and ``ignore``): the writer's side of what ``quant`` reads back as an ``Fp8Plan``.
"""

from __future__ import annotations

import re

from reference.config import MTPConfig
from reference.weights import layer_shapes

from .options import CT_QUANTS, QUANTS
from .quant import CT_FORMAT, CT_METHOD, DEFAULT_BLOCK, KEPT_BF16, MODELOPT_ALGO

def ct_ignore(cfg: MTPConfig, naming: str, style: str = "regex") -> list[str]:
    """A synthetic compressed-tensors checkpoint's ``ignore`` list.

    ``lm_head`` by name, then the MTP modules kept bf16: "regex" writes ``re:`` patterns that match
    any layer prefix (llm-compressor's ``re:.*...$`` form: the attention gate, and as documentation the
    modules vLLM never quantizes); the routed experts stay FP8. "checkpoint-names" writes each MTP
    layer's modules by their exact checkpoint names and its routed experts as a checkpoint-named
    ``re:`` pattern (kept bf16): what vLLM's MTP remap does not translate (``CT_GAP``).
    """
    from .names import layer_prefix

    layer = layer_shapes(cfg)
    out = ["lm_head"]
    if style == "regex":
        if "attn.linear_gate" in layer:
            out.append(r"re:.*self_attn\.linear_gate$")
        out.append(r"re:.*\.eh_proj$")
        if "mlp.gate" in layer:
            out.append(r"re:.*mlp\.gate$")
        if "indexer.wk" in layer:
            out.append(r"re:.*self_attn\.indexer\.(wk|weights_proj)$")
        return out
    if style != "checkpoint-names":
        raise ValueError(f"ignore style must be 'regex' or 'checkpoint-names', got {style!r}")
    for i in range(cfg.num_mtp_layers):
        p = layer_prefix(cfg, i, naming)
        if "attn.linear_gate" in layer:
            out.append(p + "self_attn.linear_gate")
        if "mlp.experts.gate_proj" in layer:
            out.append("re:" + re.escape(p + "mlp.experts.") + ".*")
        out.append(p + "eh_proj")
        if "mlp.gate" in layer:
            out.append(p + "mlp.gate")
        if "indexer.wk" in layer:
            out += [p + "self_attn.indexer.wk", p + "self_attn.indexer.weights_proj"]
    return out


def ct_quantization_config(cfg: MTPConfig, naming: str, quant: str, ignore_style: str = "regex") -> dict:
    """The compressed-tensors ``quantization_config`` of a synthetic checkpoint, in the form
    compressed-tensors writes it (llm-compressor's FP8 dynamic schemes)."""
    strategy = CT_QUANTS[quant]
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
               "group_size": None, "block_structure": list(DEFAULT_BLOCK) if strategy == "block" else None,
               "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
            "strategy": "token" if strategy == "channel" else "group",
            "group_size": None if strategy == "channel" else DEFAULT_BLOCK[1], "block_structure": None,
            "actorder": None, "observer": None, "observer_kwargs": {}}
    return {"quant_method": CT_METHOD, "format": CT_FORMAT, "quantization_status": "compressed",
            "global_compression_ratio": None, "kv_cache_scheme": None, "sparsity_config": {},
            "transform_config": {}, "version": "0.12.2",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None, "format": CT_FORMAT}},
            "ignore": ct_ignore(cfg, naming, ignore_style)}


def modules_to_not_convert(cfg: MTPConfig, naming: str, indexer_wk_bf16: bool) -> list[str]:
    """Checkpoint-named MTP modules a synthetic FP8 checkpoint keeps in bf16."""
    from .names import layer_prefix

    out = []
    layer = layer_shapes(cfg)
    for i in range(cfg.num_mtp_layers):
        p = layer_prefix(cfg, i, naming)
        for m in KEPT_BF16:
            if m == "self_attn.linear_gate" and "attn.linear_gate" not in layer:
                continue
            if m == "mlp.gate" and "mlp.gate" not in layer:
                continue
            if m.startswith("self_attn.indexer.") and "indexer.wk" not in layer:
                continue
            out.append(p + m)
        if indexer_wk_bf16 and "indexer.wk" in layer:
            out.append(p + "self_attn.indexer.wk")
    return out


def exclude_modules(cfg: MTPConfig, naming: str, bf16_layers=()) -> list[str]:
    """A synthetic ModelOpt checkpoint's ``exclude_modules``, checkpoint-named.

    ``lm_head``; per MTP layer the attention gate by its exact name, the routed experts as a
    sub-tree wildcard (ModelOpt's own ``module_path*`` form), the modules vLLM never quantizes
    (documentation, as in ``modules_to_not_convert``), and for each layer in ``bf16_layers`` the
    whole layer as ``<layer prefix>.*``.
    """
    from .names import layer_prefix

    bad = [i for i in bf16_layers if not 0 <= i < cfg.num_mtp_layers]
    if bad:
        raise ValueError(f"bf16 MTP layer(s) {bad} out of range: the config has {cfg.num_mtp_layers} MTP layer(s)")
    out = ["lm_head"]
    layer = layer_shapes(cfg)
    for i in range(cfg.num_mtp_layers):
        p = layer_prefix(cfg, i, naming)
        if i in bf16_layers:
            out.append(p + "*")
            continue
        if "attn.linear_gate" in layer:
            out.append(p + "self_attn.linear_gate")
        if "mlp.experts.gate_proj" in layer:
            out.append(p + "mlp.experts*")
        out += [p + m for m in KEPT_BF16[1:] if m != "mlp.gate" or "mlp.gate" in layer
                if not m.startswith("self_attn.indexer.") or "indexer.wk" in layer]
        if "indexer.wk" in layer:
            out.append(p + "self_attn.indexer.wk")
    return out


def quantization_config(cfg: MTPConfig, naming: str, quant: str, indexer_wk_fp8: bool,
                        bf16_layers=(), ct_ignore_style: str = "regex") -> dict | None:
    """``config.json``'s quantization_config for a synthetic checkpoint (None for bf16).

    ``bf16_layers`` (modelopt-fp8-pb only): MTP layers excluded whole by a wildcard.
    """
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    if bf16_layers and quant != "modelopt-fp8-pb":
        raise ValueError("whole bf16 MTP layers need --quant modelopt-fp8-pb (exclude_modules wildcards)")
    if quant == "bf16":
        return None
    if quant in CT_QUANTS:
        return ct_quantization_config(cfg, naming, quant, ct_ignore_style)
    if quant == "modelopt-fp8-pb":
        # the flat config.json form ModelOptFp8Config.from_config reads; no input scales (dynamic
        # per-128-group activations), the KV cache unquantized
        return {"quant_method": "modelopt", "quant_algo": MODELOPT_ALGO, "kv_cache_quant_algo": None,
                "exclude_modules": exclude_modules(cfg, naming, tuple(bf16_layers))}
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic",
          "weight_block_size": list(DEFAULT_BLOCK),
          "modules_to_not_convert": modules_to_not_convert(cfg, naming, not indexer_wk_fp8)}
    if quant == "fp8-ue8m0":
        qc["scale_fmt"] = "ue8m0"
    return qc
