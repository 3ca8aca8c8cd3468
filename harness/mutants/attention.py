"""Planted bugs of sparse MLA: latents, queries and RoPE, the top-k rows it reads (compaction,
skip_topk), the FP8 KV cache's rows (fp8_ds_mla: how the tile scales are read, how the rope is
stored), the sink and softmax scale, the output gate (components attn.q_c, attn.kv_c, attn.q,
attn.topk, attn.kv_cache, attn.core, attn.out: each ``Planted`` below is listed under its
component's registry record, ``harness.components``, which the catalogue is derived from)."""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch

from .base import (CT_CHANNEL, FP8KV, HEADWISE, K1, K3SHARE, LONGSHARE, MODELOPT_DENSE, Ctx, MutantNotApplicable,
                   Planted, _impl, _neox_copy, _param, need)
from .cpu import cpu_rope_neox


@torch.no_grad()
def m_q_a_norm_ones(ctx: Ctx) -> None:
    _param(need(ctx.attn, "q_a_layernorm", "self_attn")).fill_(1.0)


@torch.no_grad()
def m_kv_a_norm_ones(ctx: Ctx) -> None:
    _param(ctx.attn.kv_a_layernorm).fill_(1.0)


def m_mla_rope_neox(ctx: Ctx) -> None:
    ctx.setattr(ctx.attn, "rotary_emb", _neox_copy(ctx, ctx.attn.rotary_emb))


@torch.no_grad()
def m_q_b_heads_rolled(ctx: Ctx) -> None:
    w = _param(need(ctx.attn, "q_b_proj", "self_attn"))
    d = int(ctx.hf["qk_nope_head_dim"]) + int(ctx.hf["qk_rope_head_dim"])
    w.copy_(torch.roll(w.clone(), shifts=d, dims=0))


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


def m_sink_dropped(ctx: Ctx) -> None:
    impl = _impl(ctx)
    need(impl, "sinks", "impl")
    ctx.setattr(impl, "sinks", None)


def m_sink_twice(ctx: Ctx) -> None:
    impl = _impl(ctx)
    s = need(impl, "sinks", "impl")
    ctx.setattr(impl, "sinks", (s + math.log(2.0)).contiguous())


def m_softmax_scale(ctx: Ctx) -> None:
    impl = _impl(ctx)
    old = float(need(impl, "softmax_scale", "impl"))
    latent = int(ctx.hf["kv_lora_rank"]) + int(ctx.hf["qk_rope_head_dim"])
    qk = int(ctx.hf["qk_nope_head_dim"]) + int(ctx.hf["qk_rope_head_dim"])
    ctx.setattr(impl, "softmax_scale", old * math.sqrt(qk / latent))


def m_sink_narrowed_twice(ctx: Ctx) -> None:
    impl = _impl(ctx)
    s = need(impl, "sinks", "impl")
    h = s.shape[0] // 2
    if h == 0:
        raise MutantNotApplicable("one head: nothing to narrow")
    ctx.setattr(impl, "sinks", torch.cat([s[:h], s[:h]] + ([s[2 * h:]] if s.shape[0] % 2 else [])).contiguous())


# ---- the FP8 KV cache (fp8_ds_mla rows: reference/kv_cache.py has the layout) ---------------------
# A reader bug is planted around the attention impl's forward_mqa: the rows' tile scales are
# rewritten to what the buggy reader would take, the kernels run, the scales are put back (the
# rows the runner records afterwards are the writer's). The edits are plain functions of the
# [rows, 4] float32 scales, so the CPU tier plants the same bugs in the reference's reader
# (tests/cpu/test_kv_cache_fp8.py).

def scale_reciprocal(s: torch.Tensor) -> torch.Tensor:
    """The stored scale read as its reciprocal (a scale_inv / scale convention mix-up)."""
    return torch.where(s != 0, 1.0 / s, s)


def scale_wrong_tile(s: torch.Tensor) -> torch.Tensor:
    """Tile t reads the scale of tile t - 1 (tile 0 the last one's): an off-by-one scale offset."""
    return torch.roll(s, 1, dims=-1)


def scale_per_row(s: torch.Tensor) -> torch.Tensor:
    """One scale per row (tile 0's) instead of one per tile of 128."""
    return s[..., :1].expand_as(s).clone()


def rope_quantised(rope: torch.Tensor) -> torch.Tensor:
    """The bf16 rope through unscaled e4m3 (saturating), as a writer quantizing it would store it."""
    return rope.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(rope.dtype)


def _fp8_rows(cache: torch.Tensor) -> torch.Tensor:
    """The packed cache as [rows, 656] uint8, sharing its memory."""
    from reference.kv_cache import ROW_BYTES

    if cache.element_size() != 1 or cache.shape[-1] != ROW_BYTES:
        raise MutantNotApplicable(f"the MLA cache is {cache.dtype} {tuple(cache.shape)}, not fp8_ds_mla rows")
    try:
        return cache.view(torch.uint8).view(-1, ROW_BYTES)
    except RuntimeError as exc:
        raise MutantNotApplicable(f"the fp8_ds_mla cache cannot be viewed as rows: {exc}") from exc


def _fp8_impl(ctx: Ctx):
    impl = _impl(ctx)
    if getattr(impl, "kv_cache_dtype", None) != "fp8_ds_mla":
        raise MutantNotApplicable(f"impl.kv_cache_dtype is {getattr(impl, 'kv_cache_dtype', None)!r}: the case is not "
                                  "served with an FP8 KV cache")
    return impl


def _scale_reader(edit: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Ctx], None]:
    def apply(ctx: Ctx) -> None:
        from reference.kv_cache import ROPE_AT, SCALE_AT

        impl = _fp8_impl(ctx)
        orig = need(impl, "forward_mqa", "impl")

        def forward_mqa(q, kv_c_and_k_pe_cache, *args, **kw):
            scales = _fp8_rows(kv_c_and_k_pe_cache)[:, SCALE_AT:ROPE_AT].view(torch.float32)
            saved = scales.clone()
            scales.copy_(edit(saved))
            try:
                return orig(q, kv_c_and_k_pe_cache, *args, **kw)
            finally:
                scales.copy_(saved)
        ctx.setattr(impl, "forward_mqa", forward_mqa, must_exist=False)
    return apply


m_kv_fp8_scale_reciprocal = _scale_reader(scale_reciprocal)
m_kv_fp8_scale_wrong_tile = _scale_reader(scale_wrong_tile)
m_kv_fp8_scale_per_row = _scale_reader(scale_per_row)
for _f, _n in ((m_kv_fp8_scale_reciprocal, "m_kv_fp8_scale_reciprocal"),
               (m_kv_fp8_scale_wrong_tile, "m_kv_fp8_scale_wrong_tile"),
               (m_kv_fp8_scale_per_row, "m_kv_fp8_scale_per_row")):
    _f.__name__ = _f.__qualname__ = _n


def m_kv_fp8_rope_quantised(ctx: Ctx) -> None:
    """After vLLM's cache write, the rows just written get their rope through e4m3."""
    from reference.kv_cache import ROPE_AT

    impl = _fp8_impl(ctx)
    orig = need(impl, "do_kv_cache_update", "impl")

    def do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, *args, **kw):
        orig(kv_c_normed, k_pe, kv_cache, slot_mapping, *args, **kw)
        rows = _fp8_rows(kv_cache)
        slots = slot_mapping.flatten().long()
        slots = slots[slots >= 0]
        rope = rows[slots, ROPE_AT:].contiguous().view(torch.bfloat16)
        rows[slots, ROPE_AT:] = rope_quantised(rope).contiguous().view(torch.uint8)
    ctx.setattr(impl, "do_kv_cache_update", do_kv_cache_update, must_exist=False)


def _gate_hooks(ctx: Ctx, remap: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """o_proj input x * sigmoid(g) -> ``remap(x / sigmoid(g) expanded, g)``: the
    eager gate path is recomputed around production's own attention output."""
    sa = ctx.attn
    gate = need(sa, "linear_gate", "self_attn")
    if getattr(sa, "use_hpc_gated_mla", False):
        raise MutantNotApplicable("HPC fused gated-MLA GEMM in use: the gate is not a separate op")
    store: dict = {}
    ctx.hook(gate.register_forward_hook(
        lambda _m, _a, out: store.__setitem__("g", out[0] if isinstance(out, tuple) else out)))

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



@contextlib.contextmanager
def exclusions_not_remapped():
    """While active, ``_remap_mtp_quant_exclusions`` looks only at ``ignored_layers`` (its list of
    exclusion attributes narrowed; the function itself is vLLM's)."""
    import importlib

    try:
        mtp = importlib.import_module("vllm.models.hy_v4.nvidia.mtp")
    except ImportError as exc:
        raise MutantNotApplicable(f"vllm.models.hy_v4.nvidia.mtp: {exc}") from exc
    attrs = getattr(mtp, "_MTP_QUANT_EXCLUSION_ATTRS", None)
    if not attrs or "exclude_modules" not in attrs:
        raise MutantNotApplicable("vllm.models.hy_v4.nvidia.mtp has no _MTP_QUANT_EXCLUSION_ATTRS with exclude_modules")
    mtp._MTP_QUANT_EXCLUSION_ATTRS = tuple(a for a in attrs if a == "ignored_layers")
    try:
        yield
    finally:
        mtp._MTP_QUANT_EXCLUSION_ATTRS = attrs


@contextlib.contextmanager
def ct_ignore_regex_dropped():
    """While active, compressed-tensors' ``should_ignore_layer`` (as ``CompressedTensorsConfig`` calls it)
    sees only the exact names of the ``ignore`` list: its ``re:`` entries never match (the matching
    function itself is vLLM's)."""
    import importlib

    try:
        ct = importlib.import_module("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors")
    except ImportError as exc:
        raise MutantNotApplicable(f"vLLM's compressed_tensors config: {exc}") from exc
    orig = getattr(ct, "should_ignore_layer", None)
    if orig is None:
        raise MutantNotApplicable("compressed_tensors.py does not call should_ignore_layer by that name")

    def exact_names_only(layer_name, ignore=(), *args, **kwargs):
        return orig(layer_name, [e for e in ignore if not str(e).startswith("re:")], *args, **kwargs)
    ct.should_ignore_layer = exact_names_only
    try:
        yield
    finally:
        ct.should_ignore_layer = orig


def m_nothing_after_load(ctx: Ctx) -> None:
    """A build-time mutant (``build_patch``) leaves the loaded model as it is."""


PLANTED: tuple[Planted, ...] = (
    # attn.q_c
    Planted("q-a-norm-ones", "q_a_layernorm weight left at its init (ones)", K1, m_q_a_norm_ones, "loading"),
    # attn.kv_c
    Planted("kv-a-norm-ones", "kv_a_layernorm weight left at its init (ones)", K1, m_kv_a_norm_ones,
            "loading"),
    # attn.q
    Planted("mla-rope-neox", "MLA rotary built with is_neox_style=True on interleaved (PTM) q_pe/k_pe", K1,
            m_mla_rope_neox, "attention", cpu_rope_neox, "rope"),
    Planted("q-b-heads-rolled", "q_b_proj rows of the wrong TP rank / head order (heads rolled by one)", K1,
            m_q_b_heads_rolled, "attention"),
    # attn.topk
    Planted("compaction-skipped", "compact_topk_indices not called: steps >= 1 read step-0 rows 0..R-1",
            K3SHARE, m_compaction_skipped, "multistep"),
    Planted("compaction-wrong-slots", "compaction gathers the rows before each request's last token", K3SHARE,
            m_compaction_wrong_slots, "multistep"),
    Planted("indexer-not-skipped", "set_skip_topk(True) ignored: the indexer re-runs at steps >= 1 "
            "instead of sharing step 0's (contexts > index_topk so the fresh set differs)", LONGSHARE,
            m_indexer_not_skipped, "multistep"),
    # attn.kv_cache
    Planted("kv-fp8-rope-quantised", "fp8_ds_mla writer stores the rope through e4m3 instead of verbatim bf16",
            FP8KV, m_kv_fp8_rope_quantised, "kv-cache"),
    # attn.core
    Planted("kv-fp8-scale-reciprocal", "fp8_ds_mla reader takes the stored tile scale as its reciprocal "
            "(scale vs scale_inv)", FP8KV, m_kv_fp8_scale_reciprocal, "kv-cache"),
    Planted("kv-fp8-scale-wrong-tile", "fp8_ds_mla reader takes tile t-1's scale for tile t (scale offset "
            "off by one tile)", FP8KV, m_kv_fp8_scale_wrong_tile, "kv-cache"),
    Planted("kv-fp8-scale-per-row", "fp8_ds_mla reader applies one scale per row (tile 0's) instead of one "
            "per tile of 128", FP8KV, m_kv_fp8_scale_per_row, "kv-cache"),
    Planted("sink-dropped", "learnable sink not forwarded to the FlashMLA kernel (impl.sinks=None)", K1,
            m_sink_dropped, "attention"),
    Planted("sink-twice", "sink added twice to the softmax denominator (sink + ln 2)", K1, m_sink_twice,
            "attention"),
    Planted("softmax-scale-latent", "softmax scale from the latent head size 576 instead of qk_head_dim", K1,
            m_softmax_scale, "attention"),
    Planted("sink-narrowed-twice", "TP sink narrowed twice: the first half of the heads' sinks duplicated",
            K1, m_sink_narrowed_twice, "tp"),
    # attn.gate
    Planted("exclusions-not-remapped", "HYV4MTP reads only ignored_layers when it remaps checkpoint-named "
            "MTP quant exclusions (an earlier upstream state): a ModelOpt exclude_modules entry "
            "(model.mtp_layers.0.self_attn.linear_gate) never reaches the draft, which quantizes the "
            "bf16 gate", MODELOPT_DENSE, m_nothing_after_load, "loading", build_patch=exclusions_not_remapped),
    Planted("ct-ignore-regex-dropped", "compressed-tensors ignore entries written as re: patterns never match "
            "(exact names alone honoured): the llm-compressor entry re:.*self_attn\\.linear_gate$ misses the "
            "draft's bf16 gate, which is built FP8", CT_CHANNEL, m_nothing_after_load, "loading",
            build_patch=ct_ignore_regex_dropped),
    # attn.out
    Planted("gate-no-sigmoid", "output gate multiplies by the raw linear_gate output (sigmoid skipped)", K1,
            m_gate_no_sigmoid, "attention"),
    Planted("headwise-gate-tiled", "headwise gate broadcast with repeat instead of repeat_interleave "
            "(gate of head h lands on other heads' columns)", HEADWISE, m_headwise_gate_tiled, "attention"),
)
