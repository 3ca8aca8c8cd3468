"""``merge_ranks``: per-rank TP traces -> one full-shape trace, each component by its TP rule."""

import torch

from harness.production.multigpu import merge_ranks


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
