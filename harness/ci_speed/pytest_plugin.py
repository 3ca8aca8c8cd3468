"""The test suite's speed machinery, as a pytest plugin (the root conftest.py registers it with
``pytest_plugins``). It changes how fast a run goes, never what a test checks:

- xdist workers for the CPU tier when the command line does not choose (``default_workers``;
  ``$HYV4_PYTEST_WORKERS``), the mode each worker learns from the controller, and the GPU
  tier's balanced order under worksteal (``xdist_schedule``);
- per process: the cyclic GC paused while collecting then frozen, glibc's large-block tuning and
  the seeded weights drawn once (``weights_memo``) (a host without a GPU only), one intra-op
  torch thread per CPU test module, the ``gc_paused`` fixture for a heavy import inside a test;
- an xdist worker's share of the host (one GPU each on a host with several, bounded CPU threads);
- ``$HYV4_JIT_CACHE`` applied, the project's bytecode compiled once before the workers start;
- ``$HYV4_TIMELINE``: where each process's wall time goes (``pytest_timeline``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import pathlib
import sys

import pytest

from harness.production.can_run import gpu_device_nodes, shared_thread_env

from .jit_cache import apply_jit_cache


WORKERS_ENV = "HYV4_PYTEST_WORKERS"
# Each worker collects the whole suite (imports torch, vLLM: ~27 s of CPU on the CI cores) before it runs a test.
MAX_DEFAULT_WORKERS = 4
TIMELINE_ENV = "HYV4_TIMELINE"  # pytest_timeline.ENV: that module is imported only where it is set


def _test_files_selected(config) -> int:
    """How many test files the command line (or testpaths) names, roughly (test_*.py under a folder)."""
    files = set()
    for arg in config.args:
        path = pathlib.Path(config.invocation_params.dir, arg.split("::", 1)[0]).resolve()
        if path.is_dir():
            files.update(path.rglob("test_*.py"))
        elif path.exists():
            files.add(path)
    return len(files)


def default_workers(config) -> tuple[int, str]:
    """(xdist workers for this run when the command line does not say, why).

    The CPU tier is spread over xdist workers test by test with work stealing
    (`--dist worksteal`: each worker starts on a contiguous half of the
    collection, so a module's fixtures are mostly built once, and an idle
    worker takes tests from a busy one; one file, test_production_fp8_prep,
    holds two thirds of the CPU tier's time, so `loadfile` could not split
    it). It stays serial where that pays better or is needed: one test
    file, a GPU visible (GPU tests must not share the device between
    workers), the GPU / real-checkpoint tiers (`-m`), --update-goldens
    (the manifest is rewritten), -s, --pdb/--trace, --collect-only, and
    `-m vllm_facing` (.ci/run's pass in each other vLLM release: nearly every
    test there reads vLLM in process, so each worker imported it, beside the
    background probe's own import; measured on CI's 2 cores: 25-27 s on 2
    workers, 16-17 s serial with the probe's readers last).
    HYV4_PYTEST_WORKERS=N|auto|0 sets it; `-n N` / `-p no:xdist` win.
    """
    env = os.environ.get(WORKERS_ENV, "").strip().lower()
    if env in ("0", "off", "no", "serial"):
        return 0, f"{WORKERS_ENV}={env}"
    if env not in ("", "auto"):
        try:
            return max(0, int(env)), f"{WORKERS_ENV}={env}"
        except ValueError:
            raise pytest.UsageError(f"{WORKERS_ENV} must be a number, auto or 0, got {env!r}") from None
    o = config.option
    files = _test_files_selected(config)
    if files < 2:
        return 0, "one test file"
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) not in ("", "-1") and gpu_device_nodes():
        return 0, "a GPU is visible"
    markexpr = getattr(o, "markexpr", "") or ""
    if "gpu" in markexpr or "real_checkpoint" in markexpr:
        return 0, f"-m {markexpr!r}"
    if markexpr.strip() == "vllm_facing":  # each worker would import vLLM (~6 s of CPU) beside the probe's own
        return 0, "-m 'vllm_facing': one vLLM import"
    if getattr(o, "update_goldens", False) or getattr(o, "usepdb", False) or getattr(o, "trace", False) \
            or getattr(o, "collectonly", False) or getattr(o, "capture", "fd") == "no":
        return 0, "a serial-only option"
    auto = config.hook.pytest_xdist_auto_num_workers(config=config) or 1
    return min(auto, MAX_DEFAULT_WORKERS, files), "auto"


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Turn xdist on for the CPU tier unless the command line chose (runs before xdist's own hook)."""
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return None
    o = config.option
    if o.numprocesses is not None or o.dist != "no" or o.tx or getattr(o, "distload", False):
        return None
    n, why = default_workers(config)
    if n >= 2:
        o.numprocesses, o.dist = n, "worksteal"
    config.stash[_WORKERS_KEY] = f"xdist: {n} workers, worksteal ({why})" if n >= 2 else f"xdist: off ({why})"
    return None


_WORKERS_KEY = pytest.StashKey[str]()


_JIT_BEFORE = pytest.StashKey[dict]()


def _watch_the_jit_cache(config) -> None:
    """On a GPU host with a cache root: the root's compiled files now, for the session's last line
    (``pytest_terminal_summary``: what the run compiled, every worker and subprocess included)."""
    from .jit_cache import JIT_CACHE_ENV, snapshot

    root = os.environ.get(JIT_CACHE_ENV)
    if root and os.path.isdir(root) and gpu_device_nodes():
        config.stash[_JIT_BEFORE] = snapshot(root)


def pytest_terminal_summary(terminalreporter, config):
    before = config.stash.get(_JIT_BEFORE, None)
    if before is None:
        return
    from .jit_cache import JIT_CACHE_ENV, compiled_line, compiled_since, snapshot

    root = os.environ[JIT_CACHE_ENV]
    terminalreporter.write_line(compiled_line(root, compiled_since(before, snapshot(root))))


def pytest_report_header(config):
    return config.stash.get(_WORKERS_KEY, None)


def pytest_configure(config):
    """After the root conftest's checks of the options and the documented variables (its
    ``pytest_configure`` runs first): this process's tuning, the JIT cache root, the host share
    or the project's bytecode, the timeline."""
    _tune_a_cpu_host_process(config)
    apply_jit_cache()  # $HYV4_JIT_CACHE: the GPU stack's JIT caches under one root (harness warmup fills it)
    if hasattr(config, "workerinput"):
        _share_the_host(config.workerinput)
    else:
        _compile_the_project()
        _watch_the_jit_cache(config)
    if os.environ.get(TIMELINE_ENV):  # where the wall time goes, per process (pytest_timeline)
        from .pytest_timeline import Recorder
        config.pluginmanager.register(Recorder(config, os.environ[TIMELINE_ENV]), "hyv4-timeline")


ROOT = pathlib.Path(__file__).resolve().parents[2]  # the project: harness/ci_speed/ is two levels down
PROJECT_SOURCES = ("harness", "reference", "tests", "benchmarks")


def _compile_the_project() -> None:
    """Compile the project's own sources once, before the workers start (~0.5 s). CI's host (like
    the lent GPU hosts) sets PYTHONDONTWRITEBYTECODE and a CI run is a fresh clone, so every
    worker and every ``python -m harness`` a test starts compiled harness/ and reference/ again:
    a fresh clone's CPU tier took 96.2 s, the same clone with its bytecode in place 80.8 s.
    ``compileall`` writes ``__pycache__`` (git-ignored) whatever that variable says, or the
    bytecode layer where one is set (``$HYV4_JIT_CACHE``); Python checks each .pyc against its
    source's mtime and size. Where the tree cannot be written, processes compile as before."""
    import compileall

    for sub in PROJECT_SOURCES:
        try:
            compileall.compile_dir(str(ROOT / sub), quiet=2)
        except OSError:
            pass


def _tune_a_cpu_host_process(config) -> None:
    """The CPU tier's process-level speed-ups (below), on a host without a GPU. A GPU host's pytest
    processes keep Python's and glibc's defaults: a frozen garbage cycle that holds CUDA memory (an
    engine torn down in the test that imported vLLM) would never be freed, and glibc's heap would
    keep the host copies of real-dims weights; neither has been run on a GPU."""
    if not gpu_device_nodes():
        _quiet_gc_while_collecting(config)
        _keep_freed_memory_mapped()


# ---- large tensors: reuse freed memory instead of faulting in fresh pages -----------------------------
# glibc serves every allocation over 32 MiB (the reference's float64 KV gathers and traces: up to ~120 MB
# each, allocated and freed thousands of times) with a fresh mmap and returns it with munmap on free, so
# each one faults in its pages again: ~15 of the ~50 CPU-s of test_production_fp8_prep were the kernel's
# page faults. In a pytest process (not its subprocesses) glibc is told to serve them from the heap
# (mallopt M_MMAP_MAX=0) and to keep up to 1 GiB of freed memory at its top (M_TRIM_THRESHOLD), so a freed
# buffer is reused. Only where the allocator happens to be glibc's; the values computed are the same
# (peak RSS of that file: ~1.65 -> ~1.9 GB).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def _keep_freed_memory_mapped() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    try:
        libc = ctypes.CDLL(None)
        mallopt, _ = libc.mallopt, libc.gnu_get_libc_version  # glibc (musl has neither)
    except (OSError, AttributeError):
        return
    mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    mallopt(_M_MMAP_MAX, 0)


# ---- the cyclic GC and the imported modules ----------------------------------------------------------
# Importing torch, hypothesis, the test modules (collection) and later vLLM grows the heap by millions of
# long-lived objects; each growth step triggers a full collection that walks all of them and frees next
# to nothing (~0.5 s each, ~10 s of CPU per xdist worker in all, the session's closing collections
# included). So the cyclic GC is paused while a process collects, and what exists once collection is done
# (modules, functions, collected items) is moved out of its reach with gc.freeze(); likewise what a test
# module's own imports added (vLLM), at that module's end. Reference counting still frees every
# non-cyclic object, and the GC still runs on everything created after a freeze (each test's objects).

def _quiet_gc_while_collecting(config) -> None:
    config.stash[_GC_TUNED_KEY] = True
    if gc.isenabled():
        gc.disable()
        config.add_cleanup(gc.enable)  # whatever happens to the run
        config.stash[_GC_PAUSED_KEY] = True
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        _settle_the_heap(config)  # the xdist controller collects nothing


def _settle_the_heap(config) -> None:
    gc.freeze()
    config.stash[_MODULES_AT_FREEZE_KEY] = len(sys.modules)
    if config.stash.get(_GC_PAUSED_KEY, False):
        config.stash[_GC_PAUSED_KEY] = False
        gc.enable()


_GC_PAUSED_KEY = pytest.StashKey[bool]()
_GC_TUNED_KEY = pytest.StashKey[bool]()  # this process pauses / freezes (pytest_configure decides)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    if session.config.stash.get(_GC_TUNED_KEY, False):  # a host without a GPU
        from .weights_memo import install

        install()  # the seeded weights drawn once per process (the tests' modules are imported now)
        _settle_the_heap(session.config)


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are gone
def pytest_runtest_teardown(item, nextitem):
    if not item.config.stash.get(_GC_TUNED_KEY, False):
        return
    if len(sys.modules) > item.config.stash.get(_MODULES_AT_FREEZE_KEY, 0) + 100:
        gc.freeze()  # the test imported a lot (vLLM, flashinfer): long-lived, out of the GC's walk
        item.config.stash[_MODULES_AT_FREEZE_KEY] = len(sys.modules)


_MODULES_AT_FREEZE_KEY = pytest.StashKey[int]()


@contextlib.contextmanager
def _gc_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


@pytest.fixture(scope="session")
def gc_paused():
    """``with gc_paused(): import vllm...``: a heavy import without the full collections its growth
    triggers (~2 s of CPU for vLLM's model modules); what it imported is frozen afterwards."""
    return _gc_paused


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread(request):
    """One intra-op torch thread for every test that computes on the CPU: the tensors are tiny,
    extra threads only spin against the other jobs on CI's 2 cores (measured 3-10x wall time on
    busy cores). GPU tests (tests/gpu) on a host with a CUDA device keep torch's default (their
    xdist workers get a share of the cores: ``_share_the_host``). A module that has not imported
    torch by the time it runs (a pytest run on non-torch files) does not pay torch's import here."""
    torch = None
    if "torch" in sys.modules:
        # the conftest's host check may still be importing torch in its thread (a gpu_subprocess test
        # does not wait for it): ``import`` waits on the module's import lock for a whole module,
        # where sys.modules would hand over a partial one
        import torch
    if torch is None or "gpu" in pathlib.Path(str(request.path)).parts and torch.cuda.is_available():
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.hookimpl(trylast=True)  # after every other plugin's unconfigure (this process's results are sent)
def pytest_unconfigure(config):
    """An xdist worker on a GPU host ends here, without interpreter teardown
    (``harness.process_exit``): its results reached the controller with its ``workerfinished``
    (sent, synchronously, at its session's end), and the controller waits for each worker process
    to exit before it ends the run; a worker that imported vLLM and held CUDA memory took seconds
    to tear down (measured: the controller ended 3.8-5.0 s after the last worker's session). The
    exit code is the controller's, from the reports. ``$HYV4_WORKER_TEARDOWN=1`` keeps teardown."""
    if hasattr(config, "workerinput") and gpu_device_nodes() and os.environ.get(WORKER_TEARDOWN_ENV) != "1":
        from ..process_exit import exit_now

        exit_now(0)


WORKER_TEARDOWN_ENV = "HYV4_WORKER_TEARDOWN"


def _share_the_host(workerinput: dict) -> None:
    """An xdist worker's share of the host: on a host with several GPUs, one GPU per worker
    (worker i takes GPU i mod n; set before CUDA is initialised, and only where the user did
    not choose with CUDA_VISIBLE_DEVICES); and a bounded CPU-thread count, so workers that
    replay the float64 reference on the CPU do not oversubscribe the cores."""
    idx = int(str(workerinput.get("workerid", "gw0")).lstrip("gw") or 0)
    count = max(1, int(workerinput.get("workercount", 1)))
    gpus = gpu_device_nodes()
    if not gpus:  # the CPU tier keeps torch's default threads (its goldens were made with them)
        return
    if len(gpus) > 1 and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(idx % len(gpus))
    os.environ.update(shared_thread_env(os.environ, count))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.hookimpl(trylast=True)  # after -m / -k deselection: the spread sees the tests that run
def pytest_collection_modifyitems(config, items):
    _spread_the_long_gpu_tests(config, items)


_DIST_KEY = "hyv4_dist"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist's controller, for each worker it starts: the worker's own config says ``dist="no"``
    (xdist resets it there), so ``_spread_the_long_gpu_tests`` reads the real mode from here."""
    node.workerinput[_DIST_KEY] = getattr(node.config.option, "dist", None)


def _spread_the_long_gpu_tests(config, items) -> None:
    """Under worksteal, each xdist worker starts with a slice of about the same expected seconds
    (``xdist_schedule``, costs from ``tests/gpu/durations.json``); only a run of GPU tests
    alone (.ci/gpu-tier) is reordered, the CPU tier keeps its module order."""
    wi = getattr(config, "workerinput", None)
    gpu_dir = ROOT / "tests" / "gpu"
    if not wi or wi.get(_DIST_KEY) != "worksteal" or not items or not all(
            pathlib.Path(str(it.path)).parent == gpu_dir for it in items):
        return
    from .xdist_schedule import expected_costs, load_durations, spread

    costs = expected_costs([it.nodeid for it in items], load_durations(str(gpu_dir / "durations.json")))
    items[:] = [items[i] for i in spread(costs, int(wi["workercount"]))]
