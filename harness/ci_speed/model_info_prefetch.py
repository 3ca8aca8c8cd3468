"""vLLM's model-class inspection, started early in the background (cold hosts only).

Building a ``VllmConfig`` makes vLLM's model registry inspect the class of each architecture
it resolves (the target ``HYV4ForCausalLM``, then the draft ``HYV4MTPModel``). With nothing in
``$VLLM_CACHE_ROOT/modelinfos`` yet, vLLM does each in a fresh Python subprocess that imports
torch and vLLM again, one after the other, on the critical path: a cold ``harness main``
spent 19.9 s and 15.3 s there (measured), against 0.02 s and 1.2 s once vLLM had
cached them. ``start`` has vLLM run those same inspections (its
``ModelRegistry._try_inspect_model_cls``, without the subprocess hop: ``_inspect``) in a
background process while this one imports and builds its inputs; ``wait`` joins it before the
config is built (``start`` registers it at the production path's ``before_vllm_config`` point,
``harness.production.run_hooks``), so vLLM then reads what it cached instead of inspecting again.

An optimisation only: it decides nothing. Failing, absent (no GPU, a vLLM without that
method) or late (``wait`` gives up after ``WAIT_S``), vLLM inspects exactly as it always did.
Once it has succeeded for a vLLM tree and cache root it is not started again (a marker keyed
by the files of ``vllm/models/hy_v4`` and the cache root); a changed tree starts it again,
and vLLM's own cache checks its module hash whatever this marker says.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

ARCHS = ("HYV4ForCausalLM", "HYV4MTPModel")  # the target, and the draft vLLM rewrites it to for "mtp"
PACKAGE = ("vllm", "models", "hy_v4")  # where both classes live (keys the marker)
MARKER = "hyv4-model-info.json"
WAIT_S = 120.0  # cold, through vLLM's two subprocesses at once, it took 40.8 s: far more is a hang
COMMANDS = ("main", "compare", "bisect-check", "warmup")  # the CLI commands that build a VllmConfig first thing
OFF_ENV = "HYV4_MODEL_INFO_PREFETCH"  # "0": never start it

_proc: subprocess.Popen | None = None
_started = 0.0


def _marker_path() -> str:
    root = os.environ.get("VLLM_CACHE_ROOT")
    if root:
        return os.path.join(root, MARKER)
    return os.path.join(os.path.expanduser("~/.cache/hyv4-mtp-harness"), MARKER)


def tree_key() -> str | None:
    """What the marker is keyed by: the cache root and every file under ``vllm/models/hy_v4``
    (relative name, size, mtime), found without importing vLLM; ``None`` without that package."""
    try:
        spec = importlib.util.find_spec(PACKAGE[0])
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg = os.path.join(str(list(spec.submodule_search_locations)[0]), *PACKAGE[1:])
    if not os.path.isdir(pkg):
        return None
    h = hashlib.sha256(os.environ.get("VLLM_CACHE_ROOT", "~").encode())
    for dirpath, dirnames, filenames in os.walk(pkg):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                st = os.stat(path)
                h.update(f"{os.path.relpath(path, pkg)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()


def done_for(key: str | None) -> bool:
    try:
        with open(_marker_path()) as f:
            return key is not None and json.load(f).get("key") == key
    except (OSError, ValueError, AttributeError, RecursionError):
        return False


def wanted(args) -> bool:
    """Whether a parsed ``python -m harness`` command should start it: one that builds a
    VllmConfig itself (not a warmup with lanes: each lane is a ``harness warmup`` process of its
    own; not a warmup that restores a packed cache first: the inspection writes into vLLM's layer
    of the cache root the restore fills), on a host with an NVIDIA GPU (elsewhere vLLM is never
    built), not switched off."""
    from ..production.can_run import gpu_device_nodes

    return (getattr(args, "command", None) in COMMANDS and (getattr(args, "lanes", None) or 1) <= 1
            and not getattr(args, "restore", None)
            and os.environ.get(OFF_ENV, "1") != "0" and bool(gpu_device_nodes()))


def _command(key: str) -> list[str]:
    return [sys.executable, "-m", "harness", "ci", "prefetch", key]  # inspect_main


def start() -> bool:
    """Start the background inspection unless it already succeeded for this vLLM tree and
    cache root (or one is running); returns whether one was started."""
    global _proc, _started
    key = tree_key()
    if _proc is not None or key is None or done_for(key):
        return False
    _started = time.perf_counter()
    try:
        _proc = subprocess.Popen(_command(key), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                 env={**os.environ, OFF_ENV: "0"})
    except OSError:
        _proc = None
        return False
    atexit.register(stop)
    from ..production import run_hooks

    run_hooks.register("before_vllm_config", wait)  # joined before vLLM would inspect on its own
    return True


def stop() -> None:
    """Kill the background process, and anything it started (its own session), if still running."""
    global _proc
    proc, _proc = _proc, None
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()


def wait() -> None:
    """Join the background inspection (if one runs) before vLLM inspects on its own; one line
    on stderr says how it went. Never raises."""
    global _proc
    proc = _proc
    if proc is None:
        return
    try:
        rc = proc.wait(timeout=max(0.0, WAIT_S - (time.perf_counter() - _started)))
        _proc = None
        how = "done" if rc == 0 else f"failed (exit {rc}); vLLM inspects as usual"
    except subprocess.TimeoutExpired:
        stop()
        how = f"gave up after {WAIT_S:.0f} s; vLLM inspects as usual"
    print(f"model info: vLLM's inspection of {', '.join(ARCHS)} in the background: {how} "
          f"({time.perf_counter() - _started:.1f} s after it started)", file=sys.stderr, flush=True)


def inspect_in_this_process() -> bool:
    """From now on vLLM's model registry runs its model-class inspection in this process
    instead of a fresh subprocess (after loading vLLM's plugins, as that subprocess does): for
    throwaway processes only (this module's background process; the CPU tier's vLLM probe,
    where each cold inspection subprocess cost ~23 s of CPU). False where this vLLM lacks the hook."""
    from vllm.model_executor.models import registry

    if not callable(getattr(registry, "_run_in_subprocess", None)):
        return False
    try:
        from vllm.plugins import load_general_plugins
        load_general_plugins()
    except ImportError:
        pass
    registry._run_in_subprocess = lambda fn: fn()
    return True


def _inspect(key: str) -> int:
    """The background process: vLLM's own inspection of each architecture (its
    ``inspect_model_cls``: module hash, ``_ModelInfo.from_model_cls``, its cache file), run in
    this process, then the marker is written. 0 all inspected.

    vLLM runs ``from_model_cls`` in a fresh subprocess only so that the *serving* process never
    initialises CUDA; that second interpreter importing torch and vLLM again is what made the
    inspection slow (measured: this process spent 40.8 s when it went through vLLM's two
    subprocesses at once). This throwaway process may initialise anything, so the hop is
    skipped here (``inspect_in_this_process``); where this vLLM lacks the hook, its subprocess
    runs as before."""
    from vllm.model_executor.models import registry

    inspect = getattr(registry.ModelRegistry, "_try_inspect_model_cls", None)
    if inspect is None:
        return 3
    inspect_in_this_process()
    if any(inspect(arch) is None for arch in ARCHS):
        return 4
    from ..atomic import atomic_write_json

    atomic_write_json(_marker_path(), {"key": key, "archs": list(ARCHS)})
    return 0



def inspect_main(argv: list[str]) -> int:
    """``python -m harness ci prefetch KEY``: the background process ``start`` runs (``_inspect``)."""
    import gc

    from .jit_cache import apply_jit_cache

    if len(argv) != 1:
        print(f"error: python -m harness ci prefetch: one KEY (tree_key), got {len(argv)} argument(s)",
              file=sys.stderr)
        return 2
    gc.disable()  # a throwaway process that only imports and inspects (harness.ci_speed.startup_gc.defer_gc)
    apply_jit_cache()  # the parent's root is in the environment: this adds the package-map layer
    return _inspect(argv[0])
