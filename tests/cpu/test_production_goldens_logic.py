"""The production-golden check on CPU with a fabricated trace: a one-ulp bf16
change is visible, another platform is 'no golden', an fp32 jitter is not."""

from __future__ import annotations

import torch

from harness.production import goldens_gpu as g

PLATFORM = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "cuda": "13.0", "vllm": "0.33.0"}


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
    g.record("c", prod, tmp_path)
    assert g.check_production_golden("c", prod, tmp_path).passed
    bumped = dict(prod)
    core = prod["step0.attn.core"].clone()
    core.view(torch.int16)[0, 0] += 1  # next bf16 value: one ulp
    bumped["step0.attn.core"] = core
    rep = g.check_production_golden("c", bumped, tmp_path)
    assert not rep.passed and rep.first_divergent.name == "step0.attn.core"
    jitter = dict(prod)
    jitter["step0.logits"] = prod["step0.logits"] * (1 + 1e-7)
    assert g.check_production_golden("c", jitter, tmp_path).passed
    monkeypatch.setattr(g, "platform", lambda: {**PLATFORM, "gpu": "NVIDIA H100"})
    assert g.check_production_golden("c", prod, tmp_path) is None


def test_only_order_variant_rows_may_move(tmp_path, monkeypatch):
    """Rows whose context exceeds index_topk (128 in tiny-k2-long) may move within the reference
    tolerance (FlashMLA sparse sums the top-k keys in a run-dependent order); others may not."""
    monkeypatch.setattr(g, "platform", lambda: dict(PLATFORM))
    gen = torch.Generator().manual_seed(1)
    pos = torch.cat([torch.arange(150), torch.arange(150)])  # two requests of 150 tokens
    prod = {"step0.positions": pos, "step0.attn.core": torch.randn(300, 8, generator=gen).to(torch.bfloat16),
            "step0.draft_token": torch.tensor([3, 7]), "step0.logits": torch.randn(2, 16, generator=gen)}
    g.record("tiny-k2-long", prod, tmp_path)

    def bump(rows, ulps=1):
        core = prod["step0.attn.core"].clone()
        core.view(torch.int16)[rows, 0] += ulps
        return {**prod, "step0.attn.core": core}

    long_rows = g.check_production_golden("tiny-k2-long", bump([140, 149, 290]), tmp_path)
    assert long_rows.passed, long_rows.table()
    assert "3 of 300 rows differ, all order-variant" in long_rows.results[0].note
    assert not g.check_production_golden("tiny-k2-long", bump([100]), tmp_path).passed  # context 101
    assert not g.check_production_golden("tiny-k2-long", bump([149], ulps=200), tmp_path).passed  # not an ulp
    flipped = {**prod, "step0.draft_token": torch.tensor([3, 8])}  # last rows: positions 149 > 128
    assert g.check_production_golden("tiny-k2-long", flipped, tmp_path).passed
