"""MLA attention of the MTP block, with sparse top-k keys, sink and output gate.

For query token t of request r at position p, head h:
  q_c   = RMSNorm(W_qa x)                        [Lq]
  q_h   = (W_qb q_c)_h = [q_nope_h (dn) ; q_pe_h (dr)],  q_pe_h roped at p
  kv    = W_kva x = [kv_c (Lkv) ; k_pe (dr)],  kv_c <- RMSNorm(kv_c), k_pe roped
  W_kvb = per head [W_UK_h (dn x Lkv) ; W_UV_h (dv x Lkv)]
  logit_h(j) = scale * (q_nope_h^T W_UK_h kv_c_j + q_pe_h . k_pe_j)   (absorbed MLA)
  j ranges over the selected positions (sparse: indexer top-k, -1 ignored;
  dense: 0..p), read from the draft cache (written before attention).
  p_h(j) = exp(logit_h(j)) / (sum_i exp(logit_h(i)) + exp(sink_h))
          (the sink adds mass to the denominator only; sink=-inf is no sink)
  core_h = W_UV_h sum_j p_h(j) kv_c_j                [dv]
  gate   = sigmoid(W_gate x): per element of core (elementwise) or per head (headwise)
  out    = W_o (core * gate)                        [H]
"""

from __future__ import annotations

import torch

from . import probes, rope
from .config import MTPConfig
from .norms import rms_norm
from .numerics import Numerics


def latents(cfg: MTPConfig, lw: dict, x: torch.Tensor, positions: torch.Tensor,
            num: Numerics) -> dict[str, torch.Tensor]:
    """The TP-replicated part: q_c [T, Lq], kv_c [T, Lkv] (normed), k_pe [T, dr] (roped)."""
    lq, lkv, dr = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    # q_a and kv_a run as one fused GEMM in vLLM; separate here (same math).
    q_c = rms_norm(num.linear(x, lw["attn.q_a_proj"]), lw["attn.q_a_layernorm"], cfg.rms_norm_eps, num)
    kv = num.linear(x, lw["attn.kv_a_proj_with_mqa"])
    kv_c = rms_norm(kv[:, :lkv], lw["attn.kv_a_layernorm"], cfg.rms_norm_eps, num)
    cos, sin = rope.cos_sin(cfg.rope, dr, positions, num)
    k_pe = num.store(rope.apply_interleaved(num.up(kv[:, None, lkv:]), cos, sin)[:, 0])
    assert q_c.shape[-1] == lq
    return {"q_c": q_c, "kv_c": kv_c, "k_pe": k_pe}


def queries(cfg: MTPConfig, lw: dict, q_c: torch.Tensor, positions: torch.Tensor,
            num: Numerics) -> torch.Tensor:
    """q [T, nh_local, dn + dr] with the rope slice rotated (local heads of ``lw``)."""
    dn, dr = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    q = num.linear(q_c, lw["attn.q_b_proj"])
    q = q.reshape(q.shape[0], -1, dn + dr)
    cos, sin = rope.cos_sin(cfg.rope, dr, positions, num)
    q_pe = num.store(rope.apply_interleaved(num.up(q[..., dn:]), cos, sin))
    return torch.cat([q[..., :dn], q_pe], dim=-1)


def attend(cfg: MTPConfig, lw: dict, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
           sink: torch.Tensor | None, num: Numerics, valid: torch.Tensor | None = None) -> torch.Tensor:
    """core [..., nh_local * dv] for each query over its S keys.

    q: [..., nh, dn + dr]; kv_c: [..., S, Lkv]; k_pe: [..., S, dr]; sink: [nh] or
    None; the leading dims (one query: none; a batch: [T]) match. ``valid``
    [..., S]: the keys each query attends (default all); the others get
    logit -inf, so p_h(j) = 0 there.
    """
    dn, dv, lkv = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    nh = q.shape[-2]
    w = lw["attn.kv_b_proj"].reshape(nh, dn + dv, lkv)
    w_uk, w_uv = w[:, :dn, :], w[:, dn:, :]
    # Absorb W_UK into the query (a bf16 bmm in production).
    q_lat = num.store(torch.einsum("...hd,hdl->...hl", num.up(q[..., :dn]), num.up(w_uk)))
    kv_c = num.up(kv_c)  # [..., S, Lkv] in the accumulation dtype, once (the largest operand here)
    logits = (num.up(q_lat) @ kv_c.transpose(-1, -2)
              + num.up(q[..., dn:]) @ num.up(k_pe).transpose(-1, -2))
    logits = logits.to(num.fp32) * cfg.softmax_scale  # [..., nh, S]
    if valid is not None:
        logits = logits.masked_fill(~valid[..., None, :], float("-inf"))
    if sink is not None:
        sink_col = sink.to(logits.dtype)[:, None].expand(*logits.shape[:-1], 1)
        p_full = torch.softmax(torch.cat([logits, sink_col], dim=-1), dim=-1)
        probes.note("attn.sink_share", p_full[..., -1])
        p = p_full[..., :-1]
    else:
        p = torch.softmax(logits, dim=-1)
    if valid is not None:
        p = p.masked_fill(~valid[..., None, :], 0.0)  # a query with no key at all: p = 0, not NaN
    o_lat = num.store(p @ kv_c.to(p.dtype))  # [..., nh, Lkv]
    core = torch.einsum("...hl,hvl->...hv", num.up(o_lat), num.up(w_uv))
    return num.store(core).reshape(*q.shape[:-2], nh * dv)


def gate(cfg: MTPConfig, lw: dict, x: torch.Tensor, num: Numerics) -> torch.Tensor:
    """sigmoid(W_gate x): [T, nh_local * g] (g = dv elementwise, 1 headwise)."""
    return num.store(torch.sigmoid(num.up(num.linear(x, lw["attn.linear_gate"]))))


def apply_gate(cfg: MTPConfig, core: torch.Tensor, g: torch.Tensor, num: Numerics) -> torch.Tensor:
    """core * gate, broadcasting a headwise gate over each head's dv entries."""
    if cfg.gating_type == "headwise":
        t = core.shape[0]
        out = num.up(core).reshape(t, -1, cfg.v_head_dim) * num.up(g)[..., None]
        return num.store(out.reshape(t, -1))
    return num.store(num.up(core) * num.up(g))
