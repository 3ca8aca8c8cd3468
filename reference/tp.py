"""Simulated tensor parallelism: split a layer's weights as vLLM shards them.

Column-parallel (split output rows): ``attn.q_b_proj``, ``attn.kv_b_proj``,
``attn.linear_gate`` (by head), the MLP's gate/up projections (by
intermediate row). Row-parallel (split input columns, partial outputs summed
= the all-reduce): ``attn.o_proj``, the down projections. The sink is
narrowed to the rank's heads. Replicated: the latent projections, norms,
the indexer (vLLM marks it "no tensor parallelism"), the router and
``eh_proj``.

MoE: ``moe_mode="tp"`` slices every expert's intermediate dimension;
``"ep"`` partitions whole experts across ranks (rank r owns the contiguous
block E/t*r .. E/t*(r+1)); shared experts are sliced as in TP either way.
"""

from __future__ import annotations

import dataclasses

import torch

from .config import MTPConfig


@dataclasses.dataclass(frozen=True)
class Shard:
    rank: int
    size: int
    cfg: MTPConfig  # local head / intermediate counts
    weights: dict[str, torch.Tensor]
    experts: range | None  # EP: the experts this rank owns; None = all (TP slices)


def check_divisible(cfg: MTPConfig, t: int, moe_mode: str = "tp") -> None:
    def need(n: int, what: str) -> None:
        if n % t:
            raise ValueError(f"TP={t} does not divide {what}={n}")

    need(cfg.num_attention_heads, "num_attention_heads")
    if cfg.mlp_moe:
        need(cfg.moe_intermediate_size * max(cfg.n_shared_experts, 1), "shared intermediate size")
        if moe_mode == "tp":
            need(cfg.moe_intermediate_size, "moe_intermediate_size")
        else:
            need(cfg.n_routed_experts, "n_routed_experts")
    else:
        need(cfg.intermediate_size, "intermediate_size")


def _rows(w: torch.Tensor, rank: int, t: int, dim: int = 0) -> torch.Tensor:
    return w.chunk(t, dim=dim)[rank].contiguous()


def _heads(w: torch.Tensor, nh: int, rank: int, t: int) -> torch.Tensor:
    """Rows grouped per head: [nh * per, in] -> this rank's [nh/t * per, in]."""
    per = w.shape[0] // nh
    return _rows(w.reshape(nh, per, *w.shape[1:]), rank, t).reshape(-1, *w.shape[1:])


def shard_layer(cfg: MTPConfig, lw: dict[str, torch.Tensor], rank: int, t: int,
                moe_mode: str = "tp") -> Shard:
    """Rank ``rank`` of ``t``'s view of one layer's canonical weights ``lw``."""
    if moe_mode not in ("tp", "ep"):
        raise ValueError(f"moe_mode must be 'tp' or 'ep', got {moe_mode!r}")
    check_divisible(cfg, t, moe_mode)
    nh = cfg.num_attention_heads
    out = dict(lw)
    for name in ("attn.q_b_proj", "attn.kv_b_proj", "attn.linear_gate"):
        if name in lw:
            out[name] = _heads(lw[name], nh, rank, t)
    out["attn.o_proj"] = _rows(lw["attn.o_proj"], rank, t, dim=1)
    if "attn.sink" in lw:
        out["attn.sink"] = _rows(lw["attn.sink"], rank, t)
    experts = None
    if cfg.mlp_moe:
        if moe_mode == "tp":
            for p in ("gate_proj", "up_proj"):
                out[f"mlp.experts.{p}"] = _rows(lw[f"mlp.experts.{p}"], rank, t, dim=1)
            out["mlp.experts.down_proj"] = _rows(lw["mlp.experts.down_proj"], rank, t, dim=2)
        else:
            per = cfg.n_routed_experts // t
            experts = range(rank * per, (rank + 1) * per)
        if cfg.n_shared_experts > 0:
            for p in ("gate_proj", "up_proj"):
                out[f"mlp.shared_experts.{p}"] = _rows(lw[f"mlp.shared_experts.{p}"], rank, t)
            out["mlp.shared_experts.down_proj"] = _rows(lw["mlp.shared_experts.down_proj"], rank, t, dim=1)
        local = cfg.replace(num_attention_heads=nh // t,
                            moe_intermediate_size=cfg.moe_intermediate_size // t
                            if moe_mode == "tp" else cfg.moe_intermediate_size)
    else:
        for p in ("gate_proj", "up_proj"):
            out[f"mlp.{p}"] = _rows(lw[f"mlp.{p}"], rank, t)
        out["mlp.down_proj"] = _rows(lw["mlp.down_proj"], rank, t, dim=1)
        local = cfg.replace(num_attention_heads=nh // t, intermediate_size=cfg.intermediate_size // t)
    return Shard(rank, t, local, out, experts)


def shard_all(cfg: MTPConfig, lw: dict[str, torch.Tensor], t: int, moe_mode: str = "tp") -> list[Shard]:
    return [shard_layer(cfg, lw, r, t, moe_mode) for r in range(t)]
