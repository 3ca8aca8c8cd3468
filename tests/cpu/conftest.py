"""CPU tier fixtures."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from harness.production.can_run import gpu_device_nodes

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "cpu" / "_vllm_config_probe.py"
PROBE_TIMEOUT_S = 900

# Importing vLLM's FP8 linear kernels (test_checkpoint_vllm_rules' FP8 quant configs) imports humming,
# which starts two background Python processes to JIT-build its CUDA launcher and nvrtc helper:
# ~16 s of CPU on the CI cores, for a build that needs CUDA. Without a CUDA device nothing in this
# process or its children runs a kernel, so humming builds on first use instead (as in the probe below).
# Set at collection, before any test imports vLLM; a host with a GPU keeps humming's default.
if not gpu_device_nodes():
    os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")


# ---- vLLM on a faked CUDA platform: one subprocess per test run -------------------------------------
# A test module that asks for the ``vllm_probe`` fixture declares what it needs at module level:
#     VLLM_PROBE = {"config": [case ids], "load": [case ids], "build": [HF config dicts], "walk": [case ids]}
# (tests/cpu/_vllm_config_probe.py's modes). Importing vLLM and faking the platform is most of a
# probe's cost, so the plans of all modules in the run go to one `_vllm_config_probe.py plan`
# process, started in the background when the first CPU test starts, once per run (xdist workers
# share it through their common temporary directory; the first claims it).

def _probe_plan(items) -> dict:
    plan: dict[str, list] = {"config": [], "load": [], "build": [], "walk": []}
    seen = set()
    for item in items:
        mod = getattr(item, "module", None)
        if mod is None or mod in seen or "vllm_probe" not in getattr(item, "fixturenames", ()):
            continue
        seen.add(mod)
        for mode, entries in getattr(mod, "VLLM_PROBE").items():
            plan[mode].extend(e for e in entries if e not in plan[mode])
    return plan


def _probe_dir(tmp_path_factory) -> pathlib.Path:
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # shared by this run's workers
    d = base / "vllm-probe"
    d.mkdir(exist_ok=True)
    return d


# ---- xdist order: vLLM in one worker, one-process memos next, the probe's readers last --------------
# Importing vLLM and its model-executor modules (HYV4MTP, rotary_embedding, the fused-MoE router) costs
# ~20 s of CPU per process, paid by every worker that runs one test needing them in process. A module
# says which of its tests import vLLM in process: ``VLLM_IN_PROCESS = True`` (all) or a set of test
# function names. Under xdist those tests go to the front of the collection (worksteal hands each worker
# a contiguous slice and steals from the tail, so they run on the first worker, one import); next the
# modules whose module-scoped memo pays only within one process (``ONE_WORKER = True``:
# test_production_fp8_prep's reference replays), so they are not split between the workers; the tests
# that wait for the background probe (``vllm_probe``) go to the back (by then it has finished); a serial
# run (`-m vllm_facing` is one) moves only those to the back. Only the order changes: every test still
# runs, with the same fixtures.

def _xdist_order(item) -> int:
    if "vllm_probe" in getattr(item, "fixturenames", ()):
        return 3
    mod = getattr(item, "module", None)
    flag = getattr(mod, "VLLM_IN_PROCESS", None)
    name = getattr(item, "originalname", None) or item.name
    if flag is True or (flag and name in flag):
        return 0
    return 1 if getattr(mod, "ONE_WORKER", False) else 2


def _vllm_facing(item) -> bool:
    """The test reaches vLLM: in process (``VLLM_IN_PROCESS``) or through the probe."""
    return _xdist_order(item) in (0, 3)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    # `-m vllm_facing` (.ci/run, in each vLLM release's environment): derived from what a module
    # declares above, never a second list
    for item in items:
        if _vllm_facing(item):
            item.add_marker(pytest.mark.vllm_facing)
    if not hasattr(config, "workerinput"):  # serial: the order as written, the probe's readers last
        items[:] = sorted(items, key=lambda item: _xdist_order(item) == 3)  # (stable)
        return
    items[:] = sorted(items, key=_xdist_order)  # stable: the written order within each group


@pytest.fixture(scope="session", autouse=True)
def _vllm_probe_started(request, tmp_path_factory):
    """Start the run's vLLM probe (if any collected test needs it and vLLM is installed); the
    worker that started it waits for it at its end, so it never outlives the run."""
    plan = _probe_plan(request.session.items)
    if not any(plan.values()) or importlib.util.find_spec("vllm") is None:
        yield
        return
    d = _probe_dir(tmp_path_factory)
    try:
        os.close(os.open(d / "claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:  # another worker started it
        yield
        return
    (d / "plan.json").write_text(json.dumps(plan))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1",  # loads and compares weights only; no thread pool against the workers
               # importing vLLM's FP8 linear kernels imports humming, which starts two background
               # Python processes to JIT-build its CUDA launcher and nvrtc helper (~20 s of CPU on the
               # CI cores, and the probe's exit waits for them); the probe runs no kernel, so it never
               # needs them (humming then builds on first use). Same JSON answers either way.
               HUMMING_DISABLE_PARALLEL_BUILD="1",
               # vLLM's model-info cache for this run only: what the probe's in-process model-class
               # inspection (under the faked platform) writes never reaches a real run's cache
               VLLM_CACHE_ROOT=str(d / "vllm-cache"))
    proc = subprocess.Popen(
        ["bash", "-c", '"$@" >"$OUT/stdout" 2>"$OUT/stderr"; echo $? >"$OUT/rc.part"; mv "$OUT/rc.part" "$OUT/rc"',
         "probe", sys.executable, str(PROBE), "plan", str(d / "plan.json")],
        cwd=ROOT, env={**env, "OUT": str(d)})
    yield
    try:
        proc.wait(timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()


class ProbeResults:
    """The probe's answers: ``config[id]``, ``load[id]``, ``walk[id]`` (dicts; a "crash" key holds a traceback)
    and ``build(hf)`` (the row for that HF config dict); ``dir``: the probe's directory (its
    plan, output, and the run's own vLLM cache, ``vllm-cache``)."""

    dir = None

    def __init__(self, plan: dict, lines: list[dict]):
        self.config = {d["id"]: d for d in lines if d.get("mode") == "config"}
        self.load = {d["id"]: d for d in lines if d.get("mode") == "load"}
        self.walk = {d["id"]: d for d in lines if d.get("mode") == "walk"}
        self._build = {json.dumps(plan["build"][d["i"]], sort_keys=True): d
                       for d in lines if d.get("mode") == "build"}
        self.stderr = ""

    def build(self, hf: dict) -> dict:
        return self._build[json.dumps(hf, sort_keys=True)]

    def answer(self, mode: str, cid: str) -> dict:
        """``config`` / ``load`` / ``walk`` answer for ``cid``, failing the test with the probe's
        traceback where vLLM crashed on it."""
        d = getattr(self, mode)[cid]
        assert "crash" not in d, d["crash"]
        return d


@pytest.fixture(scope="session")
def vllm_probe(_vllm_probe_started, tmp_path_factory) -> ProbeResults:
    """This run's vLLM probe results (waits for the background process); skips where the
    CUDA platform cannot be faked (the probe's exit 77), fails on any other non-zero exit."""
    if importlib.util.find_spec("vllm") is None:  # not importorskip: the waiting worker need not import vLLM
        pytest.skip("vLLM is not installed")
    d = _probe_dir(tmp_path_factory)
    if not (d / "claim").exists():
        pytest.fail("the vLLM probe was not started (no collected test declared VLLM_PROBE?)")
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    while not (d / "rc").exists():
        if time.monotonic() > deadline:
            pytest.fail(f"the vLLM probe did not finish in {PROBE_TIMEOUT_S} s (output in {d})")
        time.sleep(0.2)
    rc = int((d / "rc").read_text().strip() or -1)
    stderr = (d / "stderr").read_text(errors="replace")
    if rc == 77:
        pytest.skip(f"cannot fake a CUDA platform for vLLM here: {stderr[-500:]}")
    assert rc == 0, stderr[-4000:]
    plan = json.loads((d / "plan.json").read_text())
    lines = [json.loads(line) for line in (d / "stdout").read_text().splitlines() if line.startswith("{")]
    res = ProbeResults(plan, lines)
    res.dir = d
    res.stderr = stderr
    return res


# ---- the bad-input tests' fixtures (test_bad_input_round3.py and _round4.py) -------------------------
# Here rather than imported from one test module into the other: a fixture imported by name is shadowed
# by the test parameter of the same name (and read as unused). test_exit_contract.py keeps a gpu_host of
# its own (a narrower stub), which overrides this one in that module.

class ProductionReached(AssertionError):
    pass


@pytest.fixture
def gpu_host(monkeypatch):
    """Looks like a GPU host; any production run, engine or mutant catalogue fails the test."""
    from harness.production import can_run
    from harness.production.engine import process as engine_process
    from harness.production.module import side_by_side

    def must_not_run(*a, **kw):
        raise ProductionReached("production reached: the input was not validated first")

    monkeypatch.setattr(can_run, "cannot_run_production_reason", lambda: None)
    monkeypatch.setattr(side_by_side, "run_case", must_not_run)
    monkeypatch.setattr(engine_process, "start_engine_cases", must_not_run)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A tiny two-shard checkpoint; tests edit copies of it (``shutil.copytree``), never it."""
    from harness.checkpoint.synth import synth_config, write_synthetic
    from reference.config import MTPConfig
    from reference.weights import random_weights

    hf = synth_config("tiny", vocab_size=128)
    return write_synthetic(tmp_path_factory.mktemp("bad-input") / "ck", hf,
                           random_weights(MTPConfig.from_hf_dict(hf), 1), shards=2)
