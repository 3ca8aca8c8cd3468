"""Planted bugs of the MTP layer's input and output: the position-0 mask, enorm/hnorm, eh_proj, the LM
head (components embed_masked, enorm, eh_proj, logits: each ``Planted`` below is listed under its
component's registry record, ``harness.components``, which the catalogue is derived from)."""

from __future__ import annotations

import torch

from .base import K1, Ctx, Planted, _param


def m_pos0_mask_off(ctx: Ctx) -> None:
    store: dict = {}
    emb = ctx.model.model.embed_tokens
    ctx.hook(emb.register_forward_hook(lambda _m, _a, out: store.__setitem__("e", out)))

    def pre(_m, args):
        e = store.pop("e", None)
        if e is None or not args or e.shape != args[0].shape:
            return None
        return (e,) + tuple(args[1:])
    ctx.hook(ctx.layer.enorm.register_forward_pre_hook(pre))


@torch.no_grad()
def m_enorm_hnorm_swap(ctx: Ctx) -> None:
    a, b = _param(ctx.layer.enorm), _param(ctx.layer.hnorm)
    t = a.clone()
    a.copy_(b)
    b.copy_(t)


@torch.no_grad()
def m_eh_proj_halves(ctx: Ctx) -> None:
    w = _param(ctx.layer.eh_proj)
    h = w.shape[1] // 2
    w.copy_(torch.cat([w[:, h:], w[:, :h]], dim=1))


@torch.no_grad()
def m_lm_head_zero(ctx: Ctx) -> None:
    _param(ctx.layer.shared_head.head).zero_()


PLANTED: tuple[Planted, ...] = (
    # embed_masked
    Planted("pos0-mask-off", "embedding of position-0 tokens not zeroed before enorm", K1, m_pos0_mask_off,
            "multistep"),
    # enorm
    Planted("enorm-hnorm-swap", "enorm and hnorm checkpoint weights swapped", K1, m_enorm_hnorm_swap,
            "loading"),
    # eh_proj
    Planted("eh-proj-concat-order", "eh_proj input concatenated as [h, e] instead of [e, h] (halves swapped)",
            K1, m_eh_proj_halves, "loading"),
    # logits
    Planted("lm-head-zero", "shared_head.head / lm_head never loaded (zero)", K1, m_lm_head_zero, "loading"),
)
