"""Host baselines and the not-judged verdict, on CPU: ``bisect-check --record-baseline DIR`` /
``--baseline DIR`` through ``python -m harness``'s own entry point, with production replaced by
synthetic traces (bf16 components, positions, draft tokens) and the platform by a stand-in.

Record then judge passes; a one-ulp regression fails naming its first component in dataflow order;
a baseline from another GPU is refused in one line (exit 2); another vLLM version is judged; a
failed recording leaves nothing (and an older baseline whole); a golden part that could not be
judged makes bisect-check exit 125 (0 with --allow-unjudged), says NOT JUDGED and is in the report.
"""

from __future__ import annotations

import errno
import json
import shutil

import pytest
import torch

from harness import case_registry, cli
from harness.goldens import store
from harness.production import can_run
from harness.trace_compare import Report
from harness.goldens import baseline, production as production_goldens
from harness.production.module import side_by_side as sbs
from harness.verdict import Verdict

H200 = {"gpu": "NVIDIA H200", "capability": "9.0", "torch": "2.11.0+cu130", "cuda": "13.0"}
V33 = {"vllm": "0.33.0", "vllm_commit": "g4ba787ec9"}
CASES = ["tiny-k3-share", "tiny-k2-clamp-headwise"]


def _trace(case_id: str, regressed: bool = False) -> dict:
    """A production trace of ``case_id`` as the hooks hand it over (CPU tensors); ``regressed``:
    indexer.k one bf16 ulp off in every row, and attn.core after it (what a k_norm no longer in
    fp32 does)."""
    gen = torch.Generator().manual_seed(sum(map(ord, case_id)))
    pos = torch.cat([torch.arange(8), torch.arange(8)])
    trace = {
        "step0.positions": pos,
        "step0.indexer.k": torch.randn(16, 32, generator=gen).to(torch.bfloat16),
        "step0.attn.core": torch.randn(16, 64, generator=gen).to(torch.bfloat16),
        "step0.logits": torch.randn(2, 50, generator=gen),
        "step0.draft_token": torch.tensor([3, 7]),
    }
    if regressed:
        for comp in ("indexer.k", "attn.core"):
            t = trace[f"step0.{comp}"].clone()
            t.view(torch.int16)[:, 0] += 1
            trace[f"step0.{comp}"] = t
    return trace


class Host:
    """The stand-in GPU host: its platform, its vLLM, and whether the vLLM carries the regression."""

    def __init__(self):
        self.platform, self.vllm, self.regressed = dict(H200), dict(V33), False
        self.reference_fails = False  # the side by side against the reference fails


@pytest.fixture
def host(monkeypatch):
    h = Host()

    def run_case(case, **_):
        bad = h.reference_fails
        return Verdict(kind="module", passed=not bad, first_divergent="step0.attn.core" if bad else None, rows=[],
                       regimes={}, trace=_trace(case.id, h.regressed), comparison=Report([]),
                       details={"case": {"id": case.id}})

    monkeypatch.setattr(sbs, "run_case", run_case)
    monkeypatch.setattr(sbs, "versions", lambda: {"note": "CPU stand-in"})
    monkeypatch.setattr(can_run, "cannot_run_production_reason", lambda: None)
    monkeypatch.setattr(production_goldens, "platform", lambda: dict(h.platform))
    monkeypatch.setattr(production_goldens, "recorded_with", lambda: dict(h.vllm))
    return h


def _bisect(*extra, cases=CASES) -> int:
    argv = ["bisect-check"]
    for c in cases:
        argv += ["--case", c]
    return cli.main([*argv, *extra])


def _lines(capsys) -> list[str]:
    cap = capsys.readouterr()
    return [ln for ln in (cap.out + cap.err).splitlines() if ln.strip()]


def test_record_then_judge_passes_and_names_the_vllm_recorded_with(tmp_path, host, capsys):
    d = tmp_path / "base"
    assert _bisect("--record-baseline", str(d)) == 0
    out = _lines(capsys)
    assert out[-1].startswith(f"recorded baseline {d}: 2 case(s) (tiny-k3-share, tiny-k2-clamp-headwise), "
                              "platform gpu=NVIDIA H200, capability=9.0, torch=2.11.0+cu130, cuda=13.0, "
                              "vLLM 0.33.0 (g4ba787ec9)")
    stamp = baseline.read_stamp(d)
    assert stamp["platform"] == H200 and stamp["recorded_with"] == V33 and stamp["cases"] == CASES
    assert sorted(p.name for p in (d / production_goldens.KIND).iterdir()) == sorted(f"{c}.safetensors" for c in CASES)
    assert not [p for p in tmp_path.iterdir() if p.name != "base"]  # no temp directory left
    report = tmp_path / "r.json"
    assert _bisect("--baseline", str(d), "--report", str(report)) == 0
    out = _lines(capsys)
    assert "ok   baseline tiny-k3-share (recorded with vLLM 0.33.0 (g4ba787ec9))" in out
    assert not [ln for ln in out if "NOT JUDGED" in ln]
    doc = json.loads(report.read_text())
    assert doc["meta"]["not_judged"] == [] and doc["meta"]["baseline"]["recorded_with"] == V33
    assert set(doc["cases"]) == {f"{k}/{c}" for k in ("side-by-side", "baseline") for c in CASES}


def test_a_regression_only_the_baseline_sees_fails_at_its_first_component(tmp_path, host, capsys):
    d = tmp_path / "base"
    assert _bisect("--record-baseline", str(d)) == 0
    host.regressed = True
    assert _bisect("--baseline", str(d)) == 1
    out = _lines(capsys)
    assert "ok   side-by-side tiny-k3-share" in out  # the reference part cannot see it
    assert ("FAIL baseline tiny-k3-share: first divergent step0.indexer.k "
            "(recorded with vLLM 0.33.0 (g4ba787ec9))") in out
    obtained = d / production_goldens.KIND / "tiny-k3-share.obtained.safetensors"
    assert f"     expected {d / production_goldens.KIND / 'tiny-k3-share.safetensors'}; obtained {obtained}" in out
    assert obtained.is_file() and baseline.read_stamp(d)["cases"] == CASES  # still the same baseline


def test_a_baseline_from_another_platform_is_refused_in_one_line(tmp_path, host, capsys):
    d = tmp_path / "base"
    assert _bisect("--record-baseline", str(d)) == 0
    capsys.readouterr()
    host.platform["gpu"] = "NVIDIA H100 80GB HBM3"
    assert _bisect("--baseline", str(d)) == 2
    out = _lines(capsys)
    assert out == [f"error: --baseline {d}: recorded on another platform: gpu 'NVIDIA H200' there, "
                   "'NVIDIA H100 80GB HBM3' here (a baseline is judged only on the GPU, torch and CUDA it "
                   "was recorded on)"]
    host.platform = {**H200, "cuda": "12.9"}
    assert _bisect("--baseline", str(d)) == 2
    assert "cuda '13.0' there, '12.9' here" in _lines(capsys)[0]


def test_the_vllm_version_may_differ(tmp_path, host, capsys):
    """What a bisect varies: the baseline of 0.33.0 judges a 0.34.0 dev build (and names 0.33.0)."""
    d = tmp_path / "base"
    assert _bisect("--record-baseline", str(d)) == 0
    host.vllm = {"vllm": "0.34.0.dev12+g0123abc", "vllm_commit": "g0123abc"}
    assert _bisect("--baseline", str(d)) == 0
    assert "ok   baseline tiny-k2-clamp-headwise (recorded with vLLM 0.33.0 (g4ba787ec9))" in _lines(capsys)


def _failing_second_write(monkeypatch):
    real, calls = store.save_file, []

    def save_file(tensors, path, *a, **k):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, path, *a, **k)
    monkeypatch.setattr(store, "save_file", save_file)


def test_a_failed_recording_leaves_nothing(tmp_path, host, capsys, monkeypatch):
    d = tmp_path / "base"
    _failing_second_write(monkeypatch)
    assert _bisect("--record-baseline", str(d)) == 125
    assert _lines(capsys)[-1].startswith(f"cannot judge: --record-baseline {d}: write failed, nothing written")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_rerecording_keeps_the_old_baseline_whole(tmp_path, host, capsys, monkeypatch):
    d = tmp_path / "base"
    assert _bisect("--record-baseline", str(d)) == 0
    before = {p.relative_to(d): p.read_bytes() for p in d.rglob("*") if p.is_file()}
    _failing_second_write(monkeypatch)
    host.vllm = {"vllm": "0.33.1", "vllm_commit": None}
    assert _bisect("--record-baseline", str(d), "--force") == 125
    assert {p.relative_to(d): p.read_bytes() for p in d.rglob("*") if p.is_file()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["base"]


def test_an_existing_baseline_is_replaced_only_with_force(tmp_path, host, capsys):
    d = tmp_path / "base"
    assert _bisect("--record-baseline", str(d)) == 0
    capsys.readouterr()
    assert _bisect("--record-baseline", str(d)) == 2
    assert _lines(capsys) == [f"error: --record-baseline {d}: already exists; a baseline is never replaced "
                              "silently (--force replaces it)"]
    host.vllm = {"vllm": "0.33.1", "vllm_commit": None}
    assert _bisect("--record-baseline", str(d), "--force") == 0
    assert baseline.read_stamp(d)["recorded_with"]["vllm"] == "0.33.1"
    assert [p.name for p in tmp_path.iterdir()] == ["base"]
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    capsys.readouterr()
    assert _bisect("--record-baseline", str(other), "--force") == 2
    assert _lines(capsys) == [f"error: --record-baseline {other}: exists and is not a baseline directory; "
                              "refusing to replace it"]
    assert (other / "keep.txt").read_text() == "mine"


def test_a_golden_part_not_judged_is_125_by_default_and_loud(tmp_path, host, capsys):
    """The checked-in goldens were recorded on an H200; on this stand-in H100 none applies."""
    host.platform["gpu"] = "NVIDIA H100 80GB HBM3"
    report = tmp_path / "r.json"
    assert _bisect("--report", str(report)) == 125
    out = _lines(capsys)
    key = "gpu=NVIDIA H100 80GB HBM3, capability=9.0, torch=2.11.0+cu130, cuda=13.0"
    assert f"NOT JUDGED: golden tiny-k3-share (no golden for platform {key})" in out
    assert out[-1].startswith("NOT JUDGED: 2 part(s) of the verdict could not be judged (listed above): exit 125")
    doc = json.loads(report.read_text())
    assert doc["meta"]["not_judged"] == [
        {"part": f"golden/{c}", "reason": f"no golden for platform {key}"} for c in CASES]
    assert _bisect("--allow-unjudged") == 0
    out = _lines(capsys)
    assert out[-1].startswith("NOT JUDGED: 2 part(s)") and "--allow-unjudged" in out[-1]
    host.reference_fails = True  # a judged part failing stays 1: the commit is bad whatever was not judged
    assert _bisect() == 1
    assert _lines(capsys)[-1].startswith("NOT JUDGED: 2 part(s) of the verdict could not be judged (listed above); "
                                         "the exit code (1) stands")


def test_a_case_the_baseline_lacks_is_not_judged(tmp_path, host, capsys):
    d = tmp_path / "base"
    assert _bisect("--record-baseline", str(d), cases=CASES[:1]) == 0
    capsys.readouterr()
    assert _bisect("--baseline", str(d)) == 125
    out = _lines(capsys)
    assert f"NOT JUDGED: baseline tiny-k2-clamp-headwise (no golden of this case in {d})" in out


def test_checked_in_goldens_are_judged_on_any_vllm_of_their_platform(host, capsys, tmp_path, monkeypatch):
    """The checked-in goldens' platform (an H200, as recorded) with another vLLM: judged, and the
    stand-in's numbers are not vLLM's, so they fail, naming the golden's vLLM and both files (the
    obtained trace lands beside the golden: here a copy of the checked-in tree)."""
    root = tmp_path / "goldens"
    shutil.copytree(store.ROOT, root, ignore=shutil.ignore_patterns("*.obtained.*"))
    monkeypatch.setattr(store, "ROOT", root)
    entry = store.read_manifest(root)["cases"][f"{production_goldens.KIND}/tiny-k3-share"]
    stamp = entry["platform"]
    host.platform = {k: stamp[k] for k in ("gpu", "torch", "cuda")}
    host.platform["capability"] = stamp.get("capability", "9.0")
    host.vllm = {"vllm": "0.34.0", "vllm_commit": None}
    # the golden's own vLLM: in the platform stamp of goldens from before the platform key left it
    # out, else in recorded_with
    recorded = (entry.get("recorded_with") or {}).get("vllm") or stamp["vllm"]
    assert _bisect(cases=["tiny-k3-share"]) == 1
    out = _lines(capsys)
    assert [ln for ln in out if ln.startswith("FAIL golden tiny-k3-share: first divergent ")
            and f"(recorded with vLLM {recorded}" in ln]
    obtained = root / production_goldens.KIND / "tiny-k3-share.obtained.safetensors"
    assert obtained.is_file()
    assert f"     expected {root / production_goldens.KIND / 'tiny-k3-share.safetensors'}; obtained {obtained}" in out


@pytest.mark.parametrize("extra, words", [
    (["--force"], "--force applies to --record-baseline"),
    (["--record-baseline", "{d}", "--baseline", "{d}"], "--record-baseline and --baseline"),
    (["--record-baseline", "{d}", "--plant", "clamp-removed"], "--plant and --record-baseline"),
    (["--record-baseline", "{d}", "--allow-unjudged"], "--allow-unjudged and --record-baseline"),
    (["--record-baseline", "{d}/no/such/dir"], "does not exist"),
    (["--baseline", "{d}/none"], "no such directory"),
    (["--baseline", "{d}"], "not a baseline (no manifest.json)"),
    (["--record-baseline", "{d}/x", "--case", "engine-tiny-k2"], "no side-by-side case to record"),
])
def test_baseline_flags_are_checked_first_on_any_machine(tmp_path, capsys, extra, words):
    """No GPU here (nothing patched): a wrong combination or directory is still exit 2, one line."""
    assert cli.main(["bisect-check", *[a.format(d=tmp_path) for a in extra]]) == 2
    out = _lines(capsys)
    assert len(out) == 1 and out[0].startswith("error: ") and words in out[0], out


def test_compare_says_not_judged_and_keeps_its_exit_code(tmp_path, host, capsys):
    host.platform["gpu"] = "NVIDIA H100 80GB HBM3"
    report = tmp_path / "r.json"
    assert cli.main(["compare", "tiny-k3-share", "--report", str(report)]) == 0
    out = _lines(capsys)
    assert [ln for ln in out
            if ln.startswith("NOT JUDGED: golden tiny-k3-share (no golden for platform gpu=NVIDIA H100")]
    assert [ln for ln in out if ln.startswith("NOT JUDGED: 1 golden part(s)")]
    assert json.loads(report.read_text())["meta"]["not_judged"][0]["part"] == "golden/tiny-k3-share"


def test_goldens_gpu_check_is_125_without_a_golden_and_record_refused_under_ci(tmp_path, host, capsys,
                                                                                monkeypatch):
    host.platform["gpu"] = "NVIDIA H100 80GB HBM3"
    assert production_goldens.main(["check", "--case", "tiny-k3-share"]) == 125
    assert _lines(capsys)[-1].startswith("NOT JUDGED: golden tiny-k3-share (no golden for platform gpu=NVIDIA H100")
    assert production_goldens.main(["record", "--root", str(tmp_path / "g")]) == 0
    assert production_goldens.main(["check", "--root", str(tmp_path / "g")]) == 0
    assert production_goldens.main(["list", "--root", str(tmp_path / "g")]) == 0
    listed = _lines(capsys)[-len(case_registry.ids(role="golden", kind="module")):]
    assert listed[0].startswith("production/tiny-k2-clamp-headwise: platform gpu=NVIDIA H100 80GB HBM3, capability=9.0")
    assert listed[0].endswith("recorded with vLLM 0.33.0 (g4ba787ec9)")
    monkeypatch.setenv("CI", "true")
    assert production_goldens.main(["record"]) == 2
    assert "refused when CI is set" in _lines(capsys)[-1]
