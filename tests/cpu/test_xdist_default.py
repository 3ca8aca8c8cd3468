"""The CPU tier's default xdist workers (``harness.ci_speed.pytest_plugin``, which the root
conftest.py registers): when it turns on, and that `-n 0`, `-p no:xdist` and
HYV4_PYTEST_WORKERS=0 keep a run serial."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from harness.ci_speed import pytest_plugin as C

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _config(args=("tests",), auto=2, **option):
    opts = dict(numprocesses=None, dist="no", tx=[], distload=False, markexpr="", update_goldens=False,
                usepdb=False, trace=False, collectonly=False, capture="fd")
    opts.update(option)
    return SimpleNamespace(
        args=list(args), invocation_params=SimpleNamespace(dir=ROOT), option=SimpleNamespace(**opts),
        hook=SimpleNamespace(pytest_xdist_auto_num_workers=lambda config: auto),
        pluginmanager=SimpleNamespace(hasplugin=lambda name: True), stash=pytest.Stash())


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.delenv(C.WORKERS_ENV, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def test_the_cpu_tier_runs_on_workers(no_gpu):
    cfg = _config()
    C.pytest_cmdline_main(cfg)
    assert (cfg.option.numprocesses, cfg.option.dist) == (2, "worksteal")
    cfg = _config(auto=64)
    C.pytest_cmdline_main(cfg)
    assert cfg.option.numprocesses == C.MAX_DEFAULT_WORKERS


@pytest.mark.parametrize("case", [
    dict(args=["tests/cpu/test_goldens.py"]),                       # one file: workers only cost
    dict(args=["tests/cpu/test_goldens.py::test_goldens_stay_small", "tests/cpu/test_goldens.py"]),
    dict(auto=1),                                                   # one CPU
    dict(markexpr="gpu"), dict(markexpr="multigpu"), dict(markexpr="real_checkpoint"),
    dict(markexpr="vllm_facing"),                                   # one vLLM import, not one per worker
    dict(update_goldens=True), dict(usepdb=True), dict(trace=True), dict(collectonly=True), dict(capture="no"),
])
def test_serial_where_workers_do_not_pay_or_would_interfere(no_gpu, case):
    cfg = _config(**case)
    C.pytest_cmdline_main(cfg)
    assert cfg.option.numprocesses is None and cfg.option.dist == "no"
    assert cfg.stash[C._WORKERS_KEY].startswith("xdist: off")


@pytest.mark.parametrize("option", [dict(numprocesses=0), dict(numprocesses=3), dict(dist="load"), dict(tx=["popen"])])
def test_the_command_line_wins(no_gpu, option):
    cfg = _config(**option)
    C.pytest_cmdline_main(cfg)
    assert (cfg.option.numprocesses, cfg.option.dist, cfg.option.tx) == (
        option.get("numprocesses"), option.get("dist", "no"), option.get("tx", []))


def test_only_the_vllm_facing_pass_itself_is_serial(no_gpu):
    cfg = _config(markexpr="not vllm_facing")
    C.pytest_cmdline_main(cfg)
    assert (cfg.option.numprocesses, cfg.option.dist) == (2, "worksteal")


def test_the_environment_variable(no_gpu, monkeypatch):
    monkeypatch.setenv(C.WORKERS_ENV, "0")
    cfg = _config()
    C.pytest_cmdline_main(cfg)
    assert cfg.option.numprocesses is None
    monkeypatch.setenv(C.WORKERS_ENV, "3")
    cfg = _config(auto=1)
    C.pytest_cmdline_main(cfg)
    assert (cfg.option.numprocesses, cfg.option.dist) == (3, "worksteal")
    monkeypatch.setenv(C.WORKERS_ENV, "many")
    with pytest.raises(pytest.UsageError, match="HYV4_PYTEST_WORKERS"):
        C.pytest_cmdline_main(_config())


def test_a_visible_gpu_keeps_the_run_serial(monkeypatch):
    monkeypatch.delenv(C.WORKERS_ENV, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(C, "gpu_device_nodes", lambda: ["/dev/nvidia0"])
    cfg = _config()
    C.pytest_cmdline_main(cfg)
    assert cfg.option.numprocesses is None and "GPU" in cfg.stash[C._WORKERS_KEY]


def test_workers_and_no_xdist_end_to_end(tmp_path):
    """A real pytest on two tiny files with the project's conftest: workers, and `-p no:xdist` still runs serially
    (`-n 0`: the unit tests above; each run here costs ~3 s of CPU per process, so only these two). The same runs
    check, with real xdist processes, that each worker learns the controller's dist mode (``pytest_configure_node``:
    xdist says "no" on the worker itself) and that ``$HYV4_TIMELINE`` records each process (``pytest_timeline``):
    the tests in the processes that ran them, none in the xdist controller."""
    from harness.ci_speed import pytest_timeline as timeline

    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    for i in (1, 2):
        (tmp_path / f"test_t{i}.py").write_text(
            "import os\n\ndef test_w(request):\n"
            "    print('worker', os.environ.get('PYTEST_XDIST_WORKER', 'none'))\n"
            "    print('dist', getattr(request.config, 'workerinput', {}).get('hyv4_dist'),"
            " getattr(request.config.option, 'dist', None))\n")
    # not this run's own xdist worker variables (PYTEST_XDIST_WORKER=gw0 when the suite runs on workers)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    env.update(PYTHONPATH=str(ROOT), HYV4_PYTEST_WORKERS="2", CI="true")

    def pytest_(tl, *args):
        r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", *args, str(tmp_path)],
                           cwd=tmp_path, env={**env, timeline.ENV: str(tl)}, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout, timeline.summarize(str(tl))["processes"]

    out, procs = pytest_(tmp_path / "tl-xdist")
    assert "xdist: 2 workers, worksteal" in out and "created: 2/2 workers" in out and "2 passed" in out
    assert out.count("dist worksteal no") == 2, out
    assert sorted(procs) == ["gw0", "gw1", "main"] and procs["main"]["tests"] == 0
    assert procs["gw0"]["tests"] + procs["gw1"]["tests"] == 2
    assert all(p["process_s"] <= p["configured_s"] <= p["collected_s"] for p in procs.values() if "collected_s" in p)
    out, procs = pytest_(tmp_path / "tl-serial", "-p", "no:xdist")
    assert "created:" not in out and "worker none" in out and "2 passed" in out, out
    assert sorted(procs) == ["main"] and procs["main"]["tests"] == 2


def test_the_gc_and_malloc_tuning_stays_off_a_gpu_host(monkeypatch):
    """The speed plugin's CPU-tier speed-ups (the cyclic GC paused while collecting, then frozen;
    glibc serving large blocks from its heap) apply on a host without a GPU device, and a GPU host's
    test processes keep the defaults (a frozen cycle holding CUDA memory would never be freed)."""
    import gc

    calls = []
    monkeypatch.setattr(C, "_keep_freed_memory_mapped", lambda: calls.append("malloc"))

    def config():
        cleanups = []
        return SimpleNamespace(stash=pytest.Stash(), add_cleanup=cleanups.append, cleanups=cleanups,
                               option=SimpleNamespace(numprocesses=None))

    was_enabled = gc.isenabled()
    try:
        monkeypatch.setattr(C, "gpu_device_nodes", lambda: ["/dev/nvidia0"])
        gpu = config()
        C._tune_a_cpu_host_process(gpu)
        assert not calls and gc.isenabled() == was_enabled and not gpu.stash.get(C._GC_TUNED_KEY, False)
        monkeypatch.setattr(C, "gpu_device_nodes", lambda: [])
        cpu = config()
        C._tune_a_cpu_host_process(cpu)
        assert calls == ["malloc"] and cpu.stash[C._GC_TUNED_KEY] and not gc.isenabled()
    finally:
        (gc.enable if was_enabled else gc.disable)()


def test_the_weights_memo_gives_each_caller_the_first_draws_values_in_its_own_tensors():
    """``weights_memo``: a repeated stream draw of the same (config, seed) is the first draw's
    values in fresh tensors (a caller that plants a bug in place changes nobody else's), another
    seed or config is drawn, ``per-tensor`` always draws, and at most ``max_bytes`` are kept."""
    import torch

    from harness.ci_speed import weights_memo
    from harness.presets import preset
    from reference import MTPConfig
    from reference.weights import random_weights as original

    draws = []

    def counted(cfg, seed, *, draw="stream"):
        draws.append((seed, draw))
        return original(cfg, seed, draw=draw)

    cfg = MTPConfig.from_hf_dict(preset("tiny"))
    size = sum(t.nbytes for t in original(cfg, 0).values())
    rw = weights_memo.memoized(counted, max_bytes=2 * size)
    first = rw(cfg, 0)
    first["layers.0.attn.q_a_proj"].zero_()  # planted in place: the next caller does not see it
    again = rw(cfg, 0)
    fresh = original(cfg, 0)
    assert list(again) == list(fresh) and all(torch.equal(again[k], v) for k, v in fresh.items())
    assert draws == [(0, "stream")]
    rw(cfg, 1), rw(cfg, 0, draw="per-tensor"), rw(cfg, 0, draw="per-tensor")
    assert draws == [(0, "stream"), (1, "stream"), (0, "per-tensor"), (0, "per-tensor")]
    rw(cfg, 2)  # a third set: the least recently used (seed 0) goes
    rw(cfg, 1), rw(cfg, 0)
    assert draws[4:] == [(2, "stream"), (0, "stream")]
    small = weights_memo.memoized(counted, max_bytes=size - 1)
    small(cfg, 5), small(cfg, 5)
    assert draws[-2:] == [(5, "stream"), (5, "stream")]  # too big to keep: drawn each time


def test_the_controller_compiled_the_projects_sources(tmp_path, monkeypatch):
    """Before any worker started, the run's bytecode of every project module is in place (where
    this process's Python reads it: __pycache__, or the bytecode layer), whatever
    PYTHONDONTWRITEBYTECODE says; a directory that is not there is no error."""
    for sub in C.PROJECT_SOURCES:
        src = sorted((ROOT / sub).rglob("*.py"))[0]
        assert pathlib.Path(importlib.util.cache_from_source(str(src))).is_file(), src
    pkg = tmp_path / "stand_in"
    pkg.mkdir()
    (pkg / "m.py").write_text("X = 1\n")
    monkeypatch.setattr(C, "ROOT", tmp_path)
    monkeypatch.setattr(C, "PROJECT_SOURCES", ("stand_in", "absent"))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    C._compile_the_project()
    assert pathlib.Path(importlib.util.cache_from_source(str(pkg / "m.py"))).is_file()  # "absent": no error


def test_a_gpu_hosts_workers_end_without_teardown_and_their_results_stand(tmp_path):
    """On a GPU host (faked here: the speed plugin's device-node probe), an xdist worker ends
    without interpreter teardown once its results are sent (``pytest_plugin.pytest_unconfigure``):
    an exit hook registered in every process runs in the controller only, and the controller still
    reports every result and the failure's exit code."""
    marker = tmp_path / "teardowns.txt"
    (tmp_path / "fakegpu.py").write_text(  # the speed plugin alone (the root conftest's imports cost seconds)
        "import atexit, os\n"
        "from harness.ci_speed import pytest_plugin\n"
        "pytest_plugin.gpu_device_nodes = lambda: ['/dev/nvidia0']\n"
        "pytest_plugins = ['harness.ci_speed.pytest_plugin']\n"
        f"atexit.register(lambda: open({str(marker)!r}, 'a')"
        ".write(os.environ.get('PYTEST_XDIST_WORKER', 'controller') + '\\n'))\n")
    (tmp_path / "test_t.py").write_text("import pytest\n\n@pytest.mark.parametrize('i', range(2))\ndef test_w(i):\n"
                                        "    assert i != 1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    env.update(PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", CI="true")
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "fakegpu", "-p", "no:cacheprovider", "-n", "1",
                        str(tmp_path / "test_t.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "1 failed, 1 passed" in r.stdout, r.stdout + r.stderr
    assert "crashed" not in r.stdout and "Not properly terminated" not in r.stdout + r.stderr, r.stdout
    assert marker.read_text().split() == ["controller"]


@pytest.mark.parametrize("gpu, worker, keep, ends", [
    (True, True, None, True),
    (True, True, "1", False),  # $HYV4_WORKER_TEARDOWN=1 keeps the teardown
    (True, False, None, False),  # the controller, or a run without xdist, ends as pytest ends
    (False, True, None, False),  # the CPU tier's workers end as they always did
])
def test_which_pytest_processes_end_without_teardown(gpu, worker, keep, ends, monkeypatch):
    from harness import process_exit
    from harness.ci_speed import pytest_plugin

    exits = []
    monkeypatch.setattr(process_exit, "exit_now", exits.append)
    monkeypatch.setattr(pytest_plugin, "gpu_device_nodes", lambda: ["/dev/nvidia0"] if gpu else [])
    monkeypatch.delenv(pytest_plugin.WORKER_TEARDOWN_ENV, raising=False)
    if keep:
        monkeypatch.setenv(pytest_plugin.WORKER_TEARDOWN_ENV, keep)
    config = type("Config", (), {"workerinput": {"workerid": "gw0"}} if worker else {})()
    pytest_plugin.pytest_unconfigure(config)
    assert exits == ([0] if ends else [])
