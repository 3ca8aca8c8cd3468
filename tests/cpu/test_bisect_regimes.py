"""bisect-check on CPU with production faked by the reference in bf16 numerics (``as_production_trace``):
the report carries every case's regimes and their coverage; ``--plant clamp-removed`` (here: the
stand-in run without the routed clamp) exits 1 with the clamp case failing first at mlp.out."""

from __future__ import annotations

import argparse
import json
import os

import pytest

import reference as R
from harness import mutants
from harness.cli import EXIT_MISMATCH, EXIT_OK
from harness.exitcodes import EXIT_CANNOT_JUDGE
from harness.commands import bisect_check
from harness.goldens import production as production_goldens
from harness.production.case_inputs import case_inputs
from harness.production.engine import process as engine_process
from harness.production.module import side_by_side as sbs
from harness.production.judging.fp8_emulation import as_production_trace
from harness.regimes import REGIMES


def _stand_in(case, clamp: bool = True) -> dict:
    hf, _, w = case_inputs(case)
    cfg = R.MTPConfig.from_hf_dict(hf)
    if not clamp:
        cfg = cfg.replace(swiglu_limit=0.0)
    first = R.make_case(cfg, case.seed, case.requests, case.tokens)
    flat = R.flatten(R.draft(cfg, w, first, case.steps, num=R.PRODUCTION))
    return sbs.judge(case, as_production_trace(cfg, flat, case.steps), {})


@pytest.fixture
def faked(monkeypatch):
    monkeypatch.setattr(sbs, "run_case", lambda case, **_: _stand_in(case))
    monkeypatch.setattr(sbs, "versions", lambda: {"note": "CPU stand-in"})
    # a platform no golden was recorded on: every golden part is NOT JUDGED (--allow-unjudged below)
    monkeypatch.setattr(production_goldens, "platform", lambda: {"gpu": "CPU stand-in", "capability": "0.0",
                                                          "torch": "none", "cuda": None})

    def planted(case, name):
        assert name == "clamp-removed"
        return _stand_in(case, clamp=False)
    monkeypatch.setattr(mutants, "run_planted", planted)


def _args(tmp_path, cases=None, plant=None):
    return argparse.Namespace(case=cases, report=str(tmp_path / "bisect.json"), plant=plant, allow_unjudged=True)


def test_bisect_report_carries_regimes_and_coverage(tmp_path, faked, capsys):
    """Two of the default cases (tiny-k2-long's replay is the slow one; the full default set's
    coverage is tests/cpu/test_regimes.py's): regimes per case in the report, coverage in its meta,
    and the regimes only tiny-k2-long and the FP8 case bring named as not exercised."""
    cases = ["tiny-k3-share", "tiny-k2-clamp-headwise"]
    assert set(cases) < set(bisect_check.DEFAULT_BISECT_CASES)
    assert bisect_check.bisect_command(_args(tmp_path, cases)) == EXIT_OK
    out = capsys.readouterr().out
    assert out.count("regimes: routed_clamp_frac=") == len(cases)
    assert ("warning: no case of this run exercises the regime(s) "
            "['topk_selecting_rows_frac', 'weight_ue8m0_rounded_frac']") in out
    assert out.count("NOT JUDGED: golden ") == len(cases)  # one per case: no golden for this platform
    assert "NOT JUDGED: 2 part(s) of the verdict could not be judged" in out and "--allow-unjudged" in out
    doc = json.loads((tmp_path / "bisect.json").read_text())
    assert [e["part"] for e in doc["meta"]["not_judged"]] == [f"golden/{c}" for c in cases]
    assert set(doc["meta"]["regimes"]) == set(cases)
    coverage = doc["meta"]["regime_coverage"]
    assert set(coverage) == {k for k, r in REGIMES.items() if r.threshold is not None}
    assert [k for k, c in coverage.items() if not c["ok"]] == ["topk_selecting_rows_frac", "weight_ue8m0_rounded_frac"]
    assert coverage["routed_clamp_frac"]["case"] == "tiny-k2-clamp-headwise"
    case_meta = doc["cases"]["side-by-side/tiny-k2-clamp-headwise"]["meta"]["regimes"]
    assert case_meta["routed_clamp_frac"] >= 0.05


def test_planted_clamp_off_exits_1_at_mlp_out(tmp_path, faked, capsys):
    args = _args(tmp_path, ["tiny-k3-share", "tiny-k2-clamp-headwise"], plant="clamp-removed")
    bisect_check.validate_args(args)
    assert bisect_check.bisect_command(args) == EXIT_MISMATCH
    out = capsys.readouterr().out
    assert "ok   side-by-side tiny-k3-share" in out  # swiglu_limit 10: nothing to clamp there
    assert "FAIL side-by-side tiny-k2-clamp-headwise: first divergent step0.mlp.out" in out
    assert ("warning: no case of this run exercises the regime(s) "
            "['topk_selecting_rows_frac', 'weight_ue8m0_rounded_frac']") in out


def test_plant_must_name_a_mutant(tmp_path):
    from harness.cli import CLIError
    with pytest.raises(CLIError, match="unknown mutant"):
        bisect_check.validate_args(_args(tmp_path, plant="no-such-bug"))


def test_engines_run_beside_the_side_by_side_and_report_after_it(tmp_path, faked, capsys):
    """bisect-check starts its engine subprocesses first and lets them run while this process
    judges the side-by-side cases; each engine's line comes after them. Here (no CUDA) the real
    engine subprocess exits 125 and says why: the run cannot be judged, the side by side passed."""
    code = bisect_check.bisect_command(_args(tmp_path, ["engine-tiny-k2", "tiny-k3-share"]))
    out = capsys.readouterr().out
    assert code == 125, out
    assert "cannot judge: engine engine-tiny-k2 exited 125: cannot judge: no CUDA device" in out
    assert out.index("ok   side-by-side tiny-k3-share") < out.index("cannot judge: engine engine-tiny-k2")


def _record_engine_starts(monkeypatch) -> list:
    """Engine subprocesses that are not started: each start recorded as (command, environment)."""
    import subprocess

    started = []

    class Recorder:  # stands in for the engine subprocess
        def __init__(self, cmd, env, **kw):
            started.append((cmd, env))

        def poll(self):
            return 125

        def wait(self):
            return 125

    monkeypatch.setattr(subprocess, "Popen", Recorder)
    return started


@pytest.mark.parametrize("ids, shared, preset, want", [
    (["engine-tiny-k2"], False, None, None),  # alone on the GPU: vLLM profiles its memory as usual
    (["engine-tiny-k2"], True, None, "4"),  # beside this process's side-by-side runs
    (["engine-tiny-k2", "engine-tiny-k3-share"], False, None, "4"),  # several engines at once
    (["engine-tiny-k2", "engine-tiny-k3-share"], False, "8", "8"),  # the user's size wins
])
def test_engines_sharing_the_gpu_get_a_fixed_kv_size(ids, shared, preset, want, monkeypatch):
    from harness.production.engine.session import ENGINE_KV_GIB_ENV

    started = _record_engine_starts(monkeypatch)
    if preset is None:
        monkeypatch.delenv(ENGINE_KV_GIB_ENV, raising=False)
    else:
        monkeypatch.setenv(ENGINE_KV_GIB_ENV, preset)
    runs = engine_process.start_engine_cases(ids, gpu_shared=shared)
    try:
        assert [cmd[cmd.index("--case") + 1] for cmd, _ in started] == ids
        assert {env.get(ENGINE_KV_GIB_ENV) for _, env in started} == {want}
    finally:
        engine_process.stop_engine_cases(runs)
    assert all(not os.path.exists(r.tmp.name) for r in runs)  # their files are gone


@pytest.mark.parametrize("ids, shared, preset, processes", [
    (["engine-tiny-k2"], False, None, None),  # alone on the host: torch's default pool
    (["engine-tiny-k2"], True, None, 2),  # beside this process's side-by-side runs
    (["engine-tiny-k2", "engine-tiny-k3-share"], True, None, 3),
    (["engine-tiny-k2", "engine-tiny-k3-share"], False, "3", None),  # the user's count wins
])
def test_engines_computing_beside_others_get_their_share_of_the_cores(ids, shared, preset, processes,
                                                                      monkeypatch):
    from harness.production.can_run import THREAD_VARS, cpu_share

    started = _record_engine_starts(monkeypatch)
    for var in THREAD_VARS:
        monkeypatch.setenv(var, preset) if preset else monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))  # a 16-core host
    runs = engine_process.start_engine_cases(ids, gpu_shared=shared)
    engine_process.stop_engine_cases(runs)
    want = preset or (str(cpu_share(processes)) if processes else None)
    assert {env.get(var) for _, env in started for var in THREAD_VARS} == {want}
    if processes:
        assert int(want) == 16 // processes


def test_cpu_share_splits_the_usable_cores(monkeypatch):
    from harness.production.can_run import cpu_share

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert [cpu_share(n) for n in (1, 2, 3, 6, 16, 40)] == [16, 8, 5, 2, 1, 1]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5})  # a mask narrower than the host
    assert cpu_share(1) == 2


def test_side_by_side_takes_its_share_while_engines_run_and_gets_its_threads_back(tmp_path, faked, monkeypatch):
    """While engine subprocesses run beside it, this process's torch threads are its share of the
    cores; between cases, once they have exited, it has its own count back, and after the loop."""
    import torch

    from harness.production.can_run import THREAD_VARS

    for var in THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)))
    tier_threads = torch.get_num_threads()
    torch.set_num_threads(8)
    before = 8

    class Engine:  # running for the first case, exited before the second
        def __init__(self):
            self.code = None

        def poll(self):
            return self.code

    engines = [Engine(), Engine()]
    seen = []
    real = sbs.run_case

    def run_case(case, **kw):
        seen.append(torch.get_num_threads())
        for e in engines:
            e.code = 0
        return real(case, **kw)
    monkeypatch.setattr(sbs, "run_case", run_case)
    runs = [engine_process.EngineRun(f"e{i}", e, None) for i, e in enumerate(engines)]
    try:
        out = bisect_check.bisect_side_by_side(["tiny-k3-share", "tiny-k2-clamp-headwise"], None, None, beside=runs)
        assert out.verdict == EXIT_OK
        assert seen == [4, before]  # 12 cores over this process and two engines; then its own again
        assert torch.get_num_threads() == before
        monkeypatch.setenv(THREAD_VARS[0], "3")  # the user chose: left alone
        seen.clear()
        engines[0].code = None
        bisect_check.bisect_side_by_side(["tiny-k3-share"], None, None, beside=runs)
        assert seen == [before]
    finally:
        torch.set_num_threads(tier_threads)


def test_engines_start_before_the_host_checks_and_stop_when_they_fail(monkeypatch, capsys):
    """On a GPU host, bisect-check's engines start as soon as its arguments are checked, so that
    their own imports and host checks overlap this process's; when this process's checks then say
    production cannot run here, the answer is the one line (125) and every engine is stopped."""
    from harness import cli
    from harness.production import can_run

    started = _record_engine_starts(monkeypatch)
    monkeypatch.setattr(can_run, "gpu_device_nodes", lambda: ["/dev/nvidia0"])
    seen_at_check = []

    def engines_started():  # (vLLM's model-info prefetch is started on a GPU host too)
        return [cmd[cmd.index("--case") + 1] for cmd, _ in started if "--case" in cmd]

    def reason():
        seen_at_check.append(len(engines_started()))
        return "vLLM 9.9: the speculator is gone"
    monkeypatch.setattr(can_run, "cannot_run_production_reason", reason)
    stopped = []
    real_stop = engine_process.stop_engine_cases
    monkeypatch.setattr(engine_process, "stop_engine_cases", lambda runs: (stopped.extend(runs), real_stop(runs)))
    assert cli.main(["bisect-check"]) == 125
    assert capsys.readouterr().out.strip() == "cannot judge: vLLM 9.9: the speculator is gone"
    engines = list(bisect_check.DEFAULT_BISECT_ENGINE_CASES)
    assert engines and seen_at_check == [len(engines)]
    assert engines_started() == engines
    assert [r.case_id for r in stopped] == engines and all(not os.path.exists(r.tmp.name) for r in stopped)


@pytest.mark.parametrize("argv, handed", [
    (["bisect-check"], list(bisect_check.DEFAULT_BISECT_ENGINE_CASES)),
    (["bisect-check", "--case", "tiny-k3-share"], None),  # no engine case: nothing started early
    (["bisect-check", "--record-baseline", "{tmp}/b"], None),  # a baseline runs no engine
])
def test_the_command_gets_the_engines_started_early(argv, handed, tmp_path, monkeypatch):
    from harness import cli
    from harness.commands import record_baseline
    from harness.production import can_run

    started = _record_engine_starts(monkeypatch)
    monkeypatch.setattr(can_run, "gpu_device_nodes", lambda: ["/dev/nvidia0"])
    monkeypatch.setattr(can_run, "cannot_run_production_reason", lambda: None)
    got = []

    def bisect_command(args, started=None):
        got.append(None if started is None else [r.case_id for r in started])
        return 0
    monkeypatch.setattr(bisect_check, "bisect_command", bisect_command)
    monkeypatch.setattr(record_baseline, "record_baseline_command", bisect_command)  # --record-baseline's command
    assert cli.main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 0
    assert got == [handed]
    assert len([cmd for cmd, _ in started if "--case" in cmd]) == len(handed or [])


def test_the_bisect_report_says_where_its_time_went(tmp_path, faked):
    """``meta.timeline_s``: this process's marks, in seconds of its life, in order; and each
    engine's span from its start to its case's end, from the start-up and case seconds it reported."""
    assert bisect_check.bisect_command(_args(tmp_path, ["tiny-k3-share"])) == EXIT_OK
    doc = json.loads((tmp_path / "bisect.json").read_text())
    t = doc["meta"]["timeline_s"]
    assert set(t) == {"checked", "side_by_side", "collected"}
    assert 0 < t["checked"] <= t["side_by_side"] <= t["collected"]

    class Run:
        case_id, started_s = "engine-x", 1.5
    spans = bisect_check._timeline([Run()], {"engine-x": {"timing_s": {"start_up": 8.0, "total": 10.25}}},
                                  checked=9.0, side_by_side=16.0, collected=20.0)
    assert spans == {"checked": 9.0, "side_by_side": 16.0, "collected": 20.0, "engine engine-x": [1.5, 19.75]}
    assert bisect_check._timeline([Run()], {}, checked=None, side_by_side=1.0, collected=2.0) == {}


def test_a_lone_engine_started_early_gets_a_fixed_kv_size_but_the_cores_to_itself(monkeypatch):
    """``bisect-check --case ENGINE``: this process creates its CUDA context during its checks while
    the engine starts, so the engine skips vLLM's memory profiling (which fails when another process
    allocates meanwhile); no side-by-side case computes beside it, so its CPU threads stay its own."""
    import argparse

    from harness.production.can_run import THREAD_VARS
    from harness.production.engine.session import ENGINE_KV_GIB_ENV

    started = _record_engine_starts(monkeypatch)
    monkeypatch.delenv(ENGINE_KV_GIB_ENV, raising=False)
    for var in THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    args = argparse.Namespace(case=["engine-tiny-k2"], graphs=False, record_baseline=None)
    runs = bisect_check.start_early(args)
    engine_process.stop_engine_cases(runs)
    [(cmd, env)] = started
    assert env.get(ENGINE_KV_GIB_ENV) == "4" and not any(env.get(v) for v in THREAD_VARS)


def test_a_plant_that_applies_to_no_case_cannot_judge_whatever_allow_unjudged_says(capsys):
    """bisect-check --plant judged vLLM as it is when the mutant applied to none of its cases (a
    release where the bug's precondition does not hold): that run says nothing about the plant."""
    sbs = bisect_check.SideBySide(
        plant_notes=["plant not applicable: p to tiny-k1 (weight is bf16): judged as vLLM is"])
    assert bisect_check.plant_verdict("p", ["tiny-k1"], sbs, EXIT_OK) == EXIT_CANNOT_JUDGE
    assert "NOT JUDGED: --plant p applies to none of this run's side-by-side cases" in capsys.readouterr().out
    assert bisect_check.plant_verdict("p", ["tiny-k1"], sbs, EXIT_MISMATCH) == EXIT_MISMATCH  # vLLM failed anyway
    applied = bisect_check.SideBySide(planted=["tiny-k1"])
    assert bisect_check.plant_verdict("p", ["tiny-k1", "tiny-k2"], applied, EXIT_OK) == EXIT_OK
    assert bisect_check.plant_verdict(None, ["tiny-k1"], bisect_check.SideBySide(), EXIT_OK) == EXIT_OK
    assert bisect_check.plant_verdict("p", [], bisect_check.SideBySide(), EXIT_OK) == EXIT_OK  # engine cases only
