"""benchmarks/bench_gpu_tier.py's bookkeeping on CPU: test counts from the tier's JUnit, and a
tier that skipped or failed tests never becomes a tier figure against the targets."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_gpu_tier", ROOT / "benchmarks" / "bench_gpu_tier.py")
B = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(B)

JUNIT = """<?xml version="1.0"?><testsuites><testsuite name="pytest">
<testcase classname="tests.gpu.test_a" name="test_ok" time="1.5"/>
<testcase classname="tests.gpu.test_a" name="test_bad" time="2.0"><failure message="x"/></testcase>
<testcase classname="tests.gpu.test_b" name="test_err" time="0.1"><error message="y"/></testcase>
<testcase classname="tests.gpu.test_b" name="test_skip" time="0.0"><skipped message="no CUDA device"/></testcase>
</testsuite></testsuites>"""


def test_junit_counts_and_cases(tmp_path):
    p = tmp_path / "j.xml"
    p.write_text(JUNIT)
    assert B._junit_counts(p) == {"passed": 1, "failed": 2, "skipped": 1}
    assert B._junit_cases(p)["test_a::test_ok"] == 1.5


def test_a_tier_that_skipped_is_no_tier_figure(capsys):
    res = {"warmup-cold": {"rc": 0, "seconds": 170.0}, "warmup-kept": {"rc": 0, "seconds": 5.0},
           "tier": {"rc": 0, "seconds": 9.3, "counts": {"passed": 0, "failed": 0, "skipped": 64}},
           "main-cold": {"rc": 0, "seconds": 72.5}}
    B.print_table(res)
    out = capsys.readouterr().out
    assert "fresh host" not in out and "kept cache" not in out  # the all-skipped tier combines with nothing
    assert "0 passed, 0 failed, 64 skipped" in out
    assert "harness main, empty cache (exit 0)" in out and "1.21" in out  # 72.5 / 60
    res["tier"].update(seconds=85.8, counts={"passed": 64, "failed": 0, "skipped": 0})
    B.print_table(res)
    out = capsys.readouterr().out
    assert "fresh host" not in out  # this tier is not known to be the first after the cold warmup
    assert "GPU tier, kept cache (warmup-kept + tier)" in out and "90.8" in out
    res["tier"]["first_after_cold_warmup"] = True
    B.print_table(res)
    out = capsys.readouterr().out
    assert "GPU tier, fresh host (warmup cold + first tier)" in out and "255.8" in out


def test_a_fresh_host_is_a_cold_warmup_and_the_first_tier_after_it(tmp_path, monkeypatch, capsys):
    """A second tier on the same cache finds what the first compiled: only the first pairs with
    the cold warmup as the fresh-host figure, across invocations sharing --out; emptying the
    cache again starts over."""
    import json

    monkeypatch.setattr(B, "_run", lambda cmd, log, env: (0, 100.0))
    monkeypatch.setattr(B, "_junit_counts", lambda p: {"passed": 3, "failed": 0, "skipped": 0})
    monkeypatch.setattr(B, "_junit_cases", lambda p: {})
    out = tmp_path / "out"
    (out / "tier-junit.xml").parent.mkdir()
    (out / "tier-junit.xml").write_text(JUNIT)

    def tier_first(only):
        assert B.main(["--out", str(out), "--only", only]) == 0
        return json.loads((out / "bench_gpu_tier.json").read_text())["tier"]["first_after_cold_warmup"]

    assert tier_first("warmup-cold,tier") is True
    assert "GPU tier, fresh host (warmup cold + first tier)" in capsys.readouterr().out
    assert tier_first("tier") is False
    assert "fresh host" not in capsys.readouterr().out
    assert tier_first("warmup-cold,bisect,tier") is False  # the bisect warmed what it ran first
    assert tier_first("warmup-cold,tier") is True


def test_an_unknown_step_is_bad_input(tmp_path, capsys):
    assert B.main(["--out", str(tmp_path), "--only", "tier,nope"]) == 2
    assert "--only nope: unknown step" in capsys.readouterr().err


def test_a_bisect_step_keeps_and_prints_where_its_time_went(tmp_path, monkeypatch, capsys):
    import json

    out = tmp_path / "out"
    timeline = {"checked": 9.1, "side_by_side": 16.4, "collected": 21.7, "engine engine-a": [0.6, 21.2]}

    def run(cmd, log, env):  # the bisect writes its report
        pathlib.Path(cmd[cmd.index("--report") + 1]).write_text(json.dumps({"meta": {"timeline_s": timeline}}))
        return 0, 22.4
    monkeypatch.setattr(B, "_run", run)
    assert B.main(["--out", str(out), "--only", "bisect"]) == 0
    assert json.loads((out / "bench_gpu_tier.json").read_text())["bisect"]["timeline"] == timeline
    assert ("bisect timeline (s): checked 9.1, side_by_side 16.4, engine engine-a 0.6-21.2, collected 21.7"
            in capsys.readouterr().out)
