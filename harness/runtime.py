"""Can the production path run here? One reason string, or None."""

from __future__ import annotations


def cannot_run_production_reason() -> str | None:
    if not gpu_device_nodes():  # said without importing torch (~2 s); CUDA needs an NVIDIA device node
        return "no CUDA device"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (9, 0):
        return f"GPU capability {major}.{minor}: FlashMLA sparse and DeepGEMM need SM90+"
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"vLLM does not import: {exc.__class__.__name__}: {exc}"
    return None


GPU_DEVICE_GLOB = "/dev/nvidia[0-9]*"


def gpu_device_nodes() -> list[str]:
    """The host's NVIDIA GPU device nodes (``/dev/nvidia0`` ...), without importing torch or
    initialising CUDA: what the pytest conftests decide on (workers, per-process tuning)."""
    import glob

    return sorted(glob.glob(GPU_DEVICE_GLOB))


def reference_device() -> str:
    """Where the float64 reference replays production: the GPU when one is present (the
    side by side's replay at real dims takes tens of seconds on a host CPU, well under a
    second on an H200), unless ``HYV4_REFERENCE_DEVICE`` says otherwise (``cpu``/``cuda``)."""
    import os

    want = os.environ.get("HYV4_REFERENCE_DEVICE", "").strip().lower()
    if want in ("cpu", "cuda"):
        return want
    try:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


JIT_CACHE_ENV = "HYV4_JIT_CACHE"

# Where each JIT layer of the GPU stack keeps what it compiled, relative to one cache root.
# Each variable is read by its library at import time, so they must be set before vLLM,
# FlashInfer, Triton, DeepGEMM or torch's inductor are imported.
JIT_CACHE_LAYOUT = {
    "VLLM_CACHE_ROOT": "vllm",                 # vLLM: torch.compile artefacts, its own kernel caches
    "TRITON_CACHE_DIR": "triton",              # Triton kernels (fused MoE, vLLM's Triton ops)
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",  # FlashInfer JIT (FP8 block GEMM); it appends .cache/flashinfer
    "DG_JIT_CACHE_DIR": "deep_gemm",           # DeepGEMM JIT (indexer logits, FP8 GEMMs)
    "TORCHINDUCTOR_CACHE_DIR": "inductor",     # torch inductor
    "CUDA_CACHE_PATH": "cuda",                 # the driver's PTX -> SASS cache
    "HUMMING_CACHE_DIR": "humming",            # humming (imported by vLLM's FP8 linear kernels): its launcher
                                               # and nvrtc helper, built in the background at import
    "TVM_FFI_CACHE_DIR": "tvm-ffi",            # tvm-ffi's JIT extensions (FlashInfer's and others' FFI)
    "PYTHONPYCACHEPREFIX": "pycache",          # Python bytecode of torch / vLLM / FlashInfer (below)
}
# Python bytecode is a JIT layer too: the lent H200 hosts set PYTHONDONTWRITEBYTECODE and ship
# torch without .pyc files, so every process re-compiled the sources of torch, transformers and
# vLLM (measured there: `import torch, transformers.modeling_utils` 11-14 s each time, 4.2-5.0 s
# with a bytecode cache; cProfile of a warm `harness main`: 14.3 s in `compile`). With a cache
# root, bytecode is written under ROOT/pycache (Python validates each .pyc against its source's
# mtime and size, so a changed source is recompiled, never served stale).
BYTECODE_VAR = "PYTHONPYCACHEPREFIX"


def jit_cache_env(root: str) -> dict[str, str]:
    """The environment that points every JIT layer at ``root``."""
    import os

    root = os.path.abspath(os.path.expanduser(root))
    return {var: os.path.join(root, sub) for var, sub in JIT_CACHE_LAYOUT.items()}


def apply_jit_cache(root: str | None = None) -> dict[str, str]:
    """Point the JIT layers at one cache root: ``root``, else ``$HYV4_JIT_CACHE``; without
    either, nothing changes (each library keeps its own default under ``~``). A variable the
    user already set wins. With a root, Python bytecode is written under ROOT/pycache even where
    the host sets PYTHONDONTWRITEBYTECODE (unless PYTHONPYCACHEPREFIX is set already). Returns
    the variables this call set. Cheap: imports nothing."""
    import os

    root = root or os.environ.get(JIT_CACHE_ENV) or None
    if not root:
        return {}
    os.environ[JIT_CACHE_ENV] = os.path.abspath(os.path.expanduser(root))
    os.environ.setdefault("CUDA_CACHE_MAXSIZE", str(4 << 30))  # the driver's default (256 MiB) evicts
    done = {}
    for var, path in jit_cache_env(root).items():
        if var not in os.environ:
            os.environ[var] = done[var] = path
    if BYTECODE_VAR in done:
        _write_bytecode_under(done[BYTECODE_VAR])
    return done


def _write_bytecode_under(prefix: str) -> None:
    """This process and its children write and read bytecode under ``prefix``: Python reads
    both variables only at start-up, so this process is switched here (modules imported
    later use it) and the children through the environment."""
    import os
    import sys

    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False


# A cold bytecode layer (a fresh host) is filled by the first process, one module at a time as
# it imports: lease 2026-12-02c's cold `harness main` spent 42 s before vLLM's first log line
# (9.5 s warm). Where the host has the cores, ``precompile_bytecode`` compiles these packages'
# sources all at once instead (``compileall``, one process per core), before they are imported.
# Lease 2026-12-02d: torch, vLLM and transformers in 4.2-5.2 s; `import vllm.models.hy_v4` (what
# vLLM's model-class inspection subprocesses import, several at once on a cold host) then still
# spent over 0.5 s each compiling sympy, scipy, pandas, networkx, openai, torchvision and numpy
# (`-X importtime` with an empty layer: 33 s of import self time, 15.5 s of it the first three).
PRECOMPILE_PACKAGES = ("torch", "vllm", "transformers",
                       "sympy", "scipy", "pandas", "networkx", "openai", "torchvision", "numpy")
PRECOMPILE_MIN_CPUS = 8  # below this, compiling every module (~58 s of CPU for the three, measured
#                          on CI's 2 cores) costs more than compiling the imported ones as they come
PRECOMPILED = "hyv4-precompiled.json"  # in the bytecode layer: {package dir: the Python that compiled it}


def precompile_bytecode(packages=None, min_cpus: int | None = None) -> list[str]:
    """Compile every source of ``packages`` into the bytecode layer (``sys.pycache_prefix``, set
    by ``apply_jit_cache``) on all cores, once per layer and Python: the package directories
    this call compiled, ``[]`` when there was nothing to do (no layer, fewer than ``min_cpus``
    cores, or done before). Locates the packages without importing them. A source that does not
    compile is left to the import that needs it (which raises as it would have)."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys
    import time

    packages = PRECOMPILE_PACKAGES if packages is None else packages
    min_cpus = PRECOMPILE_MIN_CPUS if min_cpus is None else min_cpus
    prefix = sys.pycache_prefix
    if not prefix or (os.cpu_count() or 1) < min_cpus:
        return []
    marker = os.path.join(prefix, PRECOMPILED)
    try:
        with open(marker) as f:
            done = dict(json.load(f))
    except (OSError, ValueError, TypeError):
        done = {}
    todo = []
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for d in map(str, (spec.submodule_search_locations or []) if spec else []):  # a Path on sys.path gives Paths
            if done.get(d) != sys.version and d not in todo:
                todo.append(d)
    if not todo:
        return []
    env = {**os.environ, BYTECODE_VAR: prefix}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    t0 = time.perf_counter()
    try:  # an optimisation only: where the layer cannot be written, imports compile as before
        os.makedirs(prefix, exist_ok=True)
        subprocess.run([sys.executable, "-m", "compileall", "-qq", "-j", "0", *todo], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        done.update({d: sys.version for d in todo})
        tmp = f"{marker}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(done, f, indent=1)
        os.replace(tmp, marker)
    except (OSError, TypeError, ValueError):
        return []
    print(f"bytecode: compiled {len(todo)} package dir(s) into {prefix} in {time.perf_counter() - t0:.1f} s "
          f"({os.cpu_count()} cores): {', '.join(todo)}", file=sys.stderr, flush=True)
    return todo
