"""HY V4's MLP: sigmoid-routed MoE with clamped SwiGLU, or a dense SwiGLU.

Router (float32 in production): l = W_router x, s = sigmoid(l).
Choice uses s + b (e_score_correction_bias); weights use s alone:
  ids = top_k(s + b)         (grouped top-k with one group == plain top-k)
  w_i = s_ids_i / sum_j s_ids_j   (when norm_topk_prob), then w_i *= routed_scaling_factor
Routed expert e (SwiGLU, clamped only here when swiglu_limit > 0, L = limit):
  E_e(x) = W_down_e (silu(min(W_gate_e x, L)) * clamp(W_up_e x, -L, L))
Shared experts: plain SwiGLU, never clamped.  out = sum_i w_i E_ids_i(x) + shared(x).
"""

from __future__ import annotations

import torch

from .config import MTPConfig
from . import probes
from .numerics import Numerics


def route(cfg: MTPConfig, lw: dict, x: torch.Tensor, num: Numerics) -> dict[str, torch.Tensor]:
    """router_logits [T, E], topk_ids [T, k], topk_weights [T, k] (fp32 / float64)."""
    logits = num.up(x).to(num.fp32) @ lw["mlp.gate"].to(num.fp32).T
    scores = torch.sigmoid(logits)
    choice = scores + lw["mlp.expert_bias"].to(num.fp32)
    ids = torch.topk(choice, cfg.num_experts_per_tok, dim=-1, sorted=True).indices
    w = torch.gather(scores, 1, ids)
    if cfg.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    w = w * cfg.routed_scaling_factor
    return {"router_logits": logits, "topk_ids": ids, "topk_weights": w}


def swiglu(g: torch.Tensor, u: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(g) * u, with g <- min(g, L) and u <- clamp(u, -L, L) when limit is set."""
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    return torch.nn.functional.silu(g) * u


def ffn(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
        limit: float | None, num: Numerics, probe: str | None = None,
        probe_rows: torch.Tensor | None = None) -> torch.Tensor:
    """W_down swiglu(W_gate x, W_up x): x [T, H] -> [T, H]; with stacked experts' weights
    ([E, I, H], [E, I, H], [E, H, I]) every expert on every token: [E, T, H]. ``probe``: name
    under which the pre-clamp (gate ; up) are noted while ``probes.recording`` is on (only the
    [E, T] entries where ``probe_rows`` is True, when given)."""
    g = num.linear(x, w_gate)
    u = num.linear(x, w_up)
    if probe and probes.active():
        gu = torch.stack([num.up(g), num.up(u)])
        probes.note(probe, gu if probe_rows is None else gu[:, probe_rows])
    a = num.store(swiglu(num.up(g), num.up(u), limit))
    return num.linear(a, w_down)


def clamp_limit(cfg: MTPConfig) -> float | None:
    return float(cfg.swiglu_limit) if cfg.swiglu_limit and cfg.swiglu_limit > 0 else None


def routed(cfg: MTPConfig, lw: dict, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
           num: Numerics, experts: range | None = None) -> torch.Tensor:
    """sum_i w_i E_ids_i(x) over the local ``experts`` (all by default): [T, H].

    ``lw`` may hold an intermediate-size shard of every expert (TP) or only
    the experts in ``experts`` at their global ids (EP). Every local expert
    runs on every token (one batched GEMM per projection, no loop over
    experts); each token then adds up its own experts' weighted outputs from
    0, in ascending expert id (the order of an index_add per expert).
    """
    t, h = x.shape
    local = range(cfg.n_routed_experts) if experts is None else experts
    lo, hi = local.start, local.stop
    chosen = (ids[None] == torch.arange(lo, hi, device=x.device)[:, None, None]).any(-1)  # [E_local, T]
    y = ffn(x, lw["mlp.experts.gate_proj"][lo:hi], lw["mlp.experts.up_proj"][lo:hi],
            lw["mlp.experts.down_proj"][lo:hi], clamp_limit(cfg), num,
            probe="moe.routed.gate_up", probe_rows=chosen)  # [E_local, T, H]
    e_sorted, order = torch.sort(ids, dim=-1)  # each token's experts, ascending id
    w_sorted = torch.gather(w, 1, order)
    rows = torch.arange(t, device=x.device)
    acc = torch.zeros(t, h, dtype=num.fp32, device=x.device)
    for i in range(ids.shape[1]):  # num_experts_per_tok slots
        e = e_sorted[:, i]
        here = ((e >= lo) & (e < hi))[:, None]
        y_i = y[(e - lo).clamp(0, hi - lo - 1), rows]  # [T, H]: token t's output of expert e_t
        acc = torch.where(here, acc + num.up(y_i).to(num.fp32) * w_sorted[:, i, None].to(num.fp32), acc)
    return num.store(acc)


def shared(cfg: MTPConfig, lw: dict, x: torch.Tensor, num: Numerics) -> torch.Tensor:
    return ffn(x, lw["mlp.shared_experts.gate_proj"], lw["mlp.shared_experts.up_proj"],
               lw["mlp.shared_experts.down_proj"], None, num)


def dense(cfg: MTPConfig, lw: dict, x: torch.Tensor, num: Numerics) -> torch.Tensor:
    return ffn(x, lw["mlp.gate_proj"], lw["mlp.up_proj"], lw["mlp.down_proj"], None, num)
