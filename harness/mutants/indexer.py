"""Planted bugs of the sparse-attention indexer: its RoPE, k norm, head weights and top-k (components
indexer.q_deq, indexer.k, indexer.head_weights, indexer.topk: each ``Planted`` below is listed under
its component's registry record, ``harness.components``, which the catalogue is derived from)."""

from __future__ import annotations

import torch

from .base import K1, LONG, Ctx, MutantNotApplicable, Planted, _neox_copy, _param, need
from .cpu import cpu_rope_neox


def _indexer(ctx: Ctx):
    return need(ctx.attn, "indexer", "self_attn")


def m_indexer_rope_neox(ctx: Ctx) -> None:
    ctx.setattr(ctx.attn, "indexer_rope_emb", _neox_copy(ctx, need(ctx.attn, "indexer_rope_emb", "self_attn")))


def m_indexer_knorm_eps(ctx: Ctx) -> None:
    kn = need(_indexer(ctx), "k_norm", "indexer")
    need(kn, "eps", "indexer.k_norm")
    ctx.setattr(kn, "eps", 1.0)


def m_indexer_knorm_bf16(ctx: Ctx) -> None:
    """k_norm built without ``dtype=torch.float32`` (an earlier upstream state): its weight and
    bias held in bf16 (the checkpoint's float32 values rounded) and its reduction in bf16."""
    import copy

    ix = _indexer(ctx)
    kn = need(ix, "k_norm", "indexer")
    w = need(kn, "weight", "indexer.k_norm")
    if w is None or w.dtype != torch.float32:
        raise MutantNotApplicable(f"indexer.k_norm weight is {getattr(w, 'dtype', None)}, not float32")
    ctx.setattr(ix, "k_norm", copy.deepcopy(kn).to(torch.bfloat16))


@torch.no_grad()
def m_indexer_weights_unscaled(ctx: Ctx) -> None:
    ix = _indexer(ctx)
    w = _param(need(ix, "wk_weights_proj", "indexer"))
    hd, nh = int(ix.head_dim), int(ix.n_head)
    if w.shape[0] != hd + nh:
        raise MutantNotApplicable(f"wk_weights_proj.weight has {w.shape[0]} rows, not {hd}+{nh}")
    w[hd:] *= nh ** 0.5  # cancels the n_heads^-0.5 folded into the weights


def m_indexer_topk_minus1(ctx: Ctx) -> None:
    op = need(_indexer(ctx), "indexer_op", "indexer")
    k = int(need(op, "topk_tokens", "indexer_op"))
    ctx.setattr(op, "topk_tokens", k - 1)


PLANTED: tuple[Planted, ...] = (
    # indexer.q_deq
    Planted("indexer-rope-neox", "indexer rotary built NeoX-style on interleaved q_pe/k_pe", K1,
            m_indexer_rope_neox, "indexer", cpu_rope_neox, "rope"),
    # indexer.k
    Planted("indexer-knorm-eps", "indexer k_norm eps read from the wrong field (1.0 instead of 1e-6)", K1,
            m_indexer_knorm_eps, "indexer"),
    Planted("indexer-knorm-bf16", "indexer k_norm built without dtype=torch.float32 (bf16 weight, bias and "
            "reduction): below the reference tolerance, seen by a golden / baseline", K1, m_indexer_knorm_bf16,
            "indexer"),
    # indexer.head_weights
    Planted("indexer-weights-unscaled", "indexer head weights miss the n_heads^-0.5 factor", K1,
            m_indexer_weights_unscaled, "indexer"),
    # indexer.topk
    Planted("indexer-topk-minus1", "indexer keeps index_topk - 1 tokens (off by one)", LONG,
            m_indexer_topk_minus1, "indexer"),
)
