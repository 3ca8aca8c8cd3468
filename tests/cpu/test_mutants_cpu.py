"""Mutation tests on CPU: vLLM's pure functions patched in process must be
flagged by the harness's reference-vs-vLLM cross-checks, and the catalogue
(``python -m harness mutants --list``) must be complete."""

from __future__ import annotations

import pytest

from harness import mutants as M
from harness.cli import main as cli_main


def test_catalogue_entries_complete():
    from harness.components import PRODUCTION_COMPONENTS

    assert len(M.CATALOGUE) >= 25
    assert len(M.BY_NAME) == len(M.CATALOGUE) + len(M.GOLDEN_CATALOGUE), "mutant names must be unique"
    assert M.GOLDEN_CATALOGUE, "a golden-only planted bug exists (bisect-check --baseline --plant)"
    for m in (*M.CATALOGUE, *M.GOLDEN_CATALOGUE):
        assert m.stands_for and m.component and m.case and callable(m.apply), m.name
        assert m.component in PRODUCTION_COMPONENTS, (m.name, m.component)
        assert M.case_by_id(m.case).id == m.case
        assert (m.cpu_apply is None) == (m.cpu_check is None), m.name
    groups = {m.group for m in M.CATALOGUE}
    assert {"loading", "attention", "indexer", "moe", "multistep", "tp"} <= groups


def test_list_subcommand(capsys):
    assert cli_main(["mutants", "--list"]) == 0
    out = capsys.readouterr().out
    for m in M.CATALOGUE:
        assert m.name in out


def test_unknown_mutant_is_usage_error(capsys):
    assert cli_main(["mutants", "--only", "no-such-mutant"]) == 2


def test_a_golden_only_mutant_is_not_run_against_the_reference(capsys):
    name = M.GOLDEN_CATALOGUE[0].name
    assert cli_main(["mutants", "--only", name]) == 2
    assert "bisect-check --baseline" in capsys.readouterr().err


def test_cannot_run_is_125(monkeypatch, capsys):
    from harness.production import can_run

    monkeypatch.setattr(can_run, "cannot_run_production_reason", lambda: "no CUDA device (test)")
    assert cli_main(["mutants", "--only", "sink-twice"]) == 125


# vLLM is imported when this module's first test runs, not at collection (every xdist worker collects
# the whole suite; `import vllm` costs ~5 s of CPU); where it is missing every test here skips, as the
# module-level importorskip did. VLLM_IN_PROCESS: tests/cpu/conftest.py runs these tests in one worker.
VLLM_IN_PROCESS = True


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    pytest.importorskip("vllm", reason="vLLM is not installed")

CPU_MUTANTS = [m for m in M.CATALOGUE if m.cpu_apply is not None]


def _check(kind: str) -> list[str]:
    if kind == "rope":
        return M.rope_cross_check("default") + M.rope_cross_check("deepseek_yarn")
    return M.routing_cross_check(seed=0) + M.routing_cross_check(seed=1, experts=16, topk=4)


@pytest.mark.parametrize("kind", ["rope", "routing"])
def test_cross_checks_clean_unmutated(kind):
    assert _check(kind) == []


@pytest.mark.parametrize("name", [m.name for m in CPU_MUTANTS])
def test_cpu_mutant_flagged(name):
    m = M.BY_NAME[name]
    with m.cpu_apply():
        problems = _check(m.cpu_check)
    assert problems, f"{name}: the {m.cpu_check} cross-check did not flag the mutant"
    # the patch is undone: the cross-check is clean again
    assert _check(m.cpu_check) == []


def test_run_catalogue_outcomes_and_report(monkeypatch, tmp_path):
    """The GPU driver's bookkeeping with the production run replaced: detected,
    missed, raised, not-applicable, control failure, budget."""
    import json

    from harness.verdict import Verdict

    def fake_run(case, mutant):
        if mutant is None:
            if case.id == "tiny-k2-headwise":
                raise RuntimeError("control boom")
            return Verdict(kind="module", passed=True, first_divergent=None, rows=[]), []
        if mutant.name == "sink-twice":
            return Verdict(kind="module", passed=True, first_divergent=None, rows=[]), []
        if mutant.name == "sink-dropped":
            raise M._RunRaised(RuntimeError("kernel said no")) from RuntimeError("kernel said no")
        if mutant.name == "softmax-scale-latent":
            raise M.MutantNotApplicable("impl.softmax_scale is missing")
        return Verdict(kind="module", passed=False, first_divergent=f"step0.{mutant.component}",
                       rows=[{"key": f"step0.{mutant.component}", "passed": False}]), []

    monkeypatch.setattr(M.driver, "_run", fake_run)
    # _free (gc.collect + CUDA cache release after each run) is counted, not run: a full gc.collect
    # in a worker holding the collected suite costs seconds each, and no fake run leaves garbage
    frees, real_free = [], M.driver._free
    monkeypatch.setattr(M.driver, "_free", lambda: frees.append(1))
    real_free()  # the real one runs on a CPU-only host (once)
    names = ["lm-head-zero", "sink-twice", "sink-dropped", "softmax-scale-latent", "headwise-gate-tiled"]
    report = tmp_path / "r.json"
    out = M.run_catalogue(M.select(names), report=str(report), log=lambda s: None)
    assert len(frees) == len(out["controls"]) + len(names)  # after every control and every mutant run
    got = {r["name"]: r for r in out["mutants"]}
    assert got["lm-head-zero"]["outcome"] == "detected" and got["lm-head-zero"]["expected_flagged"]
    assert got["sink-twice"]["outcome"] == "missed"
    assert got["sink-dropped"]["outcome"] == "detected (raised)" and "kernel said no" in got["sink-dropped"]["error"]
    assert got["softmax-scale-latent"]["outcome"] == "not-applicable"
    assert got["headwise-gate-tiled"]["outcome"] == "inconclusive (control failed)"
    assert not out["controls"]["tiny-k2-headwise"]["passed"]
    saved = json.loads(report.read_text())
    assert saved["summary"]["detected"] == 2 and saved["summary"]["missed"] == ["sink-twice"]
    assert saved["summary"]["not_applicable"] == ["softmax-scale-latent"]
    # exit code: 1 unless every selected mutant is detected
    monkeypatch.setattr("harness.production.can_run.cannot_run_production_reason", lambda: None)
    assert cli_main(["mutants", "--only", "lm-head-zero", "--report", str(report)]) == 0
    assert cli_main(["mutants", "--only", "lm-head-zero", "sink-twice"]) == 1
    out = M.run_catalogue(M.select(["lm-head-zero", "q-b-heads-rolled"]), budget_s=-1.0, log=lambda s: None)
    assert [r["outcome"] for r in out["mutants"]] == ["not-run", "not-run"]


def _fake_session(gating_type: str):
    """A stand-in for a loaded ProductionSession: modules and attributes named as
    vLLM 0.33's HYV4MTP names them (what the GPU mutants touch), tiny shapes."""
    import dataclasses
    import types

    import torch
    from torch import nn
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from harness.presets import preset

    hf = preset("tiny", gating_type=gating_type)
    h, nh, v = hf["hidden_size"], hf["num_attention_heads"], hf["v_head_dim"]
    qk = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]

    class Lin(nn.Module):
        def __init__(self, i, o):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(o, i, dtype=torch.bfloat16))

        def forward(self, x):
            return x @ self.weight.t(), None

    class Norm(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(n))
            self.eps = 1e-6

        def forward(self, x):
            return x * self.weight

    @dataclasses.dataclass(frozen=True)
    class MoeCfg:
        swiglu_limit: float | None = 10.0

    class Router:
        def __init__(self, bias):
            self.renormalize, self.routed_scaling_factor, self.e_score_correction_bias = True, 2.827, bias

        def select_experts(self, *a):
            raise NotImplementedError

    class QuantMethod:
        def __init__(self, bias):
            self.moe, self.router = MoeCfg(), Router(bias)

    class Experts(nn.Module):
        def __init__(self, bias):
            super().__init__()
            self.w13_weight = nn.Parameter(torch.randn(8, 256, 256, dtype=torch.bfloat16))
            self.swiglu_limit = 10.0
            self.quant_method = QuantMethod(bias)

    for cls in (MoeCfg, QuantMethod, Experts):
        cls.__module__ = "vllm.fake"
    vc = VllmConfig(device_config=DeviceConfig(device="cpu"))
    sa = nn.Module()
    with set_current_vllm_config(vc):
        sa.rotary_emb = get_rope(64, max_position=8192, is_neox_style=False,
                                 rope_parameters=dict(hf["rope_parameters"]), dtype=torch.bfloat16)
    sa.indexer_rope_emb = sa.rotary_emb
    sa.max_position_embeddings = 8192
    sa.kv_a_layernorm, sa.q_a_layernorm, sa.q_b_proj = Norm(512), Norm(256), Lin(256, nh * qk)
    sa.linear_gate = Lin(h, nh * (1 if gating_type == "headwise" else v))
    sa.o_proj, sa.use_hpc_gated_mla = Lin(nh * v, h), False
    sa.mla_attn = nn.Module()
    sa.mla_attn.impl = types.SimpleNamespace(sinks=torch.randn(nh), softmax_scale=qk ** -0.5)
    ix = nn.Module()
    ix.k_norm, ix.wk_weights_proj, ix.head_dim, ix.n_head = Norm(128), Lin(h, 128 + 32), 128, 32
    ix.indexer_op = nn.Module()
    ix.indexer_op.topk_tokens = 128
    sa.indexer = ix
    mlp = nn.Module()
    mlp.expert_bias = nn.Parameter(torch.randn(8))
    mlp.experts = Experts(mlp.expert_bias)
    mlp.shared_experts = nn.Module()
    mlp.shared_experts.act_fn = nn.Identity()
    blk = nn.Module()
    blk.self_attn, blk.mlp = sa, mlp
    layer = nn.Module()
    layer.mtp_block, layer.enorm, layer.hnorm, layer.eh_proj = blk, Norm(h), Norm(h), Lin(2 * h, h)
    layer.shared_head = nn.Module()
    layer.shared_head.head = Lin(h, 1024)
    inner = nn.Module()
    inner.layers, inner.embed_tokens = nn.ModuleDict({"2": layer}), nn.Embedding(10, h)
    inner.calls = []
    inner.compact_topk_indices = lambda slot_ids: inner.calls.append(("compact", slot_ids))
    inner.set_skip_topk = lambda skip: inner.calls.append(("skip", skip))
    model = nn.Module()
    model.model = inner
    return types.SimpleNamespace(model=model, hf_config=hf, vllm_config=vc)


def _snapshot(sess) -> dict:
    import torch

    m = sess.model
    sa = m.model.layers["2"].mtp_block.self_attn
    out = {k: v.detach().clone() for k, v in m.state_dict().items()}
    out["rope"] = (id(sa.rotary_emb), id(sa.indexer_rope_emb), sa.rotary_emb.is_neox_style)
    impl = sa.mla_attn.impl
    out["impl"] = (impl.sinks.clone() if torch.is_tensor(impl.sinks) else impl.sinks, impl.softmax_scale)
    ex = m.model.layers["2"].mtp_block.mlp.experts
    r = ex.quant_method.router
    out["moe"] = (ex.swiglu_limit, ex.quant_method.moe.swiglu_limit, r.renormalize, r.routed_scaling_factor)
    out["misc"] = (sa.indexer.k_norm.eps, sa.indexer.indexer_op.topk_tokens,
                   type(m.model.layers["2"].mtp_block.mlp.shared_experts.act_fn).__name__)
    return out


def _same(a: dict, b: dict) -> bool:
    import torch

    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if torch.is_tensor(x):
            if not torch.equal(x, y):
                return False
        elif k == "impl":
            if (x[0] is None) != (y[0] is None) or (x[0] is not None and not torch.equal(x[0], y[0])) or x[1] != y[1]:
                return False
        elif x != y:
            return False
    return True


def _drive(sess) -> None:
    """One pass over the hooked modules and the multi-step calls."""
    import torch

    inner = sess.model.model
    layer = inner.layers["2"]
    sa = layer.mtp_block.self_attn
    x = torch.randn(3, sess.hf_config["hidden_size"], dtype=torch.bfloat16)
    sa.linear_gate(x)
    sa.o_proj(torch.randn(3, sa.o_proj.weight.shape[1], dtype=torch.bfloat16))
    e = inner.embed_tokens(torch.tensor([1, 2]))
    layer.enorm(torch.zeros_like(e))
    inner.set_skip_topk(True)
    inner.compact_topk_indices(torch.tensor([3, 5]))


@pytest.mark.parametrize("gating", ["elementwise", "headwise"])
def test_gpu_mutants_apply_and_undo_on_a_stand_in(gating):
    """Every GPU mutant's apply() on a stand-in with vLLM's attribute names: it
    changes something (weights, attributes, hooks or calls), and the attribute /
    hook changes are undone by Ctx.restore (weight edits die with the model)."""
    import torch

    for m in M.CATALOGUE:
        if m.build_patch is not None:  # acts while vLLM builds the model (test_checkpoint_modelopt)
            continue
        sess = _fake_session(gating)
        before = _snapshot(sess)
        ctx = M.Ctx(sess)
        try:
            m.apply(ctx)
        except M.MutantNotApplicable:
            # the stand-in's attention has a bf16 cache: the FP8-KV mutants refuse it
            # (tests/cpu/test_kv_cache_fp8.py drives them on a stand-in holding fp8_ds_mla rows)
            assert (m.name == "headwise-gate-tiled" and gating == "elementwise") or m.name.startswith("kv-fp8-"), m.name
            continue
        during = _snapshot(sess)
        inner = sess.model.model
        inner.calls.clear()
        sa = inner.layers["2"].mtp_block.self_attn
        o_in = {}
        h1 = sa.o_proj.register_forward_pre_hook(lambda _m, a: o_in.__setitem__("x", a[0]))
        en_in = {}
        h2 = inner.layers["2"].enorm.register_forward_pre_hook(lambda _m, a: en_in.__setitem__("x", a[0]))
        _drive(sess)
        h1.remove()
        h2.remove()
        changed = (not _same(before, during) or inner.calls != [("skip", True), ("compact", inner.calls[-1][1])]
                   or not torch.equal(inner.calls[-1][1], torch.tensor([3, 5]))
                   or en_in["x"].abs().sum() > 0)
        # the gate mutants act through hooks: o_proj sees a modified input
        changed = changed or m.name in ("gate-no-sigmoid", "headwise-gate-tiled")
        assert changed, f"{m.name}: apply() changed nothing"
        ctx.restore()
        after = _snapshot(sess)
        for k in ("rope", "impl", "moe", "misc"):
            assert _same({k: after[k]}, {k: before[k]}), (m.name, k)
        inner.calls.clear()
        _drive(sess)
        assert inner.calls[0] == ("skip", True) and torch.equal(inner.calls[1][1], torch.tensor([3, 5])), m.name
