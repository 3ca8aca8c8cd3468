"""The production-golden check on CPU with fabricated traces: a one-ulp bf16
change is visible, another platform is 'no golden', an fp32 jitter is not; the
golden stores every component the side by side compares, so
the first divergence names the cause; older goldens are reported, not crashed on."""

from __future__ import annotations

import torch

import pytest

import reference as R
from harness import case_registry as reg
from harness.components import PRODUCTION_COMPONENTS
from harness.goldens import production as g
from harness.goldens import store
from harness.production.case_inputs import case_inputs
from harness.production.module import side_by_side as sbs
from harness.production.judging.fp8_emulation import as_production_trace

PLATFORM = {"gpu": "NVIDIA H200", "capability": "9.0", "torch": "2.11.0+cu130", "cuda": "13.0"}


def _check(case_id: str, prod: dict, root):
    """The report of ``store.check`` on a production golden; None when none applies here."""
    return store.check(g.PRODUCTION, case_id, prod, root=root).report


def _record(case_id: str, prod: dict, root):
    assert store.check(g.PRODUCTION, case_id, prod, root=root, regen=True).regenerated


@pytest.fixture(autouse=True)
def _vllm_stamp(monkeypatch):
    """The vLLM a golden is stamped with, without importing vLLM."""
    monkeypatch.setattr(g, "recorded_with", lambda: {"vllm": "0.33.0", "vllm_commit": "g4ba787ec9"})


def _trace():
    gen = torch.Generator().manual_seed(0)
    return {
        "step0.attn.core": torch.randn(5, 8, generator=gen).to(torch.bfloat16),
        "step0.logits": torch.randn(2, 16, generator=gen),
        "step0.draft_token": torch.tensor([3, 7]),
        "step0.indexer.topk": torch.tensor([[0, 1, -1], [2, 0, 1]], dtype=torch.int32),
        "step0.attn.q": torch.randn(5, 4, generator=gen).to(torch.bfloat16),  # not stored
    }


def test_one_ulp_is_visible_and_platform_keyed(tmp_path, monkeypatch):
    monkeypatch.setattr(g, "platform", lambda: dict(PLATFORM))
    prod = _trace()
    _record("c", prod, tmp_path)
    assert _check("c", prod, tmp_path).passed
    bumped = dict(prod)
    core = prod["step0.attn.core"].clone()
    core.view(torch.int16)[0, 0] += 1  # next bf16 value: one ulp
    bumped["step0.attn.core"] = core
    rep = _check("c", bumped, tmp_path)
    assert not rep.passed and rep.first_divergent.name == "step0.attn.core"
    jitter = dict(prod)
    jitter["step0.logits"] = prod["step0.logits"] * (1 + 1e-7)
    assert _check("c", jitter, tmp_path).passed
    monkeypatch.setattr(g, "platform", lambda: {**PLATFORM, "gpu": "NVIDIA H100"})
    assert _check("c", prod, tmp_path) is None
    assert g.absent_reason("c", tmp_path) == ("no golden for platform gpu=NVIDIA H100, capability=9.0, "
                                              "torch=2.11.0+cu130, cuda=13.0")


def test_the_platform_key_leaves_the_vllm_version_out(tmp_path, monkeypatch):
    """A golden is judged on every vLLM of its platform and names the vLLM it was recorded with;
    goldens stamped before the key had a compute capability (and with the vLLM in it) still apply."""
    monkeypatch.setattr(g, "platform", lambda: dict(PLATFORM))
    prod = _trace()
    _record("c", prod, tmp_path)
    entry = store.read_manifest(tmp_path)["cases"]["production/c"]
    assert entry["platform"] == PLATFORM and entry["recorded_with"]["vllm"] == "0.33.0"
    monkeypatch.setattr(g, "recorded_with", lambda: {"vllm": "0.34.0", "vllm_commit": None})
    rep = _check("c", prod, tmp_path)
    assert rep.passed and rep.meta["recorded_with"] == {"vllm": "0.33.0", "vllm_commit": "g4ba787ec9"}
    legacy = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "cuda": "13.0", "vllm": "0.33.0"}
    store.write(g.KIND, "old", g._encode("old", prod), {"case": "old", "platform": legacy}, tmp_path)
    rep = _check("old", prod, tmp_path)
    assert rep.passed and rep.meta["recorded_with"] == {"vllm": "0.33.0", "vllm_commit": None}
    monkeypatch.setattr(g, "platform", lambda: {**PLATFORM, "torch": "2.12.0+cu130"})
    assert _check("old", prod, tmp_path) is None


def test_the_golden_cases_are_the_default_bisect_set_and_the_checked_in_goldens_fit():
    golden_ids = reg.ids(role="golden", kind="module")
    assert golden_ids == reg.ids(role="bisect", kind="module")
    assert "tiny-k2-fp8-ue8m0-fused-scale-long" in golden_ids
    size = sum(p.stat().st_size for p in store.ROOT.rglob("*") if p.is_file() and not store.is_obtained(p))
    assert size < 5 * 2**20, f"goldens/ holds {size} bytes: re-record the long cases at ROW_CAP {g.ROW_CAP}"


def test_only_order_variant_rows_may_move(tmp_path, monkeypatch):
    """Rows whose context exceeds index_topk (128 in tiny-k2-long) may move within the reference
    tolerance (FlashMLA sparse sums the top-k keys in a run-dependent order); others may not."""
    monkeypatch.setattr(g, "platform", lambda: dict(PLATFORM))
    monkeypatch.setattr(g, "ROW_CAP", 1000)  # every row kept (row capping: tests below)
    gen = torch.Generator().manual_seed(1)
    pos = torch.cat([torch.arange(150), torch.arange(150)])  # two requests of 150 tokens
    prod = {"step0.positions": pos, "step0.attn.core": torch.randn(300, 8, generator=gen).to(torch.bfloat16),
            "step0.draft_token": torch.tensor([3, 7]), "step0.logits": torch.randn(2, 16, generator=gen)}
    _record("tiny-k2-long", prod, tmp_path)

    def bump(rows, ulps=1):
        core = prod["step0.attn.core"].clone()
        core.view(torch.int16)[rows, 0] += ulps
        return {**prod, "step0.attn.core": core}

    long_rows = _check("tiny-k2-long", bump([140, 149, 290]), tmp_path)
    assert long_rows.passed, long_rows.table()
    assert "3 of 300 rows differ, all order-variant" in long_rows.results[0].note
    assert not _check("tiny-k2-long", bump([100]), tmp_path).passed  # context 101
    assert not _check("tiny-k2-long", bump([149], ulps=200), tmp_path).passed  # not an ulp
    flipped = {**prod, "step0.draft_token": torch.tensor([3, 8])}  # last rows: positions 149 > 128
    assert _check("tiny-k2-long", flipped, tmp_path).passed
    # what the run history's drift rule reads: max |d| over the settled rows only (0 while only
    # order-variant rows moved), beside the max over every row
    core = long_rows.results[0]
    assert core.max_abs > 0 and core.max_abs_settled == 0.0
    assert core.as_dict()["max_abs_settled"] == 0.0
    short = _check("tiny-k2-long", bump([100, 149]), tmp_path).results[0]
    assert short.max_abs_settled > 0
    exact = _check("tiny-k2-long", prod, tmp_path).results[0]
    assert exact.max_abs == exact.max_abs_settled == 0.0


def _fabricated(case_id: str) -> dict:
    """What production's hooks hand the golden: the reference in bf16 numerics, shaped by
    ``as_production_trace`` (q_fp8 e4m3 values, the raw indexer.kw, attn.topk, no scores)."""
    case = reg.spec(case_id, kind="module")
    hf, _, w = case_inputs(case)
    cfg = R.MTPConfig.from_hf_dict(hf)
    first = R.make_case(cfg, case.seed, case.requests, case.tokens)
    flat = R.flatten(R.draft(cfg, w, first, case.steps, num=R.PRODUCTION))
    prod = as_production_trace(cfg, flat, case.steps)
    for k in [k for k in prod if k.endswith("indexer.q_fp8")]:
        prod[k] = prod[k].to(torch.float8_e4m3fn)  # as the hook captures it
    return prod


def _by_step(keys) -> dict:
    out: dict = {}
    for k in keys:
        step, comp = k.split(".", 1)
        out.setdefault(step, set()).add(comp)
    return out


@pytest.fixture(scope="module")
def k3share() -> dict:
    return _fabricated("tiny-k3-share")


def test_golden_stores_what_the_side_by_side_compares(tmp_path, monkeypatch, k3share):
    monkeypatch.setattr(g, "platform", lambda: dict(PLATFORM))
    _record("tiny-k3-share", k3share, tmp_path)
    stored, _ = g._decode(store.load(g.KIND, "tiny-k3-share", tmp_path)[0])
    judged = sbs.judge(reg.spec("tiny-k3-share", kind="module"), k3share, {})
    assert judged.passed, judged.details["table"]
    compared = [r.name for r in judged.comparison.results]
    assert _by_step(stored) == _by_step(compared)
    for must in ("indexer.k", "indexer.q_deq", "indexer.q_scale", "indexer.topk", "attn.topk", "embed", "attn.q_c"):
        assert must in _by_step(stored)["step0"], must
    assert g.stored_components("tiny-k3-share", tmp_path) == [
        c for c in PRODUCTION_COMPONENTS if c in _by_step(compared)["step0"]]
    assert _check("tiny-k3-share", k3share, tmp_path).passed


def test_first_divergence_names_the_cause(tmp_path, monkeypatch, k3share):
    """An upstream-style indexer regression (k no longer normed in fp32: every k moves by an ulp)
    that also moves attn.core is reported at indexer.k, not at attn.core."""
    monkeypatch.setattr(g, "platform", lambda: dict(PLATFORM))
    _record("tiny-k3-share", k3share, tmp_path)
    bad = dict(k3share)
    for comp in ("indexer.k", "attn.core"):
        t = bad[f"step0.{comp}"].clone()
        t.view(torch.int16)[:, 3] += 1
        bad[f"step0.{comp}"] = t
    rep = _check("tiny-k3-share", bad, tmp_path)
    assert not rep.passed and rep.first_divergent.name == "step0.indexer.k", rep.table()
    assert [r.name for r in rep.results if not r.passed] == ["step0.indexer.k", "step0.attn.core"]
    q = dict(k3share)  # one e4m3 step of one indexer q element: seen at q_deq
    q8 = q["step0.indexer.q_fp8"].float()
    q8[0, 0, 0] = q8[0, 0, 0] * 1.125 if q8[0, 0, 0] != 0 else 1.0
    q["step0.indexer.q_fp8"] = q8.to(torch.float8_e4m3fn)
    assert _check("tiny-k3-share", q, tmp_path).first_divergent.name == "step0.indexer.q_deq"


def test_long_steps_keep_capped_rows_and_the_goldens_fit(tmp_path, monkeypatch):
    """tiny-k2-long (317 step-0 rows) keeps ROW_CAP rows incl. each request's first and last; the
    goldens directory (reference + every production golden, recorded from fabricated traces) stays
    under 5 MB; a one-ulp change in a kept short-context row fails, the same trace passes."""
    monkeypatch.setattr(g, "platform", lambda: dict(PLATFORM))
    traces = {cid: _fabricated(cid) for cid in reg.ids(role="golden", kind="module")}
    for cid, prod in traces.items():
        _record(cid, prod, tmp_path)
    prod_bytes = sum(p.stat().st_size for p in (tmp_path / g.KIND).iterdir())
    ref_bytes = sum(p.stat().st_size for p in (store.ROOT / "reference").iterdir() if not store.is_obtained(p))
    assert prod_bytes + ref_bytes < 5 * 2**20, (prod_bytes, ref_bytes)
    long = traces["tiny-k2-long"]
    stored, rows = g._decode(store.load(g.KIND, "tiny-k2-long", tmp_path)[0])
    kept = rows["step0"]
    assert "step1" not in rows and kept.numel() <= g.ROW_CAP
    pos = long["step0.positions"]
    starts = [0] + (torch.nonzero(pos[1:] <= pos[:-1]).flatten() + 1).tolist()
    assert set(starts) | {s - 1 for s in starts[1:]} | {pos.numel() - 1} <= set(kept.tolist())
    assert stored["step0.indexer.k"].shape[0] == kept.numel() and stored["step0.logits"].shape[0] == 2
    assert stored["step0.indexer.topk"].dtype == torch.int16
    assert _check("tiny-k2-long", long, tmp_path).passed
    short = int(kept[(pos[kept] + 1 <= 128)][5])  # a kept row that reads every key: tight tolerance
    bumped = dict(long)
    t = long["step0.embed"].clone()
    t.view(torch.int16)[short, 0] += 1
    bumped["step0.embed"] = t
    rep = _check("tiny-k2-long", bumped, tmp_path)
    assert not rep.passed and rep.first_divergent.name == "step0.embed"
    fewer = {k: v for k, v in long.items()}
    fewer["step0.positions"] = long["step0.positions"][:100]
    rep = _check("tiny-k2-long", fewer, tmp_path)
    assert not rep.passed and "re-record" in rep.results[0].note


def test_a_golden_recorded_before_the_new_components_is_reported_not_crashed_on(tmp_path, monkeypatch, k3share):
    """The first goldens (format 1) hold 13 components at every row: the check judges those and says
    which components the golden predates."""
    monkeypatch.setattr(g, "platform", lambda: dict(PLATFORM))
    old = ("eh_proj", "attn.kv_c", "indexer.topk", "attn.topk", "attn.core", "attn.out", "moe.router_logits",
           "moe.topk_ids", "moe.topk_weights", "mlp.out", "final_norm", "logits", "draft_token")
    legacy = {k: v.clone() for k, v in k3share.items() if k.split(".", 1)[1] in old}
    store.write(g.KIND, "tiny-k3-share", legacy, {"case": "tiny-k3-share", "platform": g.platform(),
                                                   "components": list(old)}, tmp_path)
    rep = _check("tiny-k3-share", k3share, tmp_path)
    assert rep.passed, rep.table()
    assert {r.name.split(".", 1)[1] for r in rep.results} == set(old)
    assert rep.meta["stale"].startswith("golden recorded before embed, embed_masked, enorm, hnorm, attn.q_c,")
    assert "indexer.k" in rep.meta["stale"] and "re-record" in rep.meta["stale"]
    bad = dict(k3share)
    t = bad["step0.attn.core"].clone()
    t.view(torch.int16)[0, 0] += 1
    bad["step0.attn.core"] = t
    assert _check("tiny-k3-share", bad, tmp_path).first_divergent.name == "step0.attn.core"


def test_router_gemm_tolerance_takes_bf16x3_not_bf16(tmp_path, monkeypatch):
    """Router logits recomputed as vLLM's bf16x3 GEMM (the fp32 weight kept to 16 bits) pass the
    golden; the same logits rounded to bf16, or computed from bf16-rounded weights, fail at
    moe.router_logits; any other fp32 component keeps the tight tolerance."""
    monkeypatch.setattr(g, "platform", lambda: dict(PLATFORM))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 64, generator=gen).to(torch.bfloat16).double()
    w = torch.randn(8, 64, generator=gen, dtype=torch.float64) * 0.05
    w32 = w.float()
    hi = w32.to(torch.bfloat16).float()
    lo = (w32 - hi).to(torch.bfloat16).float()

    def trace(weight, round_bf16=False):
        logits = (x @ weight.double().T).float()
        if round_bf16:
            logits = logits.to(torch.bfloat16).float()
        return {"step0.moe.router_logits": logits, "step0.logits": torch.randn(2, 16, generator=gen)}

    prod = trace(w32)
    _record("c", prod, tmp_path)
    x3 = trace(hi + lo)  # bf16x3: w's first 16 bits (x is bf16, exact)
    x3["step0.logits"] = prod["step0.logits"]
    moved = float((x3["step0.moe.router_logits"] - prod["step0.moe.router_logits"]).abs().max())
    assert moved > 1e-7, moved  # the tight fp32 tolerance alone would not take it
    assert _check("c", x3, tmp_path).passed
    for bad in (trace(w32, round_bf16=True), trace(hi)):
        bad["step0.logits"] = prod["step0.logits"]
        rep = _check("c", bad, tmp_path)
        assert not rep.passed and rep.first_divergent.name == "step0.moe.router_logits", rep.table()
    other = dict(prod)
    other["step0.logits"] = prod["step0.logits"] + 2e-6
    assert not _check("c", other, tmp_path).passed
