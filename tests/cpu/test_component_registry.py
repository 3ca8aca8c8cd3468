"""The component registry (harness/components.py) is the one list: every derived list equals
the registry's derivation, and equals what the scattered lists held before the registry existed
(``data/component_lists_before_registry.json``, recorded from the tree before the move). The
production hooks derived from it record exactly the components they did (on a stand-in model
with vLLM 0.33's module names)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from harness import components as C
from harness.components import REGISTRY

BEFORE = json.loads((Path(__file__).parent / "data" / "component_lists_before_registry.json").read_text())


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
    from harness import compare
    from harness.production.engine import replay as engine_replay
    from harness.production.goldens import goldens_gpu
    from harness.production.tp import multigpu
    from harness.production.verdict import tolerances

    assert compare.COMPONENTS == tuple(_names(lambda c: c.reference_trace))
    assert compare.INDEX_COMPONENTS == tuple(_names(lambda c: c.compare == "index"))
    assert C.PRODUCTION_COMPONENTS == tuple(_names(lambda c: c.production is not None))
    assert goldens_gpu.STORED == C.PRODUCTION_COMPONENTS
    assert engine_replay.DIAGNOSTIC_COMPONENTS == tuple(_names(lambda c: c.diagnostic))
    assert multigpu.HEAD_SHARDED == tuple(_names(lambda c: c.tp == "head-sharded"))
    assert multigpu.PARTIAL_SUM == tuple(_names(lambda c: c.tp == "partial-sum"))
    for precision in C.PRECISIONS:
        table = tolerances.tolerances_for(precision)
        assert table == {c.name: c.tolerance.get(precision, c.tolerance["bf16"])
                         for c in REGISTRY if "bf16" in c.tolerance}
    assert [(h, names) for h, names in C.HOOKS] == [
        (h, tuple(n for c in REGISTRY for hh in c.hooks if hh == h for n in [hh.capture or c.name]))
        for h in dict.fromkeys(h for c in REGISTRY for h in c.hooks)]


def test_derived_lists_equal_the_lists_before_the_registry():
    from harness import compare, mutants, regimes
    from harness.production.engine import replay as engine_replay
    from harness.production.goldens import goldens_gpu
    from harness.production.tp import multigpu
    from harness.production.verdict import tolerances

    assert list(compare.COMPONENTS) == BEFORE["COMPONENTS"]
    assert list(compare.INDEX_COMPONENTS) == BEFORE["INDEX_COMPONENTS"]
    assert list(C.PRODUCTION_COMPONENTS) == BEFORE["PRODUCTION_COMPONENTS"]
    assert list(engine_replay.DIAGNOSTIC_COMPONENTS) == BEFORE["DIAGNOSTIC_COMPONENTS"]
    assert list(goldens_gpu.STORED) == BEFORE["GOLDENS_STORED"]
    assert list(multigpu.HEAD_SHARDED) == BEFORE["HEAD_SHARDED"]
    assert list(multigpu.PARTIAL_SUM) == BEFORE["PARTIAL_SUM"]
    tables = tolerances.GPU_VS_REFERENCE_BY_QUANT
    assert {q: {c: [t.atol, t.rtol, t.why] for c, t in tab.items()} for q, tab in tables.items()} \
        == BEFORE["TOLERANCES"]
    # the FP8 tables share the bf16 Tolerance objects where FP8 does not widen
    assert {q: sorted(c for c, t in tab.items() if t is tolerances.GPU_VS_REFERENCE[c])
            for q, tab in tables.items()} == BEFORE["TOLERANCES_SHARED_WITH_BF16"]
    rows = [{**m.row(), "apply": m.apply.__name__, "cpu_apply": m.cpu_apply.__name__ if m.cpu_apply else None}
            for m in mutants.CATALOGUE]
    assert sorted(rows, key=lambda r: r["name"]) == sorted(BEFORE["MUTANTS"], key=lambda r: r["name"])
    assert {n: [r.threshold, r.why] for n, r in regimes.REGIMES.items()} == BEFORE["REGIMES"]


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
