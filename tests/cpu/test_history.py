"""The run history (``harness.history``): the SQLite store (concurrent writers, a damaged, foreign
or newer file refused and left as it was, a migration from schema 1, merge), the ingest of a
report, the drift rule, and the commands over them (exit codes)."""

from __future__ import annotations

import json
import multiprocessing
import sqlite3

import pytest

from harness.cli import main as cli_main
from harness.history import ingest, store
from harness.history.drift import find_drift
from harness.history.store import Filters, HistoryError, Run

PLATFORM = {"gpu": "NVIDIA H200", "capability": "9.0", "torch": "2.11.0+cu130", "cuda": "13.0"}


def report(scale: float = 1.0, accepted: int = 8, passed: bool = True, vllm: str = "0.33.0",
           tag: str = "") -> dict:
    """A bisect-check report as ``harness.report.write_report`` writes it: one side-by-side case,
    one engine case with acceptance (K = 3, three verify steps of one request)."""
    per_step = [3, 3, accepted - 6]
    return {"meta": {"versions": {**PLATFORM, "vllm": vllm}, "tag": tag,
                     "engine": {"engine-accept-k3-share": {
                         "exit": 0, "problems": [], "counts": {"num_speculative_tokens": 3},
                         "acceptance": {"request 0": {"accepted": accepted, "drafted": 9, "rate": accepted / 9,
                                                      "per_step": per_step}},
                         "components": {"attn.out": {"max_abs": 1e-3, "calls_out_of_tol": 0}},
                         "timing_s": {"generate": 1.5}}}},
            "cases": {"side-by-side/tiny-seed0": {
                "passed": passed, "first_divergent": None if passed else "step0.attn.out", "meta": {"seconds": 3.0},
                "components": [
                    {"name": "step0.attn.out", "passed": passed, "tolerance": {"atol": 1e-2, "rtol": 1e-2},
                     "max_abs": 1e-4 * scale, "max_rel": 1e-3, "mean_abs": 1e-5, "similarity_gap": 0.0},
                    {"name": "step0.logits", "passed": True, "tolerance": {"atol": 2e-2, "rtol": 1e-2},
                     "max_abs": 2e-4, "max_rel": 1e-3, "mean_abs": 2e-5, "similarity_gap": 0.0}]}}}


def run_of(doc: dict, day: int, code: int = 0) -> Run:
    return ingest.run_from_doc(doc, kind="bisect-check", exit_code=code, started_at=f"2026-12-{day:02d}T03:00:00+00:00",
                               context={"harness_commit": "abc"})


def _count(path, table: str = "runs") -> int:
    with sqlite3.connect(path) as c:
        return c.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


# ---- ingest --------------------------------------------------------------------------------------


def test_a_report_becomes_rows_per_component_request_and_draft_position():
    run = run_of(report(accepted=7), 1)
    assert (run.gpu, run.capability, run.torch, run.cuda, run.vllm) == ("NVIDIA H200", "9.0", "2.11.0+cu130", "13.0",
                                                                         "0.33.0")
    assert run.platform == "NVIDIA H200 (sm 9.0), torch 2.11.0+cu130, CUDA 13.0"
    rows = {(r["case_id"], r["component"]): r for r in run.components}
    attn = rows[("side-by-side/tiny-seed0", "step0.attn.out")]
    assert attn["max_abs"] == 1e-4 and attn["mean_abs"] == 1e-5 and attn["atol"] == 1e-2
    assert attn["ratio"] == pytest.approx(1e-2) and attn["passed"] == 1
    assert rows[("engine/engine-accept-k3-share", "verdict")]["passed"] == 1
    acc = {r["request"]: (r["accepted"], r["drafted"]) for r in run.acceptance}
    assert acc == {"request 0": (7, 9), "all": (7, 9)}
    # per_step [3, 3, 1] of K = 3: position 0 accepted 3 of 3, position 1 2 of 3, position 2 2 of 3
    assert [(p["position"], p["accepted"], p["drafted"]) for p in run.positions] == [(0, 3, 3), (1, 2, 3), (2, 2, 3)]
    assert run.verdict == "good"


def test_the_same_report_is_one_run_and_another_commit_another(tmp_path):
    h = tmp_path / "h.sqlite"
    doc = report()
    assert store.append(h, run_of(doc, 1)) is True
    assert store.append(h, run_of(json.loads(json.dumps(doc)), 2)) is False  # ingested twice: one run
    step = ingest.run_from_doc(doc, kind="autobisect-step", exit_code=0, identity={"commit": "c1", "session": "s"})
    step2 = ingest.run_from_doc(doc, kind="autobisect-step", exit_code=0, identity={"commit": "c2", "session": "s"})
    assert store.append(h, step) and store.append(h, step2)
    assert _count(h) == 3 and _count(h, "components") == 3 * 4


# ---- the store -----------------------------------------------------------------------------------


def _writer(path: str, worker: int, n: int, barrier) -> None:
    barrier.wait()
    for i in range(n):
        store.append(path, run_of(report(scale=1 + worker, tag=f"{worker}/{i}"), 1 + i % 28))


def test_concurrent_writers_lose_nothing(tmp_path):
    path = str(tmp_path / "h.sqlite")
    ctx = multiprocessing.get_context("fork")
    workers, n = 4, 6
    barrier = ctx.Barrier(workers)
    procs = [ctx.Process(target=_writer, args=(path, w, n, barrier)) for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * workers
    assert _count(path) == workers * n
    assert _count(path, "components") == workers * n * 4
    assert _count(path, "acceptance_position") == workers * n * 3
    with sqlite3.connect(path) as c:
        assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def _damaged(path) -> None:
    """A history whose table pages are overwritten with garbage (its header intact)."""
    for i in range(30):
        store.append(path, run_of(report(tag=str(i)), 1))
    conn = store.open_history(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    data = bytearray(path.read_bytes())
    page = 4096
    data[2 * page:len(data)] = b"\xa5" * (len(data) - 2 * page)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["text", "damaged", "foreign", "newer", "directory"])
def test_a_file_that_is_not_a_good_history_is_refused_and_left_as_it_is(tmp_path, kind, capsys):
    path = tmp_path / "h.sqlite"
    if kind == "text":
        path.write_text("run,case\n1,tiny\n")
        why = "not a SQLite database"
    elif kind == "damaged":
        _damaged(path)
        why = "damaged"
    elif kind == "foreign":
        with sqlite3.connect(path) as c:
            c.execute("CREATE TABLE invoices (id INTEGER)")
        why = "another application"
    elif kind == "newer":
        store.append(path, run_of(report(), 1))
        with sqlite3.connect(path) as c:
            c.execute("PRAGMA user_version = 99")
        why = "newer than this harness"
    else:
        path.mkdir()
        why = "is a directory"
    before = path.read_bytes() if path.is_file() else None
    with pytest.raises(HistoryError, match=why):
        store.append(path, run_of(report(), 2))
    assert (path.read_bytes() if path.is_file() else None) == before
    # through the commands: one line, exit 2, before anything runs
    for argv in (["history", "--history", path], ["bisect-check", "--history", path],
                 ["history", "--history", path, "ingest", tmp_path / "nothing.json"]):
        assert cli_main([str(a) for a in argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0] and str(path) in err[0], err
    assert (path.read_bytes() if path.is_file() else None) == before


def _v1_history(path) -> None:
    """A history as schema 1 wrote it, with one run."""
    with sqlite3.connect(path) as c:
        for stmt in store.MIGRATIONS[1]:
            c.execute(stmt)
        c.execute(f"PRAGMA application_id = {store.APPLICATION_ID}")
        c.execute("PRAGMA user_version = 1")
        c.execute("INSERT INTO runs (run_id, started_at, kind, verdict, gpu, platform, vllm) "
                  "VALUES ('old1', '2026-11-01T00:00:00+00:00', 'bisect-check', 'good', 'NVIDIA H200', "
                  "'NVIDIA H200 (sm 9.0), torch 2.11.0+cu130, CUDA 13.0', '0.33.0')")
        c.execute("INSERT INTO components (run_id, case_id, component, max_abs, passed) "
                  "VALUES ('old1', 'side-by-side/tiny-seed0', 'step0.attn.out', 1e-4, 1)")


def test_a_schema_1_history_is_migrated_in_place_keeping_its_runs(tmp_path):
    path = tmp_path / "old.sqlite"
    _v1_history(path)
    # merge reads an older source through a migrated copy: the source stays schema 1
    dest = tmp_path / "merged.sqlite"
    assert store.merge(dest, [path]) == [(str(path), 1, 0)]
    with sqlite3.connect(path) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == 1
    conn = store.open_history(path)  # opened for writing: migrated
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == store.SCHEMA_VERSION
        assert [tuple(r) for r in conn.execute("SELECT run_id, label FROM runs")] == [("old1", None)]
        assert conn.execute("SELECT max_abs FROM components").fetchone()[0] == 1e-4
    finally:
        conn.close()
    assert store.append(path, run_of(report(), 2))  # the new tables are there
    assert _count(path, "acceptance_position") == 3 and _count(path) == 2


def test_merge_is_idempotent_and_checks_every_source_first(tmp_path):
    a, b, dest = tmp_path / "a.sqlite", tmp_path / "b.sqlite", tmp_path / "fleet.sqlite"
    r1, r2, r3 = (run_of(report(scale=s), d) for s, d in ((1, 1), (2, 2), (3, 3)))
    for path, runs in ((a, (r1, r2)), (b, (r2, r3))):
        for r in runs:
            store.append(path, r)
    assert store.merge(dest, [a, b]) == [(str(a), 2, 0), (str(b), 1, 1)]
    assert store.merge(dest, [a, b]) == [(str(a), 0, 2), (str(b), 0, 2)]
    assert _count(dest) == 3 and _count(dest, "components") == 12 and _count(dest, "acceptance") == 6
    foreign = tmp_path / "foreign.sqlite"
    with sqlite3.connect(foreign) as c:
        c.execute("CREATE TABLE t (x)")
    before = dest.read_bytes()
    with pytest.raises(HistoryError, match="another application"):
        store.merge(dest, [a, foreign])
    assert dest.read_bytes() == before
    assert cli_main(["history", "merge", str(dest), str(a)]) == 0


# ---- drift ---------------------------------------------------------------------------------------


def _nights(tmp_path, scales, accepted=None, last_passed=True):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "h.sqlite"
    accepted = accepted or [8] * len(scales)
    for i, (s, a) in enumerate(zip(scales, accepted)):
        passed = last_passed or i < len(scales) - 1
        store.append(path, run_of(report(scale=s, accepted=a, passed=passed, tag=str(i)), 1 + i))
    return path


def _findings(path, factor=3.0, **kw):
    conn = store.open_history(path, readonly=True)
    try:
        return find_drift(conn, Filters(**kw), factor=factor)
    finally:
        conn.close()


def test_drift_names_a_component_that_moved_within_tolerance(tmp_path):
    path = _nights(tmp_path, [1.0, 1.1, 0.9, 1.0, 10.0])
    (f,) = _findings(path)
    assert (f.kind, f.case_id, f.name) == ("component", "side-by-side/tiny-seed0", "step0.attn.out")
    assert f.latest == pytest.approx(1e-3) and f.median == pytest.approx(1e-4) and f.runs == 4
    assert "x10" in f.line() and "still within tolerance" in f.line()
    assert _findings(path, factor=20.0) == []  # a factor above the move: nothing
    assert _findings(path, release="0.34") == []  # no run of that release


def test_a_small_move_a_failure_and_too_few_runs_are_no_drift(tmp_path):
    assert _findings(_nights(tmp_path / "a", [1.0, 1.0, 2.0])) == []  # x2 < factor 3
    assert _findings(_nights(tmp_path / "b", [1.0, 1.0, 50.0], last_passed=False)) == []  # the verdict says it
    assert _findings(_nights(tmp_path / "c", [1.0])) == []


def test_runs_started_in_one_second_keep_the_order_they_were_recorded_in(tmp_path):
    """Three ``bisect-check`` runs of one process can start within one second (the drift GPU test's:
    same stamp to the second on one H200). The latest run is the last one recorded, whatever its
    content hash; the moved run's tag is chosen so that its id sorts before the other two."""
    path = tmp_path / "h.sqlite"
    same = "2026-12-04T10:17:25+00:00"
    docs = [report(tag="a"), report(tag="b")]
    moved = next(d for d in (report(scale=10.0, tag=f"m{i}") for i in range(64))
                 if all(ingest.run_id(d, "bisect-check") < ingest.run_id(x, "bisect-check") for x in docs))
    for d in (*docs, moved):
        store.append(path, ingest.run_from_doc(d, kind="bisect-check", exit_code=0, started_at=same))
    (f,) = _findings(path)
    assert (f.name, f.latest, f.median) == ("step0.attn.out", pytest.approx(1e-3), pytest.approx(1e-4))
    stamps = [ingest.now_utc() for _ in range(2)]
    assert all("." in s.split("T")[1] for s in stamps) and stamps[0] <= stamps[1]  # sub-second stamps


def test_drift_of_a_golden_comparison_reads_its_settled_rows(tmp_path):
    """A golden / baseline comparison records max |d| over the rows settled run to run beside the
    max over all rows: jitter of the order-variant rows alone (measured on one H200: 0 in one run,
    1.95e-3 the next) is no drift; a move of the settled rows is, named with both values."""
    path = tmp_path / "h.sqlite"

    def night(day: int, all_rows: float, settled: float):
        doc = report(tag=str(day))
        comp = doc["cases"]["side-by-side/tiny-seed0"]["components"][0]
        comp.update(max_abs=all_rows, max_abs_settled=settled)
        store.append(path, run_of(doc, day))

    for day, all_rows in enumerate([0.0, 1.95e-3, 0.0, 1.95e-3], start=1):
        night(day, all_rows, 0.0)
    assert _findings(path) == []
    night(5, 1.95e-3, 4e-4)
    (f,) = _findings(path)
    assert (f.name, f.latest, f.median) == ("step0.attn.out", 4e-4, 0.0)
    assert "order-variant rows left out (all rows: max|d| 1.950e-03)" in f.line()
    conn = store.open_history(path, readonly=True)
    try:
        assert conn.execute("SELECT max_abs_settled FROM components WHERE max_abs_settled IS NOT NULL "
                            "ORDER BY rowid DESC").fetchone()[0] == 4e-4
    finally:
        conn.close()


def test_drift_names_acceptance_that_fell(tmp_path):
    path = _nights(tmp_path, [1.0, 1.0, 1.0], accepted=[8, 8, 7])
    names = {(f.kind, f.name) for f in _findings(path)}
    assert names == {("acceptance", "request 0"), ("acceptance", "all"), ("acceptance", "position 1")}
    assert _findings(_nights(tmp_path / "up", [1.0, 1.0], accepted=[7, 8])) == []  # a rise is no finding


def test_history_drift_is_a_gate(tmp_path, capsys):
    drifted = _nights(tmp_path / "a", [1.0, 1.0, 10.0])
    plots = tmp_path / "plots"
    assert cli_main(["history", "--history", str(drifted), "--drift", "3", "--plots", str(plots)]) == 1
    out = capsys.readouterr().out
    assert "DRIFT: 1 finding(s)" in out and "step0.attn.out" in out
    assert sorted(p.name for p in plots.iterdir()) == [
        "acceptance-engine_engine-accept-k3-share.png", "trend-engine_engine-accept-k3-share.png",
        "trend-side-by-side_tiny-seed0.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in plots.iterdir())
    assert cli_main(["history", "--history", str(_nights(tmp_path / "b", [1.0, 1.2])), "--drift", "3"]) == 0
    assert cli_main(["history", "--history", str(_nights(tmp_path / "c", [1.0])), "--drift", "3"]) == 125
    assert "NOT JUDGED" in capsys.readouterr().out
    assert cli_main(["history", "--history", str(drifted), "--drift", "1"]) == 2


def test_a_command_records_a_run_it_could_not_judge(tmp_path, capsys, monkeypatch):
    """bisect-check on this GPU-less host: 125, and the history says so (a check that did not run
    is in the history as such, never as a pass)."""
    from harness.production import can_run

    monkeypatch.setattr(can_run, "cannot_run_production_reason", lambda: "no CUDA device")
    monkeypatch.setattr(can_run, "gpu_device_nodes", lambda: [])
    path = tmp_path / "h.sqlite"
    monkeypatch.setenv("HYV4_HISTORY", str(path))
    assert cli_main(["bisect-check"]) == 125
    assert "cannot judge" in capsys.readouterr().out
    with sqlite3.connect(path) as c:
        assert c.execute("SELECT kind, verdict, exit_code FROM runs").fetchall() == [("bisect-check", "cannot judge",
                                                                                      125)]
        assert c.execute("SELECT count(*) FROM components").fetchone()[0] == 0


def test_history_ingest_reads_each_producer_format(tmp_path, capsys):
    path = tmp_path / "h.sqlite"
    rep = tmp_path / "bisect.json"
    rep.write_text(json.dumps(report()))
    engine = tmp_path / "tier" / "engine_mtp_engine-accept-k3-share.json"
    engine.parent.mkdir()
    engine.write_text(json.dumps({"case": {"id": "engine-accept-k3-share"}, "versions": {**PLATFORM, "vllm": "0.34.0"},
                                  "counts": {"num_speculative_tokens": 3}, "problems": [], "passed": True,
                                  "acceptance": {"request 0": {"accepted": 3, "drafted": 3, "per_step": [3]}},
                                  "components": {"logits": {"max_abs": 0.01}}}))
    (engine.parent / "gpu_side_by_side.jsonl").write_text(json.dumps(
        {"case": {"id": "tiny-seed0"}, "passed": True,
         "rows": [{"key": "step0.enorm", "passed": True, "max_abs_vs_exact": 1e-3, "atol": 1e-2, "rtol": 0}]}) + "\n")
    assert cli_main(["history", "--history", str(path), "ingest", str(rep), str(engine), str(engine.parent)]) == 0
    with sqlite3.connect(path) as c:
        kinds = dict(c.execute("SELECT kind, vllm FROM runs").fetchall())
        tier = c.execute("SELECT component, ratio FROM components JOIN runs USING (run_id) "
                         "WHERE kind = 'gpu-tier' AND case_id LIKE 'side-by-side/%'").fetchall()
    assert kinds == {"bisect-check": "0.33.0", "engine": "0.34.0", "gpu-tier": "0.34.0"}
    assert tier == [("step0.enorm", pytest.approx(0.1))]
    bad = tmp_path / "bad.json"
    bad.write_text("{\"x\": 1}")
    assert cli_main(["history", "--history", str(path), "ingest", str(bad)]) == 2


def test_the_gpu_tier_run_is_one_run_with_pytest_s_verdict(tmp_path):
    """What the root conftest records at the end of ``pytest --history`` (``record_tier``): the
    side-by-side lines and engine reports its tests wrote, one run, pytest's status as the verdict."""
    from harness.commands.history import record_tier

    d = tmp_path / "reports"
    d.mkdir()
    (d / "engine_mtp_engine-tiny-k2.json").write_text(json.dumps(
        {"case": {"id": "engine-tiny-k2"}, "versions": {**PLATFORM, "vllm": "0.33.0"}, "counts": {}, "problems": [],
         "components": {"logits": {"max_abs": 0.01}}}))
    h = tmp_path / "h.sqlite"
    assert record_tier(str(h), [str(tmp_path / "empty"), str(d), str(d)], 0) is not None
    assert record_tier(str(h), [str(tmp_path / "empty")], 0) is None  # no GPU test wrote anything
    (d / "gpu_side_by_side.jsonl").write_text(json.dumps({"case": {"id": "tiny-seed0"}, "rows": []}) + "\n")
    assert "bad" in record_tier(str(h), [str(d)], 1)
    with sqlite3.connect(h) as c:
        assert sorted(c.execute("SELECT kind, verdict, platform FROM runs")) == [
            ("gpu-tier", "bad", "NVIDIA H200 (sm 9.0), torch 2.11.0+cu130, CUDA 13.0"),
            ("gpu-tier", "good", "NVIDIA H200 (sm 9.0), torch 2.11.0+cu130, CUDA 13.0")]


def test_the_last_good_commit_is_this_platform_s_latest_good_run(tmp_path):
    from harness.commands.nightly import last_good_commit

    h = tmp_path / "h.sqlite"
    for day, commit, code, gpu in ((1, "aaa1111", 0, "NVIDIA H200"), (2, "bbb2222", 0, "NVIDIA H200"),
                                   (3, "ccc3333", 1, "NVIDIA H200"), (4, "ddd4444", 0, "NVIDIA H100")):
        doc = report(tag=commit)
        doc["meta"]["versions"]["gpu"] = gpu
        store.append(h, ingest.run_from_doc(doc, kind="bisect-check", exit_code=code,
                                            started_at=f"2026-12-0{day}T03:00:00+00:00",
                                            context={"vllm_commit": "g" + commit}))
    h200 = "NVIDIA H200 (sm 9.0), torch 2.11.0+cu130, CUDA 13.0"
    assert last_good_commit(str(h), h200) == "bbb2222"  # setuptools-scm's g prefix dropped
    assert last_good_commit(str(h), h200, before="2026-12-02") == "aaa1111"
    assert last_good_commit(str(h), "NVIDIA B200 (sm 10.0), torch 2.11.0+cu130, CUDA 13.0") is None


def test_nightly_without_a_gpu_says_it_could_not_judge_and_leaves_its_artifacts(tmp_path, capsys):
    from harness.production.can_run import gpu_device_nodes

    if gpu_device_nodes():
        pytest.skip("a GPU host: bisect-check would run for real")
    out, h = tmp_path / "out", tmp_path / "h.sqlite"
    assert cli_main(["nightly", str(out), "--history", str(h), "--skip-tier"]) == 125
    assert {p.name for p in out.iterdir()} >= {"log.txt", "bisect.log", "drift.txt", "history.sqlite", "nightly.json"}
    assert json.loads((out / "nightly.json").read_text())["codes"] == {"bisect-check": 125}
    with sqlite3.connect(out / "history.sqlite") as c:  # the copy: one self-contained file
        assert c.execute("SELECT kind, verdict FROM runs").fetchall() == [("bisect-check", "cannot judge")]
    assert cli_main(["nightly", str(out)]) == 2  # no history: bad input


def test_a_night_s_tier_and_bisect_check_are_judged_each_against_their_own_kind(tmp_path):
    path = tmp_path / "h.sqlite"
    for night, scale in enumerate([1.0, 1.0, 10.0]):
        for kind in ("gpu-tier", "bisect-check"):
            doc = report(scale=scale if kind == "gpu-tier" else 1.0, tag=f"{night}{kind}")
            store.append(path, ingest.run_from_doc(doc, kind=kind, exit_code=0,
                                                   started_at=f"2026-12-0{night + 1}"
                                                              f"T0{3 if kind == 'gpu-tier' else 4}:00:00+00:00"))
    (f,) = _findings(path)  # the tier moved; bisect-check, run after it, did not
    assert f.name == "step0.attn.out" and f.runs == 2


def test_an_engine_diagnostic_past_its_tolerance_is_not_judged_not_failed():
    """Engine components are diagnostics (routing ties not masked; the verdict judges draft tokens):
    one with calls past its tolerance in a good run is recorded as not judged, with the count."""
    from harness.history.ingest import engine_component_rows

    rows = {r["component"]: r for r in engine_component_rows(
        "engine/x", {"mlp.out": {"max_abs": 3.7, "calls_out_of_tol": 4}, "attn.out": {"max_abs": 1e-3,
                                                                                     "calls_out_of_tol": 0}}, [])}
    assert rows["mlp.out"]["passed"] is None and "4 draft call(s) past the tolerance" in rows["mlp.out"]["note"]
    assert rows["attn.out"]["passed"] == 1 and rows["attn.out"]["note"] is None
    assert rows["verdict"]["passed"] == 1
