"""Reference goldens: the harness's own drift, checked on every CI run; and the one golden entry,
``store.check``: a mismatch writes the obtained trace beside the golden and names both, a match
writes nothing, an obtained file is never a golden, and regenerating writes the golden."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from harness.goldens import store
from harness import case_registry
from harness.goldens.reference import KIND, REFERENCE, check_case, reference_trace


@pytest.mark.parametrize("case_id", case_registry.ids(role="golden", kind="reference"))
def test_reference_matches_golden(case_id, update_goldens):
    checked = check_case(case_id, regen=update_goldens)
    if checked.regenerated:
        pytest.fail(f"{checked.message}; rerun without --update-goldens")
    assert "key_set_differs" not in checked.report.meta, checked.report.meta
    assert checked.passed, f"{checked.message}\n{checked.report.table()}"


def test_goldens_stay_small():
    size = sum(p.stat().st_size for p in store.ROOT.rglob("*") if p.is_file() and not store.is_obtained(p))
    assert size < 5 * 1024 * 1024, f"goldens/ is {size} bytes"


def test_missing_golden_fails_clearly(tmp_path):
    with pytest.raises(store.GoldenError, match="no golden reference/nope"):
        store.load("reference", "nope", root=tmp_path)


def test_corrupt_golden_is_detected(tmp_path):
    root = tmp_path / "g"
    shutil.copytree(store.ROOT, root)
    path = root / "reference" / f"{case_registry.ids(role='golden', kind='reference')[0]}.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(store.GoldenError, match="corrupt or edited"):
        store.load("reference", case_registry.ids(role="golden", kind="reference")[0], root=root)


def test_write_is_atomic_and_recorded(tmp_path):
    trace = {"step0.logits": torch.arange(6, dtype=torch.float64).reshape(2, 3)}
    store.write("reference", "c1", trace, {"case": "c1"}, root=tmp_path)
    back, entry = store.load("reference", "c1", root=tmp_path)
    assert torch.equal(back["step0.logits"], trace["step0.logits"])
    assert entry["versions"]["torch"] == torch.__version__
    assert not [p for p in (tmp_path / "reference").iterdir() if p.name.startswith(".")]


@pytest.fixture
def copied(tmp_path, monkeypatch):
    """A copy of the checked-in goldens as ``store.ROOT`` (what a failing check writes lands there)."""
    root = tmp_path / "g"
    shutil.copytree(store.ROOT, root, ignore=shutil.ignore_patterns("*.obtained.*"))
    monkeypatch.setattr(store, "ROOT", root)
    return root


def _drift(monkeypatch):
    """A 1e-6 change in the MoE scaling."""
    from reference import moe

    real = moe.route

    def drifted(cfg, lw, x, num):
        out = real(cfg, lw, x, num)
        out["topk_weights"] = out["topk_weights"] * (1 + 1e-6)
        return out

    monkeypatch.setattr(moe, "route", drifted)


CASE = "tiny-moe-sink-elementwise"


def test_a_changed_reference_is_caught_and_its_trace_written_beside_the_golden(copied, monkeypatch):
    """Planted drift fails the golden check; the obtained trace lies beside the golden (loadable, with
    the drift in it), the message names both files and the first divergent component, the golden
    and the manifest are untouched, and the obtained file is no golden."""
    before = {p.name: p.read_bytes() for p in copied.rglob("*") if p.is_file()}
    _drift(monkeypatch)
    checked = check_case(CASE)
    assert not checked.passed and checked.report.first_divergent.name == "step0.moe.topk_weights"
    expected = copied / KIND / f"{CASE}.safetensors"
    obtained = copied / KIND / f"{CASE}.obtained.safetensors"
    assert checked.expected == expected and checked.obtained == obtained and obtained.is_file()
    assert f"expected: {expected}" in checked.message and f"obtained: {obtained}" in checked.message
    assert "first divergent step0.moe.topk_weights" in checked.message
    assert checked.paths_line == f"expected {expected}; obtained {obtained}"
    v = checked.verdict  # the one verdict record every judge gives
    assert v.kind == "golden" and not v.passed and v.first_divergent == "step0.moe.topk_weights"
    assert [r["name"] for r in v.rows] == [r.name for r in checked.report.results]
    assert v.to_report() == {"case": CASE, "golden": str(expected), "passed": False,
                             "first_divergent": "step0.moe.topk_weights", "rows": v.rows,
                             "obtained": str(obtained)}
    assert {p.name: p.read_bytes() for p in copied.rglob("*") if p.is_file() and p != obtained} == before
    assert not [p for p in obtained.parent.iterdir() if p.name.startswith(".")]  # no temp file left
    got = load_file(str(obtained))
    now = reference_trace(CASE)
    assert set(got) == set(now) and torch.equal(got["step0.moe.topk_weights"], now["step0.moe.topk_weights"])
    # never a golden: not in the manifest, refused by name, skipped if a manifest lists it
    assert not [k for k in store.read_manifest(copied)["cases"] if "obtained" in k]
    with pytest.raises(store.GoldenError, match="never a golden"):
        store.load(KIND, f"{CASE}.obtained", root=copied)
    with pytest.raises(store.GoldenError, match="never a golden"):
        store.write(KIND, f"{CASE}.obtained", now, {}, root=copied)
    doc = json.loads((copied / "manifest.json").read_text())
    doc["cases"][f"{KIND}/{CASE}.obtained"] = {"file": f"{KIND}/{CASE}.obtained.safetensors"}
    (copied / "manifest.json").write_text(json.dumps(doc))
    assert f"{KIND}/{CASE}.obtained" not in store.read_manifest(copied)["cases"]


def test_a_match_writes_nothing_and_clears_an_old_obtained_file(copied):
    before = sorted(p.relative_to(copied) for p in copied.rglob("*"))
    checked = check_case(CASE)
    assert checked.passed and checked.obtained is None and checked.paths_line is None
    assert checked.verdict.passed and checked.verdict.first_divergent is None
    assert sorted(p.relative_to(copied) for p in copied.rglob("*")) == before
    stale = copied / KIND / f"{CASE}.obtained.safetensors"
    stale.write_bytes(b"left by an earlier mismatch")
    assert check_case(CASE).passed and not stale.exists()


def test_the_main_job_names_both_files_and_exits_1(copied, monkeypatch, capsys):
    from harness.goldens.reference import check_reference_goldens

    _drift(monkeypatch)
    assert check_reference_goldens() == 1
    out = capsys.readouterr().out.splitlines()
    obtained = copied / KIND / f"{CASE}.obtained.safetensors"
    assert f"FAIL {CASE}: " in "\n".join(out) and obtained.is_file()
    assert f"     expected {copied / KIND / f'{CASE}.safetensors'}; obtained {obtained}" in out


def test_an_unwritable_obtained_file_keeps_the_verdict(copied, monkeypatch):
    _drift(monkeypatch)

    def refuse(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "save_file", refuse)
    checked = check_case(CASE)
    assert not checked.passed and checked.obtained is None
    assert "obtained: not written (OSError" in checked.message and "No space left" in checked.message


def test_regenerate_writes_the_golden_on_purpose(copied, monkeypatch):
    """``regen`` (--update-goldens) writes the expected file and its manifest entry; the next
    check matches; an obtained file of the old golden is gone."""
    _drift(monkeypatch)
    assert not check_case(CASE).passed
    old = (copied / KIND / f"{CASE}.safetensors").read_bytes()
    checked = check_case(CASE, regen=True)
    assert checked.regenerated and checked.report is None and "written on purpose" in checked.message
    assert (copied / KIND / f"{CASE}.safetensors").read_bytes() != old
    assert not (copied / KIND / f"{CASE}.obtained.safetensors").exists()
    entry = store.read_manifest(copied)["cases"][f"{KIND}/{CASE}"]
    assert entry["case"] == CASE and entry["dtype"] == "float64"
    assert check_case(CASE).passed
    # a new golden of a kind with no entry yet: written by regen, missing before (GoldenError)
    trace = {"step0.logits": torch.zeros(2, 3, dtype=torch.float64)}
    kind = store.GoldenKind("scratch", encode=lambda c, t: dict(t), entry=lambda c, t: {"case": c},
                              judge=REFERENCE.judge)
    with pytest.raises(store.GoldenError, match="no golden scratch/c1"):
        store.check(kind, "c1", trace, root=copied)
    assert store.check(kind, "c1", trace, root=copied, regen=True).regenerated
    assert store.check(kind, "c1", trace, root=copied).passed


def test_production_goldens_are_intact_on_cpu():
    """Production goldens are checked against vLLM on their GPU platform; here
    at least their files must match the manifest (sha256) and hold traces."""
    cases = [k.split("/", 1)[1] for k in store.read_manifest()["cases"] if k.startswith("production/")]
    assert cases, "no production goldens recorded"
    for cid in cases:
        tensors, entry = store.load("production", cid)
        assert entry["platform"]["gpu"] and any(k.endswith(".attn.core") for k in tensors)
