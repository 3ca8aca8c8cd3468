"""Reports: JSON round trip, diff of two runs, plot, bisect-check's cannot-judge exit."""

from __future__ import annotations

import torch

from harness.trace_compare import compare_traces
from harness.production.judging.tolerances import GPU_VS_REFERENCE as VS_PRODUCTION
from harness.report import diff, plot, read_report, write_report


def _report(scale: float):
    g = torch.Generator().manual_seed(0)
    ref = {"step0.attn.core": torch.randn(4, 8, generator=g, dtype=torch.float64),
           "step0.logits": torch.randn(2, 16, generator=g, dtype=torch.float64)}
    prod = {k: v + scale * torch.ones_like(v) for k, v in ref.items()}
    return compare_traces(prod, ref, VS_PRODUCTION)


def test_diff_names_the_components_that_moved(tmp_path):
    a = write_report(tmp_path / "a.json", {"c": _report(1e-4)})
    b = write_report(tmp_path / "b.json", {"c": _report(1.0)})
    moved = diff(read_report(a), read_report(b))
    assert any("step0.attn.core: ok -> FAIL" in m for m in moved)
    assert any("step0.logits" in m for m in moved)
    assert diff(read_report(a), read_report(a)) == []
    png = plot(read_report(b), tmp_path / "b.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_compare_table_names_first_divergent_component():
    rep = _report(1.0)
    assert not rep.passed and rep.first_divergent.name == "step0.attn.core"
    assert "first divergent component: step0.attn.core" in rep.table()


def test_nan_mask_mismatch_fails_first():
    ref = {"step0.mlp.out": torch.zeros(2, 2, dtype=torch.float64)}
    prod = {"step0.mlp.out": torch.tensor([[0.0, float("nan")], [0.0, 0.0]])}
    rep = compare_traces(prod, ref, VS_PRODUCTION)
    assert not rep.passed and "NaN masks differ" in rep.results[0].note


def test_topk_ties_are_reported_not_failed():
    scores = torch.tensor([[3.0, 2.0, 2.0, 1.0]], dtype=torch.float64)
    ref = {"step0.indexer.scores": scores, "step0.indexer.topk": torch.tensor([[0, 1]])}
    prod = {"step0.indexer.scores": scores, "step0.indexer.topk": torch.tensor([[0, 2]])}
    rep = compare_traces(prod, ref, VS_PRODUCTION)
    topk = [r for r in rep.results if r.name.endswith("indexer.topk")][0]
    assert topk.passed and topk.ties == 1
    prod["step0.indexer.topk"] = torch.tensor([[0, 3]])
    assert not compare_traces(prod, ref, VS_PRODUCTION).passed


def test_bisect_check_cannot_judge_without_gpu(monkeypatch, capsys):
    """``harness.cli.main`` in process (test_cli_and_project runs ``python -m harness compare`` with
    CUDA_VISIBLE_DEVICES="" as a subprocess: the same 125 path), torch seeing no CUDA device."""
    from harness.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU-only machine's view, also on a GPU host
    assert main(["bisect-check"]) == 125
    assert capsys.readouterr().out.startswith("cannot judge:")
