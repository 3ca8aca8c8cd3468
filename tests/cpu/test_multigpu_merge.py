"""``merge_ranks``: per-rank TP traces -> one full-shape trace, each component by its TP rule."""

import torch

from harness.production.tp.multigpu import merge_ranks


def _full():
    g = torch.Generator().manual_seed(0)
    return {"step0.attn.q": torch.randn(4, 8, 3, generator=g), "step0.embed": torch.randn(4, 5, generator=g),
            "step0.moe.shared": torch.randn(4, 5, generator=g)}


def _ranks(full):
    q = full["step0.attn.q"]
    return [{"step0.attn.q": q[:, :4].clone(), "step0.embed": full["step0.embed"].clone(),
             "step0.moe.shared": full["step0.moe.shared"] * 0.25},
            {"step0.attn.q": q[:, 4:].clone(), "step0.embed": full["step0.embed"].clone(),
             "step0.moe.shared": full["step0.moe.shared"] * 0.75}]


def test_rules_rebuild_the_full_trace():
    full = _full()
    merged, rules = merge_ranks(_ranks(full), full)
    assert rules == {"step0.attn.q": "head-sharded: concatenated along dim 1", "step0.embed": "replicated",
                     "step0.moe.shared": "partial-sum: summed over ranks"}
    assert torch.equal(merged["step0.attn.q"], full["step0.attn.q"])
    assert torch.equal(merged["step0.embed"], full["step0.embed"])
    assert torch.allclose(merged["step0.moe.shared"], full["step0.moe.shared"], atol=1e-6)


def test_replicated_components_must_agree_bitwise():
    full = _full()
    ranks = _ranks(full)
    ranks[1]["step0.embed"][0, 0] += 2 ** -20
    merged, rules = merge_ranks(ranks, full)
    assert rules["step0.embed"].startswith("problem: replicated component differs across ranks")
    assert torch.equal(merged["step0.embed"], full["step0.embed"])  # rank 0's, still judged


def test_shards_that_do_not_tile_are_reported_and_dropped():
    full = _full()
    ranks = _ranks(full)
    ranks[1]["step0.attn.q"] = ranks[1]["step0.attn.q"][:, :3]
    merged, rules = merge_ranks(ranks, full)
    assert rules["step0.attn.q"].startswith("problem: rank shapes")
    assert "step0.attn.q" not in merged


def test_topk_rows_compare_as_sets_across_ranks():
    full = {"step0.attn.topk": torch.tensor([[3, 1, 2, -1], [0, 1, 2, 3]])}
    r0 = {"step0.attn.topk": torch.tensor([[1, 2, 3, -1], [0, 1, 2, 3]])}
    assert merge_ranks([r0, dict(r0)], full)[1]["step0.attn.topk"] == "replicated"
    assert merge_ranks([r0, full], full)[1]["step0.attn.topk"] == "replicated (same sets, order differs)"
    r1 = {"step0.attn.topk": torch.tensor([[3, 1, 2, -1], [0, 1, 2, 4]])}
    assert (merge_ranks([r0, r1], full)[1]["step0.attn.topk"]
            == "rank-variant: 1 row(s) select different sets across ranks")


def _judged(final_norm, tokens1, logits1):
    from harness.verdict import Verdict

    prod = {"step0.final_norm": final_norm, "step0.draft_token": torch.tensor([5]),
            "step0.logits": torch.tensor([[0.0, 0, 0, 0, 0, 9.0]]),
            "step1.final_norm": final_norm * 3, "step1.draft_token": tokens1, "step1.logits": logits1}
    return Verdict(kind="module", passed=True, first_divergent=None, rows=[], trace_compared=prod, reference={})


def test_tp_vs_tp1_judges_step0_values_and_tokens_only():
    from harness.production.tp.multigpu import compare_tp
    from harness.components import PRODUCTION_COMPONENTS
    from harness.production.judging.tolerances import tolerances_for

    tols = tolerances_for("bf16")
    base = torch.ones(2, 4)
    decisive = torch.tensor([[0.0, 9.0, 0.0]])
    tp1 = _judged(base, torch.tensor([1]), decisive)
    # step 1 values may drift (different inputs); step 0 within tolerance; tokens equal
    ok = compare_tp(_judged(base + 0.01, torch.tensor([1]), decisive), tp1, tols, PRODUCTION_COMPONENTS)
    assert ok.passed, ok.table()
    assert {r.name for r in ok.results} == {"step0.final_norm", "step0.logits", "step0.draft_token",
                                            "step1.draft_token"}
    # a routing tie masked (NaN) on one side is masked on both
    masked = base.clone()
    masked[0] = float("nan")
    assert compare_tp(_judged(masked, torch.tensor([1]), decisive), tp1, tols, PRODUCTION_COMPONENTS).passed
    far = compare_tp(_judged(base + 1.0, torch.tensor([1]), decisive), tp1, tols, PRODUCTION_COMPONENTS)
    assert far.first_divergent.name == "step0.final_norm"
    flip = compare_tp(_judged(base, torch.tensor([0]), decisive), tp1, tols, PRODUCTION_COMPONENTS)
    assert flip.first_divergent.name == "step1.draft_token"
