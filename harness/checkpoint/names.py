"""Checkpoint tensor names of HY V4's MTP head <-> the reference's canonical names.

Real HY V4 checkpoints name MTP layer i either ``model.mtp_layers.<i>.*``
or ``model.layers.<num_hidden_layers + i>.*`` (vLLM's ``HYV4MTP.load_weights``
accepts both). The embedding and LM head are shared with the target:
``model.embed_tokens.weight`` and ``lm_head.weight``. Routed experts come
split (``mlp.experts.<e>.{gate,up,down}_proj.weight``) or fused
(``mlp.experts.gate_up_proj`` [E, 2I, H] with gate rows first, and
``mlp.experts.down_proj`` [E, H, I]).
"""

from __future__ import annotations

import torch

from reference.config import MTPConfig

from .options import EXPERT_LAYOUTS, NAMINGS

# the tensors the MTP head shares with the target: checkpoint name -> canonical name
SHARED = {"model.embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head"}

# canonical leaf -> checkpoint leaf (both relative to their layer prefix)
_LEAF = {
    "enorm": "enorm.weight",
    "hnorm": "hnorm.weight",
    "eh_proj": "eh_proj.weight",
    "final_layernorm": "final_layernorm.weight",
    "input_layernorm": "input_layernorm.weight",
    "post_attention_layernorm": "post_attention_layernorm.weight",
    "attn.q_a_proj": "self_attn.q_a_proj.weight",
    "attn.q_a_layernorm": "self_attn.q_a_layernorm.weight",
    "attn.q_b_proj": "self_attn.q_b_proj.weight",
    "attn.kv_a_proj_with_mqa": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_a_layernorm": "self_attn.kv_a_layernorm.weight",
    "attn.kv_b_proj": "self_attn.kv_b_proj.weight",
    "attn.o_proj": "self_attn.o_proj.weight",
    "attn.linear_gate": "self_attn.linear_gate.weight",
    "attn.sink": "self_attn.learnable_sink_param",
    "indexer.wq_b": "self_attn.indexer.wq_b.weight",
    "indexer.wk": "self_attn.indexer.wk.weight",
    "indexer.weights_proj": "self_attn.indexer.weights_proj.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "mlp.gate": "mlp.gate.weight",
    "mlp.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.gate_proj": "mlp.shared_experts.gate_proj.weight",
    "mlp.shared_experts.up_proj": "mlp.shared_experts.up_proj.weight",
    "mlp.shared_experts.down_proj": "mlp.shared_experts.down_proj.weight",
    "mlp.gate_proj": "mlp.gate_proj.weight",
    "mlp.up_proj": "mlp.up_proj.weight",
    "mlp.down_proj": "mlp.down_proj.weight",
}
_EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")


def layer_prefix(cfg: MTPConfig, layer: int, naming: str) -> str:
    if naming == "mtp_layers":
        return f"model.mtp_layers.{layer}."
    if naming == "layers":
        return f"model.layers.{cfg.num_hidden_layers + layer}."
    raise ValueError(f"naming must be one of {NAMINGS}, got {naming!r}")


def to_checkpoint(cfg: MTPConfig, weights: dict[str, torch.Tensor], naming: str = "mtp_layers",
                  experts: str = "split") -> dict[str, torch.Tensor]:
    """Canonical weights -> unquantized checkpoint tensors (float64 values; cast at write)."""
    if experts not in EXPERT_LAYOUTS:
        raise ValueError(f"experts must be one of {EXPERT_LAYOUTS}, got {experts!r}")
    out = {"model.embed_tokens.weight": weights["embed_tokens"], "lm_head.weight": weights["lm_head"]}
    for name, value in weights.items():
        if not name.startswith("layers."):
            continue
        _, idx, leaf = name.split(".", 2)
        prefix = layer_prefix(cfg, int(idx), naming)
        if leaf.startswith("mlp.experts."):
            proj = leaf.rsplit(".", 1)[1]
            if experts == "split":
                for e in range(value.shape[0]):
                    out[f"{prefix}mlp.experts.{e}.{proj}.weight"] = value[e]
            elif proj == "down_proj":
                out[f"{prefix}mlp.experts.down_proj"] = value
            elif proj == "gate_proj":
                up = weights[name.replace("gate_proj", "up_proj")]
                out[f"{prefix}mlp.experts.gate_up_proj"] = torch.cat([value, up], dim=-2)
            continue
        out[prefix + _LEAF[leaf]] = value
    return out


def canonical_leaf(ckpt_leaf: str) -> str | None:
    """Inverse of the per-layer leaf map (non-expert tensors); None when unknown."""
    for k, v in _LEAF.items():
        if v == ckpt_leaf:
            return k
    return None


def parse_layer_name(name: str, num_hidden_layers: int) -> tuple[int, str, str] | None:
    """``model.mtp_layers.<i>.<leaf>`` / ``model.layers.<N+i>.<leaf>`` -> (i, naming, leaf).

    None for every other name (backbone layers ``model.layers.<k>`` with
    k < num_hidden_layers, ``model.norm``, the embedding, the LM head, ...).
    """
    for naming, head in (("mtp_layers", "model.mtp_layers."), ("layers", "model.layers.")):
        if not name.startswith(head):
            continue
        idx, sep, leaf = name[len(head):].partition(".")
        if not sep or not idx.isdigit() or not leaf:
            return None
        k = int(idx)
        if naming == "layers":
            if k < num_hidden_layers:
                return None
            k -= num_hidden_layers
        return k, naming, leaf
    return None


def checkpoint_leaf(canonical_leaf_name: str) -> str:
    """Canonical per-layer leaf -> checkpoint leaf (non-expert tensors)."""
    return _LEAF[canonical_leaf_name]


def known_leaves() -> tuple[str, ...]:
    """Every non-expert checkpoint leaf the MTP layer may hold."""
    return tuple(_LEAF.values())
