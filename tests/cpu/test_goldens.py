"""Reference goldens: the harness's own drift, checked on every CI run."""

from __future__ import annotations

import shutil

import pytest
import torch

from harness import goldens
from harness.cases import GOLDEN_CASES
from harness.golden_check import KIND, check_case, record_case


@pytest.mark.parametrize("case_id", GOLDEN_CASES)
def test_reference_matches_golden(case_id, update_goldens):
    if update_goldens:
        record_case(case_id)
        pytest.fail(f"golden {KIND}/{case_id} rewritten: review `git diff goldens/` and rerun without --update-goldens")
    report = check_case(case_id)
    assert "key_set_differs" not in report.meta, report.meta
    assert report.passed, report.table()


def test_goldens_stay_small():
    size = sum(p.stat().st_size for p in goldens.ROOT.rglob("*") if p.is_file())
    assert size < 5 * 1024 * 1024, f"goldens/ is {size} bytes"


def test_missing_golden_fails_clearly(tmp_path):
    with pytest.raises(goldens.GoldenError, match="no golden reference/nope"):
        goldens.load("reference", "nope", root=tmp_path)


def test_corrupt_golden_is_detected(tmp_path):
    root = tmp_path / "g"
    shutil.copytree(goldens.ROOT, root)
    path = root / "reference" / f"{GOLDEN_CASES[0]}.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(goldens.GoldenError, match="corrupt or edited"):
        goldens.load("reference", GOLDEN_CASES[0], root=root)


def test_write_is_atomic_and_recorded(tmp_path):
    trace = {"step0.logits": torch.arange(6, dtype=torch.float64).reshape(2, 3)}
    goldens.write("reference", "c1", trace, {"case": "c1"}, root=tmp_path)
    back, entry = goldens.load("reference", "c1", root=tmp_path)
    assert torch.equal(back["step0.logits"], trace["step0.logits"])
    assert entry["versions"]["torch"] == torch.__version__
    assert not [p for p in (tmp_path / "reference").iterdir() if p.name.startswith(".")]


def test_a_changed_reference_is_caught(monkeypatch):
    """Planted drift: a 1e-6 change in the MoE scaling must fail the golden check."""
    from reference import moe

    real = moe.route

    def drifted(cfg, lw, x, num):
        out = real(cfg, lw, x, num)
        out["topk_weights"] = out["topk_weights"] * (1 + 1e-6)
        return out

    monkeypatch.setattr(moe, "route", drifted)
    report = check_case("tiny-moe-sink-elementwise")
    assert not report.passed
    assert report.first_divergent.name == "step0.moe.topk_weights"


def test_production_goldens_are_intact_on_cpu():
    """Production goldens are checked against vLLM on their GPU platform; here
    at least their files must match the manifest (sha256) and hold traces."""
    cases = [k.split("/", 1)[1] for k in goldens.read_manifest()["cases"] if k.startswith("production/")]
    assert cases, "no production goldens recorded"
    for cid in cases:
        tensors, entry = goldens.load("production", cid)
        assert entry["platform"]["gpu"] and any(k.endswith(".attn.core") for k in tensors)
