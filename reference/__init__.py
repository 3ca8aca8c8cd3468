"""Exact eager reference of vLLM's HY V4 MTP draft head (pure PyTorch, no vLLM).

API:
    cfg = MTPConfig.from_hf_dict(json.load(open("config.json")))
    weights = random_weights(cfg, seed)          # or harness.checkpoint loaders
    first = make_case(cfg, seed, requests=2, tokens=8)
    result = draft(cfg, weights, first, steps=3)  # result.traces[k]["attn.core"], ...
    flat = flatten(result)                        # {"step0.attn.core": ...}
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# torch-free; re-exported (the `X as X` form: __all__ below is computed, so a linter cannot read it)
from .config import ConfigError as ConfigError, MTPConfig as MTPConfig, RopeConfig as RopeConfig

# the rest imports torch: loaded on first use (PEP 562), so reading a config or a preset
# (``harness warmup`` / ``compare`` checking their arguments) never imports torch
_LAZY = {
    "DraftCache": "cache", "UnwrittenKVError": "cache",
    "make_case": "case", "request_lengths": "case",
    "DraftResult": "mtp", "StepInput": "mtp", "compact_topk": "mtp", "draft": "mtp", "forward_step": "mtp",
    "layer_weights": "mtp",
    "EXACT": "numerics", "PRODUCTION": "numerics", "Numerics": "numerics", "numerics_by_name": "numerics",
    "shard_all": "tp", "shard_layer": "tp",
    "check_weights": "weights", "random_weights": "weights", "shapes": "weights",
}


if TYPE_CHECKING:
    from .mtp import DraftResult


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


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


__all__ = sorted(["ConfigError", "MTPConfig", "RopeConfig", "flatten", *_LAZY])
