"""Planted bugs of the MoE: routing bias, renormalisation and scaling, the SwiGLU clamp, expert order
(components moe.topk_ids, moe.topk_weights, moe.shared, mlp.out: each ``Planted`` below is listed
under its component's registry record, ``harness.components``, which the catalogue is derived from)."""

from __future__ import annotations

import torch

from .base import CLAMP, K1, LONG, Ctx, MutantNotApplicable, Planted, _param, _router, _walk, need
from .cpu import cpu_bias_zero, cpu_renorm_flipped, cpu_scaling_twice


@torch.no_grad()
def m_expert_bias_zero(ctx: Ctx) -> None:
    b = _param(ctx.mlp, "expert_bias")
    r = _router(ctx)
    rb = getattr(r, "e_score_correction_bias", None)
    if rb is not None and rb.data_ptr() != b.data_ptr():
        rb.zero_()
    b.zero_()


def m_renorm_flipped(ctx: Ctx) -> None:
    r = _router(ctx)
    if not hasattr(r, "renormalize"):
        raise MutantNotApplicable(f"{type(r).__name__}.renormalize missing")
    ctx.setattr(r, "renormalize", not bool(r.renormalize))


def _scaling_holder(ctx: Ctx):
    """The object whose routed_scaling_factor production applies: the router (scales
    the top-k weights) or, with apply_routed_scale_to_output, the MoE runner
    (scales the fused output); the other holds 1.0."""
    r = _router(ctx)
    if float(getattr(r, "routed_scaling_factor", 1.0) or 1.0) != 1.0:
        return r, float(r.routed_scaling_factor)
    for obj in _walk(need(ctx.mlp, "experts", "mlp"), max_depth=9):
        f = getattr(obj, "routed_scaling_factor", None) if "Runner" in type(obj).__name__ else None
        if isinstance(f, (int, float)) and float(f) != 1.0:
            ctx.notes.append(f"routed_scaling_factor lives on {type(obj).__name__} (output scale)")
            return obj, float(f)
    raise MutantNotApplicable("no router or MoE runner holds a routed_scaling_factor != 1.0")


def m_scaling_twice(ctx: Ctx) -> None:
    obj, f = _scaling_holder(ctx)
    ctx.setattr(obj, "routed_scaling_factor", f * f)


def m_scaling_missing(ctx: Ctx) -> None:
    obj, _ = _scaling_holder(ctx)
    ctx.setattr(obj, "routed_scaling_factor", 1.0)


class _ClampedSwiGLU(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, limit: float) -> None:
        super().__init__()
        self.inner, self.limit = inner, limit

    def forward(self, x):
        d = x.shape[-1] // 2
        g = x[..., :d].clamp(max=self.limit)
        u = x[..., d:].clamp(-self.limit, self.limit)
        return self.inner(torch.cat([g, u], dim=-1))


def _limit(ctx: Ctx) -> float:
    lim = float(ctx.hf.get("swiglu_limit") or 0)
    if lim <= 0:
        raise MutantNotApplicable("case has no swiglu_limit")
    return lim


def m_clamp_shared(ctx: Ctx) -> None:
    sh = need(ctx.mlp, "shared_experts", "mlp")
    act = need(sh, "act_fn", "shared_experts")
    ctx.setattr(sh, "act_fn", _ClampedSwiGLU(act, _limit(ctx)))


@torch.no_grad()
def m_expert_swap(ctx: Ctx) -> None:
    e = int(ctx.hf["n_routed_experts"])
    hits = [(n, p) for n, p in ctx.mlp.named_parameters() if n.endswith("w13_weight")]
    if not hits:
        raise MutantNotApplicable("no *w13_weight parameter under the MTP layer's mlp")
    for n, p in hits:
        if p.shape[0] != e:
            raise MutantNotApplicable(f"{n} dim 0 is {p.shape[0]}, not the {e} experts")
        a = p[0].clone()
        p[0].copy_(p[1])
        p[1].copy_(a)
    ctx.notes.append(f"swapped experts 0 and 1 in {[n for n, _ in hits]}")


_LIMIT_NAMES = ("swiglu_limit", "gemm1_clamp_limit", "clamp_limit", "activation_clamp", "gate_up_clamp")


def m_clamp_removed(ctx: Ctx) -> None:
    lim = _limit(ctx)
    hit = []
    for obj in _walk(need(ctx.mlp, "experts", "mlp"), max_depth=9):
        try:
            attrs = vars(obj)
        except TypeError:
            continue
        for name in _LIMIT_NAMES:
            v = attrs.get(name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and float(v) == lim:
                ctx.setattr(obj, name, None)
                hit.append(f"{type(obj).__name__}.{name}")
    if not hit:
        raise MutantNotApplicable(f"no attribute among {_LIMIT_NAMES} equal to {lim} under mlp.experts")
    ctx.notes.append(f"cleared {hit}")


PLANTED: tuple[Planted, ...] = (
    # moe.topk_ids
    Planted("expert-bias-ignored", "mlp.gate.e_score_correction_bias not renamed to expert_bias: bias stays 0",
            LONG, m_expert_bias_zero, "loading", cpu_bias_zero, "routing"),
    # moe.topk_weights
    Planted("renorm-flipped", "norm_topk_prob/route_norm ignored (top-k weights not renormalised)", K1,
            m_renorm_flipped, "moe", cpu_renorm_flipped, "routing"),
    Planted("routed-scaling-twice", "routed_scaling_factor applied twice (router and experts)", K1,
            m_scaling_twice, "moe", cpu_scaling_twice, "routing"),
    Planted("routed-scaling-missing", "routed_scaling_factor not applied (router_scaling_factor alias missed)",
            K1, m_scaling_missing, "moe"),
    # moe.shared
    Planted("clamp-on-shared", "swiglu_limit clamp applied to the shared experts too", CLAMP, m_clamp_shared,
            "moe"),
    # mlp.out
    Planted("expert-swap", "routed expert 0's gate_up weights loaded into expert 1's slot and back "
            "(fused-checkpoint expert index misaligned)", K1, m_expert_swap, "loading"),
    Planted("clamp-removed", "routed-expert swiglu_limit clamp not applied", CLAMP, m_clamp_removed, "moe"),
)
