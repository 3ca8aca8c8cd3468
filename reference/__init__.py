"""Exact eager reference of vLLM's HY V4 MTP draft head (pure PyTorch, no vLLM).

API:
    cfg = MTPConfig.from_hf_dict(json.load(open("config.json")))
    weights = random_weights(cfg, seed)          # or harness.checkpoint loaders
    first = make_case(cfg, seed, requests=2, tokens=8)
    result = draft(cfg, weights, first, steps=3)  # result.traces[k]["attn.core"], ...
    flat = flatten(result)                        # {"step0.attn.core": ...}
"""

from .cache import DraftCache, UnwrittenKVError
from .case import make_case, request_lengths
from .config import ConfigError, MTPConfig, RopeConfig
from .mtp import DraftResult, StepInput, compact_topk, draft, forward_step, layer_weights
from .numerics import EXACT, PRODUCTION, Numerics, numerics_by_name
from .tp import shard_all, shard_layer
from .weights import check_weights, random_weights, shapes


def flatten(result: DraftResult) -> dict:
    """{"step{k}.{component}": tensor} plus each step's inputs."""
    out = {}
    for k, (tr, inp) in enumerate(zip(result.traces, result.inputs)):
        out[f"step{k}.input_ids"] = inp.input_ids
        out[f"step{k}.positions"] = inp.positions
        out[f"step{k}.hidden_in"] = inp.hidden
        for name, value in tr.items():
            out[f"step{k}.{name}"] = value.clone()
    return out


__all__ = [
    "ConfigError", "DraftCache", "DraftResult", "EXACT", "MTPConfig", "Numerics", "PRODUCTION",
    "RopeConfig", "StepInput", "UnwrittenKVError", "check_weights", "compact_topk", "draft",
    "flatten", "forward_step", "layer_weights", "make_case", "numerics_by_name", "random_weights",
    "request_lengths", "shapes", "shard_all", "shard_layer",
]
