"""harness.ci_speed.pytest_timeline: the per-process record of a pytest run (where the GPU tier's wall time goes)."""

from __future__ import annotations

import json
import types

import pytest

from harness.ci_speed import pytest_timeline as timeline

def _recorder(tmp_path, monkeypatch, who, clock, controller=False):
    monkeypatch.setattr(timeline.time, "time", lambda: clock[0])
    monkeypatch.setattr(timeline, "process_start_epoch", lambda: clock[0] - 5.0)
    cfg = types.SimpleNamespace(pluginmanager=types.SimpleNamespace(has_plugin=lambda name: controller))
    if who != "main":
        cfg.workerinput = {"workerid": who}
    return timeline.Recorder(cfg, str(tmp_path))


def test_a_recorded_run_summarizes_per_process(tmp_path, monkeypatch):
    """Two workers and the controller: start-up from /proc's process start, busy = the sum of
    test spans, idle = the gaps between them, the critical process is the one that finished last;
    the controller records no tests (it only relays its workers' reports)."""
    clock = [100.0]
    ctl = _recorder(tmp_path, monkeypatch, "main", clock, controller=True)
    clock[0] = 102.0
    w = {g: _recorder(tmp_path, monkeypatch, g, clock) for g in ("gw0", "gw1")}
    clock[0] = 110.0
    for r in w.values():
        r.pytest_collection_finish(types.SimpleNamespace(items=[1, 2]))
    for who, nodeid, start, stop in (("gw0", "a", 111, 121), ("gw0", "b", 123, 126), ("gw1", "c", 112, 140)):
        clock[0] = start
        w[who].pytest_runtest_logstart(nodeid, None)
        ctl.pytest_runtest_logstart(nodeid, None)
        clock[0] = stop
        w[who].pytest_runtest_logfinish(nodeid, None)
        ctl.pytest_runtest_logfinish(nodeid, None)
    clock[0] = 141.0
    for r in (*w.values(), ctl):
        r.pytest_sessionfinish(None)
    s = timeline.summarize(str(tmp_path))
    gw0, gw1, main = (s["processes"][k] for k in ("gw0", "gw1", "main"))
    assert (gw0["process_s"], gw0["configured_s"], gw0["collected_s"], gw0["first_test_s"]) == (2.0, 7.0, 15.0, 16.0)
    assert ((gw0["tests"], gw0["busy_s"], gw0["idle_s"], gw0["last_finish_s"], gw0["last_test"])
            == (2, 13.0, 2.0, 31.0, "b"))
    assert (gw1["tests"], gw1["busy_s"], gw1["idle_s"], gw1["last_finish_s"]) == (1, 28.0, 0.0, 45.0)
    assert main["tests"] == 0 and main["process_s"] == 0.0 and main["end_s"] == 46.0
    assert s["critical"] == "gw1"
    table = timeline.format_summary(s)
    assert len(table) == 4 and table[1].startswith("main") and table[-1].endswith("<- critical")


def test_a_folder_of_several_runs_is_summarized_by_its_latest(tmp_path):
    """Each process appends to its file: a second run into the same folder (fewer workers) must not
    start its clock at the first run's start, nor count the first run's tests or its extra worker."""
    def run(t0, workers, tests):
        for who in ("main", *workers):
            with open(tmp_path / f"{who}.jsonl", "a") as f:
                start = t0 if who == "main" else t0 + 1
                f.write(json.dumps({"who": who, "event": "process", "t": start}) + "\n")
                for i in range(tests if who != "main" else 0):
                    f.write(json.dumps({"who": who, "event": "start", "nodeid": f"{who}-{i}",
                                        "t": start + 2 + i}) + "\n")
                    f.write(json.dumps({"who": who, "event": "finish", "nodeid": f"{who}-{i}",
                                        "t": start + 2.5 + i}) + "\n")
    run(1000.0, ("gw0", "gw1", "gw2"), 3)
    run(5000.0, ("gw0",), 2)
    s = timeline.summarize(str(tmp_path))
    assert s["runs"] == 2 and sorted(s["processes"]) == ["gw0", "main"]
    assert s["processes"]["main"]["process_s"] == 0.0 and s["processes"]["gw0"]["process_s"] == 1.0
    assert s["processes"]["gw0"]["tests"] == 2 and s["processes"]["gw0"]["last_finish_s"] == 4.5
    assert "the latest of 2 runs" in timeline.format_summary(s)[0]


def test_a_line_cut_by_a_kill_or_not_ours_is_skipped(tmp_path):
    (tmp_path / "gw0.jsonl").write_text(
        json.dumps({"who": "gw0", "event": "process", "t": 1.0}) + "\n"
        + json.dumps({"who": "gw0", "event": "start", "nodeid": "x", "t": 2.0}) + "\n"
        + '[1, 2]\n{"who": "gw0", "event": "finish", "t": "late"}\n{"event": "end"}\n' + '{"who": "gw0", "ev')
    s = timeline.summarize(str(tmp_path))
    assert s["processes"]["gw0"]["first_test_s"] == 1.0 and s["processes"]["gw0"]["tests"] == 0
    assert s["critical"] is None  # nothing finished


def test_process_start_is_before_now():
    import time

    t = timeline.process_start_epoch()
    if t is None:
        pytest.skip("no /proc here")
    assert time.time() - 3600 < t <= time.time()


def test_the_command_prints_a_summary_and_exits_2_on_a_directory_without_records(tmp_path, capsys):
    """``python -m harness ci timeline DIR``; the speed plugin's recording in real pytest and xdist
    processes: ``test_xdist_default.test_workers_and_no_xdist_end_to_end``."""
    (tmp_path / "tl").mkdir()
    (tmp_path / "tl" / "main.jsonl").write_text("".join(json.dumps(e) + "\n" for e in (
        {"who": "main", "event": "process", "t": 1.0}, {"who": "main", "event": "start", "nodeid": "a", "t": 2.0},
        {"who": "main", "event": "finish", "nodeid": "a", "t": 3.5})))
    assert timeline.main([str(tmp_path / "tl")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("main") and out[1].endswith("<- critical") and "1.5" in out[1]
    (tmp_path / "empty").mkdir()
    for argv in ([str(tmp_path / "empty")], [str(tmp_path / "missing")], []):
        assert timeline.main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and (not argv or argv[0] in err)


def test_process_age_is_the_time_since_the_process_started():
    import time

    from harness.process_clock import process_age_s, process_start_epoch

    age = process_age_s()
    if age is None:
        pytest.skip("no /proc here")
    assert 0 < age < 3600
    assert abs(process_start_epoch() - (time.time() - process_age_s())) < 0.1
    assert process_age_s() >= age
