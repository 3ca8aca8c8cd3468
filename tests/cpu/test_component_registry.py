"""The component registry (harness/components.py) is the one list: every derived list equals
the registry's derivation, and keeps the invariants stated below (the reference's trace holds
exactly the trace components, integer quantities are compared as sets or exactly, every judged
value has a tolerance per precision that says what it absorbs, FP8 only widens, planted bugs
sit in their component's area). The production hooks derived from it record exactly the
components they declare (on a stand-in model with vLLM 0.33's module names)."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from harness import components as C
from harness.components import REGISTRY

def _names(pred) -> list[str]:
    return [c.name for c in REGISTRY if pred(c)]


def test_registry_records_are_well_formed():
    names = [c.name for c in REGISTRY]
    assert len(names) == len(set(names))
    for c in REGISTRY:
        assert c.compare in ("values", "index", "token", "tie-bound"), c.name
        assert c.production in (None, "hook", "derived", "runner"), c.name
        assert c.tp in ("replicated", "head-sharded", "partial-sum"), c.name
        assert set(c.tolerance) <= set(C.PRECISIONS), c.name
        if c.compare in ("values", "tie-bound") and c.production is not None:
            assert "bf16" in c.tolerance, f"{c.name}: judged by value without a bf16 tolerance"
        if c.production == "hook":
            assert c.hooks, f"{c.name}: production reads it through a hook, none declared"
        for h in c.hooks:
            assert h.kind in ("out", "in", "topk-buffer", "indexer-topk", "router"), (c.name, h)
        # the reference function exists
        mod, fn = c.reference.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(mod), fn)), c.reference


def test_derived_lists_equal_the_registry():
    from harness import trace_compare
    from harness.production.engine import draft_replay
    from harness.goldens import production as production_goldens
    from harness.production.tp import multigpu
    from harness.production.judging import tolerances

    assert trace_compare.COMPONENTS == tuple(_names(lambda c: c.reference_trace))
    assert trace_compare.INDEX_COMPONENTS == tuple(_names(lambda c: c.compare == "index"))
    assert C.PRODUCTION_COMPONENTS == tuple(_names(lambda c: c.production is not None))
    assert production_goldens.STORED == C.PRODUCTION_COMPONENTS
    assert draft_replay.DIAGNOSTIC_COMPONENTS == tuple(_names(lambda c: c.diagnostic))
    assert multigpu.HEAD_SHARDED == tuple(_names(lambda c: c.tp == "head-sharded"))
    assert multigpu.PARTIAL_SUM == tuple(_names(lambda c: c.tp == "partial-sum"))
    for precision in C.PRECISIONS:
        table = tolerances.tolerances_for(precision)
        assert table == {c.name: c.tolerance.get(precision, c.tolerance["bf16"])
                         for c in REGISTRY if "bf16" in c.tolerance}
    assert [(h, names) for h, names in C.HOOKS] == [
        (h, tuple(n for c in REGISTRY for hh in c.hooks if hh == h for n in [hh.capture or c.name]))
        for h in dict.fromkeys(h for c in REGISTRY for h in c.hooks)]


# The invariants the derived lists keep, stated directly (they replace a snapshot of the lists as
# they were before the registry existed: adding a component is one record, not a snapshot edit).

@pytest.fixture(scope="module")
def reference_step0():
    """{component: tensor} of step 0 of the reference's own trace (tiny preset, 2 x 6 tokens)."""
    from harness.presets import preset
    from reference import MTPConfig, draft, flatten, make_case, numerics_by_name, random_weights

    cfg = MTPConfig.from_hf_dict(preset("tiny"))
    trace = flatten(draft(cfg, random_weights(cfg, 0), make_case(cfg, 0, 2, 6), 2, numerics_by_name("float64")))
    return {k.split(".", 1)[1]: v for k, v in trace.items() if k.startswith("step0.")}


STEP_INPUTS = {"input_ids", "positions", "hidden_in"}  # what a step is given, not what it computes


def test_the_reference_trace_holds_exactly_the_trace_components(reference_step0):
    from harness import trace_compare

    computed = set(reference_step0) - STEP_INPUTS
    assert set(trace_compare.COMPONENTS) == computed, (set(trace_compare.COMPONENTS) ^ computed)
    assert len(trace_compare.COMPONENTS) == len(set(trace_compare.COMPONENTS))
    # compared as sets or exactly: the integer-valued quantities, and only those
    integer = {n for n in computed if not reference_step0[n].is_floating_point()}
    assert {c.name for c in REGISTRY if c.compare in ("index", "token")} == integer
    assert set(trace_compare.INDEX_COMPONENTS) == integer - {"draft_token"}
    # what the reference does not store is derived from what it does, by the judge
    for c in REGISTRY:
        if not c.reference_trace:
            assert c.production == "derived", c.name


def test_every_judged_value_has_a_tolerance_in_every_precision():
    from harness.production.judging import tolerances

    tables = tolerances.GPU_VS_REFERENCE_BY_QUANT
    assert tuple(tables) == C.PRECISIONS
    judged = {c.name for c in REGISTRY if c.production is not None and c.compare == "values"}
    for precision, table in tables.items():
        assert judged <= set(table), (precision, judged - set(table))
        assert set(table) == {c.name for c in REGISTRY if c.tolerance}, precision
        for name, t in table.items():
            assert t.why.strip() and 0 <= t.atol < 1 and 0 <= t.rtol <= 1, (precision, name, t)
    assert set(tolerances.tolerances_for("modelopt-fp8-pb")) == set(tables["fp8"])


def test_fp8_tolerances_widen_the_bf16_ones_and_nothing_else():
    from harness.production.judging import tolerances

    bf16 = tolerances.GPU_VS_REFERENCE
    for precision in C.PRECISIONS[1:]:
        table = tolerances.GPU_VS_REFERENCE_BY_QUANT[precision]
        for c in REGISTRY:
            if not c.tolerance:
                continue
            if precision in c.tolerance:  # widened: more atol, the same rtol, the bf16 reason kept
                t = table[c.name]
                assert t.atol >= bf16[c.name].atol and t.rtol == bf16[c.name].rtol, (precision, c.name)
                assert t.why.startswith(bf16[c.name].why) and "FP8" in t.why, (precision, c.name)
            else:  # left alone: the bf16 object itself
                assert table[c.name] is bf16[c.name], (precision, c.name)
        # before the first FP8 GEMM nothing is FP8-rounded yet: these keep their bf16 entries
        for name in ("embed", "embed_masked", "enorm", "hnorm", "eh_proj"):
            assert table[name] is bf16[name], (precision, name)


def test_tp_merge_rules_cover_what_tp_splits():
    """Head-sharded: per-head quantities (attention queries, core, gate); a partial sum: the one
    row-parallel output summed across ranks that production exposes before its all-reduce."""
    assert set(C.HEAD_SHARDED) == {"attn.q", "attn.core", "attn.gate"}
    assert C.PARTIAL_SUM == ("moe.shared",)
    assert not set(C.HEAD_SHARDED) & set(C.PARTIAL_SUM)


def test_each_planted_bug_lives_in_its_component_s_area():
    from harness import mutants

    def area(component: str) -> str:
        prefix = component.split(".", 1)[0]
        return {"attn": "attention", "indexer": "indexer", "moe": "moe", "mlp": "moe"}.get(prefix, "mtp_io")

    for m in (*mutants.CATALOGUE, *mutants.GOLDEN_CATALOGUE):
        assert m.apply.__module__ == f"harness.mutants.{area(m.component)}", (m.name, m.apply.__module__)
        if m.cpu_apply is not None:
            assert m.cpu_apply.__module__ == "harness.mutants.cpu", m.name
        assert m.group and m.stands_for, m.name


def test_every_regime_says_why_and_when_it_counts():
    import math

    from harness.regimes import REGIMES

    for name, r in REGIMES.items():
        assert r.why.strip(), name
        assert r.threshold is None or (math.isfinite(r.threshold) and r.threshold > 0), (name, r.threshold)
    assert any(r.threshold is not None for r in REGIMES.values())


def test_mutant_catalogue_is_the_registry_s():
    from harness import mutants

    assert [m.name for m in mutants.CATALOGUE] == [n for c in REGISTRY for n in c.mutants]
    for m in mutants.CATALOGUE:
        assert m.name in C.BY_NAME[m.component].mutants, m.name
    assert C.component_of_mutant() == {m.name: m.component for m in mutants.CATALOGUE}


def test_every_regime_names_its_components():
    from harness.regimes import REGIMES

    named = {r for c in REGISTRY for r in c.regimes}
    assert named == set(REGIMES), (named ^ set(REGIMES))
    for name in REGIMES:
        assert C.components_exercised_by(name), name


# ---- the hooks on a stand-in with vLLM 0.33's module names ------------------------------------

class _Lin(nn.Linear):
    def forward(self, x):  # vLLM's linear layers return (output, bias)
        return super().forward(x), None


class _Norm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(n))

    def forward(self, x, residual=None):
        y = (x if residual is None else x + residual) * self.weight
        return y if residual is None else (y, x)


class _MLA(nn.Module):
    def forward(self, q, kv_c, k_pe):
        return q[:, :, :4].reshape(q.shape[0], -1) + kv_c.sum(-1, keepdim=True)


class _IndexerOp(nn.Module):
    def __init__(self, buf):
        super().__init__()
        self.buf = buf

    def forward(self, x, q_fp8, k, weights):
        self.buf[: x.shape[0]] = torch.arange(x.shape[0] * 3).reshape(-1, 3).int()
        return self.buf


class _Router:
    def select_experts(self, x, logits):
        w, ids = torch.topk(logits.sigmoid(), 2)
        return w, ids.int()


def _stand_in(*, hpc: bool = False, router: bool = True):
    torch.manual_seed(0)
    h, nh = 8, 2
    buf = torch.zeros(16, 3, dtype=torch.int32)
    sa = nn.Module()
    sa.q_a_layernorm, sa.kv_a_layernorm = _Norm(h), _Norm(h)
    sa.mla_attn = _MLA()
    sa.mla_attn.impl = type("Impl", (), {"topk_indices_buffer": buf})()
    sa.is_sparse, sa.use_hpc_gated_mla = True, hpc
    sa.linear_gate, sa.o_proj = _Lin(h, nh * 4), _Lin(nh * 4, h)
    sa.indexer = nn.Module()
    sa.indexer.indexer_op, sa.indexer.wk_weights_proj = _IndexerOp(buf), _Lin(h, 6)
    sa.indexer.topk_indices_buffer = buf
    mlp = nn.Module()
    mlp.gate, mlp.shared_experts = _Lin(h, 4), _Lin(h, h)
    mlp.experts = nn.Module()
    mlp.experts.quant_method = type("QM", (), {})()
    if router:
        mlp.experts.quant_method.router = _Router()
    blk = nn.Module()
    blk.self_attn, blk.mlp, blk.post_attention_layernorm = sa, mlp, _Norm(h)
    layer = nn.Module()
    layer.enorm, layer.hnorm, layer.eh_proj, layer.final_layernorm = _Norm(h), _Norm(h), _Lin(2 * h, h), _Norm(h)
    layer.mtp_block = blk
    inner = nn.Module()
    inner.embed_tokens, inner.layers = nn.Embedding(10, h), nn.ModuleDict({"3": layer})
    model = nn.Module()
    model.model = inner
    return model


def _run(model) -> dict:
    """One forward through the stand-in in vLLM's order; the values each hook should see."""
    inner = model.model
    layer = inner.layers["3"]
    sa, mlp = layer.mtp_block.self_attn, layer.mtp_block.mlp
    ids, hid = torch.tensor([0, 3, 4]), torch.randn(3, 8)
    v = {"embed": inner.embed_tokens(ids)}
    v["embed_masked"] = v["embed"] * torch.tensor([0.0, 1, 1])[:, None]
    v["enorm"], v["hnorm"] = layer.enorm(v["embed_masked"]), layer.hnorm(hid)
    v["eh_proj"] = layer.eh_proj(torch.cat([v["enorm"], v["hnorm"]], -1))[0]
    v["attn.q_c"], v["attn.kv_c"] = sa.q_a_layernorm(v["eh_proj"]), sa.kv_a_layernorm(v["eh_proj"])
    kw = sa.indexer.wk_weights_proj(v["eh_proj"])[0]
    v["indexer.kw"] = kw
    q8, k, w = torch.randn(3, 2, 4).to(torch.float8_e4m3fn), torch.randn(3, 4), torch.randn(3, 2)
    v["indexer.q_fp8"], v["indexer.k"], v["indexer.weights"] = q8, k, w
    v["indexer.topk"] = sa.indexer.indexer_op(v["eh_proj"], q8, k, w)[:3].clone()
    q, k_pe = torch.randn(3, 2, 6), torch.randn(3, 1, 2)
    v["attn.q"], v["attn.k_pe"], v["attn.topk"] = q, k_pe.reshape(3, -1), v["indexer.topk"]
    v["attn.core"] = sa.mla_attn(q, v["attn.kv_c"], k_pe)
    v["attn.gate"] = torch.sigmoid(sa.linear_gate(v["eh_proj"])[0])
    v["attn.out"] = sa.o_proj(v["attn.core"] * v["attn.gate"])[0]
    v["attn.residual"] = v["attn.out"] + v["eh_proj"]
    x = layer.mtp_block.post_attention_layernorm(v["attn.residual"])
    mlp.forward = lambda x_: mlp.shared_experts(x_)[0] + _route(mlp, x_)
    v["moe.router_logits"] = mlp.gate(x)[0]
    v["moe.topk_weights"], v["moe.topk_ids"] = _Router().select_experts(x, v["moe.router_logits"])
    v["moe.shared"] = mlp.shared_experts(x)[0]
    v["mlp.out"] = mlp(x)
    v["final_norm"] = layer.final_layernorm(v["mlp.out"], v["attn.residual"])[0]
    return v


def _route(mlp, x):
    logits = mlp.gate(x)[0]
    router = getattr(mlp.experts.quant_method, "router", None)
    if router is not None:
        router.select_experts(x, logits)
    return logits.sum(-1, keepdim=True)


def test_hooks_record_every_hooked_component():
    from harness.production.module import capture

    model = _stand_in()
    rec = capture.Recorder()
    notes = capture.attach(model, rec)
    want = _run(model)
    assert notes == []
    hooked = {n for _, names in C.HOOKS for n in names}
    assert set(rec.trace) == set(want) == hooked
    for name, value in want.items():
        got = rec.trace[name]
        assert got.dtype == value.dtype and torch.equal(got.float(), value.detach().float()), name
    rec.remove()
    rec.trace.clear()
    _run(model)
    assert not rec.trace, "remove() left a hook behind"
    assert "select_experts" not in vars(model.model.layers["3"].mtp_block.mlp.experts.quant_method.router)


def test_hooks_note_what_they_cannot_observe():
    from harness.production.module import capture

    model = _stand_in(hpc=True, router=False)
    rec = capture.Recorder()
    notes = capture.attach(model, rec)
    assert notes == ["attn.gate: HPC fused gated-MLA GEMM in use; gate not observable",
                     "moe.topk_ids: no router with select_experts found"]
    _run(model)
    assert "moe.topk_ids" not in rec.trace and "attn.gate" in rec.trace
    rec.remove()


@pytest.mark.parametrize("drop", ["q_a_layernorm", "linear_gate", "indexer"])
def test_optional_modules_absent(drop):
    from harness.production.module import capture

    model = _stand_in()
    sa = model.model.layers["3"].mtp_block.self_attn
    setattr(sa, drop, None)
    rec = capture.Recorder()
    capture.attach(model, rec)
    rec.remove()
