"""The FP8 KV cache (``reference.kv_cache``: vLLM's fp8_ds_mla rows) on CPU.

- the scale writer / reader convention, as a property: whatever latent a row holds (zeros, huge,
  tiny, mixed signs, tiles of very different magnitudes), the writer's tile scales are the
  smallest powers of two >= max(amax / 448, 1e-4), the reader recovers every value within half an
  e4m3 step of it, the rope comes back bit for bit, and the bytes sit where vLLM's row puts them;
- the planted reader / writer bugs of ``harness.mutants.attention`` (kv-fp8-*) break that
  convention, and the side-by-side verdict names the attention component they should flag first
  when they are planted in an emulated production trace; on a stand-in attention impl holding a
  packed cache, each GPU mutant edits what it says and is undone.

vLLM exposes no CPU path for this layout (the writer is the CUDA op ``concat_and_cache_mla``,
the readers FlashMLA's decode kernel and ``cp_gather_and_upconvert_fp8_kv_cache``), so the
reference's writer is checked against vLLM's on the GPU only: the module case's ``attn.kv_cache``
(tiny-k2-long-fp8kv) compares production's rows with it, exactly.
"""

from __future__ import annotations

import dataclasses
import types
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from reference import kv_cache as K

BF16_MAX = float(torch.finfo(torch.bfloat16).max)


@st.composite
def latent_rows(draw):
    """[rows, 512] bf16 latents: per tile a pattern (random, all zero, one spike, constant) times a
    per-tile power of two from 2^-133 (bf16 subnormals) to 2^120 (amax near bf16's max)."""
    rows = draw(st.integers(1, 3))
    base = draw(hnp.arrays(np.float32, (rows, K.TILES, K.TILE),
                           elements=st.floats(-4.0, 4.0, width=32, allow_subnormal=False)))
    x = torch.from_numpy(base).double()
    for r in range(rows):
        for t in range(K.TILES):
            kind = draw(st.sampled_from(["random", "zero", "spike", "constant", "random"]))
            if kind == "zero":
                x[r, t] = 0.0
            elif kind == "spike":
                x[r, t] = 0.0
                x[r, t, draw(st.integers(0, K.TILE - 1))] = draw(st.sampled_from([-1.0, 1.0])) * 3.0
            elif kind == "constant":
                x[r, t] = draw(st.floats(-4.0, 4.0, width=32))
            x[r, t] *= 2.0 ** draw(st.integers(-133, 120))
    return x.clamp(-BF16_MAX, BF16_MAX).to(torch.bfloat16).reshape(rows, K.NOPE)


@st.composite
def rope_rows(draw, rows: int):
    vals = draw(hnp.arrays(np.float32, (rows, K.ROPE), elements=st.floats(-2.0 ** 127, 2.0 ** 127, width=32)))
    return torch.from_numpy(vals).to(torch.bfloat16)


def half_step_bound(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Half an e4m3 step at each x / s_t, times s_t: the most a round to nearest can move x.

    e4m3 keeps 3 mantissa bits: for |x / s| >= 2^-6 (normal) the step at x is 2^(e - 3) with
    2^e <= |x/s|, so half of it is at most 2^-4 |x| (relative 2^-4 of the tile-scaled value);
    below 2^-6 (subnormal) the step is 2^-9, so the error is at most 2^-10 s_t."""
    s_el = s.double().repeat_interleave(K.TILE, -1)
    return torch.maximum(2.0 ** -4 * x.double().abs(), 2.0 ** -10 * s_el)


@given(data=st.data())
def test_the_reader_recovers_what_the_writer_stored_within_half_an_e4m3_step(data):
    x = data.draw(latent_rows())
    pe = data.draw(rope_rows(x.shape[0]))
    rows = K.pack_rows(x, pe)
    assert rows.dtype == torch.uint8 and rows.shape == (x.shape[0], 656)
    q, s, rope = K.unpack_rows(rows)
    # the writer's scale: the smallest power of two >= max(amax / 448, 1e-4), per tile
    amax = x.float().reshape(-1, K.TILES, K.TILE).abs().amax(-1).double()
    raw = torch.maximum(amax / 448.0, torch.full_like(amax, float(torch.tensor(1e-4, dtype=torch.float32))))
    s64 = s.double()
    assert torch.equal(torch.exp2(torch.round(torch.log2(s64))), s64), "tile scales are powers of two"
    assert bool((s64 >= raw).all()) and bool((s64 < 2 * raw).all()), (s64, raw)
    # the reader: q * s per tile, within half an e4m3 step of the written value; no saturation
    got = K.read_rows(rows)
    err = (got[:, :K.NOPE] - x.double()).abs()
    assert bool((err <= half_step_bound(x, s)).all()), float((err - half_step_bound(x, s)).max())
    assert bool((q.float().abs() <= 448).all())
    # dequantized values are exact in bf16 (power-of-two scales): the kernels' bf16 read adds nothing
    assert torch.equal(got[:, :K.NOPE].to(torch.bfloat16).double(), got[:, :K.NOPE])
    # the rope is stored verbatim: bit-exact bf16, at bytes 528..655
    assert torch.equal(rope.view(torch.int16), pe.view(torch.int16))
    assert torch.equal(rows[:, K.ROPE_AT:], pe.contiguous().view(torch.uint8))
    # the latent bytes are the e4m3 codes, the scales float32 at 512..527 in tile order
    assert torch.equal(rows[:, :K.NOPE].view(torch.float8_e4m3fn).float(), q.float())
    assert torch.equal(rows[:, K.SCALE_AT:K.ROPE_AT].contiguous().view(torch.float32), s)


@given(data=st.data())
def test_e4m3_rounding_is_torch_s_cast_and_round_to_nearest_even(data):
    """``round_e4m3`` (float64 arithmetic) equals torch's float32 -> e4m3 cast where float32 holds
    the value, and is the nearest e4m3 value (ties to the even code)."""
    v = torch.from_numpy(data.draw(hnp.arrays(np.float32, (64,), elements=st.floats(-448, 448, width=32))))
    ours = K.round_e4m3(v.double())
    assert torch.equal(ours, v.to(torch.float8_e4m3fn).double())
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    grid = grid[torch.isfinite(grid)]
    dist = (grid[None, :] - v.double()[:, None]).abs()
    assert torch.equal((ours - v.double()).abs(), dist.min(-1).values)


def test_the_writer_is_vllm_0_33_s_rule_on_a_hand_worked_row():
    """Tile 0 amax 3.0 -> 3/448 = 0.0067 -> 2^-7; tile 1 all zero -> the 1e-4 floor -> 2^-13; tile 2
    amax 448 * 2^-3 exactly -> 2^-3 (a power of two is kept); tile 3 amax 1000 -> 2.23 -> 4."""
    x = torch.zeros(1, 512, dtype=torch.float64)
    x[0, 0], x[0, 1] = 3.0, -0.01
    x[0, 256] = 56.0
    x[0, 384], x[0, 385] = -1000.0, 1.0
    q, s = K.quantize_latent(x.to(torch.bfloat16))
    assert s.tolist() == [[2.0 ** -7, 2.0 ** -13, 2.0 ** -3, 4.0]]
    assert q[0, 0].float() == 384.0 and q[0, 1].float() == -1.25  # 3/2^-7 = 384; -0.01*128 = -1.28 -> -1.25
    assert q[0, 256].float() == 448.0 and q[0, 384].float() == -256.0 and q[0, 385].float() == 0.25


def test_kv_cache_dtype_names_and_the_stored_values():
    assert [K.canonical(d) for d in ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla")] == \
        ["bf16", "bf16", "fp8_ds_mla", "fp8_ds_mla", "fp8_ds_mla"]
    from reference import ConfigError, DraftCache
    for bad in ("fp8_e5m2", "nvfp4_ds_mla", "int8"):
        with pytest.raises(ConfigError, match=bad):
            DraftCache(bad)
    g = torch.Generator().manual_seed(0)
    kv_c = torch.randn(5, 512, generator=g, dtype=torch.float64)
    pe = torch.randn(5, 64, generator=g, dtype=torch.float64)
    assert K.stored_kv("auto", kv_c, pe) == (kv_c, pe)
    c8, p8 = K.stored_kv("fp8", kv_c, pe)
    assert c8.dtype == torch.float64 and not torch.equal(c8, kv_c)
    assert torch.equal(p8, pe.to(torch.bfloat16).double())  # the rope stored as bf16
    assert torch.equal(c8, K.read_rows(K.pack_rows(kv_c, pe))[:, :512])


# ---- the planted bugs: the convention they break, and the verdict that must name them ------------

def _reader(edit):
    """``stored_kv`` with the reader's scales passed through ``edit`` (a reader bug)."""
    def stored(kv_cache_dtype, kv_c, k_pe):
        q, s = K.quantize_latent(kv_c)
        return K.dequantize_latent(q, edit(s)).to(kv_c.dtype), k_pe.to(torch.bfloat16).to(k_pe.dtype)
    return stored


@given(x=latent_rows())
def test_a_reader_in_another_convention_does_not_recover_tiles_of_different_scales(x):
    from harness.mutants import attention as A

    q, s = K.quantize_latent(x)
    bound = half_step_bound(x, s)
    for edit in (A.scale_reciprocal, A.scale_wrong_tile, A.scale_per_row):
        got = K.dequantize_latent(q, edit(s))
        err = (got - x.double()).abs()
        # a value misread: its tile's scale differs from the one the reader takes (by a factor 2^k,
        # k != 0: every scale is a power of two), and its code is an e4m3 normal (|q| >= 2^-6), so
        # |q s' - x| >= |q s| / 2 - 2^-4 |x| > 2^-4 |x|; a subnormal code may land near x by chance
        misread = (edit(s) != s).repeat_interleave(K.TILE, -1) & (q.float().abs() >= 2.0 ** -6)
        assert bool((err[misread] > bound[misread]).all()), edit.__name__
        same = ~(edit(s) != s).repeat_interleave(K.TILE, -1)
        assert torch.equal(got[same], K.dequantize_latent(q, s)[same]), edit.__name__


@pytest.fixture(scope="module")
def short_fp8kv_case():
    """tiny-k2-long-fp8kv with 2 x 24 tokens (every key selected: top-k 128 > the context): the
    verdict's machinery on an emulated production trace in about a second."""
    from harness import case_registry
    gpu_cases = case_registry.specs(kind="module", without="probe")

    return dataclasses.replace(gpu_cases["tiny-k2-long-fp8kv"], id="fp8kv-short", tokens=24)


def _verdict(case, trace):
    from harness.production.judging.trace_judge import judge
    return judge(case, trace, {})


def test_the_emulated_fp8kv_production_passes_and_a_bf16_reference_is_not_what_it_serves(short_fp8kv_case):
    from harness.production.judging import kv_fp8_emulation as E

    res = _verdict(short_fp8kv_case, E.emulated_trace(short_fp8kv_case))
    assert res.passed, res.details["table"]
    kv_rows = [r for r in res.rows if r["key"].endswith("attn.kv_cache")]
    assert len(kv_rows) == short_fp8kv_case.steps and all(r["max_abs_vs_exact"] == 0 for r in kv_rows)
    # a production served with an FP8 cache whose rows were not recorded is not judged as passing
    bare = {k: v for k, v in E.emulated_trace(short_fp8kv_case).items() if not k.endswith("attn.kv_cache_rows")}
    res = _verdict(short_fp8kv_case, bare)
    assert not res.passed and res.first_divergent == "step0.attn.kv_cache"


@pytest.mark.parametrize("name", ["kv-fp8-scale-reciprocal", "kv-fp8-scale-wrong-tile", "kv-fp8-scale-per-row",
                                  "kv-fp8-rope-quantised"])
def test_each_planted_fp8kv_bug_in_an_emulated_production_fails_naming_its_component(name, short_fp8kv_case):
    from harness import mutants as M
    from harness.mutants import attention as A
    from harness.production.judging import kv_fp8_emulation as E

    case = short_fp8kv_case
    if name == "kv-fp8-rope-quantised":  # the writer's bug: the rows production records
        trace = E.emulated_trace(case)
        for k in range(case.steps):
            rows = trace[f"step{k}.attn.kv_cache_rows"].clone()
            rope = rows[:, K.ROPE_AT:].contiguous().view(torch.bfloat16)
            rows[:, K.ROPE_AT:] = A.rope_quantised(rope).contiguous().view(torch.uint8)
            trace[f"step{k}.attn.kv_cache_rows"] = rows
    else:  # the reader's bug: what production's attention reads back
        edit = {"kv-fp8-scale-reciprocal": A.scale_reciprocal, "kv-fp8-scale-wrong-tile": A.scale_wrong_tile,
                "kv-fp8-scale-per-row": A.scale_per_row}[name]
        with mock.patch.object(K, "stored_kv", _reader(edit)):
            trace = E.emulated_trace(case)
    res = _verdict(case, trace)
    assert not res.passed
    assert res.first_divergent == f"step0.{M.BY_NAME[name].component}", (name, res.first_divergent)


def _stand_in_ctx():
    """A ``Ctx`` over a stand-in MTP layer whose attention impl holds a packed fp8_ds_mla cache and
    records the tile scales its forward_mqa reads; do_kv_cache_update is the reference's writer."""
    from harness import mutants as M

    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 512, generator=g) * torch.tensor([0.5, 2.0, 8.0, 0.1]).repeat_interleave(128)
    pe = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    cache = torch.zeros(1, 64, 656, dtype=torch.uint8)
    cache.view(-1, 656)[:6] = K.pack_rows(x.to(torch.bfloat16), pe)
    seen = {}

    class Impl:
        kv_cache_dtype = "fp8_ds_mla"

        def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
            seen["scales"] = kv_c_and_k_pe_cache.view(-1, 656)[:6, 512:528].contiguous().view(torch.float32).clone()
            return q, None

        def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale, skip=False):
            kv_cache.view(-1, 656)[slot_mapping.long()] = K.pack_rows(kv_c_normed, k_pe.squeeze(1))

    impl = Impl()
    layer = types.SimpleNamespace(mtp_block=types.SimpleNamespace(self_attn=types.SimpleNamespace(
        mla_attn=types.SimpleNamespace(impl=impl))))
    model = types.SimpleNamespace(model=types.SimpleNamespace(layers={"2": layer}))
    sess = types.SimpleNamespace(model=model, hf_config={}, vllm_config=None)
    return M.Ctx(sess), impl, cache, seen, (x.to(torch.bfloat16), pe)


@pytest.mark.parametrize("name", ["kv-fp8-scale-reciprocal", "kv-fp8-scale-wrong-tile", "kv-fp8-scale-per-row"])
def test_a_gpu_reader_mutant_shows_the_kernel_the_wrong_scales_and_puts_them_back(name):
    from harness import mutants as M
    from harness.mutants import attention as A

    ctx, impl, cache, seen, _ = _stand_in_ctx()
    stored = cache.view(-1, 656)[:6, 512:528].contiguous().view(torch.float32).clone()
    before = cache.clone()
    M.BY_NAME[name].apply(ctx)
    impl.forward_mqa(torch.zeros(1), cache, None, None)
    edit = {"kv-fp8-scale-reciprocal": A.scale_reciprocal, "kv-fp8-scale-wrong-tile": A.scale_wrong_tile,
            "kv-fp8-scale-per-row": A.scale_per_row}[name]
    assert torch.equal(seen["scales"], edit(stored)) and not torch.equal(seen["scales"], stored)
    assert torch.equal(cache, before), "the rows the runner records afterwards are the writer's"
    ctx.restore()
    impl.forward_mqa(torch.zeros(1), cache, None, None)
    assert torch.equal(seen["scales"], stored)


def test_the_gpu_rope_mutant_quantizes_the_rows_just_written_and_is_undone():
    from harness import mutants as M

    ctx, impl, cache, _, (x, pe) = _stand_in_ctx()
    M.BY_NAME["kv-fp8-rope-quantised"].apply(ctx)
    slots = torch.tensor([10, 11, -1])
    impl.do_kv_cache_update(x[:3], pe[:3, None], cache, slots, "fp8_ds_mla", None)
    rows = cache.view(-1, 656)
    got = rows[10:12, K.ROPE_AT:].contiguous().view(torch.bfloat16)
    assert torch.equal(got, pe[:2].float().to(torch.float8_e4m3fn).to(torch.bfloat16))
    assert torch.equal(rows[10:12, :K.ROPE_AT], K.pack_rows(x[:2], pe[:2])[:, :K.ROPE_AT])  # latent untouched
    ctx.restore()
    impl.do_kv_cache_update(x[:2], pe[:2, None], cache, torch.tensor([20, 21]), "fp8_ds_mla", None)
    assert torch.equal(rows[20:22], K.pack_rows(x[:2], pe[:2]))


def test_fp8kv_mutants_refuse_a_bf16_cache():
    from harness import mutants as M

    ctx, impl, _, _, _ = _stand_in_ctx()
    impl.kv_cache_dtype = "auto"
    for name in ("kv-fp8-scale-reciprocal", "kv-fp8-rope-quantised"):
        with pytest.raises(M.MutantNotApplicable, match="not served with an FP8 KV cache"):
            M.BY_NAME[name].apply(ctx)


def test_fp8kv_tolerances_widen_the_bf16_ones_downstream_of_the_cache_and_say_so():
    from harness.components import KV_CACHE_FP8_ATOL, ORDER, PRECISIONS, tolerance_table

    for precision in PRECISIONS:
        base, kv = tolerance_table(precision), tolerance_table(precision, "fp8")
        assert tolerance_table(precision, "auto") is base and tolerance_table(precision, "fp8_ds_mla") == kv
        assert set(kv) == set(base)
        for name, t in kv.items():
            if name in KV_CACHE_FP8_ATOL:  # widened: more atol, the same rtol, the reason kept and extended
                assert t.atol >= base[name].atol and t.rtol == base[name].rtol, name
                assert t.why.startswith(base[name].why) and "FP8 KV cache" in t.why, name
            else:
                assert t is base[name], name
    # only what reads the cached latent, and what follows it, is widened
    assert all(ORDER.index(n) >= ORDER.index("attn.core") for n in KV_CACHE_FP8_ATOL)
    kv_tol = tolerance_table("bf16", "fp8")["attn.kv_cache"]
    assert kv_tol.atol == 0 == kv_tol.rtol
    with pytest.raises(KeyError, match="fp8_e5m2"):
        tolerance_table("bf16", "fp8_e5m2")


def test_an_engine_case_served_with_fp8_whose_draft_ran_another_cache_fails():
    from harness.production.engine.generation_judge import verdict_problems

    def rep(stored):
        return {"counts": {"compared": 3, "max_context": 200, "index_topk": 128, "num_speculative_tokens": 1,
                           "max_draft_steps": 1},
                "load": {"landed": {"w": True}}, "case": {"kv_cache_dtype": "fp8"}, "kv_cache": stored}
    assert verdict_problems(rep({"model.layers.2.mtp_block.self_attn": "fp8_ds_mla"})) == []
    for stored in ({"model.layers.2.mtp_block.self_attn": "auto"}, {}):
        assert any("not exercised" in p for p in verdict_problems(rep(stored))), stored
