"""Mutation testing of the side-by-side harness: does it catch real HYV4MTP bugs?

    python -m harness mutants [--list] [--only NAME ...] [--report R.json] [--no-control]

Each mutant stands for one bug HY V4 MTP could plausibly ship with. It is
applied *in process* to vLLM 0.33.0's real ``HYV4MTP`` after weights are
loaded (installed files are never edited): a parameter edited in place, an
attribute of the built model / attention impl / MoE router replaced, a
forward (pre-)hook, or a method replaced on the model *instance*. The model
of each mutant is built fresh and thrown away afterwards; attribute and hook
changes are undone in a ``finally`` as well, so mutants are independent.

A mutant is *detected* when the side-by-side verdict
(``side_by_side.judge``) fails, or when the run raises after the mutant was
applied while the same case passes unmutated (the control). ``not-applicable``
(the attribute the mutant needs is absent in this vLLM build) is reported
apart from ``missed``. Exit: 0 every selected mutant detected, 1 otherwise,
125 production cannot run here.

The pure-function mutants (RoPE style, grouped-top-k routing flags) also run
on CPU: ``cpu_apply`` patches vLLM's pure PyTorch function and
``rope_cross_check`` / ``routing_cross_check`` (the comparisons of
tests/cpu/test_reference_vs_vllm_pure.py, returning problems instead of
asserting) must then report a problem; see tests/cpu/test_mutants_cpu.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import time
import traceback
from typing import Callable

import torch

from harness.atomic import atomic_write_json


class MutantNotApplicable(Exception):
    """The attribute/parameter a mutant needs does not exist in this build."""


# ---------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------

def _extra_cases() -> dict:
    """Cases only the mutants use (none at present: the clamp mutants run on the default bisect
    case tiny-k2-clamp-headwise, swiglu_limit 1.5, ~20 % of the routed SwiGLU elements clamped,
    harness/regimes.py; the preset's limit 10 never binds on O(1) synthetic activations)."""
    return {}


def case_by_id(case_id: str):
    from harness.production.cases import GPU_CASES

    extra = _extra_cases()
    if case_id in extra:
        return extra[case_id]
    return GPU_CASES[case_id]


# ---------------------------------------------------------------------------
# applying mutants to a loaded session
# ---------------------------------------------------------------------------

class Ctx:
    """A loaded ``ProductionSession`` plus an undo stack for attribute sets and hooks."""

    def __init__(self, session) -> None:
        self.session = session
        self.model = session.model
        self.hf = session.hf_config
        self._undo: list[Callable[[], None]] = []
        self.notes: list[str] = []

    # model parts (MTP layer 0 serves every proposer step)
    @property
    def layer(self):
        return next(iter(self.model.model.layers.values()))

    @property
    def attn(self):
        return self.layer.mtp_block.self_attn

    @property
    def mlp(self):
        return self.layer.mtp_block.mlp

    def setattr(self, obj, attr: str, value, *, must_exist: bool = True) -> None:
        had = attr in getattr(obj, "__dict__", {}) or (
            isinstance(obj, torch.nn.Module)
            and any(attr in d for d in (obj._modules, obj._parameters, obj._buffers)))
        if must_exist and not hasattr(obj, attr):
            raise MutantNotApplicable(f"{type(obj).__name__} has no attribute {attr!r}")
        old = getattr(obj, attr, None)
        _force_setattr(obj, attr, value)

        def undo():
            if had:
                _force_setattr(obj, attr, old)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(obj, attr)
        self._undo.append(undo)

    def hook(self, handle) -> None:
        self._undo.append(handle.remove)

    def restore(self) -> None:
        while self._undo:
            fn = self._undo.pop()
            with contextlib.suppress(Exception):
                fn()


def _force_setattr(obj, attr, value) -> None:
    try:
        setattr(obj, attr, value)
    except (AttributeError, dataclasses.FrozenInstanceError, TypeError):
        object.__setattr__(obj, attr, value)


def need(obj, attr: str, what: str = ""):
    """``getattr(obj, attr)`` or MutantNotApplicable naming what is missing."""
    v = getattr(obj, attr, None)
    if v is None:
        raise MutantNotApplicable(f"{what or type(obj).__name__}.{attr} is missing or None")
    return v


def _param(module, name: str = "weight") -> torch.Tensor:
    p = getattr(module, name, None)
    if not isinstance(p, torch.Tensor):
        raise MutantNotApplicable(f"{type(module).__name__}.{name} is not a tensor")
    if p.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise MutantNotApplicable(f"{type(module).__name__}.{name} is {p.dtype} (quantized): edit not defined")
    return p


def _router(ctx: Ctx):
    from harness.production.module.capture import _find_router

    r = _find_router(need(ctx.mlp, "experts", "mlp"))
    if r is None:
        raise MutantNotApplicable("no MoE router with select_experts under mlp.experts")
    return r


def _impl(ctx: Ctx):
    return need(ctx.attn.mla_attn, "impl", "mla_attn")


def _walk(root, max_depth: int = 6):
    """Objects reachable from ``root`` through modules and vLLM objects' attributes."""
    seen, stack = set(), [(root, 0)]
    while stack:
        obj, d = stack.pop()
        if obj is None or id(obj) in seen or d > max_depth or torch.is_tensor(obj):
            continue
        seen.add(id(obj))
        yield obj
        if isinstance(obj, (list, tuple)):
            stack.extend((x, d + 1) for x in obj)
            continue
        if isinstance(obj, dict):
            stack.extend((x, d + 1) for x in obj.values())
            continue
        mod = type(obj).__module__ or ""
        if not (mod.startswith("vllm") or isinstance(obj, torch.nn.Module)):
            continue
        try:
            attrs = vars(obj)
        except TypeError:
            continue
        for k, v in attrs.items():
            if k in ("_parameters", "_buffers"):
                continue
            if k == "_modules":
                stack.extend((x, d + 1) for x in v.values())
            elif isinstance(v, torch.nn.Module) or not callable(v):
                stack.append((v, d + 1))


# ---- weight loading / naming ------------------------------------------------

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


@torch.no_grad()
def m_lm_head_zero(ctx: Ctx) -> None:
    _param(ctx.layer.shared_head.head).zero_()


@torch.no_grad()
def m_expert_bias_zero(ctx: Ctx) -> None:
    b = _param(ctx.mlp, "expert_bias")
    r = _router(ctx)
    rb = getattr(r, "e_score_correction_bias", None)
    if rb is not None and rb.data_ptr() != b.data_ptr():
        rb.zero_()
    b.zero_()


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
def m_kv_a_norm_ones(ctx: Ctx) -> None:
    _param(ctx.attn.kv_a_layernorm).fill_(1.0)


@torch.no_grad()
def m_q_a_norm_ones(ctx: Ctx) -> None:
    _param(need(ctx.attn, "q_a_layernorm", "self_attn")).fill_(1.0)


# ---- attention ---------------------------------------------------------------

def _neox_copy(ctx: Ctx, rope):
    """A fresh get_rope(..., is_neox_style=True) twin of ``rope`` (get_rope caches
    instances, and the MLA and indexer share one: never mutate the cached object)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding as re_mod

    if getattr(rope, "is_neox_style", None) is not False:
        raise MutantNotApplicable(f"{type(rope).__name__}.is_neox_style is {getattr(rope, 'is_neox_style', None)!r}")
    cache = need(rope, "cos_sin_cache", type(rope).__name__)
    vc = ctx.session.vllm_config
    draft = getattr(getattr(getattr(vc, "speculative_config", None), "draft_model_config", None), "hf_config", None)
    params = getattr(draft, "rope_parameters", None) or ctx.hf["rope_parameters"]
    with set_current_vllm_config(vc):
        new = re_mod.get_rope(int(ctx.hf["qk_rope_head_dim"]),
                              max_position=int(getattr(ctx.attn, "max_position_embeddings", 8192)),
                              is_neox_style=True, rope_parameters=dict(params), dtype=cache.dtype)
    new = new.to(cache.device)
    if not new.is_neox_style or new is rope:
        raise MutantNotApplicable("get_rope did not return a NeoX-style twin")
    return new


def m_mla_rope_neox(ctx: Ctx) -> None:
    ctx.setattr(ctx.attn, "rotary_emb", _neox_copy(ctx, ctx.attn.rotary_emb))


def m_indexer_rope_neox(ctx: Ctx) -> None:
    ctx.setattr(ctx.attn, "indexer_rope_emb", _neox_copy(ctx, need(ctx.attn, "indexer_rope_emb", "self_attn")))


def m_sink_dropped(ctx: Ctx) -> None:
    impl = _impl(ctx)
    need(impl, "sinks", "impl")
    ctx.setattr(impl, "sinks", None)


def m_sink_twice(ctx: Ctx) -> None:
    impl = _impl(ctx)
    s = need(impl, "sinks", "impl")
    ctx.setattr(impl, "sinks", (s + math.log(2.0)).contiguous())


def m_sink_narrowed_twice(ctx: Ctx) -> None:
    impl = _impl(ctx)
    s = need(impl, "sinks", "impl")
    h = s.shape[0] // 2
    if h == 0:
        raise MutantNotApplicable("one head: nothing to narrow")
    ctx.setattr(impl, "sinks", torch.cat([s[:h], s[:h]] + ([s[2 * h:]] if s.shape[0] % 2 else [])).contiguous())


def m_softmax_scale(ctx: Ctx) -> None:
    impl = _impl(ctx)
    old = float(need(impl, "softmax_scale", "impl"))
    latent = int(ctx.hf["kv_lora_rank"]) + int(ctx.hf["qk_rope_head_dim"])
    qk = int(ctx.hf["qk_nope_head_dim"]) + int(ctx.hf["qk_rope_head_dim"])
    ctx.setattr(impl, "softmax_scale", old * math.sqrt(qk / latent))


def _gate_hooks(ctx: Ctx, remap: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """o_proj input x * sigmoid(g) -> ``remap(x / sigmoid(g) expanded, g)``: the
    eager gate path is recomputed around production's own attention output."""
    sa = ctx.attn
    gate = need(sa, "linear_gate", "self_attn")
    if getattr(sa, "use_hpc_gated_mla", False):
        raise MutantNotApplicable("HPC fused gated-MLA GEMM in use: the gate is not a separate op")
    store: dict = {}
    ctx.hook(gate.register_forward_hook(lambda _m, _a, out: store.__setitem__("g", out[0] if isinstance(out, tuple) else out)))

    def pre(_m, args):
        g = store.pop("g", None)
        if g is None or not args:
            return None
        return (remap(args[0], g),) + tuple(args[1:])
    ctx.hook(sa.o_proj.register_forward_pre_hook(pre))


def m_gate_no_sigmoid(ctx: Ctx) -> None:
    v = int(ctx.hf["v_head_dim"])
    headwise = ctx.hf.get("gating_type") == "headwise"

    def remap(x, g):
        gf = g.float()
        if headwise:
            gf = gf.repeat_interleave(v, dim=-1)
        return (x.float() / torch.sigmoid(gf) * gf).to(x.dtype)
    _gate_hooks(ctx, remap)


def m_headwise_gate_tiled(ctx: Ctx) -> None:
    if ctx.hf.get("gating_type") != "headwise":
        raise MutantNotApplicable("case is not gating_type=headwise")
    v = int(ctx.hf["v_head_dim"])

    def remap(x, g):
        s = torch.sigmoid(g.float())
        right = s.repeat_interleave(v, dim=-1)
        wrong = s.repeat(1, v)  # head h's gate lands on column c where c % H == h
        return (x.float() / right * wrong).to(x.dtype)
    _gate_hooks(ctx, remap)


@torch.no_grad()
def m_q_b_heads_rolled(ctx: Ctx) -> None:
    w = _param(need(ctx.attn, "q_b_proj", "self_attn"))
    d = int(ctx.hf["qk_nope_head_dim"]) + int(ctx.hf["qk_rope_head_dim"])
    w.copy_(torch.roll(w.clone(), shifts=d, dims=0))


# ---- indexer -------------------------------------------------------------------

def _indexer(ctx: Ctx):
    return need(ctx.attn, "indexer", "self_attn")


def m_indexer_knorm_eps(ctx: Ctx) -> None:
    kn = need(_indexer(ctx), "k_norm", "indexer")
    need(kn, "eps", "indexer.k_norm")
    ctx.setattr(kn, "eps", 1.0)


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


# ---- MoE -----------------------------------------------------------------------

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


# ---- multi-step ---------------------------------------------------------------------

def m_compaction_skipped(ctx: Ctx) -> None:
    inner = ctx.model.model
    need(inner, "compact_topk_indices", "model.model")
    ctx.setattr(inner, "compact_topk_indices", lambda slot_ids: None, must_exist=False)


def m_compaction_wrong_slots(ctx: Ctx) -> None:
    inner = ctx.model.model
    orig = need(inner, "compact_topk_indices", "model.model")
    ctx.setattr(inner, "compact_topk_indices",
                lambda slot_ids: orig((slot_ids - 1).clamp_min(0)), must_exist=False)


def m_indexer_not_skipped(ctx: Ctx) -> None:
    inner = ctx.model.model
    orig = need(inner, "set_skip_topk", "model.model")
    ctx.setattr(inner, "set_skip_topk", lambda skip: orig(False), must_exist=False)


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


# ---------------------------------------------------------------------------
# CPU: vLLM's pure functions, patched
# ---------------------------------------------------------------------------

@contextlib.contextmanager
def _patch_module_attr(mod, name: str, wrap: Callable):
    orig = getattr(mod, name)
    setattr(mod, name, wrap(orig))
    try:
        yield
    finally:
        setattr(mod, name, orig)


def cpu_rope_neox():
    from vllm.model_executor.layers import rotary_embedding as m

    def wrap(orig):
        def get_rope(*a, **kw):
            kw["is_neox_style"] = True
            return orig(*a, **kw)
        return get_rope
    return _patch_module_attr(m, "get_rope", wrap)


def _cpu_grouped_topk(edit: Callable[[dict], None]):
    from vllm.model_executor.layers.fused_moe.router import grouped_topk_router as m

    def wrap(orig):
        def grouped_topk(hidden_states, gating_output, topk, renormalize, **kw):
            kw = dict(kw, topk=topk, renormalize=renormalize)
            edit(kw)
            return orig(hidden_states, gating_output, **kw)
        return grouped_topk
    return _patch_module_attr(m, "grouped_topk", wrap)


def cpu_renorm_flipped():
    return _cpu_grouped_topk(lambda kw: kw.__setitem__("renormalize", not kw["renormalize"]))


def cpu_scaling_twice():
    return _cpu_grouped_topk(lambda kw: kw.__setitem__(
        "routed_scaling_factor", kw.get("routed_scaling_factor", 1.0) ** 2))


def cpu_bias_zero():
    def edit(kw):
        b = kw.get("e_score_correction_bias")
        if b is not None:
            kw["e_score_correction_bias"] = torch.zeros_like(b)
    return _cpu_grouped_topk(edit)


ROPE_PARAMS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0},
    "deepseek_yarn": {"rope_type": "deepseek_yarn", "rope_theta": 10000.0, "factor": 4.0,
                      "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
                      "mscale": 1.0, "mscale_all_dim": 0.7},
}


def vllm_hf_config(hf: dict):
    """``hf`` as vLLM 0.33 reads a checkpoint's ``config.json``: its own ``get_config``
    (HYV4Config, transformers' rope standardization and layer-type checks, vLLM's
    rope patches), from a temporary model directory. Raises what vLLM raises."""
    import shutil
    from unittest import mock

    from vllm.transformers_utils import config as vcfg

    from harness.production.module.vllm_config import write_model_dir

    path = write_model_dir(hf)
    try:
        # one attempt: with_retry would sleep 2 s before re-raising a refusal
        with mock.patch.object(vcfg, "with_retry", lambda func, *a, **k: func()):
            return vcfg.get_config(path, trust_remote_code=False)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def rope_cross_check(kind: "str | dict" = "default", positions: list[int] | None = None) -> list[str]:
    """The reference's interleaved RoPE vs vLLM's ``get_rope(..., is_neox_style=False)``.

    ``kind``: a ``ROPE_PARAMS`` name, or config keys to set on the tiny preset
    (``rope_parameters`` and any top-level key; None removes one). Both sides
    read the same ``config.json``: vLLM through ``vllm_hf_config`` and the
    ``get_rope`` call ``HYV4MLAAttention`` makes (head size qk_rope_head_dim,
    ``max_position_embeddings``), the reference through ``MTPConfig.from_hf_dict``.
    Compared: refusal (vLLM raises <=> the reference raises ConfigError, except
    that the reference may refuse what it says it does not model), the
    rotated width, the magnitude, the cos/sin table rows and ``forward_native``'s
    q / k at ``positions`` (default: spread over the table, capped at 4000).
    Returns the problems found.
    """
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding as re_mod

    from harness.presets import preset
    from reference import ConfigError, MTPConfig, rope

    name = kind if isinstance(kind, str) else "params"
    hf = preset("tiny")
    for key, value in ({"rope_parameters": dict(ROPE_PARAMS[kind])} if isinstance(kind, str) else kind).items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    head = int(hf["qk_rope_head_dim"])
    ref_err = vllm_err = None
    try:
        cfg = MTPConfig.from_hf_dict(hf)
    except ConfigError as exc:
        ref_err = exc
    try:
        vc = vllm_hf_config(hf)
        with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
            vr = re_mod.get_rope(head, max_position=getattr(vc, "max_position_embeddings", 8192),
                                 rope_parameters=vc.rope_parameters, is_neox_style=False, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 (whatever vLLM raises is a refusal)
        vllm_err = exc
    if ref_err is not None or vllm_err is not None:
        if vllm_err is None and "not modelled" in str(ref_err):
            return []  # a documented refusal, naming the key the reference does not model
        if (ref_err is None) != (vllm_err is None):
            return [f"rope[{name}]: vLLM {'refuses' if vllm_err else 'accepts'} ({vllm_err!r:.200}), the reference "
                    f"{'refuses' if ref_err else 'accepts'} ({ref_err!r:.200})"]
        return []
    problems = []
    if vr.rotary_dim != cfg.rotary_dim:
        return [f"rope[{name}]: rotary_dim vLLM {vr.rotary_dim} vs reference {cfg.rotary_dim}"]
    m = rope.mscale(cfg.rope)
    if hasattr(vr, "mscale") and abs(vr.mscale - m) > 1e-12 * max(1.0, abs(m)):
        problems.append(f"rope[{name}].mscale: vLLM {vr.mscale!r} vs reference {m!r}")
    n_rows = vr.cos_sin_cache.shape[0]
    if positions is None:
        top = min(n_rows, 4001) - 1
        positions = sorted({0, 1, 5, top // 7, top // 2, top})
    pos = torch.tensor(positions)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 3, head, generator=g, dtype=torch.float32)
    k = torch.randn(len(positions), 1, head, generator=g, dtype=torch.float32)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        vq, vk = vr.forward_native(pos, q.clone(), k.clone())
    c, s = rope.cos_sin(cfg.rope, head, pos)
    # vLLM builds inv_freq and the angles p * f_i in float32: a few float32 roundings of
    # angles up to ~4000 rad (absolute ~ 4000 * 2^-23 ~ 5e-4), times the magnitude.
    atol = 2e-3 * max(1.0, abs(m))
    for what, got, want in (("cos_sin", vr.cos_sin_cache[pos].double(), torch.cat([c, s], dim=-1)),
                            ("q", vq.double(), rope.apply_interleaved(q.double(), c, s)),
                            ("k", vk.double(), rope.apply_interleaved(k.double(), c, s))):
        try:
            torch.testing.assert_close(got, want, atol=atol, rtol=1e-3)
        except AssertionError as exc:
            problems.append(f"rope[{name}].{what}: {str(exc).splitlines()[0]} "
                            f"(max |d| {float((got - want).abs().max()):.3g})")
    return problems


def routing_cross_check(seed: int = 0, experts: int = 8, topk: int = 2, renorm: bool = True,
                        tokens: int = 64) -> list[str]:
    """``reference.moe.route`` vs vLLM's ``grouped_topk`` (sigmoid + bias, one group);
    expert sets per row and weights per expert; returns the problems found."""
    from vllm.model_executor.layers.fused_moe.router import grouped_topk_router as m

    from reference import EXACT, moe
    from reference.config import MTPConfig

    cfg = MTPConfig().replace(n_routed_experts=experts, num_experts_per_tok=topk, hidden_size=16,
                              routed_scaling_factor=2.827, norm_topk_prob=renorm)
    g = torch.Generator().manual_seed(seed)
    lw = {"mlp.gate": torch.randn(experts, 16, generator=g, dtype=torch.float64),
          "mlp.expert_bias": 0.05 * torch.randn(experts, generator=g, dtype=torch.float64)}
    x = torch.randn(tokens, 16, generator=g, dtype=torch.float64)
    ref = moe.route(cfg, lw, x, EXACT)
    w, ids = m.grouped_topk(x.float(), ref["router_logits"].float(), topk, renorm, num_expert_group=1,
                            topk_group=1, scoring_func="sigmoid", routed_scaling_factor=2.827,
                            e_score_correction_bias=lw["mlp.expert_bias"].float())
    problems = []
    if ids.shape != ref["topk_ids"].shape:
        return [f"routing: shape {tuple(ids.shape)} vs {tuple(ref['topk_ids'].shape)}"]
    bad_ids = bad_w = 0
    for t in range(tokens):
        if set(ids[t].tolist()) != set(ref["topk_ids"][t].tolist()):
            bad_ids += 1
            continue
        got = dict(zip(ids[t].tolist(), w[t].double().tolist()))
        for eid, want in zip(ref["topk_ids"][t].tolist(), ref["topk_weights"][t].tolist()):
            # fp32 sigmoid / normalisation in vLLM vs float64 in the reference
            if abs(got[eid] - want) > 1e-6 + 1e-5 * abs(want):
                bad_w += 1
                break
    if bad_ids:
        problems.append(f"routing: {bad_ids}/{tokens} rows choose other experts")
    if bad_w:
        problems.append(f"routing: {bad_w}/{tokens} rows have other weights")
    return problems


# ---------------------------------------------------------------------------
# the catalogue
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    stands_for: str
    component: str          # the canonical component that should flag it first
    case: str               # GPU case id (side_by_side.GPU_CASES or _extra_cases)
    apply: Callable[[Ctx], None]
    group: str
    cpu_apply: Callable | None = None     # context manager factory patching a pure vLLM function
    cpu_check: str | None = None          # "rope" or "routing"

    def row(self) -> dict:
        return {"name": self.name, "group": self.group, "stands_for": self.stands_for,
                "component": self.component, "case": self.case,
                "cpu": self.cpu_check or ""}


K1, K3SHARE, LONG, LONGSHARE, HEADWISE, CLAMP = (
    "tiny-k1", "tiny-k3-share", "tiny-k2-long", "tiny-k3-long-share", "tiny-k2-headwise", "tiny-k2-clamp-headwise")

CATALOGUE: tuple[Mutant, ...] = (
    # weight loading / naming
    Mutant("expert-swap", "routed expert 0's gate_up weights loaded into expert 1's slot and back "
           "(fused-checkpoint expert index misaligned)", "mlp.out", K1, m_expert_swap, "loading"),
    Mutant("lm-head-zero", "shared_head.head / lm_head never loaded (zero)", "logits", K1, m_lm_head_zero, "loading"),
    Mutant("expert-bias-ignored", "mlp.gate.e_score_correction_bias not renamed to expert_bias: bias stays 0",
           "moe.topk_ids", LONG, m_expert_bias_zero, "loading", cpu_bias_zero, "routing"),
    Mutant("enorm-hnorm-swap", "enorm and hnorm checkpoint weights swapped", "enorm", K1, m_enorm_hnorm_swap, "loading"),
    Mutant("eh-proj-concat-order", "eh_proj input concatenated as [h, e] instead of [e, h] (halves swapped)",
           "eh_proj", K1, m_eh_proj_halves, "loading"),
    Mutant("kv-a-norm-ones", "kv_a_layernorm weight left at its init (ones)", "attn.kv_c", K1,
           m_kv_a_norm_ones, "loading"),
    Mutant("q-a-norm-ones", "q_a_layernorm weight left at its init (ones)", "attn.q_c", K1,
           m_q_a_norm_ones, "loading"),
    # attention
    Mutant("mla-rope-neox", "MLA rotary built with is_neox_style=True on interleaved (PTM) q_pe/k_pe",
           "attn.q", K1, m_mla_rope_neox, "attention", cpu_rope_neox, "rope"),
    Mutant("sink-dropped", "learnable sink not forwarded to the FlashMLA kernel (impl.sinks=None)",
           "attn.core", K1, m_sink_dropped, "attention"),
    Mutant("sink-twice", "sink added twice to the softmax denominator (sink + ln 2)", "attn.core", K1,
           m_sink_twice, "attention"),
    Mutant("softmax-scale-latent", "softmax scale from the latent head size 576 instead of qk_head_dim",
           "attn.core", K1, m_softmax_scale, "attention"),
    Mutant("gate-no-sigmoid", "output gate multiplies by the raw linear_gate output (sigmoid skipped)",
           "attn.out", K1, m_gate_no_sigmoid, "attention"),
    Mutant("headwise-gate-tiled", "headwise gate broadcast with repeat instead of repeat_interleave "
           "(gate of head h lands on other heads' columns)", "attn.out", HEADWISE, m_headwise_gate_tiled,
           "attention"),
    Mutant("q-b-heads-rolled", "q_b_proj rows of the wrong TP rank / head order (heads rolled by one)",
           "attn.q", K1, m_q_b_heads_rolled, "attention"),
    Mutant("sink-narrowed-twice", "TP sink narrowed twice: the first half of the heads' sinks duplicated",
           "attn.core", K1, m_sink_narrowed_twice, "tp"),
    # indexer
    Mutant("indexer-knorm-eps", "indexer k_norm eps read from the wrong field (1.0 instead of 1e-6)",
           "indexer.k", K1, m_indexer_knorm_eps, "indexer"),
    Mutant("indexer-weights-unscaled", "indexer head weights miss the n_heads^-0.5 factor",
           "indexer.head_weights", K1, m_indexer_weights_unscaled, "indexer"),
    Mutant("indexer-topk-minus1", "indexer keeps index_topk - 1 tokens (off by one)", "indexer.topk", LONG,
           m_indexer_topk_minus1, "indexer"),
    Mutant("indexer-rope-neox", "indexer rotary built NeoX-style on interleaved q_pe/k_pe",
           "indexer.q_deq", K1, m_indexer_rope_neox, "indexer", cpu_rope_neox, "rope"),
    # MoE
    Mutant("clamp-on-shared", "swiglu_limit clamp applied to the shared experts too", "moe.shared", CLAMP,
           m_clamp_shared, "moe"),
    Mutant("clamp-removed", "routed-expert swiglu_limit clamp not applied", "mlp.out", CLAMP,
           m_clamp_removed, "moe"),
    Mutant("renorm-flipped", "norm_topk_prob/route_norm ignored (top-k weights not renormalised)",
           "moe.topk_weights", K1, m_renorm_flipped, "moe", cpu_renorm_flipped, "routing"),
    Mutant("routed-scaling-twice", "routed_scaling_factor applied twice (router and experts)",
           "moe.topk_weights", K1, m_scaling_twice, "moe", cpu_scaling_twice, "routing"),
    Mutant("routed-scaling-missing", "routed_scaling_factor not applied (router_scaling_factor alias missed)",
           "moe.topk_weights", K1, m_scaling_missing, "moe"),
    # multi-step
    Mutant("compaction-skipped", "compact_topk_indices not called: steps >= 1 read step-0 rows 0..R-1",
           "attn.topk", K3SHARE, m_compaction_skipped, "multistep"),
    Mutant("compaction-wrong-slots", "compaction gathers the rows before each request's last token",
           "attn.topk", K3SHARE, m_compaction_wrong_slots, "multistep"),
    Mutant("indexer-not-skipped", "set_skip_topk(True) ignored: the indexer re-runs at steps >= 1 "
           "instead of sharing step 0's (contexts > index_topk so the fresh set differs)",
           "attn.topk", LONGSHARE, m_indexer_not_skipped, "multistep"),
    Mutant("pos0-mask-off", "embedding of position-0 tokens not zeroed before enorm", "embed_masked", K1,
           m_pos0_mask_off, "multistep"),
)

BY_NAME = {m.name: m for m in CATALOGUE}


# ---------------------------------------------------------------------------
# running on the GPU
# ---------------------------------------------------------------------------

def _run(case, mutant: Mutant | None) -> tuple[dict, list[str]]:
    """Build, load, apply ``mutant`` (None: control), run, judge (as side_by_side.run_case)."""
    import reference as R
    from harness.production.module import side_by_side as sbs
    from harness.production.module.runner import ProductionSession

    hf, ckpt, _ = sbs.case_inputs(case)
    cfg = R.MTPConfig.from_hf_dict(hf)
    first = R.make_case(cfg, case.seed, case.requests, case.tokens)
    t0 = time.perf_counter()
    sess = ProductionSession(hf, num_speculative_tokens=case.steps)
    t_build = time.perf_counter() - t0
    sess.load(ckpt, strict=not case.known_audit)
    t_load = time.perf_counter() - t0 - t_build
    ctx = Ctx(sess)
    try:
        if mutant is not None:
            mutant.apply(ctx)
            torch.cuda.synchronize()
        try:
            prod = sess.run(first, case.steps)
            torch.cuda.synchronize()
        except MutantNotApplicable:
            raise
        except Exception as exc:
            raise _RunRaised(exc) from exc
    finally:
        ctx.restore()
    t_run = time.perf_counter() - t0 - t_build - t_load
    info = {"audit": sess.audit_problems, "attach_notes": sess.attach_notes,
            "step_notes": [dataclasses.asdict(n) for n in sess.notes],
            "timing_s": {"build": t_build, "load": t_load, "run": t_run}}
    del sess, ctx
    return sbs.judge(case, prod, info), []


def run_planted(case, name: str) -> dict:
    """``side_by_side.judge`` of ``case`` run with mutant ``name`` planted (``bisect-check --plant``).

    Raises MutantNotApplicable when the mutant has nothing to act on in this case, _RunRaised
    when production raised after the mutant was applied.
    """
    return _run(case, BY_NAME[name])[0]


class _RunRaised(Exception):
    """The production run raised after the mutant was applied."""


def _failing(result: dict) -> list[str]:
    return [r["key"] for r in result.get("rows", []) if not r["passed"]]


def _component(key: str | None) -> str | None:
    return key.split(".", 1)[1] if key and key.startswith("step") else key


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_control(case_id: str) -> dict:
    t0 = time.perf_counter()
    rec = {"case": case_id}
    try:
        res, _ = _run(case_by_id(case_id), None)
        rec.update(passed=bool(res["passed"]), first_divergent=res["first_divergent"], failing=_failing(res))
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        inner = exc.__cause__ if isinstance(exc, _RunRaised) else exc
        rec.update(passed=False, error=f"{type(inner).__name__}: {inner}", traceback=traceback.format_exc())
    rec["wall_s"] = round(time.perf_counter() - t0, 2)
    _free()
    return rec


def run_mutant(m: Mutant, control: dict | None = None) -> dict:
    """One mutant on its case: outcome detected / missed / not-applicable / error / inconclusive."""
    t0 = time.perf_counter()
    rec = {**m.row(), "detected": False}
    control_ok = control is None or bool(control.get("passed"))
    try:
        res, _ = _run(case_by_id(m.case), m)
        fails = _failing(res)
        comps = sorted({_component(k) for k in fails})
        rec.update(first_divergent=res["first_divergent"], failing=fails,
                   expected_flagged=m.component in comps, failing_components=comps,
                   first_divergent_component=_component(res["first_divergent"]))
        if res["passed"]:
            rec["outcome"] = "missed"
        elif control_ok:
            rec.update(outcome="detected", detected=True)
        else:
            rec["outcome"] = "inconclusive (control failed)"
    except MutantNotApplicable as exc:
        rec.update(outcome="not-applicable", error=str(exc))
    except _RunRaised as exc:
        inner = exc.__cause__
        rec["error"] = f"{type(inner).__name__}: {inner}"
        rec["traceback"] = traceback.format_exc()
        if control_ok:
            rec.update(outcome="detected (raised)", detected=True)
        else:
            rec["outcome"] = "inconclusive (raised; control failed)"
    except Exception as exc:  # noqa: BLE001 - build/load/judge trouble: not attributable
        rec.update(outcome="error", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    rec["wall_s"] = round(time.perf_counter() - t0, 2)
    _free()
    return rec


def select(only: list[str] | None) -> list[Mutant]:
    if not only:
        return list(CATALOGUE)
    unknown = [n for n in only if n not in BY_NAME]
    if unknown:
        raise KeyError(f"unknown mutant(s) {unknown}; --list shows the catalogue")
    return [BY_NAME[n] for n in only]


def format_list() -> str:
    lines = [f"{'name':26s} {'component':21s} {'case':19s} {'cpu':8s} stands for"]
    for m in CATALOGUE:
        lines.append(f"{m.name:26s} {m.component:21s} {m.case:19s} {m.cpu_check or '':8s} {m.stands_for}")
    return "\n".join(lines)


def run_catalogue(mutants: list[Mutant], *, report: str | None = None, control: bool = True,
                  log=print, budget_s: float | None = None) -> dict:
    """Controls (one unmutated run per case used) then each mutant; the report is rewritten as it goes.
    With ``budget_s``, nothing new starts once that many seconds have passed (outcome "not-run")."""
    t_start = time.perf_counter()

    def over() -> bool:
        return budget_s is not None and time.perf_counter() - t_start > budget_s

    out: dict = {"controls": {}, "mutants": [], "budget_s": budget_s}
    try:
        from harness.production.module.side_by_side import versions
        out["versions"] = versions()
    except Exception as exc:  # noqa: BLE001
        out["versions"] = {"error": str(exc)}

    def save():
        if report:
            os.makedirs(os.path.dirname(os.path.abspath(report)), exist_ok=True)
            atomic_write_json(report, out, default=str)

    if control:
        for cid in dict.fromkeys(m.case for m in mutants):
            if over():
                out["controls"][cid] = {"case": cid, "passed": False, "error": "not run: --budget-s spent"}
                continue
            c = run_control(cid)
            out["controls"][cid] = c
            log(f"control {cid}: {'PASS' if c['passed'] else 'FAIL'} {c.get('first_divergent') or c.get('error') or ''}"
                f" ({c['wall_s']}s)")
            save()
    for m in mutants:
        if over():
            out["mutants"].append({**m.row(), "detected": False, "outcome": "not-run",
                                   "error": "--budget-s spent", "wall_s": 0.0})
            log(f"{m.name:26s} not-run (budget spent)")
            continue
        r = run_mutant(m, out["controls"].get(m.case))
        out["mutants"].append(r)
        log(f"{m.name:26s} {r['outcome']:24s} expected {m.component:20s} first "
            f"{r.get('first_divergent')} ({r['wall_s']}s){'  ' + r['error'][:200] if r.get('error') else ''}")
        save()
    n = len(out["mutants"])
    det = sum(r["detected"] for r in out["mutants"])
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    out["summary"] = {"selected": n, "detected": det,
                      "missed": [r["name"] for r in out["mutants"] if r["outcome"] == "missed"],
                      "not_applicable": [r["name"] for r in out["mutants"] if r["outcome"] == "not-applicable"],
                      "other": [r["name"] for r in out["mutants"]
                                if not r["detected"] and r["outcome"] not in ("missed", "not-applicable")]}
    save()
    log(f"mutants: {det}/{n} detected; summary {json.dumps(out['summary'])}")
    return out


def mutants_command(args) -> int:
    """Exit codes are ``harness.exitcodes``'s: 0 every selected mutant detected, 1 one missed,
    2 bad arguments (checked first), 125 production cannot run here."""
    from harness import runtime
    from harness.exitcodes import EXIT_CANNOT_JUDGE, EXIT_MISMATCH, EXIT_OK, CLIError

    if getattr(args, "speculator", False):  # planted bugs in vLLM's speculator, through bisect-check
        from harness.production.engine import speculator_mutants as S

        if args.list:
            print("\n".join(f"{m.name:30s} {m.case:30s} first line names {m.expect!r}: {m.what}"
                            for m in S.MUTANTS.values()))
            return EXIT_OK
        unknown = [n for n in (args.only or []) if n not in S.MUTANTS]
        if unknown:
            raise CLIError(f"--only {unknown}: unknown speculator mutant(s); known: {', '.join(S.MUTANTS)}")
        reason = runtime.cannot_run_production_reason()
        if reason:
            print(f"cannot judge: {reason}")
            return EXIT_CANNOT_JUDGE
        doc = S.run_catalogue(args.only, report=args.report, log=lambda x: print(x, flush=True))
        s = doc["summary"]
        return EXIT_OK if s["caught"] == s["named_first"] == s["mutants"] and s["controls_ok"] else EXIT_MISMATCH
    if args.list:
        print(format_list())
        return EXIT_OK
    try:
        chosen = select(args.only)
    except KeyError as exc:
        raise CLIError(exc.args[0]) from exc
    if args.budget_s is not None and not (0 < args.budget_s < float("inf")):
        raise CLIError(f"--budget-s {args.budget_s}: must be a finite number of seconds > 0")
    if args.report and os.path.isdir(args.report):
        raise CLIError(f"--report {args.report}: is a directory; give a .json file path")
    reason = runtime.cannot_run_production_reason()
    if reason:
        print(f"cannot judge: {reason}")
        return EXIT_CANNOT_JUDGE
    out = run_catalogue(chosen, report=args.report, control=not args.no_control,
                        log=lambda s: print(s, flush=True), budget_s=args.budget_s)
    return EXIT_OK if out["summary"]["detected"] == out["summary"]["selected"] else EXIT_MISMATCH


def add_arguments(p) -> None:
    p.add_argument("--list", action="store_true", help="print the catalogue and exit")
    p.add_argument("--speculator", action="store_true",
                   help="the planted bugs in vLLM's MTP speculator (harness.production.engine.speculator_mutants), each "
                        "through bisect-check on its engine case, plus pristine controls")
    p.add_argument("--only", nargs="+", action="extend", default=None, metavar="NAME",
                   help="run only these mutants")
    p.add_argument("--report", default=None, metavar="R.json", help="write the JSON report here")
    p.add_argument("--budget-s", type=float, default=None, metavar="S",
                   help="start no new run after S seconds (the rest is reported not-run)")
    p.add_argument("--no-control", action="store_true",
                   help="skip the unmutated control run of each case")
