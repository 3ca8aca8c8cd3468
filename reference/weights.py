"""Canonical weights of the MTP head: names, shapes, and a seeded generator.

Canonical names are unfused and relative: ``embed_tokens``, ``lm_head`` and
``layers.<i>.<component>`` for MTP layer i (0-based, i.e. checkpoint
``model.mtp_layers.<i>`` / ``model.layers.<num_hidden_layers+i>``). Routed
experts are stacked: ``mlp.experts.gate_proj`` is [E, I, H]. The sink is
``attn.sink`` [num_heads]. The checkpoint code in ``harness`` maps every
checkpoint layout onto these names.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import math
import os

import torch

from .config import MTPConfig

Weights = dict[str, torch.Tensor]


def layer_shapes(cfg: MTPConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one MTP layer's canonical weights (without the prefix)."""
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    lq, lkv = cfg.q_lora_rank, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    s: dict[str, tuple[int, ...]] = {
        "enorm": (h,), "hnorm": (h,), "eh_proj": (h, 2 * h), "final_layernorm": (h,),
        "input_layernorm": (h,), "post_attention_layernorm": (h,),
        "attn.q_a_proj": (lq, h), "attn.q_a_layernorm": (lq,),
        "attn.q_b_proj": (nh * (dn + dr), lq),
        "attn.kv_a_proj_with_mqa": (lkv + dr, h), "attn.kv_a_layernorm": (lkv,),
        "attn.kv_b_proj": (nh * (dn + dv), lkv),
        "attn.o_proj": (h, nh * dv),
    }
    if cfg.gated_mla:
        s["attn.linear_gate"] = (nh * cfg.gate_size_per_head, h)
    if cfg.learnable_sink:
        s["attn.sink"] = (nh,)
    if cfg.attention_sparse:
        ih, idim = cfg.index_n_heads, cfg.index_head_dim
        s.update({
            "indexer.wq_b": (ih * idim, lq), "indexer.wk": (idim, h),
            "indexer.weights_proj": (ih, h),
            "indexer.k_norm.weight": (idim,), "indexer.k_norm.bias": (idim,),
        })
    if cfg.mlp_moe:
        e, i = cfg.n_routed_experts, cfg.moe_intermediate_size
        s.update({
            "mlp.gate": (e, h), "mlp.expert_bias": (e,),
            "mlp.experts.gate_proj": (e, i, h), "mlp.experts.up_proj": (e, i, h),
            "mlp.experts.down_proj": (e, h, i),
        })
        if cfg.n_shared_experts > 0:
            i_s = i * cfg.n_shared_experts
            s.update({
                "mlp.shared_experts.gate_proj": (i_s, h), "mlp.shared_experts.up_proj": (i_s, h),
                "mlp.shared_experts.down_proj": (h, i_s),
            })
    else:
        i = cfg.intermediate_size
        s.update({"mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)})
    return s


def shapes(cfg: MTPConfig) -> dict[str, tuple[int, ...]]:
    """All canonical names -> shapes for ``cfg``."""
    out: dict[str, tuple[int, ...]] = {
        "embed_tokens": (cfg.vocab_size, cfg.hidden_size),
        "lm_head": (cfg.vocab_size, cfg.hidden_size),
    }
    for i in range(cfg.num_mtp_layers):
        for k, v in layer_shapes(cfg).items():
            out[f"layers.{i}.{k}"] = v
    return out


# Parameters that vLLM keeps in float32 whatever the checkpoint dtype.
FP32_PARAMS = ("mlp.gate", "mlp.expert_bias", "attn.sink", "indexer.k_norm.weight",
               "indexer.k_norm.bias")


def is_fp32_param(name: str) -> bool:
    return name.split(".", 2)[-1] in FP32_PARAMS


DRAWS = ("stream", "per-tensor")


# A CPU float64 ``randn`` is serial (one thread whatever torch's intra-op count), so the
# per-tensor draw's thread pool is its only parallelism, and it is the case's critical path. At
# real dims three expert stacks of ~554 M values make most of the 1.8 G (37-68 CPU-s on one
# thread, by host): a pool of 4 takes the draw to about its biggest tensor's time. So the pool is
# at least this many threads where the process may use the cores, also where its torch share is 1.
PER_TENSOR_DRAW_THREADS = 4


def random_weights(cfg: MTPConfig, seed: int, *, draw: str = "stream", threads: int | None = None) -> Weights:
    """Seeded synthetic weights, float64 holding bf16-representable values.

    Matrices ~ N(0, 1/in_features) so activations stay O(1); norm weights
    ~ 1 + 0.1 N; the sink ~ N(0, 1); expert bias ~ 0.05 N. Parameters vLLM keeps
    in fp32 (router, bias, sink, k_norm) stay fp32-representable instead.

    ``draw="stream"`` (every golden's): draws happen in sorted-name order from one
    generator, so adding a tensor does not reshuffle the others only if its name
    sorts last: regenerate goldens when ``layer_shapes`` changes. ``draw="per-tensor"``:
    each tensor from its own generator, seeded by (seed, name), drawn on ``threads``
    threads (default: ``torch.get_num_threads()``, at least ``PER_TENSOR_DRAW_THREADS`` where
    the host has them; the values do not depend on it): the same distributions, other values,
    no reshuffling, and several times faster at real dims (1.8 G parameters), where the one
    serial stream is what a case waits for. float64 draws either way: CPU float32 draws take
    an AVX2-specific path, so their values would depend on the host.
    """
    if draw not in DRAWS:
        raise ValueError(f"draw={draw!r}: expected one of {', '.join(DRAWS)}")
    items = sorted(shapes(cfg).items())
    if draw == "stream":
        gen = torch.Generator().manual_seed(seed)
        return {name: _scaled(name, torch.randn(shape, generator=gen, dtype=torch.float64)) for name, shape in items}

    def one(item):
        name, shape = item
        gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
        return name, _scaled(name, torch.randn(shape, generator=gen, dtype=torch.float64))

    # biggest first, so the long draws start at once; the dict keeps sorted-name order
    order = sorted(items, key=lambda it: -math.prod(it[1]))
    if threads is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(torch.get_num_threads(), min(PER_TENSOR_DRAW_THREADS, cores))
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        drawn = dict(pool.map(one, order))
    return {name: drawn[name] for name, _ in items}


def _tensor_seed(seed: int, name: str) -> int:
    """A per-tensor seed: stable across processes and hosts (not Python's salted ``hash``)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # < 2**63: manual_seed takes it on every platform


def _scaled(name: str, x: torch.Tensor) -> torch.Tensor:
    """A fresh float64 standard normal draw ``x``, scaled for tensor ``name`` and rounded to its
    storage precision, in place (a real-dims expert stack is 4 GiB: no float64 temporaries)."""
    leaf = name.split(".", 2)[-1] if name.startswith("layers.") else name
    if leaf.endswith(("norm", "layernorm", "k_norm.weight")):
        x.mul_(0.1).add_(1.0)
    elif leaf == "indexer.k_norm.bias":
        x.mul_(0.1)
    elif leaf == "mlp.expert_bias":
        x.mul_(0.05)
    elif leaf not in ("attn.sink", "embed_tokens"):  # matrices: N(0, 1 / in_features)
        x.div_(math.sqrt(x.shape[-1]))
    rounding = torch.float32 if is_fp32_param(name) else torch.bfloat16
    return x.copy_(x.to(rounding))


def check_weights(cfg: MTPConfig, weights: Weights) -> None:
    """Raise ValueError naming the first missing, extra or misshapen tensor."""
    want = shapes(cfg)
    missing = sorted(set(want) - set(weights))
    extra = sorted(set(weights) - set(want))
    if missing:
        raise ValueError(f"missing canonical weights: {', '.join(missing[:5])}")
    if extra:
        raise ValueError(f"unexpected canonical weights: {', '.join(extra[:5])}")
    for k, shp in want.items():
        if tuple(weights[k].shape) != shp:
            raise ValueError(f"{k}: shape {tuple(weights[k].shape)}, expected {shp}")
